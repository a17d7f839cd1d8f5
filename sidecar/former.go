package sidecar

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/sidecar/plan"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/bolt"
)

// FormerStore is what forming steps needs of the trace store.
type FormerStore interface {
	trace.GroupStore
	trace.StepStore
}

// examined is a complete group decided and reconstructed once, kept until a step takes
// it or it is dropped.
type examined struct {
	exam    plan.Examination
	decided *decidedGroup          // nil when the group is invalid
	rec     *batcher.Reconstructed // nil when the group is invalid
	stale   int                    // trainable calls set aside as stale
}

// examine reads group id, decides it under cfg's failed-session policy and advantage and
// the staleness cut-off minVersion, and reconstructs it.
func examine(store trace.GroupStore, id string, minVersion int64, cfg Config) (*examined, error) {
	g, err := store.Group(id)
	if err != nil {
		return nil, fmt.Errorf("group %s: %w", id, err)
	}
	d, err := cfg.decide(g, minVersion)
	// Usable sessions are those whose rewards form the group's baseline: a group with
	// fewer has no comparison to learn from.
	usable := 0
	for i := range d.group.Sessions {
		if batcher.InBaseline(&d.group.Sessions[i]) {
			usable++
		}
	}
	e := &examined{exam: plan.Examination{UsableSessions: usable}, stale: d.stale}
	if err != nil {
		e.exam.Invalid = err.Error()
		return e, nil //nolint:nilerr // an invalid group is an examination result, not a failure
	}
	rec, err := batcher.ReconstructWith(&d.group, cfg.Batcher, d.advantages)
	if err != nil {
		e.exam.Invalid = err.Error()
		return e, nil //nolint:nilerr // an invalid group is an examination result, not a failure
	}
	e.decided, e.rec = d, rec
	e.exam.OldestTrainable, e.exam.HasTrainable = rec.OldestTrainable()
	e.exam.LongestPath, e.exam.LongestSession = rec.LongestPath()
	return e, nil
}

// planState is the planner's view of store, with the examinations made so far.
func planState(store trace.GroupStore, exams map[string]*examined) ([]plan.Group, error) {
	gs, err := store.Groups()
	if err != nil {
		return nil, fmt.Errorf("listing groups: %w", err)
	}
	out := make([]plan.Group, len(gs))
	for i, g := range gs {
		out[i] = plan.Group{GroupState: g}
		if e, ok := exams[g.ID]; ok {
			out[i].Exam = &e.exam
		}
	}
	return out, nil
}

// PlanDataDir is PlanSteps over the store in cfg's data dir, opened read-only, so that
// a benchmark can ask while no floe serves it.
func PlanDataDir(cfg Config) ([]plan.Form, error) {
	st, err := bolt.New(cfg.DataDir, bolt.Options{ReadOnly: true})
	if err != nil {
		return nil, fmt.Errorf("data dir %s: %w", cfg.DataDir, err)
	}
	defer func() { _ = st.Close() }() // read only: a Close error loses nothing
	return PlanSteps(st, cfg)
}

// PlanSteps is the steps floe serve with cfg (its fixed token budget, no staleness
// cut-off, no group timeout) would form from the complete groups of store, decided by
// the same planner: for benchmarks that must tell a trainer how many steps to expect.
// It writes nothing.
func PlanSteps(store trace.GroupStore, cfg Config) ([]plan.Form, error) {
	p := cfg.policy()
	p.GroupTimeout = 0
	if err := p.Validate(); err != nil {
		return nil, err
	}
	groups, err := planState(store, nil)
	if err != nil {
		return nil, err
	}
	exams := map[string]*examined{}
	var forms []plan.Form
	for {
		for i := range groups {
			if e, ok := exams[groups[i].ID]; ok {
				groups[i].Exam = &e.exam
			}
		}
		st := plan.State{Groups: groups, NextStep: int64(len(forms)), TokenBudget: cfg.Batcher.TokenBudget}
		ds := plan.Plan(st, p, time.Time{})
		if len(ds) == 0 {
			return forms, nil
		}
		for _, d := range ds {
			switch d := d.(type) {
			case plan.Examine:
				e, err := examine(store, d.Group, d.MinPolicyVersion, cfg)
				if err != nil {
					return nil, err
				}
				exams[d.Group] = e
			case plan.Drop:
				setGroup(groups, d.Group, func(g *plan.Group) { g.Dropped = true })
			case plan.Form:
				for _, id := range d.Groups {
					setGroup(groups, id, func(g *plan.Group) { g.Step = d.Step })
				}
				forms = append(forms, d)
			}
		}
	}
}

