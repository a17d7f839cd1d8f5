package batcher_test

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/trace"
)

func ids(xs ...int32) []int32 { return xs }

func call(session string, index int, prompt, response []int32) trace.Call {
	lp := make([]float32, len(response))
	for i := range lp {
		lp[i] = -0.125 * float32(index*len(response)+i+1)
	}
	return trace.Call{SessionID: session, Index: index, PromptIDs: prompt, ResponseIDs: response, Logprobs: lp, Trainable: true}
}

func group(sessions ...trace.Session) []trace.Group {
	for i := range sessions {
		sessions[i].Reward = float64(i)
	}
	return []trace.Group{{ID: "g", TaskID: "t", Sessions: sessions}}
}

func testConfig(s batcher.Strategy) batcher.Config {
	cfg := batcher.DefaultConfig()
	cfg.Strategy = s
	cfg.TokenBudget = 64
	cfg.PadMultiple = 8
	return cfg
}

// TestRowsPerStrategy pins the row counts of small hand-made groups, and that each layout
// trains exactly the per-request loss terms.
func TestRowsPerStrategy(t *testing.T) {
	sys := ids(1, 2, 3, 4)
	turn1 := call("a", 0, append(sys, 10), ids(11, 12))
	turn2 := call("a", 1, append(sys, 10, 11, 12, 13), ids(14, 15))
	tests := []struct {
		name   string
		groups []trace.Group
		rows   map[batcher.Strategy]int64
	}{
		{
			name:   "multi-turn chain merges under prefix_merging and tree",
			groups: group(trace.Session{ID: "a", Calls: []trace.Call{turn1, turn2}}),
			rows:   map[batcher.Strategy]int64{batcher.PerRequest: 7 + 10, batcher.PrefixMerging: 10, batcher.Tree: 10},
		},
		{
			name: "group prompt shared only by tree",
			groups: group(
				trace.Session{ID: "a", Calls: []trace.Call{call("a", 0, append(sys, 10), ids(11, 12))}},
				trace.Session{ID: "b", Calls: []trace.Call{call("b", 0, append(sys, 20), ids(21))}},
			),
			rows: map[batcher.Strategy]int64{batcher.PerRequest: 7 + 6, batcher.PrefixMerging: 7 + 6, batcher.Tree: 4 + 3 + 2},
		},
		{
			name: "retry sampling the same tokens is split, not shared",
			groups: group(trace.Session{ID: "a", Calls: []trace.Call{
				call("a", 0, ids(1, 2, 3), ids(7, 8, 9)),
				call("a", 1, ids(1, 2, 3), ids(7, 8, 5)),
			}}),
			rows: map[batcher.Strategy]int64{batcher.PerRequest: 12, batcher.PrefixMerging: 12, batcher.Tree: 3 + 3 + 3},
		},
		{
			name: "prompt ending inside another call's response branches before re-sampled rows",
			groups: group(trace.Session{ID: "a", Calls: []trace.Call{
				call("a", 0, ids(1, 2), ids(3, 4, 5)),
				call("a", 1, ids(1, 2, 3), ids(4, 5, 6)),
			}}),
			rows: map[batcher.Strategy]int64{batcher.PerRequest: 11, batcher.PrefixMerging: 11, batcher.Tree: 5 + 3},
		},
		{
			name: "response sampling tokens another prompt holds claims those rows",
			groups: group(trace.Session{ID: "a", Calls: []trace.Call{
				call("a", 0, ids(1, 2, 3, 4, 5), ids(6)),
				call("a", 1, ids(1, 2), ids(3, 4, 9)),
			}}),
			rows: map[batcher.Strategy]int64{batcher.PerRequest: 11, batcher.PrefixMerging: 11, batcher.Tree: 6 + 1},
		},
		{
			name: "drift in the history branches inside the response",
			groups: group(trace.Session{ID: "a", Calls: []trace.Call{
				call("a", 0, ids(1, 2), ids(3, 4, 5)),
				call("a", 1, ids(1, 2, 3, 40, 41, 5, 6), ids(7)),
			}}),
			rows: map[batcher.Strategy]int64{batcher.PerRequest: 13, batcher.PrefixMerging: 13, batcher.Tree: 5 + 5},
		},
		{
			name: "untrainable call contributes nothing",
			groups: group(trace.Session{ID: "a", Calls: []trace.Call{
				{SessionID: "a", PromptIDs: ids(1, 2), ResponseIDs: ids(3), Trainable: false, UntrainableReason: "no logprobs"},
				call("a", 1, ids(1, 2, 3, 4), ids(5)),
			}}),
			rows: map[batcher.Strategy]int64{batcher.PerRequest: 5, batcher.PrefixMerging: 5, batcher.Tree: 5},
		},
	}
	for _, tt := range tests {
		want := perRequestTerms(tt.groups, batcher.GRPO)
		for _, s := range batcher.Strategies {
			t.Run(tt.name+"/"+string(s), func(t *testing.T) {
				cfg := testConfig(s)
				st, err := batcher.FormStep(1, tt.groups, cfg)
				if err != nil {
					t.Fatal(err)
				}
				if got := st.Stats.Rows; got != tt.rows[s] {
					t.Errorf("rows = %d, want %d", got, tt.rows[s])
				}
				diffTerms(t, string(s), decodeStep(t, st, cfg), want)
			})
		}
	}
}

