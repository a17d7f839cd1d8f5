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
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/bolt"
)

// Node owns floe's training lifecycle: the store, the READY buffer, the step tracker,
// the step former, the archiver and the policy version. A step's life (formed, served,
// committed, archived, forgotten) and a session's end go through its methods, and every
// door (the Flight actions, the control API's /floe/v1) is a thin adapter over it, so
// that a pause, a resume, a report or a status is the same act, logged the same way and
// failing with the same error classes (arrowflight.ErrInvalid, ErrRefused,
// ErrUnavailable), whichever door it came through. Modelled on etcd raft's Node: the
// planner is the pure core, Run owns the goroutines that do I/O, and the step record
// holds decisions (docs/architecture.md, "One commit, from the trainer to the archive").
//
// floe serve builds the whole Node (Serve); floe proxy one with a store and a gate but
// no steps; floe corpus-serve one with a READY buffer alone. Each part it lacks is nil
// and its figures are absent from the status.
type Node struct {
	log   *slog.Logger
	gate  *proxy.Gate
	ready *Ready             // nil: no steps (floe proxy)
	store trace.SessionStore // nil: takes no sessions (floe corpus-serve)

	// floe serve's parts (Serve sets them): nil elsewhere.
	steps     *stepTracker
	former    *stepFormer
	archiver  *Archiver
	metrics   *Metrics
	upstreams *proxy.Pool

	// version is the policy version: the Node's, told to the gate (which stamps calls
	// with it) and to the former (which measures staleness against it).
	version *policyVersion
	// resumeMu orders resumes: the check against the current version, the durable write
	// and telling the gate are one act.
	resumeMu sync.Mutex

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
	// Ready is the READY buffer the Node commits from and whose state the status reports.
	Ready *Ready
	// Store takes the control API's sessions; nil: no sessions. A store that keeps
	// policy versions (trace.PolicyVersions) makes them durable: the Node starts at the
	// last one and records each resume before the gate hears of it.
	Store trace.SessionStore
}

// NewNode builds the Node over cfg, at the store's last policy version.
func NewNode(cfg NodeConfig) (*Node, error) {
	n := &Node{log: cfg.Log, gate: cfg.Gate, ready: cfg.Ready, store: cfg.Store,
		reports: map[int]arrowflight.Report{}, version: &policyVersion{}}
	if n.log == nil {
		n.log = slog.Default()
	}
	if n.gate == nil {
		n.gate = &proxy.Gate{}
	}
	if pv, ok := n.store.(trace.PolicyVersions); ok {
		v, err := pv.PolicyVersion()
		if err != nil {
			return nil, fmt.Errorf("reading the policy version: %w", err)
		}
		// Rollouts go on under the version the trainer last resumed them with.
		if err := n.gate.Resume(v); err != nil {
			return nil, err
		}
		n.version.set(v)
	}
	return n, nil
}

