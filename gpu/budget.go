package gpu

import (
	"errors"
	"fmt"
	"math"
)

// Defaults of BudgetConfig.
const (
	DefaultPadMultiple  = 128
	DefaultMemoryTarget = 0.9
	DefaultGrowFactor   = 1.25
	DefaultGrowAfter    = 3
	DefaultHistory      = 16
	DefaultPressureHold = 64
)

// BudgetConfig configures a BudgetController.
type BudgetConfig struct {
	PadMultiple int // B is always a multiple of it; DefaultPadMultiple when zero
	Min, Max    int // bounds of B in rows; Min defaults to PadMultiple, Max is required
	Initial     int // first B; Min when zero

	// MemoryTarget is the fraction of device memory the predicted peak must stay under;
	// DefaultMemoryTarget when zero.
	MemoryTarget float64
	// MemoryTotal is the trainer device's memory in bytes (the smallest, with several);
	// an Observation may supply it instead.
	MemoryTotal uint64

	// GrowFactor caps growth per decision (B grows by at most this factor, or one pad
	// multiple when that is more); DefaultGrowFactor when zero.
	GrowFactor float64
	// GrowAfter is the number of consecutive observations without pressure needed before
	// B grows; every change of B restarts the count. Set it above the number of steps
	// formed ahead so growth waits for a step packed with the current B.
	// DefaultGrowAfter when zero.
	GrowAfter int
	// History is how many recent observations the memory model is fitted on;
	// DefaultHistory when zero.
	History int
	// PressureHold is how many observations B stays below the rows of an observation
	// that was above the target (so a discontinuity the model cannot see is not hit
	// again at once); DefaultPressureHold when zero.
	PressureHold int
}

// Observation is what one finished training step says about memory.
type Observation struct {
	// Rows is the row count of the step's largest micro-batch (over all ranks).
	Rows int
	// ReportedPeak is the largest peak_memory_bytes the trainer ranks reported.
	ReportedPeak uint64
	// DevicePeak is NVML's peak device memory over the step (Summary.PeakMemoryUsed);
	// 0 without a GPU.
	DevicePeak uint64
	// MemoryTotal is the device memory (Summary.MemoryTotal); 0 to use the config's.
	MemoryTotal uint64
}

// BudgetDecision is the controller's answer to one observation.
type BudgetDecision struct {
	Budget, Previous int
	Reason           string // "hold", "grow", "shrink: pressure", "shrink: predicted", "ignored: ..."
	Peak, Limit      uint64 // the observation's peak and memory_target·total, bytes
	Base, PerRow     float64
	Predicted        uint64 // predicted peak at Budget
}

// BudgetController chooses the token budget B (rows per micro-batch) for
// `--token-budget auto`. It fits peak memory ≈ base + k·rows to recent observations and
// keeps the predicted peak at B under memory_target·total. It shrinks at once when an
// observation is above the target (or the model predicts it would be) and grows slowly:
// only after GrowAfter quiet observations, by at most GrowFactor, and half of the way to
// the model's largest safe B at a time. It is pure and deterministic: no clock, no I/O.
// Not safe for concurrent use.
type BudgetController struct {
	cfg   BudgetConfig
	b     int
	calm  int
	hist  []point
	total uint64

	base, k         float64 // the model for holding and shrinking
	baseGrow, kGrow float64 // the steeper model growth must satisfy
	slopeKnown      bool    // a history with varied rows has been seen

	ceiling     int // B stays at or below it while ceilingLeft > 0
	ceilingLeft int
}

type point struct{ rows, peak float64 }

