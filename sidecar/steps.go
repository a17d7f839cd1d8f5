package sidecar

import (
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/floe-rl/floe/arrowflight"
	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/gpu"
)

// keepUnfinished bounds how many committed steps whose reports never all came are kept.
const keepUnfinished = 64

// stepTracker follows each formed step from READY through serving and commit to the
// trainer's reports. When a step is committed and every rank has reported on it, the
// step is finished: the GPU window from its first micro-batch served to its commit is
// summarized, and with --token-budget auto the budget controller observes the step. It
// chooses the budget new steps are formed with and answers the status action's
// budget, GPU and last-step fields.
type stepTracker struct {
	log     *slog.Logger
	metrics *Metrics     // nil: none
	monitor *gpu.Monitor // nil: no GPU figures
	ctl     *gpu.BudgetController
	fixed   int // the budget without a controller
	now     func() time.Time

	// observer, when set, is told of each step's formation, reports and commit.
	observer StepObserver

	mu       sync.Mutex
	steps    map[int64]*stepState
	pids     map[int]int32 // trainer PIDs by rank
	last     *stepOutcome
	decision *gpu.BudgetDecision
}

type stepState struct {
	ranks     int
	budget    int
	maxRows   int // padded rows of the largest micro-batch
	stats     batcher.Stats
	formed    time.Time
	served    time.Time // first micro-batch sent; zero until then
	committed time.Time // zero until committed
	reports   map[int]arrowflight.Report
}

func newStepTracker(log *slog.Logger, m *Metrics, mon *gpu.Monitor, ctl *gpu.BudgetController, fixed int) *stepTracker {
	t := &stepTracker{log: log, metrics: m, monitor: mon, ctl: ctl, fixed: fixed, now: time.Now,
		steps: map[int64]*stepState{}, pids: map[int]int32{}}
	if m != nil {
		m.budget.Set(float64(t.Budget()))
	}
	return t
}

// Budget is the token budget the next new step is formed with.
func (t *stepTracker) Budget() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.budgetLocked()
}

func (t *stepTracker) budgetLocked() int {
	if t.ctl != nil {
		return t.ctl.Budget()
	}
	return t.fixed
}

// formed notes step st, formed with budget in took.
func (t *stepTracker) formed(st *batcher.Step, budget int, took time.Duration, recovered bool) {
	s := &stepState{ranks: len(st.Ranks), budget: budget, stats: st.Stats, formed: t.now(), reports: map[int]arrowflight.Report{}}
	for _, rank := range st.Ranks {
		for _, mb := range rank {
			s.maxRows = max(s.maxRows, int(mb.PaddedRows))
		}
	}
	t.mu.Lock()
	t.steps[st.Number] = s
	t.mu.Unlock()
	if t.metrics != nil {
		t.metrics.stepFormed(st, took, recovered)
	}
	if t.observer != nil {
		t.observer.StepFormed(st, took)
	}
}

