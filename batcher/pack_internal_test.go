package batcher

import (
	"math/rand/v2"
	"slices"
	"testing"
	"testing/quick"

	"github.com/floe-rl/floe/benchmarks/corpus"
)

// TestTreesThatFitAreNotSplit checks that cutting touches only trees larger than the
// budget: a tree that fits lands whole in exactly one piece.
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