// Run runs the lifecycle's own goroutines, the step former and the archiver, until ctx
// ends; pending are the steps saved but not committed before a restart, formed again
// first.
func (n *Node) Run(ctx context.Context, pending []trace.StepRecord) error {
	errc := make(chan error, 2)
	running := 0
	if n.former != nil {
		running++
		go func() { errc <- n.former.run(ctx, pending) }()
	}
	if n.archiver != nil {
		running++
		go func() { errc <- n.archiver.Run(ctx) }()
	}
	var first error
	for range running {
		if err := <-errc; err != nil && first == nil {
			first = err
		}
	}
	return first
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

// Resume releases paused calls under policy version v: it records v durably (when the
// store keeps versions), then tells the gate and the former. It logs the resume saying
// whether the version moved: a resume at the same version (weights not pushed, or a
// manual resume) is worth seeing in the log too. A version older than the current one
// is ErrRefused.
func (n *Node) Resume(_ context.Context, v int64, via Door) error {
	n.resumeMu.Lock()
	defer n.resumeMu.Unlock()
	previous := n.version.get()
	refuse := func(err error) error {
		n.log.Warn("resume refused", "policy_version", v, "current", previous, "via", via, "err", err)
		return fmt.Errorf("resume: %w", err)
	}
	if v < previous {
		return refuse(fmt.Errorf("%w: policy version %d is older than the current %d: %w", arrowflight.ErrRefused, v, previous, proxy.ErrOlderVersion))
	}
	if pv, ok := n.store.(trace.PolicyVersions); ok && v != previous {
		if err := pv.SetPolicyVersion(v); err != nil {
			return refuse(fmt.Errorf("recording policy version %d: %w", v, err))
		}
	}
	if err := n.gate.Resume(v); err != nil {
		if errors.Is(err, proxy.ErrOlderVersion) {
			err = fmt.Errorf("%w: %w", arrowflight.ErrRefused, err)
		}
		return refuse(err)
	}
	n.version.set(v)
	n.log.Info("rollouts resumed", "policy_version", v, "previous", previous, "same_version", v == previous, "via", via)
	return nil
}

// Commit consumes step n, exactly once. The Node sequences it: the READY buffer marks
// the step as being committed (Step, Next and Status go on answering), the store makes
// the commit durable outside every lock, then the buffer releases the step, the tracker
// notes it, the former gets its room and the archiver its step.
func (n *Node) Commit(_ context.Context, step int64) error {
	if n.ready == nil {
		return fmt.Errorf("commit step %d: %w: floe forms no steps here", step, arrowflight.ErrNoSuchStep)
	}
	if err := n.ready.claim(step); err != nil {
		return err
	}
	var err error
	if c, ok := n.store.(interface{ CommitStep(int64) error }); ok {
		err = c.CommitStep(step)
	}
	if err := n.ready.settle(step, err); err != nil {
		return err
	}
	if n.steps != nil {
		n.steps.committed(step)
	}
	if n.former != nil {
		n.former.poke() // room in the buffer
	}
	if n.archiver != nil {
		n.archiver.Kick()
	}
	return nil
}

// FinishSession records a session's outcome and wakes the former: its group may be
// complete. It returns the session's group when the store can tell (ok false
// otherwise).
func (n *Node) FinishSession(_ context.Context, id string, reward float64, status trace.Status) (g trace.GroupState, ok bool, err error) {
	if n.store == nil {
		return g, false, fmt.Errorf("finish session %s: %w: floe takes no sessions here", id, arrowflight.ErrRefused)
	}
	if err := n.store.FinishSession(id, reward, status); err != nil {
		return g, false, fmt.Errorf("finish: %w: %w", arrowflight.ErrRefused, err)
	}
	if n.former != nil {
		n.former.poke()
	}
	if n.metrics != nil {
		n.metrics.sessionFinished(status)
	}
	if gs, isGS := n.store.(groupStates); isGS {
		if g, err := gs.SessionGroupState(id); err == nil {
			return g, true, nil
		}
	}
	return g, false, nil
}

// Report records what a trainer rank says about a step it finished, and tells the step
// tracker (metrics, the GPU monitor's trainer PIDs, the budget controller); a negative
// field is ErrInvalid.
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
	if n.steps != nil {
		n.steps.report(r)
	}
	return nil
}

// sessionCreated counts a session the control API created, for the status.
func (n *Node) sessionCreated() {
	n.mu.Lock()
	n.sessions++
	n.mu.Unlock()
}

// Status is floe's state now: the one builder both doors answer with. Each part the
// Node has adds its figures.
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
	if n.steps != nil {
		n.steps.describe(&out)
	}
	if n.former != nil {
		out.DroppedGroups = n.former.droppedGroups()
	}
	if n.upstreams != nil {
		out.Upstreams = n.upstreams.Status()
	}
	if u, ok := n.store.(interface{ Usage() (bolt.Usage, error) }); ok {
		if usage, err := u.Usage(); err == nil {
			out.Store = &usage // what the durable store holds and costs on disk
		} else {
			n.log.Warn("measuring the store", "err", err)
		}
	}
	if n.archiver != nil {
		a := n.archiver.Status()
		out.Archive = &a
	}
	return out
}

// Flight is the Node as the Flight service's Source and Control: the same calls, logged
// as coming through Flight.
func (n *Node) Flight() FlightDoor { return FlightDoor{n} }

// FlightDoor adapts a Node to arrowflight's Source and Control.
type FlightDoor struct{ n *Node }

var (
	_ arrowflight.Source          = FlightDoor{}
	_ arrowflight.Control[Status] = FlightDoor{}
)

func (d FlightDoor) Step(ctx context.Context, step int64) (arrowflight.Step, error) {
	return d.n.ready.Step(ctx, step)
}
func (d FlightDoor) Next(ctx context.Context) (arrowflight.Step, error) { return d.n.ready.Next(ctx) }
func (d FlightDoor) Commit(ctx context.Context, step int64) error       { return d.n.Commit(ctx, step) }
func (d FlightDoor) Pause(ctx context.Context) (int64, error)           { return d.n.Pause(ctx, ViaFlight) }
func (d FlightDoor) Resume(ctx context.Context, v int64) error {
	return d.n.Resume(ctx, v, ViaFlight)
}
func (d FlightDoor) Report(ctx context.Context, r arrowflight.Report) error {
	return d.n.Report(ctx, r)
}
func (d FlightDoor) Status(ctx context.Context) Status { return d.n.Status(ctx) }
