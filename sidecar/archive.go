package sidecar

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/archive"
)

// Archiver moves committed steps out of the store into the Parquet archive
// (docs/archive.md): each step's calls, sessions (with their advantages) and record are
// written to the archive, durable, and only then removed from the store in one write;
// the store is compacted when that pays. A crash anywhere leaves the step in the store
// (it is archived again, its files replaced) or gone from it with its files complete.
// What a step trained on (each session's advantage, each call's mark) is replayed from
// the decisions its record holds, never derived from floe's settings.
type Archiver struct {
	Store trace.ArchiveStore
	Dir   string // the archive's directory (Retention.Dir of the data dir)
	// Retention holds the retry delays and the compaction thresholds; its Archive and
	// ArchiveDir were read by whoever built the archiver.
	Retention trace.Retention
	Mem       memory.Allocator
	Log       *slog.Logger
	// Write bounds the memory one step's calls take while they are written (zero: the
	// production setting).
	Write archive.WriteOptions
	// Metrics, when set, counts the steps archived, the failures and the time taken.
	Metrics ArchiveMetrics

	mu      sync.Mutex // guards failing and status
	failing map[string]*archiveFailure
	status  ArchiveStatus
	now     func() time.Time

	kick chan struct{}
	// live is the store's live bytes at the latest passes: compaction is measured against
	// their largest (hysteresis).
	live liveWindow
	// at, set by crash tests, is called at each stage of archiving a step.
	at func(stage string)
}

// NewArchiver returns an archiver of store into dir.
func NewArchiver(store trace.ArchiveStore, dir string, mem memory.Allocator, log *slog.Logger) *Archiver {
	return &Archiver{Store: store, Dir: dir, Mem: mem, Log: log, kick: make(chan struct{}, 1),
		failing: map[string]*archiveFailure{}, now: time.Now}
}

// ArchiveMetrics is what the archiver reports to Prometheus (*Metrics).
type ArchiveMetrics interface {
	// StepArchived: a step (or a dropped group: step false) left the store for the
	// archive, in took.
	StepArchived(step bool, took time.Duration)
	// ArchiveFailed: archiving a step or a dropped group failed (it stays in the store).
	ArchiveFailed(step bool)
}

// ArchiveStatus is the archiver's part of the status (docs/control.md): what it did
// since floe started and what keeps failing.
type ArchiveStatus struct {
	// StepsArchived and GroupsArchived count the steps and dropped groups archived.
	StepsArchived  int `json:"steps_archived"`
	GroupsArchived int `json:"dropped_groups_archived"`
	// Failures counts failed attempts; Failing lists what failed at its last attempt
	// ("step 12", "dropped group g7"), oldest first, with LastError the latest error.
	Failures  int      `json:"failures"`
	Failing   []string `json:"failing,omitempty"`
	LastError string   `json:"last_error,omitempty"`
}

// archiveFailure is a step or group that failed: tried again after next.
type archiveFailure struct {
	count int
	first time.Time
	next  time.Time
}

// Status is what the archiver did and what is failing.
func (a *Archiver) Status() ArchiveStatus {
	a.mu.Lock()
	defer a.mu.Unlock()
	st := a.status
	type f struct {
		what  string
		first time.Time
	}
	var fs []f
	for what, af := range a.failing {
		fs = append(fs, f{what, af.first})
	}
	slices.SortFunc(fs, func(x, y f) int { return x.first.Compare(y.first) })
	for _, x := range fs {
		st.Failing = append(st.Failing, x.what)
	}
	return st
}

// due says whether what may be tried now (it has not failed, or its wait is over).
func (a *Archiver) due(what string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	f := a.failing[what]
	return f == nil || !a.clock().Before(f.next)
}

func (a *Archiver) clock() time.Time {
	if a.now == nil {
		return time.Now()
	}
	return a.now()
}

