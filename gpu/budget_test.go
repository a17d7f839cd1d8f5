package gpu

import (
	"math"
	"testing"
)

const (
	mib = 1 << 20
	gib = 1 << 30
)

// h200Total is an H200's memory as go-nvml's mock machine reports it.
const h200Total = 144384 * mib

type memModel func(rows int) uint64

func linear(base, perRow float64) memModel {
	return func(rows int) uint64 { return uint64(base + perRow*float64(rows)) }
}

// simStep is one simulated training step.
type simStep struct {
	rows   int    // rows of the step's largest micro-batch (the budget it was packed with)
	peak   uint64 // its peak memory
	budget int    // the budget after observing it
	reason string
}

// simulate runs steps training steps. A step is packed with the budget in force lag
// decisions earlier (steps are formed ahead), fills it, and peaks at model(rows)
// (spikes, when set, overrides a step's peak).
func simulate(t *testing.T, cfg BudgetConfig, model memModel, steps, lag int, spikes map[int]uint64) []simStep {
	t.Helper()
	c, err := NewBudgetController(cfg)
	if err != nil {
		t.Fatal(err)
	}
	budgets := []int{c.Budget()}
	var out []simStep
	for i := range steps {
		rows := budgets[max(0, len(budgets)-1-lag)]
		peak := model(rows)
		if p, ok := spikes[i]; ok {
			peak = p
		}
		d := c.Observe(Observation{Rows: rows, ReportedPeak: peak * 9 / 10, DevicePeak: peak, MemoryTotal: h200Total})
		if d.Budget%cfg.PadMultiple != 0 || d.Budget < cfg.Min || d.Budget > cfg.Max {
			t.Fatalf("step %d: budget %d not a multiple of %d in [%d, %d]", i, d.Budget, cfg.PadMultiple, cfg.Min, cfg.Max)
		}
		budgets = append(budgets, d.Budget)
		out = append(out, simStep{rows: rows, peak: peak, budget: d.Budget, reason: d.Reason})
	}
	return out
}

func baseCfg() BudgetConfig {
	return BudgetConfig{PadMultiple: 128, Min: 1024, Max: 131072, Initial: 4096}
}

// checkSlowGrowth asserts every increase is by at most the grow factor (or one pad
// multiple) and follows at least GrowAfter observations at the previous budget.
func checkSlowGrowth(t *testing.T, cfg BudgetConfig, tr []simStep, from int) {
	t.Helper()
	prev, since := tr[max(from-1, 0)].budget, 0
	for i := from; i < len(tr); i++ {
		since++
		b := tr[i].budget
		if b > prev {
			if lim := max(int(float64(prev)*DefaultGrowFactor), prev+cfg.PadMultiple); b > lim {
				t.Errorf("step %d: grew %d -> %d, more than %d", i, prev, b, lim)
			}
			if since < DefaultGrowAfter {
				t.Errorf("step %d: grew after %d observations, want >= %d", i, since, DefaultGrowAfter)
			}
		}
		if b != prev {
			since = 0
		}
		prev = b
	}
}

func TestBudgetConvergesOnLinearModel(t *testing.T) {
	limit := 0.9 * h200Total
	tests := []struct {
		name         string
		base, perRow float64
		lag          int
	}{
		{"large base", 60 * gib, 1.5 * mib, 0},
		{"large base, 2 steps ahead", 60 * gib, 1.5 * mib, 2},
		{"small base", 4 * gib, 3 * mib, 0},
		{"small base, 2 steps ahead", 4 * gib, 3 * mib, 2},
		{"max is safe", 10 * gib, 64 * 1024, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := baseCfg()
			cfg.GrowAfter = tt.lag + 1
			if cfg.GrowAfter < DefaultGrowAfter {
				cfg.GrowAfter = DefaultGrowAfter
			}
			tr := simulate(t, cfg, linear(tt.base, tt.perRow), 120, tt.lag, nil)
			want := min(int((limit-tt.base)/tt.perRow)/128*128, cfg.Max)
			for i, s := range tr {
				if float64(s.peak) > limit {
					t.Fatalf("step %d: peak %d above the target %d (rows %d)", i, s.peak, uint64(limit), s.rows)
				}
			}
			if got := tr[len(tr)-1].budget; got != want {
				t.Fatalf("converged to %d, want the largest safe budget %d", got, want)
			}
			checkSlowGrowth(t, cfg, tr, 0)
		})
	}
}

