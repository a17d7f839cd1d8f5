package batcher_test

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/trace"
)

// Issue 12 item 5 / issue 13 item 4: a step never carries a non-finite advantage or
// log-prob. Rewards whose advantages overflow (dr_grpo with 1e39 is beyond float32; grpo
// with ±1e308 overflows the deviation and used to give 0 silently) and a trainable call
// holding vLLM's -9999 sentinel are refused, naming the group.
func TestFormStepRefusesNonFiniteSignal(t *testing.T) {
	twoSessions := func(r0, r1 float64) []trace.Group {
		return []trace.Group{{ID: "g-big", TaskID: "t", Sessions: []trace.Session{
			{ID: "a", Reward: r0, Calls: []trace.Call{call("a", 0, ids(1, 2), ids(3))}},
			{ID: "b", Reward: r1, Calls: []trace.Call{call("b", 0, ids(1, 2), ids(4))}},
		}}}
	}
	sentinel := call("b", 0, ids(1, 2), ids(4, 5))
	sentinel.Logprobs = []float32{-0.5, -9999}
	tests := []struct {
		name   string
		kind   batcher.Advantage
		groups []trace.Group
		is     error
	}{
		{"dr_grpo reward 1e39", batcher.DrGRPO, twoSessions(1e39, 0), batcher.ErrNonFiniteAdvantage},
		{"rloo reward 1e39", batcher.RLOO, twoSessions(1e39, 0), batcher.ErrNonFiniteAdvantage},
		{"grpo rewards ±1e308", batcher.GRPO, twoSessions(1e308, -1e308), batcher.ErrNonFiniteAdvantage},
		{"grpo rewards 1e308, 1e308", batcher.GRPO, twoSessions(1e308, 1e308), batcher.ErrNonFiniteAdvantage},
		{"logprob -9999", batcher.GRPO, []trace.Group{{ID: "g-big", TaskID: "t", Sessions: []trace.Session{
			{ID: "a", Reward: 1, Calls: []trace.Call{call("a", 0, ids(1, 2), ids(3))}},
			{ID: "b", Reward: 0, Calls: []trace.Call{sentinel}},
		}}}, trace.ErrInvalidCall},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := testConfig(batcher.Tree)
			cfg.Advantage = tt.kind
			step, err := batcher.FormStep(1, tt.groups, cfg)
			if err == nil {
				for _, s := range step.Samples {
					t.Logf("sample %s advantage %v", s.SessionID, s.Advantage)
				}
				t.Fatal("FormStep formed the step")
			}
			if !errors.Is(err, tt.is) || !strings.Contains(err.Error(), `group "g-big"`) {
				t.Fatalf("err = %v, want %v naming the group", err, tt.is)
			}
		})
	}
	// Large but representable rewards still train, with the right advantages.
	cfg := testConfig(batcher.Tree)
	cfg.Advantage = batcher.DrGRPO
	step, err := batcher.FormStep(1, twoSessions(1e30, -1e30), cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range step.Samples {
		if want := map[string]float64{"a": 1e30, "b": -1e30}[s.SessionID]; math.Abs(float64(s.Advantage)-want) > 1e24 {
			t.Errorf("session %s advantage %v, want %v", s.SessionID, s.Advantage, want)
		}
	}
}
