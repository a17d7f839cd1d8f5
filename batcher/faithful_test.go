package batcher_test

import (
	"strings"
	"testing"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/internal/corpus"
	"github.com/floe-rl/floe/trace"
)

// checkFaithful forms one step per strategy from groups and checks that each trains
// exactly the per-request loss terms, decoded from the Arrow columns alone, and that the
// packing rules hold. It returns false when the budget cannot hold the longest path (an
// expected error, checked for its wording).
func checkFaithful(t *testing.T, groups []trace.Group, budget, pad, dp int, adv batcher.Advantage) bool {
	return checkFaithfulCost(t, groups, budget, pad, dp, adv, batcher.DefaultConfig().PassCost)
}

// checkFaithfulCost is checkFaithful under pass cost c.
func checkFaithfulCost(t *testing.T, groups []trace.Group, budget, pad, dp int, adv batcher.Advantage, c float64) bool {
	t.Helper()
	want := perRequestTerms(groups, adv)
	for _, s := range batcher.Strategies {
		cfg := batcher.DefaultConfig()
		cfg.Strategy, cfg.Advantage = s, adv
		cfg.TokenBudget, cfg.PadMultiple, cfg.DPSize, cfg.PassCost = budget, pad, dp, c
		st, err := batcher.FormStep(7, groups, cfg)
		if err != nil {
			if strings.Contains(err.Error(), "longer than the token budget") {
				return false
			}
			t.Fatalf("%s: %v", s, err)
		}
		checkPacking(t, st, cfg)
		diffTerms(t, string(s), decodeStep(t, st, cfg), want)
	}
	return true
}

// checkPacking checks the plan itself: budgets, equal micro-batch counts per rank, and
// that only trees larger than the budget are cut.
func checkPacking(t *testing.T, st *batcher.Step, cfg batcher.Config) {
	t.Helper()
	for r := range st.Ranks {
		if len(st.Ranks[r]) != len(st.Ranks[0]) {
			t.Fatalf("%s: rank %d has %d micro-batches, rank 0 has %d", cfg.Strategy, r, len(st.Ranks[r]), len(st.Ranks[0]))
		}
		for _, mb := range st.Ranks[r] {
			if mb.PaddedRows > int64(cfg.TokenBudget) || mb.PaddedRows%int64(cfg.PadMultiple) != 0 || mb.Rows > mb.PaddedRows {
				t.Fatalf("%s: micro-batch of %d rows padded to %d, budget %d", cfg.Strategy, mb.Rows, mb.PaddedRows, cfg.TokenBudget)
			}
		}
	}
	if st.Stats.MicroBatches%cfg.DPSize != 0 {
		t.Fatalf("%s: %d micro-batches for %d ranks", cfg.Strategy, st.Stats.MicroBatches, cfg.DPSize)
	}
	if st.Stats.Rows < st.Stats.DistinctRows {
		t.Fatalf("%s: %d rows placed, fewer than the %d distinct rows", cfg.Strategy, st.Stats.Rows, st.Stats.DistinctRows)
	}
	if st.Stats.Pieces == st.Stats.Trees && st.Stats.Rows != st.Stats.DistinctRows {
		t.Fatalf("%s: nothing was cut, yet %d rows placed for %d distinct", cfg.Strategy, st.Stats.Rows, st.Stats.DistinctRows)
	}
}

// TestFaithfulness is the property: on random groups with every kind of history event —
// shared task prompt, multi-turn chains, drift, stripped reasoning, compaction,
// sub-agents, retries, n>1 choices, untrainable calls — every strategy trains exactly the
// per-request loss terms, under budgets small enough to force cuts.
func TestFaithfulness(t *testing.T) {
	cfg := corpus.Small()
	cfg.Groups = 3
	advs := []batcher.Advantage{batcher.GRPO, batcher.DrGRPO, batcher.RLOO}
	cut := 0
	for seed := int64(1); seed <= 12; seed++ {
		groups, err := corpus.Generate(cfg, seed)
		if err != nil {
			t.Fatal(err)
		}
		longest := longestSequence(groups)
		for _, budget := range []int{roundUp(longest, 16), roundUp(longest*2, 16), 4096} {
			if !checkFaithful(t, groups, budget, 16, int(seed%4)+1, advs[seed%3]) {
				t.Fatalf("seed %d: budget %d refused although the longest call has %d tokens", seed, budget, longest)
			}
			// The pass cost splits trees that fit: at 0 never, at B/8 eagerly.
			for _, c := range []float64{0, float64(budget) / 8} {
				checkFaithfulCost(t, groups, budget, 16, int(seed%4)+1, advs[seed%3], c)
			}
			if budget < 4096 {
				cut++
			}
		}
	}
	if cut == 0 {
		t.Fatal("no case forced a cut")
	}
}

// FuzzFaithfulness explores seeds, budgets and rank counts. Budgets below the longest
// path must fail with the overlong-path error, never with a wrong layout.
func FuzzFaithfulness(f *testing.F) {
	f.Add(int64(1), uint16(300), uint8(2))
	f.Add(int64(2), uint16(90), uint8(1))
	f.Add(int64(3), uint16(2000), uint8(8))
	f.Fuzz(func(t *testing.T, seed int64, budget uint16, dp uint8) {
		// The pass cost follows the seed: 0 (no split of a tree that fits), the default,
		// or B/8 and B (eager splitting).
		cfg := corpus.Small()
		cfg.Groups = 2
		groups, err := corpus.Generate(cfg, seed)
		if err != nil {
			t.Fatal(err)
		}
		b := roundUp(int(budget)+1, 8)
		c := []float64{0, batcher.DefaultConfig().PassCost, float64(b) / 8, float64(b)}[uint64(seed)%4]
		ok := checkFaithfulCost(t, groups, b, 8, int(dp%8)+1, batcher.GRPO, c)
		if ok != (b >= longestSequence(groups)) {
			t.Fatalf("budget %d, longest call %d: formed = %v", b, longestSequence(groups), ok)
		}
	})
}

func longestSequence(groups []trace.Group) int {
	n := 0
	for _, g := range groups {
		for _, s := range g.Sessions {
			for _, c := range s.Calls {
				if c.Trainable {
					n = max(n, len(c.PromptIDs)+len(c.ResponseIDs))
				}
			}
		}
	}
	return n
}

func roundUp(x, m int) int { return (x + m - 1) / m * m }
