package batcher_test

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/trace"
)

// Adversarial tests: hand-built groups that sit on the edges of reconstruction (identical
// samples, prefixes of samples, prompts ending inside samples, single tokens, many roots,
// deep chains, untrainable and empty sessions), packed under edge budgets and rank counts,
// checked for loss terms attributed to the right session, stats, the sample table and
// byte-for-byte determinism.

// decodeOwned reads the owned loss terms of every micro-batch from its columns, naming the
// owner through sample_idx and the step's sample table.
func decodeOwned(t *testing.T, st *batcher.Step) ownedSet {
	t.Helper()
	mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
	defer mem.AssertSize(t, 0)
	out := ownedSet{}
	for rank := range st.Ranks {
		for i := range st.Ranks[rank] {
			rec, err := st.Record(mem, rank, i)
			if err != nil {
				t.Fatalf("Record(%d, %d): %v", rank, i, err)
			}
			ids := rec.Column(0).(*array.Int32).Int32Values()
			pred := rec.Column(3).(*array.Int32).Int32Values()
			mask := rec.Column(4).(*array.Uint8).Uint8Values()
			lps := rec.Column(5).(*array.Float32).Float32Values()
			advs := rec.Column(6).(*array.Float32).Float32Values()
			sample := rec.Column(7).(*array.Int32).Int32Values()
			temps := rec.Column(8).(*array.Float32).Float32Values()
			for q := range mask {
				if mask[q] == 0 {
					continue
				}
				s := sample[q]
				if s < 0 || int(s) >= len(st.Samples) {
					t.Fatalf("rank %d micro-batch %d row %d: sample_idx %d out of range", rank, i, q, s)
				}
				var chain []int32
				for k := pred[q]; k != -1; k = pred[k] {
					chain = append([]int32{ids[k]}, chain...)
				}
				sm := &st.Samples[s]
				out[ownedTerm{sm.GroupID, sm.SessionID, lossTerm{tokensKey(chain), ids[q], lps[q], advs[q], temps[q]}}]++
			}
			rec.Release()
		}
	}
	return out
}

func diffOwned(t *testing.T, name string, got, want ownedSet) {
	t.Helper()
	for k, w := range want {
		if g := got[k]; g != w {
			t.Fatalf("%s: session %s/%s term %v: got %d, want %d", name, k.group, k.session, k.lossTerm, g, w)
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			t.Fatalf("%s: session %s/%s term %v: got %d, want 0", name, k.group, k.session, k.lossTerm, g)
		}
	}
}