// outcome records how archiving what went: err nil, done; otherwise a failure, logged,
// counted, and what waits before it is tried again.
func (a *Archiver) outcome(what string, step bool, took time.Duration, err error) {
	a.mu.Lock()
	if err == nil {
		delete(a.failing, what)
		if step {
			a.status.StepsArchived++
		} else {
			a.status.GroupsArchived++
		}
	} else {
		f := a.failing[what]
		if f == nil {
			if a.failing == nil {
				a.failing = map[string]*archiveFailure{}
			}
			f = &archiveFailure{first: a.clock()}
			a.failing[what] = f
		}
		f.count++
		wait := a.Retention.RetryWait(f.count)
		f.next = a.clock().Add(wait)
		a.status.Failures++
		// The first line: a panic's stack stays in the log, out of the status.
		a.status.LastError, _, _ = strings.Cut(err.Error(), "\n")
		a.Log.Error("archiving failed (it stays in the store and is tried again; the others go on)", "what", what,
			"failures_in_a_row", f.count, "retry_in", wait, "err", err)
	}
	a.mu.Unlock()
	if a.Metrics == nil {
		return
	}
	if err == nil {
		a.Metrics.StepArchived(step, took)
	} else {
		a.Metrics.ArchiveFailed(step)
	}
}

// Kick asks Run to archive the steps committed since; it never blocks.
func (a *Archiver) Kick() {
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

// Run archives the committed steps left in the store (those a crash or a floe without
// archiving left), then each step as it is committed (Kick), until ctx ends. A step that
// fails to archive stays in the store and is tried again later (RetryAfter), while the
// steps after it are archived; nothing is lost, and training goes on.
func (a *Archiver) Run(ctx context.Context) error {
	tick := time.NewTicker(time.Minute)
	defer tick.Stop()
	for {
		if _, err := a.ArchiveCommitted(ctx); err != nil && ctx.Err() == nil {
			a.Log.Error("archiving committed steps (what failed stays in the store and is tried again)", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-a.kick:
		case <-tick.C:
		}
	}
}

// ArchiveCommitted archives every committed step still in the store, in order, and
// every dropped group (never trained, so final too), then compacts the store when the
// policy says it pays. A step or group that fails is skipped (and left for a while,
// RetryAfter) so that it never holds back the others; the error says what failed. ctx
// is checked between steps and between groups: a SIGTERM during a backlog returns
// promptly, leaving the rest for the next start. It returns the steps archived.
func (a *Archiver) ArchiveCommitted(ctx context.Context) ([]int64, error) {
	steps, err := a.Store.ArchivableSteps()
	if err != nil {
		return nil, fmt.Errorf("listing committed steps: %w", err)
	}
	var done []int64
	var errs []error
	for _, n := range steps {
		if err := ctx.Err(); err != nil {
			return done, err
		}
		what := fmt.Sprintf("step %d", n)
		if !a.due(what) {
			continue
		}
		began := time.Now()
		err := safely("archiving "+what, func() error { return a.archiveStep(ctx, n) })
		if ctx.Err() != nil {
			return done, errors.Join(append(errs, ctx.Err())...)
		}
		a.outcome(what, true, time.Since(began), err)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		done = append(done, n)
	}
	var dropped int
	err = safely("archiving dropped groups", func() (err error) { dropped, err = a.archiveDropped(ctx); return err })
	if err != nil {
		errs = append(errs, err)
	}
	if ctx.Err() != nil {
		return done, errors.Join(append(errs, ctx.Err())...)
	}
	if len(done) == 0 && dropped == 0 {
		return done, errors.Join(errs...)
	}
	c, err := a.Store.CompactIfWorth(a.Retention.Compact, a.live.max())
	if err != nil {
		return done, errors.Join(append(errs, err)...)
	}
	a.live.add(c.LiveBytes)
	if c.Compacted {
		a.Log.Info("store compacted", "before_bytes", c.BeforeBytes, "after_bytes", c.AfterBytes, "live_bytes", c.LiveBytes,
			"took", c.Took.Round(time.Millisecond))
	}
	a.stage("compacted")
	return done, errors.Join(errs...)
}

func (a *Archiver) stage(s string) {
	if a.at != nil {
		a.at(s)
	}
}

// safely runs archiving work fn, turning a panic in it into an error: a step that
// cannot be archived must cost floe that step's archiving (it stays in the store, and
// is tried again), never the process, which would die again on the same step at every
// restart.
func safely(what string, fn func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%s: panic: %v\n%s", what, r, debug.Stack())
		}
	}()
	return fn()
}

