package sidecar

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"

	"github.com/floe-rl/floe/arrowflight"
	"github.com/floe-rl/floe/proxy"
)

// Node is floe's one control path: every door (the Flight actions, the control API's
// /floe/v1) is a thin adapter over it, so that a pause, a resume, a report or a status
// is the same act, logged the same way and failing with the same error classes
// (arrowflight.ErrInvalid, ErrRefused, ErrUnavailable), whichever door it came through
// (docs/architecture.md, "One control path").
type Node struct {
	log   *slog.Logger
	gate  *proxy.Gate
	ready *Ready       // nil: no steps (floe proxy)
	store SessionStore // nil: takes no sessions (floe corpus-serve)
	// describe adds floe serve's figures to a status (token budget, GPU, last step,
	// store, archive); onReport passes an accepted report on (metrics, GPU monitor,
	// budget controller).
	describe func(*Status)
	onReport func(arrowflight.Report)

	mu       sync.Mutex
	reports  map[int]arrowflight.Report
	sessions int // created since start
}

// NodeConfig is what a Node is built from; every field is optional.
type NodeConfig struct {
	Log *slog.Logger
	// Gate is the proxy's: a pause holds new upstream calls and waits for those in
	// flight. Nil: the Node keeps a gate of its own (floe corpus-serve has no proxy, and
	// its trainer still pauses and resumes).
	Gate *proxy.Gate
	// Ready is the READY buffer whose state the status reports.
	Ready *Ready
	// Store takes the control API's sessions; nil: no sessions.
	Store SessionStore
	// Describe adds floe serve's own figures to a status.
	Describe func(*Status)
	// OnReport is called with every accepted report.
	OnReport func(arrowflight.Report)
}

// NewNode builds the Node over cfg.
func NewNode(cfg NodeConfig) *Node {
	n := &Node{log: cfg.Log, gate: cfg.Gate, ready: cfg.Ready, store: cfg.Store, describe: cfg.Describe,
		onReport: cfg.OnReport, reports: map[int]arrowflight.Report{}}
	if n.log == nil {
		n.log = slog.Default()
	}
	if n.gate == nil {
		n.gate = &proxy.Gate{}
	}
	return n
}

// Door names the way a control call came in, for the log.
type Door string

// The doors a control call comes through.
const (
	ViaFlight  Door = "flight"
	ViaControl Door = "control"
)

// Pause stops new rollout calls and waits for those in flight (at most the gate's drain
// timeout); it returns the current policy version. A pause that cannot finish (ctx ends
// first) is ErrUnavailable: the gate stays paused and the caller may try again.
func (n *Node) Pause(ctx context.Context, via Door) (int64, error) {
	v, err := n.gate.Pause(ctx)
	if err != nil {
		n.log.Warn("pause did not finish", "via", via, "err", err)
		return 0, fmt.Errorf("pause: %w: %w", arrowflight.ErrUnavailable, err)
	}
	n.log.Info("rollouts paused", "policy_version", v, "via", via)
	return v, nil
}

// Resume releases paused calls under policy version v and logs it, saying whether the
// version moved: a resume at the same version (weights not pushed, or a manual resume)
// is worth seeing in the log too. A version older than the current one is ErrRefused.
func (n *Node) Resume(_ context.Context, v int64, via Door) error {
	_, previous, _ := n.gate.State()
	if err := n.gate.Resume(v); err != nil {
		n.log.Warn("resume refused", "policy_version", v, "current", previous, "via", via, "err", err)
		if errors.Is(err, proxy.ErrOlderVersion) {
			return fmt.Errorf("resume: %w: %w", arrowflight.ErrRefused, err)
		}
		return fmt.Errorf("resume: %w", err)
	}
	n.log.Info("rollouts resumed", "policy_version", v, "previous", previous, "same_version", v == previous, "via", via)
	return nil
}

// Report records what a trainer rank says about a step it finished; a negative field is
// ErrInvalid.
func (n *Node) Report(_ context.Context, r arrowflight.Report) error {
	if r.Rank < 0 || r.Step < 0 || r.StepSeconds < 0 || r.WaitSeconds < 0 || r.PeakMemoryBytes < 0 {
		return fmt.Errorf("report %+v has a negative field: %w", r, arrowflight.ErrInvalid)
	}
	if r.PID < 0 {
		return fmt.Errorf("report %+v has a negative pid: %w", r, arrowflight.ErrInvalid)
	}
	n.mu.Lock()
	n.reports[r.Rank] = r
	n.mu.Unlock()
	n.log.Info("trainer report", "step", r.Step, "rank", r.Rank, "step_seconds", r.StepSeconds,
		"wait_seconds", r.WaitSeconds, "peak_memory_bytes", r.PeakMemoryBytes, "pid", r.PID)
	if n.onReport != nil {
		n.onReport(r)
	}
	return nil
}

// sessionCreated counts a session the control API created, for the status.
func (n *Node) sessionCreated() {
	n.mu.Lock()
	n.sessions++
	n.mu.Unlock()
}

// Status is floe's state now: the one builder both doors answer with.
func (n *Node) Status(context.Context) Status {
	paused, version, inflight := n.gate.State()
	out := Status{Paused: paused, PolicyVersion: version, Inflight: inflight, Reports: []arrowflight.Report{},
		PauseExpired: n.gate.PauseExpired()}
	if n.ready != nil {
		out.ReadyStatus = n.ready.Snapshot()
	}
	n.mu.Lock()
	for _, r := range n.reports {
		out.Reports = append(out.Reports, r)
	}
	created := n.sessions
	n.mu.Unlock()
	slices.SortFunc(out.Reports, func(a, b arrowflight.Report) int { return a.Rank - b.Rank })
	if n.store != nil {
		out.Sessions = &created
		if gs, ok := n.store.(groupStates); ok {
			if all, err := gs.Groups(); err == nil {
				out.Groups = groupCounts(all)
			} else {
				n.log.Warn("counting groups for the status", "err", err)
			}
		}
	}
	if n.describe != nil {
		n.describe(&out)
	}
	return out
}

// Flight is the Node as the Flight service's Control: the same calls, logged as coming
// through Flight.
func (n *Node) Flight() arrowflight.Control[Status] { return flightDoor{n} }

type flightDoor struct{ n *Node }

func (d flightDoor) Pause(ctx context.Context) (int64, error) { return d.n.Pause(ctx, ViaFlight) }
func (d flightDoor) Resume(ctx context.Context, v int64) error {
	return d.n.Resume(ctx, v, ViaFlight)
}
func (d flightDoor) Report(ctx context.Context, r arrowflight.Report) error {
	return d.n.Report(ctx, r)
}
func (d flightDoor) Status(ctx context.Context) Status { return d.n.Status(ctx) }