// NewBudgetController validates cfg and fills its defaults.
func NewBudgetController(cfg BudgetConfig) (*BudgetController, error) {
	if cfg.PadMultiple <= 0 {
		cfg.PadMultiple = DefaultPadMultiple
	}
	if cfg.Min <= 0 {
		cfg.Min = cfg.PadMultiple
	}
	if cfg.MemoryTarget == 0 {
		cfg.MemoryTarget = DefaultMemoryTarget
	}
	if cfg.GrowFactor == 0 {
		cfg.GrowFactor = DefaultGrowFactor
	}
	if cfg.GrowAfter <= 0 {
		cfg.GrowAfter = DefaultGrowAfter
	}
	if cfg.History <= 0 {
		cfg.History = DefaultHistory
	}
	if cfg.PressureHold <= 0 {
		cfg.PressureHold = DefaultPressureHold
	}
	switch {
	case cfg.Max <= 0:
		return nil, errors.New("token budget: max rows is required")
	case cfg.Min%cfg.PadMultiple != 0 || cfg.Max%cfg.PadMultiple != 0:
		return nil, fmt.Errorf("token budget: min %d and max %d must be multiples of the pad multiple %d", cfg.Min, cfg.Max, cfg.PadMultiple)
	case cfg.Min > cfg.Max:
		return nil, fmt.Errorf("token budget: min %d above max %d", cfg.Min, cfg.Max)
	case cfg.MemoryTarget <= 0 || cfg.MemoryTarget > 1:
		return nil, fmt.Errorf("token budget: memory target %g outside (0, 1]", cfg.MemoryTarget)
	case cfg.GrowFactor < 1:
		return nil, fmt.Errorf("token budget: grow factor %g below 1", cfg.GrowFactor)
	}
	if cfg.Initial == 0 {
		cfg.Initial = cfg.Min
	}
	c := &BudgetController{cfg: cfg, total: cfg.MemoryTotal}
	c.b = c.clamp(c.floorPad(cfg.Initial))
	return c, nil
}

// Budget is the current B.
func (c *BudgetController) Budget() int { return c.b }

// Model is the fitted peak ≈ base + perRow·rows (bytes); ok is false before the first
// observation.
func (c *BudgetController) Model() (base, perRow float64, ok bool) {
	return c.base, c.k, len(c.hist) > 0
}

func (c *BudgetController) floorPad(rows int) int {
	return rows / c.cfg.PadMultiple * c.cfg.PadMultiple
}

func (c *BudgetController) ceilPad(rows int) int {
	return (rows + c.cfg.PadMultiple - 1) / c.cfg.PadMultiple * c.cfg.PadMultiple
}

func (c *BudgetController) clamp(b int) int { return min(max(b, c.cfg.Min), c.cfg.Max) }

// Observe takes one step's observation and returns the budget for the next steps.
func (c *BudgetController) Observe(o Observation) BudgetDecision {
	d := BudgetDecision{Previous: c.b, Budget: c.b, Reason: "hold"}
	peak := max(o.ReportedPeak, o.DevicePeak)
	if o.MemoryTotal > 0 && (c.total == 0 || o.MemoryTotal < c.total) {
		c.total = o.MemoryTotal
	}
	switch {
	case o.Rows <= 0:
		d.Reason = "ignored: no rows"
		return d
	case peak == 0:
		d.Reason = "ignored: no peak memory"
		return d
	case c.total == 0:
		d.Reason = "ignored: device memory unknown"
		return d
	}
	limit := c.cfg.MemoryTarget * float64(c.total)
	d.Peak, d.Limit = peak, uint64(limit)

	c.hist = append(c.hist, point{float64(o.Rows), float64(peak)})
	if len(c.hist) > c.cfg.History {
		c.hist = c.hist[len(c.hist)-c.cfg.History:]
	}
	c.fit()
	fitB := c.largestSafe(c.base, c.k, limit)
	growB := min(fitB, c.largestSafe(c.baseGrow, c.kGrow, limit))
	if c.ceilingLeft > 0 {
		c.ceilingLeft--
		fitB, growB = min(fitB, c.ceiling), min(growB, c.ceiling)
	}

	switch {
	case float64(peak) > limit:
		// Pressure: cut at once, below both the model's answer and a proportional
		// scaling of the observed rows, and by at least one pad multiple; and stay
		// below the rows that caused it for PressureHold observations.
		cut := min(fitB, c.floorPad(int(float64(o.Rows)*limit/float64(peak))), c.b-c.cfg.PadMultiple)
		c.set(c.clamp(cut))
		c.ceiling = c.clamp(min(c.b, o.Rows-c.cfg.PadMultiple))
		c.ceilingLeft = c.cfg.PressureHold
		d.Reason = "shrink: pressure"
	case fitB < c.b:
		c.set(fitB)
		d.Reason = "shrink: predicted"
	default:
		c.calm++
		if c.calm >= c.cfg.GrowAfter && growB > c.b {
			half := max(c.ceilPad((growB-c.b)/2), c.cfg.PadMultiple)
			capped := max(c.floorPad(int(float64(c.b)*c.cfg.GrowFactor)), c.b+c.cfg.PadMultiple)
			c.set(min(growB, c.b+half, capped))
			d.Reason = "grow"
		}
	}
	d.Budget, d.Base, d.PerRow = c.b, c.base, c.k
	d.Predicted = uint64(math.Max(0, c.base+c.k*float64(c.b)))
	return d
}