func TestOverlongPathNamesSessionAndLengths(t *testing.T) {
	long := make([]int32, 70)
	for i := range long {
		long[i] = int32(i)
	}
	groups := group(trace.Session{ID: "sess-long", Calls: []trace.Call{call("sess-long", 0, long, ids(1, 2))}})
	for _, s := range batcher.Strategies {
		_, err := batcher.FormStep(3, groups, testConfig(s))
		if err == nil {
			t.Fatalf("%s: no error for a 72-row path with a 64-row budget", s)
		}
		for _, want := range []string{`"sess-long"`, "72 rows", "64 rows"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: error %q does not mention %s", s, err, want)
			}
		}
	}
}

func TestFormStepRejectsInvalidInput(t *testing.T) {
	bad := call("a", 0, ids(1, 2), ids(3))
	bad.Logprobs = []float32{0.5}
	tests := []struct {
		name   string
		groups []trace.Group
		cfg    func(*batcher.Config)
		want   string
	}{
		{"positive logprob", group(trace.Session{ID: "a", Calls: []trace.Call{bad}}), nil, "positive"},
		{"budget not a pad multiple", group(), func(c *batcher.Config) { c.TokenBudget = 100 }, "multiple"},
		{"unknown strategy", group(), func(c *batcher.Config) { c.Strategy = "flat" }, "unknown strategy"},
		{"zero ranks", group(), func(c *batcher.Config) { c.DPSize = 0 }, "data-parallel"},
		{"empty group", []trace.Group{{ID: "empty"}}, nil, "no sessions"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := testConfig(batcher.Tree)
			if tt.cfg != nil {
				tt.cfg(&cfg)
			}
			_, err := batcher.FormStep(1, tt.groups, cfg)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want one mentioning %q", err, tt.want)
			}
		})
	}
	_, err := batcher.FormStep(1, group(trace.Session{ID: "a", Calls: []trace.Call{bad}}), testConfig(batcher.Tree))
	if !errors.Is(err, trace.ErrInvalidCall) {
		t.Errorf("err = %v, want it to wrap trace.ErrInvalidCall", err)
	}
}

func TestAdvantages(t *testing.T) {
	rewards := []float64{1, 0, 0, 1}
	std := math.Sqrt(1.0 / 3) // unbiased: Σ(r-mean)² = 1 over n-1 = 3
	tests := []struct {
		kind batcher.Advantage
		want []float64
	}{
		{batcher.GRPO, []float64{0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)}},
		{batcher.DrGRPO, []float64{0.5, -0.5, -0.5, 0.5}},
		{batcher.RLOO, []float64{1 - 1.0/3, 0 - 2.0/3, 0 - 2.0/3, 1 - 1.0/3}},
	}
	for _, tt := range tests {
		got := batcher.Advantages(tt.kind, rewards)
		for i := range got {
			if math.Abs(got[i]-tt.want[i]) > 1e-12 {
				t.Errorf("%s: advantage[%d] = %v, want %v", tt.kind, i, got[i], tt.want[i])
			}
		}
		if one := batcher.Advantages(tt.kind, []float64{3}); one[0] != 0 {
			t.Errorf("%s: a group of one got advantage %v, want 0", tt.kind, one[0])
		}
	}
}