func setGroup(gs []plan.Group, id string, fn func(*plan.Group)) {
	for i := range gs {
		if gs[i].ID == id {
			fn(&gs[i])
		}
	}
}

// stepFormer applies the planner's decisions: it times groups out, examines groups as
// they complete, drops the ones that cannot train, and forms steps in order into the
// READY buffer. It blocks while the buffer is full, so groups wait and nothing is
// dropped.
type stepFormer struct {
	cfg   Config
	store FormerStore
	ready *Ready
	mem   memory.Allocator
	log   *slog.Logger
	wake  chan struct{}
	now   func() time.Time
	// steps chooses the budget of each new step and is told of each formed step.
	steps *stepTracker
	// version is the Node's policy version, against which staleness is measured.
	version *policyVersion
	metrics *Metrics

	exams map[string]*examined

	mu      sync.Mutex
	dropped []DroppedGroup // the latest keepDropped, for the status
}

// poke wakes the former: a session finished, or a commit made room. It never blocks.
func (f *stepFormer) poke() {
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

// keepDropped bounds the dropped groups the status lists.
const keepDropped = 16

// droppedGroups are the latest groups dropped, oldest first.
func (f *stepFormer) droppedGroups() []DroppedGroup {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.dropped)
}

func (f *stepFormer) run(ctx context.Context, pending []trace.StepRecord) error {
	// Recovery: the steps saved but not committed, formed again from the same groups.
	for _, rec := range pending {
		for f.ready.NextNumber() < rec.N {
			if err := f.ready.Skip(f.ready.NextNumber()); err != nil {
				return err
			}
		}
		if err := f.recover(ctx, rec); err != nil {
			return err
		}
	}
	// The tick times groups out and is a safety net; finishing a session wakes us at once.
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		if err := f.advance(ctx); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-f.wake:
		case <-tick.C:
		}
	}
}

// advance plans and applies the decisions until the planner has nothing more to do.
// Every decision moves a group on (timed out, examined, dropped, in a step), so this
// ends.
func (f *stepFormer) advance(ctx context.Context) error {
	for ctx.Err() == nil {
		groups, err := planState(f.store, f.exams)
		if err != nil {
			return err
		}
		st := plan.State{Groups: groups, NextStep: f.ready.NextNumber(), TokenBudget: f.steps.Budget(),
			PadMultiple: f.cfg.Batcher.PadMultiple}
		if f.cfg.TokenBudgetAuto {
			// A step longer than the controller's budget grows to hold its longest path.
			st.MaxTokenBudget = f.cfg.TokenBudgetMax
		}
		if f.cfg.MaxStaleness >= 0 {
			current := f.version.get()
			st.MinPolicyVersion = max(0, current-f.cfg.MaxStaleness)
		}
		ds := plan.Plan(st, f.cfg.policy(), f.now())
		if len(ds) == 0 {
			return nil
		}
		for _, d := range ds {
			if err := f.apply(ctx, d); err != nil {
				return err
			}
		}
	}
	return nil
}

func (f *stepFormer) apply(ctx context.Context, d plan.Decision) error {
	switch d := d.(type) {
	case plan.TimeOut:
		return f.timeOut(d)
	case plan.Examine:
		e, err := examine(f.store, d.Group, d.MinPolicyVersion, f.cfg)
		if err != nil {
			return err
		}
		if n := e.stale - f.exams[d.Group].staleCount(); n > 0 {
			f.metrics.staleCalls(n)
			f.log.Info("stale calls not trained", "group", d.Group, "calls", n, "min_policy_version", d.MinPolicyVersion)
		}
		f.exams[d.Group] = e
		return nil
	case plan.Drop:
		delete(f.exams, d.Group)
		f.log.Warn("group dropped", "group", d.Group, "kind", d.Kind, "reason", d.Reason)
		if err := f.store.DropGroup(d.Group, d.Reason); err != nil {
			return fmt.Errorf("dropping group %s: %w", d.Group, err)
		}
		f.metrics.groupDropped(d.Kind)
		f.mu.Lock()
		f.dropped = append(f.dropped, DroppedGroup{Group: d.Group, Kind: d.Kind, Reason: d.Reason})
		if len(f.dropped) > keepDropped {
			f.dropped = slices.Delete(f.dropped, 0, len(f.dropped)-keepDropped)
		}
		f.mu.Unlock()
		return nil
	case plan.Form:
		return f.form(ctx, d)
	}
	return fmt.Errorf("internal error: unknown decision %T", d)
}

