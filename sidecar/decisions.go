package sidecar

import (
	"fmt"
	"log/slog"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/trace"
)

// A step's decisions (trace.StepDecisions) are taken once, when its groups are examined
// and the step is formed, from the settings floe serve runs with then, and saved with
// the step. Everything after replays them: a restart forms an uncommitted step again
// from its record, byte for byte as it was served, and the archiver writes what a
// committed step trained on from it. Neither re-derives them from the flags of the day,
// which a restart may have changed.

// decidedGroup is a complete group as a step trains on it.
type decidedGroup struct {
	// group holds the sessions the step keeps, each call marked trained or not (with the
	// reason); advantages are theirs, one per session of group.
	group      trace.Group
	advantages []float64
	// sessions are the decisions on every session of the group as stored, left out or
	// not, in creation order: what the step record keeps.
	sessions []trace.SessionDecision
	// stale counts the trainable calls set aside as stale.
	stale int
}

// decide takes the decisions on group g under cfg's failed-session policy and advantage
// and the staleness cut-off minVersion: a failed or timed-out session trains no call
// (and with -drop-failed leaves the group: in no baseline, no advantage); a call sampled
// by a policy older than minVersion stays as context with no loss. It fails when the
// group's advantages are not finite float32s (batcher.ErrNonFiniteAdvantage): such a
// group cannot train, and the decided group comes without advantages or decisions (its
// sessions are still counted for the planner).
func (cfg Config) decide(g trace.Group, minVersion int64) (*decidedGroup, error) {
	d := &decidedGroup{group: g}
	d.group.Sessions = nil
	leftOut := make([]bool, len(g.Sessions))
	for si := range g.Sessions {
		s := &g.Sessions[si]
		if s.Status == trace.StatusFailed || s.Status == trace.StatusTimeout {
			for i := range s.Calls {
				if s.Calls[i].Trainable {
					s.Calls[i].MarkUntrainable("session " + string(s.Status))
				}
			}
			if cfg.DropFailed {
				leftOut[si] = true
				continue
			}
		}
		for i := range s.Calls {
			if c := &s.Calls[i]; c.Trainable && c.PolicyVersion < minVersion {
				c.MarkUntrainable(fmt.Sprintf("stale: policy version %d, older than %d", c.PolicyVersion, minVersion))
				d.stale++
			}
		}
		d.group.Sessions = append(d.group.Sessions, *s)
	}
	adv, err := batcher.SessionAdvantages(cfg.Batcher.Advantage, d.group.Sessions)
	if err != nil {
		return d, fmt.Errorf("group %q: %w", g.ID, err)
	}
	d.advantages = adv
	k := 0
	for si := range g.Sessions {
		if leftOut[si] {
			d.sessions = append(d.sessions, trace.DecideSession(&g.Sessions[si], 0, true))
			continue
		}
		d.sessions = append(d.sessions, trace.DecideSession(&g.Sessions[si], adv[k], false))
		k++
	}
	return d, nil
}

// stepDecisions are the decisions of a step formed now from groups, in its order.
func (cfg Config) stepDecisions(groups []*decidedGroup) *trace.StepDecisions {
	d := &trace.StepDecisions{Strategy: string(cfg.Batcher.Strategy), Advantage: string(cfg.Batcher.Advantage),
		PadMultiple: cfg.Batcher.PadMultiple, PassCost: cfg.Batcher.PassCost}
	for _, g := range groups {
		d.Sessions = append(d.Sessions, g.sessions...)
	}
	return d
}

// packedWith is the batcher configuration step rec was formed with: its recorded
// strategy, advantage, pad multiple, pass cost and token budget. The data-parallel ranks
// and the rank-balancing weights are cfg's: the ranks are the trainer's, which a restart
// may change, and the weights are not settings.
func (cfg Config) packedWith(rec trace.StepRecord) (batcher.Config, error) {
	d := rec.Decisions
	if d == nil {
		return batcher.Config{}, fmt.Errorf("step %d has no recorded decisions (an older floe formed it, and this start did not decide it)", rec.N)
	}
	bc := cfg.Batcher
	bc.Strategy, bc.Advantage = batcher.Strategy(d.Strategy), batcher.Advantage(d.Advantage)
	bc.PadMultiple, bc.PassCost, bc.TokenBudget = d.PadMultiple, d.PassCost, rec.TokenBudget
	if err := bc.Validate(); err != nil {
		return batcher.Config{}, fmt.Errorf("step %d's recorded settings: %w", rec.N, err)
	}
	return bc, nil
}