// checkStats checks the counts a formed step reports against the input.
func checkStats(t *testing.T, st *batcher.Step, groups []trace.Group, cfg batcher.Config) {
	t.Helper()
	s := st.Stats
	var sessions, calls, trainable int
	var input, loss int64
	for _, g := range groups {
		sessions += len(g.Sessions)
		for _, se := range g.Sessions {
			for _, c := range se.Calls {
				calls++
				input += int64(len(c.PromptIDs) + len(c.ResponseIDs))
				if c.Trainable {
					trainable++
					loss += int64(len(c.ResponseIDs))
				}
			}
		}
	}
	if s.Groups != len(groups) || s.Sessions != sessions || s.Calls != calls || s.TrainableCalls != trainable || s.InputTokens != input {
		t.Errorf("stats %+v: want %d groups, %d sessions, %d calls, %d trainable, %d input tokens", s, len(groups), sessions, calls, trainable, input)
	}
	for r := range st.Ranks {
		for i := range st.Ranks[r] {
			if m := st.Meta(r, i); m.LossTokensGlobal != loss || m.PolicyVersionMin != st.PolicyVersionMin || m.PolicyVersionMax != st.PolicyVersionMax {
				t.Errorf("rank %d micro-batch %d metadata %+v: want %d loss tokens, versions [%d, %d]",
					r, i, m, loss, st.PolicyVersionMin, st.PolicyVersionMax)
			}
		}
	}
	if s.LossRows != loss {
		t.Errorf("LossRows = %d, want %d trainable response tokens", s.LossRows, loss)
	}
	if s.Rows < s.DistinctRows {
		t.Errorf("Rows %d < DistinctRows %d", s.Rows, s.DistinctRows)
	}
	if s.CutFloor > s.Rows {
		t.Errorf("CutFloor %d > Rows %d", s.CutFloor, s.Rows)
	}
	if s.CutFloor < s.DistinctRows {
		t.Errorf("CutFloor %d < DistinctRows %d: every distinct row is forwarded at least once", s.CutFloor, s.DistinctRows)
	}
	if s.Pieces < s.Trees {
		t.Errorf("Pieces %d < Trees %d", s.Pieces, s.Trees)
	}
	if !(s.Fill > 0 && s.Fill <= 1) {
		t.Errorf("Fill = %v, want in (0, 1]", s.Fill)
	}
	if !(s.Imbalance >= 1-1e-9) || math.IsInf(s.Imbalance, 0) {
		t.Errorf("Imbalance = %v, want >= 1", s.Imbalance)
	}
	var mbs int
	var rows, padded, lossRows int64
	for r, mbsOfRank := range st.Ranks {
		for i, mb := range mbsOfRank {
			mbs++
			if mb.Rank != r || mb.Index != i {
				t.Errorf("micro-batch at rank %d index %d says rank %d index %d", r, i, mb.Rank, mb.Index)
			}
			rows += mb.Rows
			padded += mb.PaddedRows
			lossRows += mb.LossRows
		}
	}
	if mbs != s.MicroBatches || rows != s.Rows || padded != s.PaddedRows || lossRows != s.LossRows {
		t.Errorf("micro-batches sum to %d mbs, %d rows, %d padded, %d loss; stats say %d, %d, %d, %d",
			mbs, rows, padded, lossRows, s.MicroBatches, s.Rows, s.PaddedRows, s.LossRows)
	}
	if s.MicroBatches == 0 || len(st.Ranks) != cfg.DPSize || len(st.Ranks[0]) == 0 {
		t.Errorf("%d micro-batches over %d ranks: every rank must run at least one forward pass", s.MicroBatches, len(st.Ranks))
	}
}

// checkSampleTable checks the step's samples and their Arrow table against the groups.
func checkSampleTable(t *testing.T, st *batcher.Step, groups []trace.Group, adv batcher.Advantage) {
	t.Helper()
	type want struct {
		group, session, task string
		reward               float64
		advantage            float32
		version              int64
		calls                int32
		loss                 int64
	}
	var ws []want
	for _, g := range groups {
		rewards := make([]float64, len(g.Sessions))
		for i := range g.Sessions {
			rewards[i] = g.Sessions[i].Reward
		}
		advs := batcher.Advantages(adv, rewards)
		for si, s := range g.Sessions {
			w := want{group: g.ID, session: s.ID, task: g.TaskID, reward: s.Reward, advantage: float32(advs[si]), calls: int32(len(s.Calls))}
			if s.TaskID != "" {
				w.task = s.TaskID
			}
			w.version = math.MaxInt64
			for _, c := range s.Calls {
				if c.Trainable {
					w.version = min(w.version, c.PolicyVersion)
					w.loss += int64(len(c.ResponseIDs))
				}
			}
			if w.version == math.MaxInt64 {
				w.version = 0
			}
			ws = append(ws, w)
		}
	}
	if len(st.Samples) != len(ws) {
		t.Fatalf("%d samples, want %d", len(st.Samples), len(ws))
	}
	for i, w := range ws {
		s := st.Samples[i]
		got := want{s.GroupID, s.SessionID, s.TaskID, s.Reward, s.Advantage, s.PolicyVersion, s.NumCalls, s.NumLossTokens}
		if s.Index != int32(i) || got != w {
			t.Errorf("sample %d = %+v (index %d), want %+v", i, got, s.Index, w)
		}
	}
	mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
	defer mem.AssertSize(t, 0)
	tab := st.SampleTable(mem)
	defer tab.Release()
	idx := tab.Column(0).(*array.Int32)
	sess := tab.Column(1).(*array.String)
	advs := tab.Column(5).(*array.Float32)
	nl := tab.Column(8).(*array.Int64)
	for i, w := range ws {
		if idx.Value(i) != int32(i) || sess.Value(i) != w.session || advs.Value(i) != w.advantage || nl.Value(i) != w.loss {
			t.Errorf("sample table row %d = (%d, %q, %v, %d), want (%d, %q, %v, %d)",
				i, idx.Value(i), sess.Value(i), advs.Value(i), nl.Value(i), i, w.session, w.advantage, w.loss)
		}
	}
}

