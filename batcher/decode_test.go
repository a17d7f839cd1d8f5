package batcher_test

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"testing"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/trace"
)

// lossTerm is what one trained token contributes to the loss: the tokens the model sees,
// the token it predicts, the rollout log-prob, the advantage and the temperature the token
// was sampled at. Two layouts train the same thing iff they yield the same multiset of these.
type lossTerm struct {
	context     string // token ids, 4 bytes each
	target      int32
	logprob     float32
	advantage   float32
	temperature float32
}

func (t lossTerm) String() string {
	return fmt.Sprintf("{context %d tokens, target %d, logprob %v, advantage %v, temperature %v}",
		len(t.context)/4, t.target, t.logprob, t.advantage, t.temperature)
}

// callTemperature is the temperature a call's tokens are scored at, from its recorded
// sampling parameters alone: 1 when none was sent, or for greedy decoding.
func callTemperature(c *trace.Call) float32 {
	if c.Sampling == nil || c.Sampling.Temperature == nil || *c.Sampling.Temperature <= 1e-5 {
		return 1
	}
	return float32(*c.Sampling.Temperature)
}

type termSet map[lossTerm]int

func tokensKey(ids []int32) string {
	b := make([]byte, 4*len(ids))
	for i, id := range ids {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(id))
	}
	return string(b)
}

// ownedTerm is a loss term together with the session that owns it: two layouts that train
// the same terms but credit them to the wrong session differ here.
type ownedTerm struct {
	group, session string
	lossTerm
}

type ownedSet map[ownedTerm]int

// perRequestOwned lists the owned loss terms straight from the recorded calls.
func perRequestOwned(groups []trace.Group, adv batcher.Advantage) ownedSet {
	out := ownedSet{}
	for gi := range groups {
		g := &groups[gi]
		// failed sessions are out of the baseline and get 0 (docs/control.md)
		var rewards []float64
		for i := range g.Sessions {
			if g.Sessions[i].Status != trace.StatusFailed {
				rewards = append(rewards, g.Sessions[i].Reward)
			}
		}
		base := batcher.Advantages(adv, rewards)
		advs := make([]float64, len(g.Sessions))
		for i, k := 0, 0; i < len(g.Sessions); i++ {
			if g.Sessions[i].Status != trace.StatusFailed {
				advs[i] = base[k]
				k++
			}
		}
		for si := range g.Sessions {
			s := &g.Sessions[si]
			for _, c := range s.Calls {
				if !c.Trainable {
					continue
				}
				seq := append(append([]int32{}, c.PromptIDs...), c.ResponseIDs...)
				for k, id := range c.ResponseIDs {
					n := len(c.PromptIDs) + k
					out[ownedTerm{g.ID, s.ID, lossTerm{tokensKey(seq[:n]), id, c.Logprobs[k], float32(advs[si]), callTemperature(&c)}}]++
				}
			}
		}
	}
	return out
}

// perRequestTerms lists the loss terms straight from the recorded calls: the definition
// every strategy must reproduce (perRequestOwned, without the owners).
func perRequestTerms(groups []trace.Group, adv batcher.Advantage) termSet {
	out := termSet{}
	for t, n := range perRequestOwned(groups, adv) {
		out[t.lossTerm] += n
	}
	return out
}

// decodeStep encodes every micro-batch of st, checks each against the layout rules of
// docs/batcher.md ("Arrow") using its columns alone, and returns the loss terms they hold.
func decodeStep(t *testing.T, st *batcher.Step, cfg batcher.Config) termSet {
	t.Helper()
	mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
	defer mem.AssertSize(t, 0)
	out := termSet{}
	var lossRows int64
	for rank := range st.Ranks {
		if len(st.Ranks[rank]) != len(st.Ranks[0]) {
			t.Fatalf("rank %d has %d micro-batches, rank 0 has %d", rank, len(st.Ranks[rank]), len(st.Ranks[0]))
		}
		for i := range st.Ranks[rank] {
			rec, err := st.Record(mem, rank, i)
			if err != nil {
				t.Fatalf("Record(%d, %d): %v", rank, i, err)
			}
			lossRows += decodeRecord(t, rec, cfg, st, rank, i, out)
			rec.Release()
		}
	}
	if lossRows != st.Stats.LossRows {
		t.Errorf("records hold %d loss rows, stats say %d", lossRows, st.Stats.LossRows)
	}
	samples := st.SampleTable(mem)
	defer samples.Release()
	if int(samples.NumRows()) != len(st.Samples) {
		t.Errorf("sample table has %d rows, want %d", samples.NumRows(), len(st.Samples))
	}
	return out
}