// sessionDecisions indexes a step's decisions by session.
func sessionDecisions(d *trace.StepDecisions) map[string]*trace.SessionDecision {
	out := make(map[string]*trace.SessionDecision, len(d.Sessions))
	for i := range d.Sessions {
		out[d.Sessions[i].ID] = &d.Sessions[i]
	}
	return out
}

// replay is group g, as the store holds it, as the step whose decisions are decided
// trained on it: the sessions it kept, their calls marked, and their advantages. Any
// session or call the decisions do not cover, or cover otherwise, is an error: the
// store no longer holds what the step was formed from.
func replay(g trace.Group, decided map[string]*trace.SessionDecision) (trace.Group, []float64, error) {
	out := g
	out.Sessions = nil
	var adv []float64
	for si := range g.Sessions {
		s := &g.Sessions[si]
		d, ok := decided[s.ID]
		if !ok {
			return trace.Group{}, nil, fmt.Errorf("group %q: session %q is not in the step's decisions", g.ID, s.ID)
		}
		if len(s.Calls) != d.Calls {
			return trace.Group{}, nil, fmt.Errorf("group %q: session %q holds %d calls, the step decided on %d", g.ID, s.ID, len(s.Calls), d.Calls)
		}
		for i := range s.Calls {
			if err := d.Replay(i, &s.Calls[i]); err != nil {
				return trace.Group{}, nil, fmt.Errorf("group %q: %w", g.ID, err)
			}
		}
		if d.LeftOut {
			continue
		}
		out.Sessions = append(out.Sessions, *s)
		adv = append(adv, d.Advantage)
	}
	return out, adv, nil
}

// undecidedStore is what deciding an older floe's steps needs of the store (*bolt.Store).
type undecidedStore interface {
	trace.GroupStore
	UndecidedSteps() ([]trace.StepRecord, error)
	DecideStep(rec trace.StepRecord) error
}

// decideOlderSteps decides, once, the steps an older floe saved without their decisions
// (bolt format 3 and before) whose groups are still in the store: as that floe formed
// them again at each start and archived them, from the settings of this start, with
// each step's own cut-off and budget (the fixed budget where it has none). From then on
// they are replayed like any other. A step that cannot be decided is logged and left:
// uncommitted, it then fails to form again; committed, to archive (tried again later).
func decideOlderSteps(store undecidedStore, cfg Config, log *slog.Logger) error {
	recs, err := store.UndecidedSteps()
	if err != nil {
		return fmt.Errorf("listing the steps an older floe formed: %w", err)
	}
	for _, rec := range recs {
		if err := decideOlderStep(store, cfg, rec); err != nil {
			log.Error("a step an older floe formed cannot be decided", "step", rec.N, "committed", rec.Committed, "err", err)
			continue
		}
		log.Info("step formed by an older floe: its decisions recorded from this start's settings", "step", rec.N,
			"committed", rec.Committed, "strategy", cfg.Batcher.Strategy, "advantage", cfg.Batcher.Advantage,
			"drop_failed", cfg.DropFailed)
	}
	return nil
}

func decideOlderStep(store undecidedStore, cfg Config, rec trace.StepRecord) error {
	groups := make([]*decidedGroup, 0, len(rec.Groups))
	for _, id := range rec.Groups {
		g, err := store.Group(id)
		if err != nil {
			return fmt.Errorf("group %s: %w", id, err)
		}
		d, err := cfg.decide(g, rec.MinPolicyVersion)
		if err != nil {
			return err
		}
		groups = append(groups, d)
	}
	if rec.TokenBudget == 0 {
		rec.TokenBudget = cfg.Batcher.TokenBudget
	}
	rec.Decisions = cfg.stepDecisions(groups)
	return store.DecideStep(rec)
}