func (e *examined) staleCount() int {
	if e == nil {
		return 0
	}
	return e.stale
}

// timeOut ends a group at the group timeout.
func (f *stepFormer) timeOut(d plan.TimeOut) error {
	ended, err := f.store.TimeOutGroup(d.Group)
	if err != nil {
		return fmt.Errorf("timing out group %s: %w", d.Group, err)
	}
	for range ended {
		f.metrics.sessionFinished(trace.StatusTimeout)
	}
	if !d.Resume {
		f.metrics.groupTimedOut()
	}
	f.log.Warn("group timed out", "group", d.Group, "age", d.Age.Round(time.Second), "sessions_timed_out", len(ended),
		"resumed", d.Resume)
	return nil
}

// form packs a new step from its examined groups, records it and puts it into the
// buffer.
func (f *stepFormer) form(ctx context.Context, d plan.Form) error {
	began := f.now()
	recs := make([]*batcher.Reconstructed, len(d.Groups))
	decided := make([]*decidedGroup, len(d.Groups))
	for i, id := range d.Groups {
		e, ok := f.exams[id]
		if !ok || e.rec == nil {
			return fmt.Errorf("internal error: step %d takes group %s, which was not examined", d.Step, id)
		}
		recs[i], decided[i] = e.rec, e.decided
	}
	bc := f.cfg.Batcher
	bc.TokenBudget = d.TokenBudget
	st, err := batcher.Pack(d.Step, recs, bc)
	if err != nil {
		return fmt.Errorf("forming step %d: %w", d.Step, err)
	}
	rec := trace.StepRecord{N: d.Step, Groups: d.Groups, MinPolicyVersion: d.MinPolicyVersion, TokenBudget: d.TokenBudget,
		Decisions: f.cfg.stepDecisions(decided)}
	if err := f.store.SaveStepRecord(rec); err != nil {
		return fmt.Errorf("saving step %d: %w", d.Step, err)
	}
	for _, id := range d.Groups {
		delete(f.exams, id)
	}
	return f.publish(ctx, st, d.TokenBudget, f.now().Sub(began), false)
}

// recover forms a saved, uncommitted step again from its groups, replaying the decisions
// it recorded (its settings, advantages, the calls it trained on) with its cut-off and
// budget: byte for byte as before, whatever the settings of this start.
func (f *stepFormer) recover(ctx context.Context, rec trace.StepRecord) error {
	began := f.now()
	bc, err := f.cfg.packedWith(rec)
	if err != nil {
		return err
	}
	decided := sessionDecisions(rec.Decisions)
	recs := make([]*batcher.Reconstructed, 0, len(rec.Groups))
	sessions := 0
	for _, id := range rec.Groups {
		stored, err := f.store.Group(id)
		if err != nil {
			return fmt.Errorf("step %d: group %s: %w", rec.N, id, err)
		}
		g, adv, err := replay(stored, decided)
		if err != nil {
			return fmt.Errorf("step %d: %w", rec.N, err)
		}
		sessions += len(stored.Sessions)
		r, err := batcher.ReconstructWith(&g, bc, adv)
		if err != nil {
			return fmt.Errorf("step %d: %w", rec.N, err)
		}
		recs = append(recs, r)
	}
	if sessions != len(decided) {
		return fmt.Errorf("step %d: its groups hold %d sessions, the step decided on %d", rec.N, sessions, len(decided))
	}
	st, err := batcher.Pack(rec.N, recs, bc)
	if err != nil {
		return fmt.Errorf("forming step %d again: %w", rec.N, err)
	}
	return f.publish(ctx, st, bc.TokenBudget, f.now().Sub(began), true)
}

// publish puts a formed step into the READY buffer.
func (f *stepFormer) publish(ctx context.Context, st *batcher.Step, budget int, took time.Duration, recovered bool) error {
	fs, err := FlightStep(st, f.mem)
	if err != nil {
		return err
	}
	f.steps.formed(st, budget, took, recovered)
	if err := f.ready.Put(ctx, fs); err != nil {
		fs.Release()
		if ctx.Err() != nil {
			return nil //nolint:nilerr // a cancelled Put is the former stopping, not failing
		}
		return err
	}
	f.log.Info("step READY", "step", st.Number, "groups", st.Stats.Groups, "micro_batches", st.Stats.MicroBatches,
		"rows", st.Stats.Rows, "loss_tokens", st.Stats.LossRows, "fill", fmt.Sprintf("%.3f", st.Stats.Fill),
		"token_budget", budget, "recovered", recovered)
	return nil
}