// archiveStep writes step n to the archive, reading and writing its calls one at a time
// (a session of any length is never in memory whole), and then forgets it in the store.
func (a *Archiver) archiveStep(ctx context.Context, n int64) error {
	began := time.Now()
	sc, err := a.Store.CommittedStepHead(n)
	if err != nil {
		return fmt.Errorf("archiving step %d: %w", n, err)
	}
	calls := 0
	rows := func(r *archive.Rows) error {
		if sc.Record.Decisions == nil {
			return fmt.Errorf("step %d has no recorded decisions (an older floe formed it, and floe serve could not decide it at start): what it trained on is unknown", n)
		}
		decided := sessionDecisions(sc.Record.Decisions)
		sessions := 0
		for _, gid := range sc.Record.Groups {
			if err := ctx.Err(); err != nil {
				return err
			}
			g, times, err := a.Store.GroupSessions(gid)
			if err != nil {
				return fmt.Errorf("step %d: %w", n, err)
			}
			k, err := a.groupRows(r, g, times, func(s *trace.Session) (archivedSession, error) {
				d, ok := decided[s.ID]
				if !ok {
					return archivedSession{}, fmt.Errorf("session %q is not in the step's decisions", s.ID)
				}
				as := archivedSession{mark: d.Replay, calls: d.Calls}
				if !d.LeftOut {
					as.advantage = &d.Advantage
				}
				return as, nil
			})
			if err != nil {
				return fmt.Errorf("step %d: %w", n, err)
			}
			calls += k
			sessions += len(g.Sessions)
		}
		if sessions != len(decided) {
			return fmt.Errorf("step %d: its groups hold %d sessions, the step decided on %d", n, sessions, len(decided))
		}
		return nil
	}
	// A step marked files-written has complete files, and may have lost some groups to a
	// crash while it was being forgotten: it is not written again, only forgotten.
	if !sc.FilesWritten {
		opt := a.Write
		opt.At = func(s archive.Stage) { a.stage(string(s)) }
		if err := archive.WriteStepRows(a.Dir, archive.StepHead{Record: sc.Record, Committed: sc.CommittedAt}, rows, a.Mem, opt); err != nil {
			return err
		}
		if err := a.Store.MarkStepFilesWritten(n); err != nil {
			return fmt.Errorf("archived step %d, marking it so: %w", n, err)
		}
		a.stage("files-marked")
	}
	// One write per group, so the proxy's writes never wait behind a whole step.
	for _, gid := range sc.Record.Groups {
		if err := ctx.Err(); err != nil {
			return err // the step is marked files-written: the next start finishes it
		}
		if err := a.Store.ForgetStepGroup(n, gid); err != nil {
			return fmt.Errorf("archived step %d, removing group %s from the store: %w", n, gid, err)
		}
		a.stage("group-forgotten")
	}
	if err := a.Store.ForgetStep(n); err != nil {
		return fmt.Errorf("archived step %d, removing it from the store: %w", n, err)
	}
	a.stage("forgotten")
	a.Log.Info("step archived", "step", n, "groups", len(sc.Record.Groups), "calls", calls, "dir", a.Dir,
		"took", time.Since(began).Round(time.Millisecond))
	return nil
}