// recordBytes encodes every micro-batch of st and returns, per record, its metadata and the
// bytes of every column.
func recordBytes(t *testing.T, st *batcher.Step) [][]byte {
	t.Helper()
	mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
	defer mem.AssertSize(t, 0)
	var out [][]byte
	for rank := range st.Ranks {
		for i := range st.Ranks[rank] {
			rec, err := st.Record(mem, rank, i)
			if err != nil {
				t.Fatalf("Record(%d, %d): %v", rank, i, err)
			}
			var b bytes.Buffer
			if md, ok := rec.(arrow.RecordBatchWithMetadata); ok {
				v, _ := md.Metadata().GetValue(batcher.MetadataKey)
				b.WriteString(v)
			}
			for k := 0; k < int(rec.NumCols()); k++ {
				d := rec.Column(k).Data()
				width := d.DataType().(arrow.FixedWidthDataType).BitWidth() / 8
				b.Write(d.Buffers()[1].Bytes()[:d.Len()*width])
			}
			out = append(out, b.Bytes())
			rec.Release()
		}
	}
	return out
}

// formChecked forms a step and runs every check: packing rules, per-request loss terms from
// the columns alone, ownership, stats, the sample table, and determinism.
func formChecked(t *testing.T, groups []trace.Group, cfg batcher.Config) *batcher.Step {
	t.Helper()
	st, err := batcher.FormStep(5, groups, cfg)
	if err != nil {
		t.Fatalf("FormStep: %v", err)
	}
	name := fmt.Sprintf("%s B=%d pad=%d dp=%d", cfg.Strategy, cfg.TokenBudget, cfg.PadMultiple, cfg.DPSize)
	checkPacking(t, st, cfg)
	diffTerms(t, name, decodeStep(t, st, cfg), perRequestTerms(groups, cfg.Advantage))
	diffOwned(t, name, decodeOwned(t, st), perRequestOwned(groups, cfg.Advantage))
	checkStats(t, st, groups, cfg)
	checkSampleTable(t, st, groups, cfg.Advantage)
	again, err := batcher.FormStep(5, groups, cfg)
	if err != nil {
		t.Fatalf("second FormStep: %v", err)
	}
	a, b := recordBytes(t, st), recordBytes(t, again)
	if len(a) != len(b) {
		t.Fatalf("%s: %d records, then %d", name, len(a), len(b))
	}
	for i := range a {
		if !bytes.Equal(a[i], b[i]) {
			t.Fatalf("%s: record %d differs between two FormStep calls on the same input", name, i)
		}
	}
	return st
}

// mk is a trainable call whose log-probs are distinct per (session, index, choice, token),
// unless same is set: then they depend on the token position alone, as two identical
// samples from the same context would have.
func mk(session string, index, choice int, prompt, response []int32, same bool) trace.Call {
	lp := make([]float32, len(response))
	h := 0
	if !same {
		for _, ch := range session {
			h = h*31 + int(ch)
		}
		h = (h%97)*1000 + index*10 + choice
	}
	for i := range lp {
		lp[i] = -float32(h*64+i+1) / 65536 // distinct, and above trace.MinLogprob
	}
	c := trace.Call{SessionID: session, Index: index, Choice: choice, PromptIDs: prompt, ResponseIDs: response,
		Logprobs: lp, Trainable: true, PolicyVersion: int64(3 + index%2)}
	if index%3 == 2 { // some calls sampled at T = 0.7: the temperature travels with each loss row
		t := 0.7
		c.Sampling = &trace.Sampling{Temperature: &t}
	}
	return c
}

func sess(id string, reward float64, calls ...trace.Call) trace.Session {
	return trace.Session{ID: id, Reward: reward, Status: trace.StatusCompleted, Calls: calls}
}

func grp(id string, sessions ...trace.Session) trace.Group {
	return trace.Group{ID: id, TaskID: "task-" + id, Sessions: sessions}
}

