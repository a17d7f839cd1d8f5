package batcher_test

import (
	"math"
	"testing"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/trace"
)

// Issue 13 item 7: a failed session's reward stays out of its group's baseline (its
// advantage is 0); a timed-out session's reward (0) is in it. The advantages are the
// formulas of docs/batcher.md written out over the baseline sessions.
func TestFailedSessionsAreOutOfTheBaseline(t *testing.T) {
	sessions := []trace.Session{
		{ID: "ok1", Reward: 1, Status: trace.StatusCompleted, Calls: []trace.Call{call("ok1", 0, ids(1, 2), ids(3))}},
		{ID: "ok2", Reward: 0.5, Status: trace.StatusCompleted, Calls: []trace.Call{call("ok2", 0, ids(1, 2), ids(4))}},
		{ID: "late", Reward: 0, Status: trace.StatusTimeout},
		{ID: "broke", Reward: 0, Status: trace.StatusFailed},
	}
	// baseline: rewards 1, 0.5, 0 -> mean 0.5, unbiased deviation 0.5
	mean, std := 0.5, 0.5
	want := map[batcher.Advantage][]float64{
		batcher.GRPO:   {(1 - mean) / (std + 1e-6), (0.5 - mean) / (std + 1e-6), (0 - mean) / (std + 1e-6), 0},
		batcher.DrGRPO: {0.5, 0, -0.5, 0},
		batcher.RLOO:   {1 - 0.25, 0.5 - 0.5, 0 - 0.75, 0}, //nolint:staticcheck // SA4000: each reward minus the mean of the others, written out as its neighbours are
	}
	for kind, w := range want {
		cfg := testConfig(batcher.Tree)
		cfg.Advantage = kind
		g := []trace.Group{{ID: "g", TaskID: "t", Sessions: append([]trace.Session(nil), sessions...)}}
		st, err := batcher.FormStep(1, g, cfg)
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]float32{}
		for _, s := range st.Samples {
			got[s.SessionID] = s.Advantage
		}
		for i, s := range sessions {
			if math.Abs(float64(got[s.ID])-w[i]) > 1e-6 {
				t.Errorf("%s: session %s (%s) advantage %v, want %v", kind, s.ID, s.Status, got[s.ID], w[i])
			}
		}
	}
}