// archiveDropped archives and forgets the dropped groups in the store, skipping one that
// failed (tried again later) so that it never holds back the others; it returns how many
// it archived.
func (a *Archiver) archiveDropped(ctx context.Context) (int, error) {
	gs, err := a.Store.Groups()
	if err != nil {
		return 0, fmt.Errorf("listing groups: %w", err)
	}
	n := 0
	var errs []error
	for _, gs := range gs {
		if !gs.Dropped || gs.Step >= 0 {
			continue
		}
		if err := ctx.Err(); err != nil {
			return n, err
		}
		what := "dropped group " + gs.ID
		if !a.due(what) {
			continue
		}
		began := time.Now()
		err := safely("archiving "+what, func() error { return a.archiveDroppedGroup(gs.ID) })
		a.outcome(what, false, time.Since(began), err)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}

// archiveDroppedGroup writes dropped group id to the archive, then forgets it.
func (a *Archiver) archiveDroppedGroup(id string) error {
	d, err := a.Store.DroppedGroup(id)
	if err != nil {
		return fmt.Errorf("archiving dropped group %s: %w", id, err)
	}
	rows := func(r *archive.Rows) error {
		// Trained on by no step: no call is trainable, and no session has an advantage.
		dropped := archivedSession{calls: -1, mark: func(_ int, c *trace.Call) error {
			if c.Trainable {
				c.MarkUntrainable("group dropped: " + d.Reason)
			}
			return nil
		}}
		_, err := a.groupRows(r, d.Group, d.Times, func(*trace.Session) (archivedSession, error) { return dropped, nil })
		return err
	}
	if err := archive.WriteDroppedGroup(a.Dir, archive.DroppedDir(id, d.Seq), d.Reason, rows, a.Mem, a.dropOpts()); err != nil {
		return err
	}
	if err := a.Store.ForgetDroppedGroup(id); err != nil {
		return fmt.Errorf("archived dropped group %s, removing it from the store: %w", id, err)
	}
	a.stage("dropped-forgotten")
	a.Log.Info("dropped group archived", "group", id, "reason", d.Reason, "dir", a.Dir)
	return nil
}

func (a *Archiver) dropOpts() archive.WriteOptions {
	opt := a.Write
	opt.At = func(s archive.Stage) { a.stage("dropped-" + string(s)) }
	return opt
}

// archivedSession is how a session of an archived group is written: each call marked
// trained or not, and the session's advantage (nil: none).
type archivedSession struct {
	mark func(i int, c *trace.Call) error
	// calls is how many calls the session must hold; -1: any.
	calls     int
	advantage *float64
}

// groupRows hands group g's calls to r, read from the store one at a time and each
// marked as session says, then each session with its times and its advantage; it
// returns the calls.
func (a *Archiver) groupRows(r *archive.Rows, g trace.Group, times map[string]trace.SessionTimes,
	session func(*trace.Session) (archivedSession, error)) (int, error) {
	calls := 0
	for si := range g.Sessions {
		s := &g.Sessions[si]
		as, err := session(s)
		if err != nil {
			return calls, fmt.Errorf("group %s: %w", g.ID, err)
		}
		k := 0
		err = a.Store.EachCall(s.ID, func(c *trace.Call) error {
			if err := as.mark(k, c); err != nil {
				return err
			}
			k++
			return r.Call(g.ID, s.TaskID, c)
		})
		if err != nil {
			return calls, fmt.Errorf("group %s: %w", g.ID, err)
		}
		if as.calls >= 0 && k != as.calls {
			return calls, fmt.Errorf("group %s: session %q holds %d calls, the step decided on %d", g.ID, s.ID, k, as.calls)
		}
		r.Session(g.ID, s, k, archive.SessionInfo{Created: times[s.ID].Created, Finished: times[s.ID].Finished, Advantage: as.advantage})
		calls += k
	}
	return calls, nil
}

// archiveDir is where cfg's archive goes.
func (cfg Config) archiveDir() string {
	return cfg.Retention.Dir(cfg.DataDir)
}

// liveWindowLen is how many archiving passes the compaction's hysteresis remembers.
const liveWindowLen = 16

// liveWindow holds the latest live sizes of the store, up to liveWindowLen.
type liveWindow struct {
	vals [liveWindowLen]int64
	n    int // values added, ever
}

func (w *liveWindow) add(v int64) {
	w.vals[w.n%liveWindowLen] = v
	w.n++
}

// max is the largest live size remembered (0 for none).
func (w *liveWindow) max() int64 {
	var m int64
	for _, v := range w.vals[:min(w.n, liveWindowLen)] {
		m = max(m, v)
	}
	return m
}
