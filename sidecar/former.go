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
	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/sidecar/plan"
	"github.com/floe-rl/floe/trace"
)

// FormerStore is what forming steps needs of the trace store.
type FormerStore interface {
	trace.GroupStore
	trace.StepStore
}

// policy is the planner's part of the configuration.
func (cfg Config) policy() plan.Policy {
	return plan.Policy{GroupsPerStep: cfg.GroupsPerStep, MinGroupSize: cfg.MinGroupSize, GroupTimeout: cfg.GroupTimeout}
}

// examined is a complete group reconstructed once, kept until a step takes it or it is
// dropped.
type examined struct {
	exam  plan.Examination
	rec   *batcher.Reconstructed // nil when the group is invalid
	stale int                    // trainable calls set aside as stale
}

// examine reads group id and reconstructs it under cfg's failed-session policy and the
// staleness cut-off minVersion.
func examine(store trace.GroupStore, id string, minVersion int64, cfg Config) (*examined, error) {
	g, err := store.Group(id)
	if err != nil {
		return nil, fmt.Errorf("group %s: %w", id, err)
	}
	g, stale := cfg.usable(g, minVersion)
	// Usable sessions are those whose rewards form the group's baseline: a group with
	// fewer has no comparison to learn from.
	usable := 0
	for i := range g.Sessions {
		if batcher.InBaseline(&g.Sessions[i]) {
			usable++
		}
	}
	e := &examined{exam: plan.Examination{UsableSessions: usable}, stale: stale}
	rec, err := batcher.Reconstruct(&g, cfg.Batcher)
	if err != nil {
		e.exam.Invalid = err.Error()
		return e, nil
	}
	e.rec = rec
	e.exam.OldestTrainable, e.exam.HasTrainable = rec.OldestTrainable()
	e.exam.LongestPath, e.exam.LongestSession = rec.LongestPath()
	return e, nil
}

// usable applies the failed-session policy and the staleness cut-off: calls sampled by a
// policy older than minVersion stay as context with no loss. It returns how many
// trainable calls were stale.
func (cfg Config) usable(g trace.Group, minVersion int64) (trace.Group, int) {
	out := g
	out.Sessions = nil
	stale := 0
	for _, s := range g.Sessions {
		if s.Status == trace.StatusFailed || s.Status == trace.StatusTimeout {
			if cfg.DropFailed {
				continue
			}
			for i := range s.Calls {
				if s.Calls[i].Trainable {
					s.Calls[i].MarkUntrainable("session " + string(s.Status))
				}
			}
		}
		for i := range s.Calls {
			if c := &s.Calls[i]; c.Trainable && c.PolicyVersion < minVersion {
				c.MarkUntrainable(fmt.Sprintf("stale: policy version %d, older than %d", c.PolicyVersion, minVersion))
				stale++
			}
		}
		out.Sessions = append(out.Sessions, s)
	}
	return out, stale
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
	// gate holds the current policy version, against which staleness is measured.
	gate    *proxy.Gate
	metrics *Metrics

	exams map[string]*examined

	mu      sync.Mutex
	dropped []DroppedGroup // the latest keepDropped, for the status
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
			_, current, _ := f.gate.State()
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
	for i, id := range d.Groups {
		e, ok := f.exams[id]
		if !ok || e.rec == nil {
			return fmt.Errorf("internal error: step %d takes group %s, which was not examined", d.Step, id)
		}
		recs[i] = e.rec
	}
	bc := f.cfg.Batcher
	bc.TokenBudget = d.TokenBudget
	st, err := batcher.Pack(d.Step, recs, bc)
	if err != nil {
		return fmt.Errorf("forming step %d: %w", d.Step, err)
	}
	rec := trace.StepRecord{N: d.Step, Groups: d.Groups, MinPolicyVersion: d.MinPolicyVersion, TokenBudget: d.TokenBudget}
	if err := f.store.SaveStepRecord(rec); err != nil {
		return fmt.Errorf("saving step %d: %w", d.Step, err)
	}
	for _, id := range d.Groups {
		delete(f.exams, id)
	}
	return f.publish(ctx, st, d.TokenBudget, f.now().Sub(began), false)
}

// recover forms a saved, uncommitted step again from its groups, with the cut-off and
// budget it was formed with, byte for byte as before.
func (f *stepFormer) recover(ctx context.Context, rec trace.StepRecord) error {
	began := f.now()
	bc := f.cfg.Batcher
	if rec.TokenBudget > 0 {
		bc.TokenBudget = rec.TokenBudget
	}
	recs := make([]*batcher.Reconstructed, 0, len(rec.Groups))
	for _, id := range rec.Groups {
		e, err := examine(f.store, id, rec.MinPolicyVersion, f.cfg)
		if err != nil {
			return fmt.Errorf("step %d: %w", rec.N, err)
		}
		if e.rec == nil {
			return fmt.Errorf("step %d: group %s: %s", rec.N, id, e.exam.Invalid)
		}
		recs = append(recs, e.rec)
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
			return nil
		}
		return err
	}
	f.log.Info("step READY", "step", st.Number, "groups", st.Stats.Groups, "micro_batches", st.Stats.MicroBatches,
		"rows", st.Stats.Rows, "loss_tokens", st.Stats.LossRows, "fill", fmt.Sprintf("%.3f", st.Stats.Fill),
		"token_budget", budget, "recovered", recovered)
	return nil
}