func cat(parts ...[]int32) []int32 {
	var out []int32
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// adversarialGroups are the hand-built groups, each a GRPO group of its own.
func adversarialGroups() map[string]trace.Group {
	P := ids(1, 2, 3, 4)
	gs := map[string]trace.Group{}
	gs["n2 identical choices"] = grp("n2",
		sess("a", 1, mk("a", 0, 0, P, ids(5, 6, 7), true), mk("a", 0, 1, P, ids(5, 6, 7), true)),
		sess("b", 0, mk("b", 0, 0, P, ids(5, 6, 7), true), mk("b", 0, 1, P, ids(5, 6, 8), true)),
	)
	gs["identical retries across sessions"] = grp("retry",
		sess("a", 1, mk("a", 0, 0, P, ids(9, 9), true), mk("a", 1, 0, P, ids(9, 9), true)),
		sess("b", 0.5, mk("b", 0, 0, P, ids(9, 9), true)),
		sess("c", 0, mk("c", 0, 0, P, ids(9, 9), true), mk("c", 1, 0, P, ids(9, 9), true), mk("c", 2, 0, P, ids(9, 9), true)),
	)
	gs["response prefix of another response"] = grp("prefix",
		sess("a", 1, mk("a", 0, 0, P, ids(5, 6, 7, 8), false)),
		sess("b", 0, mk("b", 0, 0, P, ids(5, 6), false), mk("b", 1, 0, P, ids(5, 6, 7), false)),
		sess("c", 2, mk("c", 0, 0, P, ids(5, 6, 7, 8, 9), false)),
	)
	gs["prompt ends where another response ends"] = grp("ends",
		sess("a", 1, mk("a", 0, 0, P, ids(5, 6), false), mk("a", 1, 0, cat(P, ids(5, 6)), ids(7, 8), false)),
		sess("b", 0, mk("b", 0, 0, cat(P, ids(5, 6)), ids(7, 8), false), mk("b", 1, 0, cat(P, ids(5, 6, 7, 8)), ids(1), false)),
		sess("c", 3, mk("c", 0, 0, cat(P, ids(5, 6, 7, 8, 1)), ids(2), false)),
	)
	gs["prompt ends inside another response"] = grp("mid",
		sess("a", 1, mk("a", 0, 0, P, ids(5, 6, 7, 8), false)),
		sess("b", 0, mk("b", 0, 0, cat(P, ids(5, 6)), ids(7, 8), false), mk("b", 1, 0, cat(P, ids(5)), ids(6, 7, 9), false)),
		sess("c", 2, mk("c", 0, 0, cat(P, ids(5, 6)), ids(7, 9), false), mk("c", 1, 0, cat(P, ids(5, 6, 7)), ids(8), false)),
	)
	gs["response equals another prompt's suffix"] = grp("suffix",
		sess("a", 1, mk("a", 0, 0, ids(1, 2, 3, 4, 5, 6), ids(7), false)),
		sess("b", 0, mk("b", 0, 0, ids(1, 2, 3), ids(4, 5, 6), false)),
		sess("c", 4, mk("c", 0, 0, ids(1, 2, 3), ids(4, 5, 6), false), mk("c", 1, 0, ids(1, 2), ids(3, 4, 5, 6, 7, 8), false)),
		sess("d", 2, mk("d", 0, 0, ids(1, 2, 3, 4, 5, 6, 7), ids(8), false)),
	)
	gs["single tokens"] = grp("single",
		sess("a", 1, mk("a", 0, 0, ids(1), ids(2), false), mk("a", 1, 0, ids(1, 2), ids(2), false), mk("a", 2, 0, ids(1), ids(2), false)),
		sess("b", 0, mk("b", 0, 0, ids(1), ids(2), true), mk("b", 1, 0, ids(2), ids(1), false)),
		sess("c", 0, mk("c", 0, 0, ids(0), ids(0), false), mk("c", 1, 0, ids(0, 0), ids(0), false)),
	)
	var roots []trace.Session
	for i := range 40 {
		id := fmt.Sprintf("r%02d", i)
		roots = append(roots, sess(id, float64(i%3), mk(id, 0, 0, ids(int32(100+i), 7), ids(8, int32(i)), false)))
	}
	gs["many roots"] = grp("roots", roots...)
	gs["untrainable and empty sessions"] = grp("mixed",
		sess("a", 1,
			trace.Call{SessionID: "a", PromptIDs: P, ResponseIDs: ids(5, 6), Logprobs: []float32{-1}, UntrainableReason: "mismatch"},
			mk("a", 1, 0, cat(P, ids(5, 6, 7)), ids(8), false),
			trace.Call{SessionID: "a", Index: 2, UntrainableReason: "no token data"},
			mk("a", 3, 0, cat(P, ids(5, 6, 7, 8, 9)), ids(10, 11), false),
		),
		sess("empty", 0),
		sess("dead", 5, trace.Call{SessionID: "dead", PromptIDs: P, ResponseIDs: ids(5), UntrainableReason: "no logprobs"}),
	)
	gs["one session"] = grp("one", sess("solo", 7, mk("solo", 0, 0, P, ids(5, 6), false), mk("solo", 1, 0, cat(P, ids(5, 6, 1)), ids(2), false)))
	return gs
}

// deepGroup is two sessions of calls long chains: each turn adds a tool result and a
// response; the second drifts every 7th turn and retries every 11th.
func deepGroup(turns int) trace.Group {
	var a, b []trace.Call
	hist := ids(1, 2, 3)
	for i := range turns {
		resp := ids(int32(1000+i), int32(2000+i))
		a = append(a, mk("deep-a", i, 0, hist, resp, false))
		hist = cat(hist, resp, ids(int32(3000+i)))
	}
	hist = ids(1, 2, 3)
	for i := range turns {
		resp := ids(int32(1000+i), int32(4000+i))
		b = append(b, mk("deep-b", i, 0, hist, resp, false))
		if i%11 == 5 {
			b = append(b, mk("deep-b", i, 1, hist, resp, false))
		}
		if i%7 == 3 {
			resp = ids(int32(5000 + i)) // the history shows a re-tokenised response
		}
		hist = cat(hist, resp, ids(int32(3000+i)))
	}
	return grp("deep", sess("deep-a", 1, a...), sess("deep-b", 0, b...))
}

// budgets are the budgets worth trying for a longest path of n rows under pad: exactly the
// path, one pad multiple above, twice, and one that holds everything.
func budgets(n, pad int) []int {
	b := roundUp(n, pad)
	return []int{b, b + pad, roundUp(2*n, pad), roundUp(4096, pad)}
}

func TestAdversarialGroups(t *testing.T) {
	advs := []batcher.Advantage{batcher.GRPO, batcher.DrGRPO, batcher.RLOO}
	k := 0
	for name, g := range adversarialGroups() {
		groups := []trace.Group{g}
		longest := longestSequence(groups)
		for _, pad := range []int{1, 8} {
			for _, budget := range budgets(longest, pad) {
				for _, dp := range []int{1, 2, 7} {
					k++
					for _, s := range batcher.Strategies {
						cfg := batcher.DefaultConfig()
						cfg.Strategy, cfg.Advantage = s, advs[k%3]
						cfg.TokenBudget, cfg.PadMultiple, cfg.DPSize = budget, pad, dp
						t.Run(fmt.Sprintf("%s/%s/B%d/pad%d/dp%d", name, s, budget, pad, dp), func(t *testing.T) {
							formChecked(t, groups, cfg)
						})
					}
				}
			}
		}
	}
}

// TestAdversarialMultiGroupStep packs every hand-built group into one step, so sample
// indices are offset per group, and checks each loss row names its own session.
func TestAdversarialMultiGroupStep(t *testing.T) {
	var groups []trace.Group
	for _, name := range []string{
		"n2 identical choices", "identical retries across sessions", "response prefix of another response",
		"prompt ends where another response ends", "prompt ends inside another response",
		"response equals another prompt's suffix", "single tokens", "many roots",
		"untrainable and empty sessions", "one session",
	} {
		groups = append(groups, adversarialGroups()[name])
	}
	groups = append(groups, deepGroup(40))
	longest := longestSequence(groups)
	for _, s := range batcher.Strategies {
		for _, dp := range []int{1, 3, 7} {
			for _, budget := range []int{roundUp(longest, 8), roundUp(longest, 8) + 8, 1024} {
				cfg := batcher.DefaultConfig()
				cfg.Strategy, cfg.TokenBudget, cfg.PadMultiple, cfg.DPSize = s, budget, 8, dp
				t.Run(fmt.Sprintf("%s/B%d/dp%d", s, budget, dp), func(t *testing.T) {
					formChecked(t, groups, cfg)
				})
			}
		}
	}
}

// TestAdversarialDeepChain packs chains of hundreds of calls.
func TestAdversarialDeepChain(t *testing.T) {
	groups := []trace.Group{deepGroup(300)}
	longest := longestSequence(groups)
	for _, s := range batcher.Strategies {
		for _, dp := range []int{1, 7} {
			cfg := batcher.DefaultConfig()
			cfg.Strategy, cfg.TokenBudget, cfg.PadMultiple, cfg.DPSize = s, roundUp(longest, 16), 16, dp
			t.Run(fmt.Sprintf("%s/dp%d", s, dp), func(t *testing.T) {
				st := formChecked(t, groups, cfg)
				// The tree stores each chain once, drift as a branch; prefix_merging restarts
				// deep-b's chain at every drift, so only the tree is bounded here.
				if s == batcher.Tree && st.Stats.Rows >= int64(3*longest) {
					t.Errorf("%d rows forwarded for two chains whose longest path is %d", st.Stats.Rows, longest)
				}
			})
		}
	}
}

// TestAdversarialTreeRows pins the tree's distinct rows on groups where the rule "a row
// trains at most one call" decides the shape.
func TestAdversarialTreeRows(t *testing.T) {
	gs := adversarialGroups()
	tests := []struct {
		name string
		rows int64
	}{
		// P (4 rows) is shared; all four samples start with the claimed 5, so each branches.
		{"n2 identical choices", 4 + 4*3},
		// P is shared; six identical samples of 9,9 each need rows of their own.
		{"identical retries across sessions", 4 + 6*2},
		// a owns 5678; b0 (56), b1 (567) and c (56789) each branch right after P.
		{"response prefix of another response", 4 + 4 + 2 + 3 + 5},
		// a: 56 then 78; b0's prompt passes a's 56, its 78 branches; b1 samples 1 after a's
		// 78; c's prompt runs to that 1 and samples 2.
		{"prompt ends where another response ends", 4 + 2 + 2 + 2 + 1 + 1},
		// a owns 5678; b0 branches 78 after 56; b1 branches 679 after 5; c0 branches 79
		// after 56; c1's prompt runs through a's 7 and its 8 branches.
		{"prompt ends inside another response", 4 + 4 + 2 + 3 + 2 + 1},
		// a's prompt 123456 then 7; b claims the prompt rows 456; c0's 456 branches; c1
		// claims the prompt row 3, then branches 45678; d's prompt runs to a's 7, then 8.
		{"response equals another prompt's suffix", 6 + 1 + 3 + 5 + 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := testConfig(batcher.Tree)
			st, err := batcher.FormStep(1, []trace.Group{gs[tt.name]}, cfg)
			if err != nil {
				t.Fatal(err)
			}
			if st.Stats.DistinctRows != tt.rows {
				t.Errorf("distinct rows = %d, want %d", st.Stats.DistinctRows, tt.rows)
			}
		})
	}
}

