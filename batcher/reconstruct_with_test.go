package batcher_test

import (
	"strings"
	"testing"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/trace"
)

// TestReconstructWithGivenAdvantages: the advantages given are the ones the samples
// train with, whatever cfg.Advantage says; the computed ones give what Reconstruct
// gives; a count other than the sessions' is refused.
func TestReconstructWithGivenAdvantages(t *testing.T) {
	g := group(
		trace.Session{ID: "a", Calls: []trace.Call{call("a", 0, ids(1, 2, 3), ids(4, 5))}},
		trace.Session{ID: "b", Calls: []trace.Call{call("b", 0, ids(1, 2, 3), ids(6))}},
	)[0]
	cfg := testConfig(batcher.Tree)
	computed, err := batcher.SessionAdvantages(cfg.Advantage, g.Sessions)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name       string
		advantages []float64
		want       []float32
		err        string
	}{
		{"computed", computed, []float32{float32(computed[0]), float32(computed[1])}, ""},
		{"recorded under another kind", []float64{-1.5, 1.5}, []float32{-1.5, 1.5}, ""},
		{"one per session", []float64{1}, nil, "1 advantages for 2 sessions"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := batcher.ReconstructWith(&g, cfg, tt.advantages)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("ReconstructWith: %v, want %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			for i, s := range r.Samples {
				if s.Advantage != tt.want[i] {
					t.Fatalf("sample %d trains with advantage %v, want %v", i, s.Advantage, tt.want[i])
				}
			}
			plain, err := batcher.Reconstruct(&g, cfg)
			if err != nil {
				t.Fatal(err)
			}
			if tt.name == "computed" && (plain.Samples[0] != r.Samples[0] || plain.Samples[1] != r.Samples[1]) {
				t.Fatalf("ReconstructWith the computed advantages %+v, Reconstruct %+v", r.Samples, plain.Samples)
			}
		})
	}
}
