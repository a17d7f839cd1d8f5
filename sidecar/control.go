package sidecar

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"

	"github.com/floe-rl/floe/arrowflight"
	"github.com/floe-rl/floe/proxy"
)

// TrainerControl is the trainer-facing control state: pausing rollouts for a weight sync
// (through the proxy's gate, when there is one), the policy version, and each rank's last
// report.
type TrainerControl struct {
	Log *slog.Logger
	// Gate, when set, is the proxy's: pause holds new upstream calls and waits for those
	// in flight. It holds the paused state and the policy version, whoever changed them
	// (the Flight actions here, or the control API); without one, TrainerControl keeps
	// its own.
	Gate *proxy.Gate
	// OnReport, when set, is called with every accepted report (floe serve: metrics,
	// trainer PIDs for the GPU monitor, the step's end and the token budget).
	OnReport func(arrowflight.Report)
	// Ready, when set, is the READY buffer whose state the status reports.
	Ready *Ready
	// Describe, when set, adds floe serve's figures to a status: token budget, GPU,
	// last step, store.
	Describe func(*Status)

	mu      sync.Mutex
	own     *proxy.Gate // when Gate is nil
	reports map[int]arrowflight.Report
}

func (c *TrainerControl) gate() *proxy.Gate {
	if c.Gate != nil {
		return c.Gate
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.own == nil {
		c.own = &proxy.Gate{}
	}
	return c.own
}

var (
	_ arrowflight.Control        = (*TrainerControl)(nil)
	_ arrowflight.StatusReporter = (*TrainerControl)(nil)
)

func (c *TrainerControl) Pause(ctx context.Context) (int64, error) {
	v, err := c.gate().Pause(ctx)
	if err != nil {
		return 0, err
	}
	c.logger().Info("rollouts paused", "policy_version", v, "via", "flight")
	return v, nil
}

func (c *TrainerControl) Resume(_ context.Context, v int64) error {
	return resumeLogged(c.gate(), v, c.logger(), "flight")
}

// resumeLogged resumes gate under policy version v and logs it, saying whether the
// version moved: a resume at the same version (weights not pushed, or a manual resume)
// is worth seeing in the log too. via names the path (flight, control).
func resumeLogged(gate *proxy.Gate, v int64, log *slog.Logger, via string) error {
	_, previous, _ := gate.State()
	if err := gate.Resume(v); err != nil {
		log.Warn("resume refused", "policy_version", v, "current", previous, "via", via, "err", err)
		return err
	}
	log.Info("rollouts resumed", "policy_version", v, "previous", previous, "same_version", v == previous, "via", via)
	return nil
}

func (c *TrainerControl) Report(r arrowflight.Report) error {
	if r.Rank < 0 || r.Step < 0 || r.StepSeconds < 0 || r.WaitSeconds < 0 || r.PeakMemoryBytes < 0 {
		return fmt.Errorf("report %+v has a negative field", r)
	}
	if r.PID < 0 {
		return fmt.Errorf("report %+v has a negative pid", r)
	}
	c.mu.Lock()
	if c.reports == nil {
		c.reports = map[int]arrowflight.Report{}
	}
	c.reports[r.Rank] = r
	c.mu.Unlock()
	c.logger().Info("trainer report", "step", r.Step, "rank", r.Rank, "step_seconds", r.StepSeconds,
		"wait_seconds", r.WaitSeconds, "peak_memory_bytes", r.PeakMemoryBytes, "pid", r.PID)
	if c.OnReport != nil {
		c.OnReport(r)
	}
	return nil
}

// Status implements arrowflight.StatusReporter: the Flight status action answers a
// Snapshot.
func (c *TrainerControl) Status() any { return c.Snapshot() }

// Snapshot is floe's Status now.
func (c *TrainerControl) Snapshot() Status {
	paused, version, inflight := c.gate().State()
	out := Status{Paused: paused, PolicyVersion: version, Inflight: inflight, Reports: []arrowflight.Report{},
		PauseExpired: c.gate().PauseExpired()}
	if c.Ready != nil {
		out.ReadyStatus = c.Ready.Snapshot()
	}
	for _, r := range c.Reports() {
		out.Reports = append(out.Reports, r)
	}
	slices.SortFunc(out.Reports, func(a, b arrowflight.Report) int { return a.Rank - b.Rank })
	if c.Describe != nil {
		c.Describe(&out)
	}
	return out
}

// Reports returns each rank's last report.
func (c *TrainerControl) Reports() map[int]arrowflight.Report {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[int]arrowflight.Report, len(c.reports))
	for k, v := range c.reports {
		out[k] = v
	}
	return out
}

func (c *TrainerControl) Paused() bool {
	paused, _, _ := c.gate().State()
	return paused
}

func (c *TrainerControl) PolicyVersion() int64 {
	_, v, _ := c.gate().State()
	return v
}

func (c *TrainerControl) logger() *slog.Logger {
	if c.Log == nil {
		return slog.Default()
	}
	return c.Log
}