// TestAdversarialBudgetBelowPath: one row short of the longest path is refused by every
// strategy, naming the session; exactly the path is accepted.
func TestAdversarialBudgetBelowPath(t *testing.T) {
	groups := []trace.Group{deepGroup(30)}
	longest := longestSequence(groups)
	for _, s := range batcher.Strategies {
		cfg := batcher.DefaultConfig()
		cfg.Strategy, cfg.PadMultiple, cfg.TokenBudget = s, 1, longest-1
		_, err := batcher.FormStep(1, groups, cfg)
		if err == nil || !strings.Contains(err.Error(), "deep-") || !strings.Contains(err.Error(), fmt.Sprint(longest)) {
			t.Errorf("%s: budget %d for a %d-row path: err = %v", s, longest-1, longest, err)
		}
		cfg.TokenBudget = longest
		formChecked(t, groups, cfg)
	}
}

// TestAdversarialAllUntrainable: a step whose groups hold no trainable call is either
// refused with a plain error or formed as a valid step: no loss rows, every rank the same
// non-zero number of padding-only micro-batches (as pack's empty bins promise), and
// finite stats (Fill is Rows / (MicroBatches × TokenBudget), never 0/0).
func TestAdversarialAllUntrainable(t *testing.T) {
	groups := []trace.Group{grp("dead",
		sess("a", 1, trace.Call{SessionID: "a", PromptIDs: ids(1, 2), ResponseIDs: ids(3), UntrainableReason: "no logprobs"}),
		sess("b", 0),
	)}
	for _, s := range batcher.Strategies {
		for _, dp := range []int{1, 4} {
			cfg := testConfig(s)
			cfg.DPSize = dp
			t.Run(fmt.Sprintf("%s/dp%d", s, dp), func(t *testing.T) {
				_, err := batcher.FormStep(1, groups, cfg)
				if !errors.Is(err, batcher.ErrNothingToTrain) {
					t.Fatalf("FormStep = %v, want ErrNothingToTrain", err)
				}
			})
		}
	}
}