func TestBudgetNeverExceedsTargetOnMonotoneModels(t *testing.T) {
	limit := 0.9 * h200Total
	tests := []struct {
		name  string
		model memModel
	}{
		{"convex (attention-like quadratic term)", func(r int) uint64 {
			x := float64(r)
			return uint64(30*gib + 0.5*mib*x + 0.00004*mib*x*x)
		}},
		{"strongly convex", func(r int) uint64 {
			x := float64(r)
			return uint64(20*gib + 0.0002*mib*x*x)
		}},
		{"concave (saturating)", func(r int) uint64 {
			return uint64(50*gib + 60*gib*(1-math.Exp(-float64(r)/40000)))
		}},
	}
	for _, tt := range tests {
		for _, lag := range []int{0, 2} {
			t.Run(tt.name, func(t *testing.T) {
				cfg := baseCfg()
				tr := simulate(t, cfg, tt.model, 150, lag, nil)
				best := 0 // largest budget that is truly safe
				for b := cfg.Min; b <= cfg.Max; b += cfg.PadMultiple {
					if float64(tt.model(b)) <= limit {
						best = b
					}
				}
				for i, s := range tr {
					if float64(s.peak) > limit {
						t.Fatalf("lag %d, step %d: peak %.1f GiB above the target %.1f GiB at %d rows",
							lag, i, float64(s.peak)/gib, limit/gib, s.rows)
					}
				}
				got := tr[len(tr)-1].budget
				if got > best || float64(got) < 0.75*float64(best) {
					t.Fatalf("lag %d: settled at %d rows, want within [0.75, 1] of the largest safe %d", lag, got, best)
				}
				checkSlowGrowth(t, cfg, tr, 0)
			})
		}
	}
}

// A jump in memory beyond every row count observed is invisible to any model: the
// controller may hit it, but then cuts at once and stays below it for PressureHold
// observations.
func TestBudgetStaircaseOvershootsRarely(t *testing.T) {
	limit := 0.9 * h200Total
	stairs := func(r int) uint64 { return uint64(40*gib + float64((r+8191)/8192)*6*gib) }
	for _, lag := range []int{0, 2} {
		cfg := baseCfg()
		tr := simulate(t, cfg, stairs, 300, lag, nil)
		last := -DefaultPressureHold
		for i, s := range tr {
			if float64(s.peak) <= limit {
				continue
			}
			if i-last <= lag {
				continue // packed before the cut: steps formed ahead are already in flight
			}
			if i-last < DefaultPressureHold {
				t.Errorf("lag %d: over the target at steps %d and %d, less than %d apart", lag, last, i, DefaultPressureHold)
			}
			if s.budget >= s.rows || s.reason != "shrink: pressure" {
				t.Errorf("lag %d, step %d: over the target at %d rows, budget %d (%s)", lag, i, s.rows, s.budget, s.reason)
			}
			last = i
		}
	}
}

func TestBudgetShrinksAtOnceOnSpikeAndGrowsBackSlowly(t *testing.T) {
	cfg := baseCfg()
	model := linear(60*gib, 1.5*mib)
	const spikeAt = 80
	tr := simulate(t, cfg, model, 200, 0, map[int]uint64{spikeAt: uint64(h200Total * 97 / 100)})
	before := tr[spikeAt-1].budget
	after := tr[spikeAt].budget
	if tr[spikeAt].reason != "shrink: pressure" || after >= before {
		t.Fatalf("spike: budget %d -> %d (%s), want an immediate cut", before, after, tr[spikeAt].reason)
	}
	if want := int(float64(before)*0.9/0.97) / 128 * 128; after > want {
		t.Errorf("spike of 0.97 against 0.9 cut the budget only from %d to %d, want <= %d", before, after, want)
	}
	checkSlowGrowth(t, cfg, tr, spikeAt+1)
	// It grows back over several decisions, not in one.
	back := -1
	for i := spikeAt + 1; i < len(tr); i++ {
		if tr[i].budget == before {
			back = i
			break
		}
	}
	if back < 0 {
		t.Fatalf("never grew back to %d (ends at %d)", before, tr[len(tr)-1].budget)
	}
	if back-spikeAt < 2*DefaultGrowAfter {
		t.Errorf("back to %d only %d steps after the spike", before, back-spikeAt)
	}
}