// Served implements arrowflight.Observer: the step's GPU window opens with its first
// micro-batch sent.
func (t *stepTracker) Served(step int64, _, rows, bytes int) {
	if t.metrics != nil {
		t.metrics.served(rows, bytes)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if s, ok := t.steps[step]; ok && s.served.IsZero() {
		s.served = t.now()
	}
}

// committed notes that step n was committed.
func (t *stepTracker) committed(n int64) {
	if t.metrics != nil {
		t.metrics.stepsCommitted.Inc()
	}
	if t.observer != nil {
		t.observer.StepCommitted(n)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	s, ok := t.steps[n]
	if !ok {
		return
	}
	s.committed = t.now()
	for m, old := range t.steps {
		if m < n-keepUnfinished && !old.committed.IsZero() {
			delete(t.steps, m)
		}
	}
	t.finishIfDone(n, s)
}

// report takes one rank's report: its PID joins the GPU monitor's trainer PIDs, and the
// step finishes once committed and reported on by every rank.
func (t *stepTracker) report(r arrowflight.Report) {
	if t.metrics != nil {
		t.metrics.report(r.Rank, r.WaitSeconds, r.StepSeconds, r.PeakMemoryBytes)
	}
	if t.observer != nil {
		t.observer.TrainerReport(r)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if r.PID > 0 && t.pids[r.Rank] != r.PID {
		t.pids[r.Rank] = r.PID
		if t.monitor != nil {
			pids := make([]int32, 0, len(t.pids))
			for _, p := range t.pids {
				pids = append(pids, p)
			}
			t.monitor.SetTrainerPIDs(pids)
		}
	}
	s, ok := t.steps[r.Step]
	if !ok || r.Rank >= s.ranks {
		return
	}
	s.reports[r.Rank] = r
	t.finishIfDone(r.Step, s)
}

// finishIfDone finishes step n when it is committed and every rank reported.
func (t *stepTracker) finishIfDone(n int64, s *stepState) {
	if s.committed.IsZero() || len(s.reports) < s.ranks {
		return
	}
	delete(t.steps, n)
	out := &stepOutcome{Step: n, TokenBudget: s.budget, MaxMicroBatchRows: s.maxRows, Rows: s.stats.Rows,
		PerRequestTokens: s.stats.InputTokens, TokensSaved: s.stats.InputTokens - s.stats.Rows,
		Fill: s.stats.Fill, Imbalance: s.stats.Imbalance}
	for _, r := range s.reports {
		out.WaitSeconds = max(out.WaitSeconds, r.WaitSeconds)
		out.StepSeconds = max(out.StepSeconds, r.StepSeconds)
		out.PeakMemoryBytes = max(out.PeakMemoryBytes, r.PeakMemoryBytes)
	}
	var sum gpu.Summary
	if t.monitor != nil && t.monitor.DeviceCount() > 0 {
		from := s.served
		if from.IsZero() {
			from = s.formed
		}
		_, sum = t.monitor.Window(from, s.committed)
		out.GPUSamples, out.GPUBusyFraction = sum.Samples, sum.BusyFraction
		out.GPUPeakMemoryBytes, out.GPUMemoryTotalBytes = sum.PeakMemoryUsed, sum.MemoryTotal
		if t.metrics != nil {
			t.metrics.gpuStep(sum)
		}
	}
	t.last = out
	if t.ctl == nil {
		return
	}
	d := t.ctl.Observe(gpu.Observation{Rows: s.maxRows, ReportedPeak: uint64(out.PeakMemoryBytes),
		DevicePeak: sum.PeakMemoryUsed, MemoryTotal: sum.MemoryTotal})
	t.decision = &d
	if t.metrics != nil {
		t.metrics.budget.Set(float64(d.Budget))
	}
	if d.Budget != d.Previous {
		t.log.Info("token budget changed", "step", n, "budget", d.Budget, "previous", d.Previous, "reason", d.Reason,
			"peak_bytes", d.Peak, "limit_bytes", d.Limit, "predicted_bytes", d.Predicted)
	}
}

// describe adds the tracker's figures to a status: the budget, its last decision, the
// last finished step, the trainer PIDs and the GPUs watched.
func (t *stepTracker) describe(out *Status) {
	t.mu.Lock()
	defer t.mu.Unlock()
	out.TokenBudget, out.TokenBudgetMode = t.budgetLocked(), "fixed"
	if t.ctl != nil {
		out.TokenBudgetMode = "auto"
	}
	if d := t.decision; d != nil {
		out.TokenBudgetDecision = &budgetDecision{Budget: d.Budget, Previous: d.Previous, Reason: d.Reason,
			PeakBytes: d.Peak, LimitBytes: d.Limit, PredictedBytes: d.Predicted}
	}
	if t.last != nil {
		last := *t.last
		out.LastStep = &last
	}
	for _, p := range t.pids {
		out.TrainerPIDs = append(out.TrainerPIDs, p)
	}
	slices.Sort(out.TrainerPIDs)
	if t.monitor != nil {
		n := t.monitor.DeviceCount()
		out.GPUDevices = &n
	}
}