// TestAdversarialPackReuse: packing the same reconstructed groups twice, and into steps in
// a different group order, gives the same records for the same order and leaves the
// reconstructed groups unchanged.
func TestAdversarialPackReuse(t *testing.T) {
	gs := adversarialGroups()
	groups := []trace.Group{gs["single tokens"], gs["n2 identical choices"], gs["response equals another prompt's suffix"]}
	cfg := testConfig(batcher.Tree)
	cfg.DPSize = 2
	var recs []*batcher.Reconstructed
	for i := range groups {
		r, err := batcher.Reconstruct(&groups[i], cfg)
		if err != nil {
			t.Fatal(err)
		}
		recs = append(recs, r)
	}
	first, err := batcher.Pack(1, recs, cfg)
	if err != nil {
		t.Fatal(err)
	}
	second, err := batcher.Pack(1, recs, cfg)
	if err != nil {
		t.Fatal(err)
	}
	a, b := recordBytes(t, first), recordBytes(t, second)
	for i := range a {
		if !bytes.Equal(a[i], b[i]) {
			t.Fatalf("record %d differs between two packs of the same groups", i)
		}
	}
	for i, r := range recs {
		for j, s := range r.Samples {
			if s.Index != int32(j) {
				t.Errorf("group %d sample %d has index %d after packing", i, j, s.Index)
			}
		}
	}
	rev := []*batcher.Reconstructed{recs[2], recs[0], recs[1]}
	st, err := batcher.Pack(2, rev, cfg)
	if err != nil {
		t.Fatal(err)
	}
	revGroups := []trace.Group{groups[2], groups[0], groups[1]}
	diffOwned(t, "reversed", decodeOwned(t, st), perRequestOwned(revGroups, cfg.Advantage))
	checkSampleTable(t, st, revGroups, cfg.Advantage)
}

