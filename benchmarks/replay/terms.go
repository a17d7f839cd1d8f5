package replay

import (
	"fmt"
	"math"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/trace"
)

// A loss term is what one trained token contributes: the tokens the model sees, the
// token it predicts, the rollout log-prob, the advantage and the temperature. Two layouts
// train the same thing iff they yield the same multiset of terms. Real contexts run to
// tens of thousands of tokens, so a term holds a 128-bit hash of its context, built token
// by token along the path (each row's hash from its parent's), instead of the tokens.
type term struct {
	ctx         ctxHash
	target      int32
	logprob     uint32 // float32 bits: equal means bit-equal
	advantage   uint32
	temperature uint32
}

// Terms is a multiset of loss terms.
type Terms map[term]int

// Len is the number of terms, counted with multiplicity.
func (t Terms) Len() int64 {
	var n int64
	for _, c := range t {
		n += int64(c)
	}
	return n
}

// Diff counts the terms of t missing from want and those t holds in excess.
func (t Terms) Diff(want Terms) (missing, extra int64) {
	for k, w := range want {
		if g := t[k]; g < w {
			missing += int64(w - g)
		} else {
			extra += int64(g - w)
		}
	}
	for k, g := range t {
		if _, ok := want[k]; !ok {
			extra += int64(g)
		}
	}
	return missing, extra
}

// ctxHash is two independent 64-bit hashes of a token sequence: a polynomial one and a
// splitmix64 chain.
type ctxHash struct{ a, b uint64 }

func (h ctxHash) push(id int32) ctxHash {
	x := uint64(uint32(id)) + 1
	return ctxHash{a: h.a*0x9e3779b97f4a7c15 + x, b: splitmix64(h.b ^ (x * 0xbf58476d1ce4e5b9))}
}

func splitmix64(z uint64) uint64 {
	z += 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// PerRequestTerms lists the loss terms straight from the recorded calls: every sampled
// token of every trainable call, in the context of its prompt and the tokens sampled
// before it, with its session's advantage. Every strategy must reproduce this multiset.
func PerRequestTerms(groups []trace.Group, adv batcher.Advantage) Terms {
	out := Terms{}
	for gi := range groups {
		g := &groups[gi]
		// Failed sessions are out of the baseline and get 0 (docs/control.md).
		var rewards []float64
		for i := range g.Sessions {
			if g.Sessions[i].Status != trace.StatusFailed {
				rewards = append(rewards, g.Sessions[i].Reward)
			}
		}
		base := batcher.Advantages(adv, rewards)
		for si, k := 0, 0; si < len(g.Sessions); si++ {
			s := &g.Sessions[si]
			var a float32
			if s.Status != trace.StatusFailed {
				a = float32(base[k])
				k++
			}
			for ci := range s.Calls {
				c := &s.Calls[ci]
				if !c.Trainable {
					continue
				}
				temp := float32(1)
				if t := c.Sampling.EffectiveTemperature(); t > 1e-5 {
					temp = float32(t)
				}
				var h ctxHash
				for _, id := range c.PromptIDs {
					h = h.push(id)
				}
				for k, id := range c.ResponseIDs {
					out[term{h, id, math.Float32bits(c.Logprobs[k]), math.Float32bits(a), math.Float32bits(temp)}]++
					h = h.push(id)
				}
			}
		}
	}
	return out
}

// StepTerms encodes every micro-batch of st as the trainer receives it and reads the loss
// terms back from the Arrow columns alone: a loss row's context is the chain of pred_idx
// ancestors above it.
func StepTerms(st *batcher.Step) (Terms, error) {
	mem := memory.NewGoAllocator()
	out := Terms{}
	for r := range st.Ranks {
		for i := range st.Ranks[r] {
			rec, err := st.Record(mem, r, i)
			if err != nil {
				return nil, fmt.Errorf("encoding rank %d micro-batch %d: %w", r, i, err)
			}
			err = recordTerms(rec, out)
			rec.Release()
			if err != nil {
				return nil, fmt.Errorf("rank %d micro-batch %d: %w", r, i, err)
			}
		}
	}
	return out, nil
}

func recordTerms(rec arrow.RecordBatch, out Terms) error {
	col := func(name string) (arrow.Array, error) {
		idx := rec.Schema().FieldIndices(name)
		if len(idx) != 1 {
			return nil, fmt.Errorf("no column %q", name)
		}
		return rec.Column(idx[0]), nil
	}
	var cols [6]arrow.Array
	for i, name := range []string{"input_ids", "pred_idx", "loss_mask", "old_logprobs", "advantages", "temperature"} {
		c, err := col(name)
		if err != nil {
			return err
		}
		cols[i] = c
	}
	ids := cols[0].(*array.Int32).Int32Values()
	pred := cols[1].(*array.Int32).Int32Values()
	mask := cols[2].(*array.Uint8).Uint8Values()
	lps := cols[3].(*array.Float32).Float32Values()
	advs := cols[4].(*array.Float32).Float32Values()
	temps := cols[5].(*array.Float32).Float32Values()
	hashes := make([]ctxHash, len(ids)) // hashes[q]: the path from the root through row q
	for q := range ids {
		var parent ctxHash
		if p := pred[q]; p >= 0 {
			if int(p) >= q {
				return fmt.Errorf("row %d: pred_idx %d is not an earlier row", q, p)
			}
			parent = hashes[p]
		}
		hashes[q] = parent.push(ids[q])
		if mask[q] == 0 {
			continue
		}
		if pred[q] < 0 {
			return fmt.Errorf("loss row %d has no predecessor", q)
		}
		out[term{parent, ids[q], math.Float32bits(lps[q]), math.Float32bits(advs[q]), math.Float32bits(temps[q])}]++
	}
	return nil
}