func decodeRecord(t *testing.T, rec arrow.RecordBatch, cfg batcher.Config, st *batcher.Step, rank, mbIdx int, out termSet) int64 {
	t.Helper()
	want := batcher.MicroBatchSchema()
	if !rec.Schema().Equal(want) {
		t.Fatalf("schema %v, want %v", rec.Schema(), want)
	}
	md, ok := rec.(arrow.RecordBatchWithMetadata)
	if !ok {
		t.Fatalf("record has no batch metadata")
	}
	raw, ok := md.Metadata().GetValue(batcher.MetadataKey)
	if !ok {
		t.Fatalf("metadata lacks key %q", batcher.MetadataKey)
	}
	var meta batcher.MicroBatchMeta
	if err := json.Unmarshal([]byte(raw), &meta); err != nil {
		t.Fatalf("metadata %q: %v", raw, err)
	}
	if meta.Step != st.Number || meta.Rank != rank || meta.MicroBatch != mbIdx || meta.NumMicroBatches != len(st.Ranks[rank]) ||
		meta.LossTokensGlobal != st.Stats.LossRows || meta.Strategy != string(cfg.Strategy) {
		t.Fatalf("metadata %+v does not describe step %d rank %d micro-batch %d", meta, st.Number, rank, mbIdx)
	}
	n := int(rec.NumRows())
	if n > cfg.TokenBudget || n%cfg.PadMultiple != 0 {
		t.Fatalf("micro-batch of %d rows: budget %d, pad multiple %d", n, cfg.TokenBudget, cfg.PadMultiple)
	}
	ids := rec.Column(0).(*array.Int32).Int32Values()
	pos := rec.Column(1).(*array.Int32).Int32Values()
	end := rec.Column(2).(*array.Int32).Int32Values()
	pred := rec.Column(3).(*array.Int32).Int32Values()
	mask := rec.Column(4).(*array.Uint8).Uint8Values()
	lps := rec.Column(5).(*array.Float32).Float32Values()
	advs := rec.Column(6).(*array.Float32).Float32Values()
	sample := rec.Column(7).(*array.Int32).Int32Values()
	temps := rec.Column(8).(*array.Float32).Float32Values()
	real := int(meta.Rows)
	for q := 0; q < n; q++ {
		if q >= real { // padding
			if mask[q] != 0 || end[q] != int32(q+1) || pred[q] != -1 || pos[q] != 0 || sample[q] != -1 || temps[q] != 1 {
				t.Fatalf("padding row %d: mask %d end %d pred %d pos %d sample %d", q, mask[q], end[q], pred[q], pos[q], sample[q])
			}
			continue
		}
		p := pred[q]
		switch {
		case p == -1 && pos[q] != 0:
			t.Fatalf("root row %d at position %d", q, pos[q])
		case p != -1 && (p < 0 || int(p) >= q):
			t.Fatalf("row %d: pred %d is not an earlier row (DFS pre-order)", q, p)
		case p != -1 && pos[q] != pos[p]+1:
			t.Fatalf("row %d: position %d, its parent %d at %d", q, pos[q], p, pos[p])
		case p != -1 && !(end[q] <= end[p]):
			t.Fatalf("row %d: subtree ends at %d past its parent's %d", q, end[q], end[p])
		case end[q] <= int32(q) || int(end[q]) > real:
			t.Fatalf("row %d: subtree_end %d out of range", q, end[q])
		}
		if mask[q] == 0 {
			if lps[q] != 0 || advs[q] != 0 || sample[q] != -1 || temps[q] != 1 {
				t.Fatalf("context row %d carries logprob %v advantage %v sample %d temperature %v", q, lps[q], advs[q], sample[q], temps[q])
			}
			continue
		}
		if p == -1 {
			t.Fatalf("loss row %d is a root: nothing predicts it", q)
		}
		if s := sample[q]; s < 0 || int(s) >= len(st.Samples) || st.Samples[s].Advantage != advs[q] {
			t.Fatalf("loss row %d: sample %d advantage %v disagrees with the sample table", q, s, advs[q])
		}
		var chain []int32
		for k := p; k != -1; k = pred[k] {
			chain = append(chain, ids[k])
		}
		for i, j := 0, len(chain)-1; i < j; i, j = i+1, j-1 {
			chain[i], chain[j] = chain[j], chain[i]
		}
		out[lossTerm{tokensKey(chain), ids[q], lps[q], advs[q], temps[q]}]++
	}
	checkVisibility(t, pred[:real], end[:real])
	return meta.LossTokensGlobal*0 + countLoss(mask)
}

func countLoss(mask []uint8) int64 {
	var n int64
	for _, m := range mask {
		n += int64(m)
	}
	return n
}

// checkVisibility checks that the mask rule k <= q < subtree_end[k] shows each row exactly
// its pred_idx ancestors and itself.
func checkVisibility(t *testing.T, pred, end []int32) {
	t.Helper()
	n := len(pred)
	anc := make([]bool, n)
	for q := 0; q < n; q++ {
		clear(anc)
		depth := 0
		for k := int32(q); k != -1; k = pred[k] {
			anc[k] = true
			depth++
		}
		seen := 0
		for k := 0; k <= q; k++ {
			if q < int(end[k]) {
				if !anc[k] {
					t.Fatalf("row %d sees row %d, which is not its ancestor", q, k)
				}
				seen++
			}
		}
		if seen != depth {
			t.Fatalf("row %d sees %d rows, it has %d ancestors and itself", q, seen, depth)
		}
	}
}

func diffTerms(t *testing.T, name string, got, want termSet) {
	t.Helper()
	var missing, extra int
	var example string
	for k, w := range want {
		if g := got[k]; g != w {
			if g < w {
				missing += w - g
			} else {
				extra += g - w
			}
			if example == "" {
				example = fmt.Sprintf("%v: got %d, want %d", k, g, w)
			}
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			extra += g
			if example == "" {
				example = fmt.Sprintf("%v: got %d, want 0", k, g)
			}
		}
	}
	if missing+extra > 0 {
		t.Fatalf("%s: loss terms differ from per-request: %d missing, %d extra; e.g. %s", name, missing, extra, example)
	}
}

var _ = math.Inf