// randomGroup builds a group over a vocabulary of a few tokens, so that unrelated calls
// collide all the time: prompts that pass through others' samples, samples equal to
// others' samples or prompts, prefixes and retries. Each call either continues its
// session's history (prompt = history + a result), retries the last prompt, or restarts
// from a random prefix of the history with drift.
func randomGroup(rng *rand.Rand, id string) trace.Group {
	tok := func(n int) []int32 {
		out := make([]int32, n)
		for i := range out {
			out[i] = int32(rng.IntN(3))
		}
		return out
	}
	g := grp(id)
	for si := range 1 + rng.IntN(6) {
		sid := fmt.Sprintf("%s-s%d", id, si)
		s := sess(sid, float64(rng.IntN(3)))
		hist := cat(ids(7, 7, 7), tok(1+rng.IntN(3))) // a task prompt the group shares
		var last []int32
		for ci := range rng.IntN(6) {
			prompt := hist
			switch r := rng.IntN(10); {
			case r < 2 && last != nil:
				prompt = last // retry
			case r < 4:
				prompt = cat(hist[:1+rng.IntN(len(hist))], tok(rng.IntN(2))) // drift
			}
			resp := tok(1 + rng.IntN(4))
			c := mk(sid, ci, 0, prompt, resp, rng.IntN(2) == 0)
			if rng.IntN(12) == 0 {
				c.MarkUntrainable("random")
			}
			s.Calls = append(s.Calls, c)
			if rng.IntN(5) == 0 { // a second choice, sometimes the same sample
				c2 := mk(sid, ci, 1, prompt, resp, true)
				if rng.IntN(2) == 0 {
					c2.ResponseIDs = tok(len(resp))
				}
				s.Calls = append(s.Calls, c2)
			}
			last = prompt
			hist = cat(prompt, resp, tok(rng.IntN(3)))
		}
		g.Sessions = append(g.Sessions, s)
	}
	return g
}

