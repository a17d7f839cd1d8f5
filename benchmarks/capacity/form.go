package capacity

import (
	"fmt"
	"runtime"
	"slices"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/sidecar"
	"github.com/floe-rl/floe/trace"
)

// FormCost is what forming one step of a given size costs floe's step former, on one
// goroutine: reconstructing its groups (batcher.Reconstruct, done as each group
// completes), packing them (batcher.Pack) and encoding every rank's micro-batches to
// Arrow (sidecar.FlightStep and MicroBatch, as Flight does when the ranks fetch).
type FormCost struct {
	Groups       int     `json:"groups"`
	Calls        int     `json:"calls"`
	InputTokens  int64   `json:"input_tokens"` // Σ prompt + answer tokens of the calls
	Rows         int64   `json:"rows"`         // rows forwarded
	MicroBatches int     `json:"micro_batches"`
	ReconstructS float64 `json:"reconstruct_s"`
	PackS        float64 `json:"pack_s"`
	EncodeS      float64 `json:"encode_s"`
}

// TotalS is the step's whole CPU cost on one core.
func (f FormCost) TotalS() float64 { return f.ReconstructS + f.PackS + f.EncodeS }

// syntheticGroup is group gid's calls as the capacity workload's agents make them and
// the fake inference server answers them, every session run to its last turn.
func syntheticGroup(w Workload, system string, seed uint64, gid int) trace.Group {
	g := trace.Group{ID: fmt.Sprintf("g%d", gid), TaskID: fmt.Sprintf("task-g%d", gid)}
	for s := 0; s < w.GroupSize; s++ {
		h := newHistory(w, system, seed, gid, s)
		sess := trace.Session{ID: fmt.Sprintf("g%d-s%d", gid, s), TaskID: g.TaskID, GroupID: g.ID,
			Reward: float64(s%2) + 0.01*float64(s), Status: trace.StatusCompleted}
		for turn := 0; turn < w.Turns; turn++ {
			var prompt []int32
			for _, m := range h.messages {
				for _, b := range []byte(m["content"]) {
					prompt = append(prompt, int32(b))
				}
				prompt = append(prompt, 0)
			}
			a := answer(len(h.messages), w.AnswerTokens)
			ids := make([]int32, len(a))
			lps := make([]float32, len(a))
			for i := range a {
				ids[i], lps[i] = int32(a[i]), -0.5
			}
			sess.Calls = append(sess.Calls, trace.Call{SessionID: sess.ID, Index: turn, PromptIDs: prompt, ResponseIDs: ids,
				Logprobs: lps, FinishReason: "stop", Trainable: true, API: "openai_chat"})
			h.advance()
		}
		g.Sessions = append(g.Sessions, sess)
	}
	return g
}

// MeasureForming forms steps of each size in groups (groups of the workload's sessions)
// with cfg, reps times each, and keeps each phase's fastest time: on a shared machine the
// fastest is the one least disturbed.
func MeasureForming(w Workload, cfg batcher.Config, sizes []int, reps int, seed uint64) ([]FormCost, error) {
	system := systemPrompt(w, seed)
	var out []FormCost
	for _, n := range sizes {
		groups := make([]trace.Group, n)
		for i := range groups {
			groups[i] = syntheticGroup(w, system, seed, i+1)
		}
		var best FormCost
		for rep := 0; rep < max(reps, 1); rep++ {
			runtime.GC()
			c, err := formOnce(int64(rep), groups, cfg)
			if err != nil {
				return nil, fmt.Errorf("forming a step of %d groups: %w", n, err)
			}
			if rep == 0 {
				best = c
				continue
			}
			best.ReconstructS = min(best.ReconstructS, c.ReconstructS)
			best.PackS = min(best.PackS, c.PackS)
			best.EncodeS = min(best.EncodeS, c.EncodeS)
		}
		out = append(out, best)
	}
	return out, nil
}

func formOnce(n int64, groups []trace.Group, cfg batcher.Config) (FormCost, error) {
	c := FormCost{Groups: len(groups)}
	t0 := time.Now()
	recs := make([]*batcher.Reconstructed, len(groups))
	for i := range groups {
		r, err := batcher.Reconstruct(&groups[i], cfg)
		if err != nil {
			return c, err
		}
		recs[i] = r
	}
	t1 := time.Now()
	st, err := batcher.Pack(n, recs, cfg)
	if err != nil {
		return c, err
	}
	t2 := time.Now()
	mem := memory.NewGoAllocator()
	fs, err := sidecar.FlightStep(st, mem)
	if err != nil {
		return c, err
	}
	defer fs.Release()
	for r := 0; r < fs.NumRanks(); r++ {
		for i := 0; i < fs.NumMicroBatches(r); i++ {
			rec, _, err := fs.MicroBatch(mem, r, i)
			if err != nil {
				return c, err
			}
			rec.Release()
		}
	}
	t3 := time.Now()
	c.Calls, c.InputTokens, c.Rows, c.MicroBatches = st.Stats.Calls, st.Stats.InputTokens, st.Stats.Rows, st.Stats.MicroBatches
	c.ReconstructS, c.PackS, c.EncodeS = t1.Sub(t0).Seconds(), t2.Sub(t1).Seconds(), t3.Sub(t2).Seconds()
	return c, nil
}

// percentileMs is the p-th percentile of xs in milliseconds (0 when xs is empty).
func percentileMs(xs []time.Duration, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return float64(s[int(p*float64(len(s)-1)+0.5)]) / 1e6
}
