package batcher

import (
	"math/rand/v2"
	"slices"
	"testing"
	"testing/quick"

	"github.com/floe-rl/floe/internal/corpus"
)

// TestTreesThatFitAreNotSplit checks that, with no pass cost, cutting touches only trees
// larger than the budget: a tree that fits lands whole in exactly one piece. (With a pass
// cost a tree that fits may be split to save a pass: TestSplitSavesPasses.)
func TestTreesThatFitAreNotSplit(t *testing.T) {
	cc := corpus.Small()
	cc.Groups = 6
	groups, err := corpus.Generate(cc, 11)
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.PadMultiple = 8
	var sizes []int64
	var recs []*Reconstructed
	for i := range groups {
		r, err := Reconstruct(&groups[i], cfg)
		if err != nil {
			t.Fatal(err)
		}
		recs = append(recs, r)
		for _, root := range r.lay.trees {
			sizes = append(sizes, r.lay.subRows[root])
		}
	}
	slices.Sort(sizes)
	// A budget between the tree sizes, so that some trees fit and some are cut.
	cfg.TokenBudget = int(sizes[len(sizes)/2]+7) / 8 * 8
	cfg.DPSize = 3
	cfg.PassCost = 0
	st, err := Pack(1, recs, cfg)
	if err != nil {
		t.Fatal(err)
	}
	type key struct {
		lay  *layout
		root int32
	}
	count := map[key]int{}
	for _, p := range st.pieces {
		count[key{p.lay, p.root}]++
	}
	var whole, cut int
	for _, r := range recs {
		for _, root := range r.lay.trees {
			n := count[key{r.lay, root}]
			if r.lay.subRows[root] <= int64(cfg.TokenBudget) {
				whole++
				if n != 1 {
					t.Errorf("tree of %d rows fits the budget of %d but is in %d pieces", r.lay.subRows[root], cfg.TokenBudget, n)
				}
			} else {
				cut++
				if n < 2 {
					t.Errorf("tree of %d rows exceeds the budget of %d but is in %d piece(s)", r.lay.subRows[root], cfg.TokenBudget, n)
				}
			}
		}
	}
	if whole == 0 || cut == 0 {
		t.Fatalf("test input has %d whole and %d cut trees; want both", whole, cut)
	}
	if st.Stats.Rows < st.Stats.CutFloor {
		t.Errorf("%d rows placed, below the cut floor %d: the floor is not a floor", st.Stats.Rows, st.Stats.CutFloor)
	}
}

// TestBalanceGivesEveryRankTheSameCount checks, on random costs, that every bin goes to
// exactly one rank, every rank gets the same number, and the heaviest rank is within the
// largest single cost of the mean (what differencing guarantees at the least).
func TestBalanceGivesEveryRankTheSameCount(t *testing.T) {
	prop := func(seed uint64, dpRaw, perRaw uint8) bool {
		rng := rand.New(rand.NewPCG(seed, 1))
		dp, per := int(dpRaw%8)+1, int(perRaw%12)+1
		costs := make([]float64, dp*per)
		for i := range costs {
			costs[i] = 1 + rng.ExpFloat64()*1000
		}
		ranks := balance(costs, dp)
		seen := make([]bool, len(costs))
		var total, heaviest float64
		for _, bins := range ranks {
			if len(bins) != per {
				t.Logf("rank has %d bins, want %d", len(bins), per)
				return false
			}
			var load float64
			for _, b := range bins {
				if seen[b] {
					t.Logf("bin %d assigned twice", b)
					return false
				}
				seen[b] = true
				load += costs[b]
			}
			total += load
			heaviest = max(heaviest, load)
		}
		return heaviest <= total/float64(dp)+slices.Max(costs)
	}
	if err := quick.Check(prop, &quick.Config{MaxCount: 300}); err != nil {
		t.Fatal(err)
	}
}

func TestBalanceFindsAnEvenSplit(t *testing.T) {
	costs := []float64{8, 7, 6, 5, 4, 3, 2, 1} // {8,5,4,1} and {7,6,3,2} both weigh 18
	ranks := balance(costs, 2)
	var loads []float64
	for _, bins := range ranks {
		var l float64
		for _, b := range bins {
			l += costs[b]
		}
		loads = append(loads, l)
	}
	if loads[0] != 18 || loads[1] != 18 {
		t.Fatalf("rank loads %v, want [18 18]", loads)
	}
}

// TestSplitSavesPasses checks the pass cost on corpus steps: every plan costs at most what
// the plan with no pass cost costs under the same c (rows + c × micro-batches), levelling's
// row overhead aside, some plan saves passes, and with dp > 1 the ranks are even in
// lockstep where each gets ≥ 4. The lockstep bound is checked at B = 4096: this corpus's
// group trees hold 1.5–3k rows, so at B ≤ 2048 a micro-batch holds one or two pieces and
// evening them out would take splits that forward more than levelOverhead extra rows.
func TestSplitSavesPasses(t *testing.T) {
	cc := corpus.Small()
	cc.Groups = 8
	saved := 0
	for seed := int64(1); seed <= 4; seed++ {
		groups, err := corpus.Generate(cc, seed)
		if err != nil {
			t.Fatal(err)
		}
		for _, budget := range []int{1024, 2048, 4096} {
			for _, dp := range []int{1, 2, 4} {
				cfg := DefaultConfig()
				cfg.PadMultiple, cfg.TokenBudget, cfg.DPSize, cfg.PassCost = 16, budget, dp, 0
				base, err := FormStep(1, groups, cfg)
				if err != nil {
					t.Fatal(err)
				}
				for _, c := range []float64{float64(budget) / 64, float64(budget) / 8} {
					cfg.PassCost = c
					st, err := FormStep(1, groups, cfg)
					if err != nil {
						t.Fatal(err)
					}
					cost := func(s *Step) float64 { return float64(s.Stats.Rows) + c*float64(s.Stats.MicroBatches) }
					if cost(st) > cost(base)*(1+levelOverhead) {
						t.Errorf("seed %d B %d dp %d c %v: cost %v (%d rows, %d passes) above no-split %v (%d rows, %d passes)",
							seed, budget, dp, c, cost(st), st.Stats.Rows, st.Stats.MicroBatches, cost(base), base.Stats.Rows, base.Stats.MicroBatches)
					}
					if st.Stats.MicroBatches < base.Stats.MicroBatches {
						saved++
					}
					if dp > 1 && budget >= 4096 && st.Stats.MicroBatches >= 4*dp && st.Stats.LockstepImbalance > 1.05 {
						t.Errorf("seed %d B %d dp %d c %v: lockstep imbalance %.3f over %d micro-batches",
							seed, budget, dp, c, st.Stats.LockstepImbalance, st.Stats.MicroBatches)
					}
				}
			}
		}
	}
	if saved == 0 {
		t.Fatal("no plan saved a pass")
	}
}

// TestBalanceIsLockstep checks that micro-batch k of every rank is alike: bins of sorted
// costs land in rows of dp.
func TestBalanceIsLockstep(t *testing.T) {
	costs := []float64{10, 1, 9, 2, 10, 1, 9, 2}
	ranks := balance(costs, 2)
	for k := range ranks[0] {
		a, b := costs[ranks[0][k]], costs[ranks[1][k]]
		if a != b {
			t.Fatalf("micro-batch %d costs %v on rank 0 and %v on rank 1; want alike (%v)", k, a, b, ranks)
		}
	}
}