// TestAdversarialRandomCollisions forms steps from random colliding groups under tight
// budgets, pad multiples 1 and 4, and 1 to 7 ranks, with every check.
func TestAdversarialRandomCollisions(t *testing.T) {
	advs := []batcher.Advantage{batcher.GRPO, batcher.DrGRPO, batcher.RLOO}
	cuts := 0
	for seed := uint64(1); seed <= 150; seed++ {
		rng := rand.New(rand.NewPCG(seed, 99))
		var groups []trace.Group
		for gi := range 1 + rng.IntN(3) {
			groups = append(groups, randomGroup(rng, fmt.Sprintf("g%d", gi)))
		}
		longest := longestSequence(groups)
		if longest == 0 {
			longest = 1
		}
		pad := []int{1, 4}[seed%2]
		budget := roundUp(longest+rng.IntN(longest/2+1), pad)
		cfg := batcher.DefaultConfig()
		cfg.Advantage = advs[seed%3]
		cfg.TokenBudget, cfg.PadMultiple, cfg.DPSize = budget, pad, 1+rng.IntN(7)
		hasLoss := false
		for _, g := range groups {
			for _, s := range g.Sessions {
				for _, c := range s.Calls {
					hasLoss = hasLoss || c.Trainable
				}
			}
		}
		if !hasLoss {
			continue // TestAdversarialAllUntrainable covers that
		}
		for _, s := range batcher.Strategies {
			cfg.Strategy = s
			t.Run(fmt.Sprintf("seed%d/%s/B%d/pad%d/dp%d", seed, s, budget, pad, cfg.DPSize), func(t *testing.T) {
				st := formChecked(t, groups, cfg)
				if s == batcher.Tree && st.Stats.Pieces > st.Stats.Trees {
					cuts++
				}
			})
		}
	}
	if cuts < 10 {
		t.Errorf("only %d tree steps were cut: the budgets are too loose to test cutting", cuts)
	}
}

// TestAdversarialPolicyVersionRange: policy_version_min/max describe the policies whose
// samples the step trains: the oldest and the newest version over all trainable calls. A
// session whose calls span a weight sync (versions 3 then 4) puts version-4 tokens in the
// step, so the max must be 4; untrainable calls (version 9 here) train nothing and count
// for neither.
func TestAdversarialPolicyVersionRange(t *testing.T) {
	a0 := mk("a", 0, 0, ids(1, 2), ids(3), false)
	a1 := mk("a", 1, 0, ids(1, 2, 3, 4), ids(5), false)
	b0 := mk("b", 0, 0, ids(1, 2), ids(6), false)
	a0.PolicyVersion, a1.PolicyVersion, b0.PolicyVersion = 3, 4, 3
	dead := trace.Call{SessionID: "b", Index: 1, PromptIDs: ids(1), ResponseIDs: ids(2), PolicyVersion: 9, UntrainableReason: "x"}
	groups := []trace.Group{grp("v", sess("a", 1, a0, a1), sess("b", 0, b0, dead))}
	for _, s := range batcher.Strategies {
		st, err := batcher.FormStep(1, groups, testConfig(s))
		if err != nil {
			t.Fatal(err)
		}
		if st.PolicyVersionMin != 3 || st.PolicyVersionMax != 4 {
			t.Errorf("%s: step policy versions [%d, %d], want [3, 4]", s, st.PolicyVersionMin, st.PolicyVersionMax)
		}
		if m := st.Meta(0, 0); m.PolicyVersionMin != 3 || m.PolicyVersionMax != 4 {
			t.Errorf("%s: record metadata policy versions [%d, %d], want [3, 4]", s, m.PolicyVersionMin, m.PolicyVersionMax)
		}
		if v := st.Samples[0].PolicyVersion; v != 3 {
			t.Errorf("%s: sample a policy version %d, want its oldest trainable call's 3", s, v)
		}
	}
}