func (c *BudgetController) set(b int) {
	if b != c.b {
		c.calm = 0
	}
	c.b = b
}

// fit sets two models from the history: (base, k) for holding and shrinking, and the
// steeper (baseGrow, kGrow) for growing.
//
// Since base >= 0 (weights, optimizer state, the CUDA context), a linear k is at most
// min(peak/rows). When the rows observed vary by 5% or more, k is the least-squares
// slope clamped to [0, that bound] and kGrow the larger of k and the secant between
// the two largest row counts (the local slope, which a convex curve makes steeper than
// any bound drawn from smaller rows). When they do not vary, the slopes of the last
// history that did are kept, or, before there was one, the proportional bound. Each
// base is then raised so that no observation lies above its line.
func (c *BudgetController) fit() {
	kMax := math.Inf(1)
	lo, hi := math.Inf(1), 0.0
	var sx, sy float64
	for _, p := range c.hist {
		kMax = min(kMax, p.peak/p.rows)
		lo, hi = min(lo, p.rows), max(hi, p.rows)
		sx += p.rows
		sy += p.peak
	}
	switch {
	case hi >= 1.05*lo:
		n := float64(len(c.hist))
		mx, my := sx/n, sy/n
		var cov, v float64
		for _, p := range c.hist {
			cov += (p.rows - mx) * (p.peak - my)
			v += (p.rows - mx) * (p.rows - mx)
		}
		c.k = min(max(cov/v, 0), kMax)
		c.kGrow = max(c.k, c.topSecant())
		c.slopeKnown = true
	case !c.slopeKnown:
		c.k, c.kGrow = kMax, kMax
	}
	c.base, c.baseGrow = c.envelope(c.k), c.envelope(c.kGrow)
}

// envelope is the smallest base for which no observation lies above base + k·rows.
func (c *BudgetController) envelope(k float64) float64 {
	base := 0.0
	for _, p := range c.hist {
		base = max(base, p.peak-k*p.rows)
	}
	return base
}

// largestSafe is the largest B in [Min, Max], a multiple of the pad multiple, whose
// predicted peak is within limit; Min when even Min is not.
func (c *BudgetController) largestSafe(base, k, limit float64) int {
	if base > limit {
		return c.cfg.Min
	}
	if k <= 0 {
		return c.cfg.Max
	}
	rows := (limit - base) / k
	if rows >= float64(c.cfg.Max) {
		return c.cfg.Max
	}
	return c.clamp(c.floorPad(int(rows)))
}

// topSecant is the slope between the highest peaks at the two largest row counts of
// the history, or 0 when they are less than 5% apart.
func (c *BudgetController) topSecant() float64 {
	var x1, y1, x2, y2 float64 // x1 the largest rows, x2 the next
	for _, p := range c.hist {
		switch {
		case p.rows == x1:
			y1 = max(y1, p.peak)
		case p.rows > x1:
			x2, y2 = x1, y1
			x1, y1 = p.rows, p.peak
		case p.rows == x2:
			y2 = max(y2, p.peak)
		case p.rows > x2:
			x2, y2 = p.rows, p.peak
		}
	}
	if x2 == 0 || x1 < 1.05*x2 {
		return 0
	}
	return (y1 - y2) / (x1 - x2)
}