func TestBudgetDecisions(t *testing.T) {
	total := uint64(100 * gib)
	tests := []struct {
		name    string
		initial int
		obs     []Observation
		want    []int
		reasons []string
	}{
		{
			name:    "pressure cuts at once, at least one pad multiple",
			initial: 8192,
			obs:     []Observation{{Rows: 8192, DevicePeak: 91 * gib}},
			want:    []int{8064},
			reasons: []string{"shrink: pressure"},
		},
		{
			name:    "pressure scales with the overshoot",
			initial: 8192,
			obs:     []Observation{{Rows: 8192, ReportedPeak: 120 * gib}},
			want:    []int{6144},
			reasons: []string{"shrink: pressure"},
		},
		{
			name:    "pressure at min stays at min",
			initial: 1024,
			obs:     []Observation{{Rows: 1024, DevicePeak: 99 * gib}},
			want:    []int{1024},
			reasons: []string{"shrink: pressure"},
		},
		{
			name:    "waits GrowAfter quiet observations, then grows by at most the factor",
			initial: 4096,
			obs:     []Observation{{Rows: 4096, DevicePeak: 10 * gib}, {Rows: 4096, DevicePeak: 10 * gib}, {Rows: 4096, DevicePeak: 10 * gib}, {Rows: 4096, DevicePeak: 10 * gib}},
			want:    []int{4096, 4096, 5120, 5120},
			reasons: []string{"hold", "hold", "grow", "hold"},
		},
		{
			name:    "observations without rows, peak or total are ignored",
			initial: 4096,
			obs:     []Observation{{Rows: 0, DevicePeak: 99 * gib}, {Rows: 4096}},
			want:    []int{4096, 4096},
			reasons: []string{"ignored: no rows", "ignored: no peak memory"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := NewBudgetController(BudgetConfig{Min: 1024, Max: 65536, Initial: tt.initial, MemoryTotal: total})
			if err != nil {
				t.Fatal(err)
			}
			for i, o := range tt.obs {
				d := c.Observe(o)
				if d.Budget != tt.want[i] || d.Reason != tt.reasons[i] {
					t.Fatalf("observation %d: budget %d (%s), want %d (%s)", i, d.Budget, d.Reason, tt.want[i], tt.reasons[i])
				}
			}
		})
	}
}

func TestBudgetDeterministic(t *testing.T) {
	cfg := baseCfg()
	model := linear(30*gib, 2*mib)
	a := simulate(t, cfg, model, 60, 1, map[int]uint64{20: 140 * gib})
	b := simulate(t, cfg, model, 60, 1, map[int]uint64{20: 140 * gib})
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("step %d differs: %+v vs %+v", i, a[i], b[i])
		}
	}
}

func TestBudgetConfigErrors(t *testing.T) {
	tests := []struct {
		name string
		cfg  BudgetConfig
	}{
		{"no max", BudgetConfig{}},
		{"min above max", BudgetConfig{Min: 2048, Max: 1024}},
		{"not pad multiples", BudgetConfig{Min: 1000, Max: 4096}},
		{"target above 1", BudgetConfig{Max: 4096, MemoryTarget: 1.5}},
		{"shrinking growth", BudgetConfig{Max: 4096, GrowFactor: 0.5}},
	}
	for _, tt := range tests {
		if _, err := NewBudgetController(tt.cfg); err == nil {
			t.Errorf("%s: no error", tt.name)
		}
	}
	c, err := NewBudgetController(BudgetConfig{Max: 4096, Initial: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if c.Budget() != 896 {
		t.Errorf("initial 1000 rows -> %d, want 896 (rounded down to the pad multiple)", c.Budget())
	}
}
