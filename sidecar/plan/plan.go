// Package plan decides, from what floe knows of its groups, what to do next: time a
// group out, examine (reconstruct) a group that completed, drop a group that cannot be
// trained on, form a step. Plan does no I/O and reads no clock: the state and the time
// are values, so a run is a sequence of Plan calls that tests replay on logical time.
// The sidecar applies the decisions to the store and the READY buffer and feeds what it
// learned (a group's examination) back into the next state, in the manner of etcd's raft
// package.
package plan

import (
	"fmt"
	"time"

	"github.com/floe-rl/floe/trace"
)

// Policy is what decides which groups train and when.
type Policy struct {
	// GroupsPerStep trainable groups form one step.
	GroupsPerStep int
	// MinGroupSize: a complete group with fewer usable sessions is dropped.
	MinGroupSize int
	// GroupTimeout ends an open group this long after its first session was created;
	// 0: never.
	GroupTimeout time.Duration
}

// Validate reports a policy no run can follow.
func (p Policy) Validate() error {
	if p.GroupsPerStep < 1 || p.MinGroupSize < 1 {
		return fmt.Errorf("groups per step (%d) and min group size (%d) must be at least 1", p.GroupsPerStep, p.MinGroupSize)
	}
	if p.GroupTimeout < 0 {
		return fmt.Errorf("group timeout %v must not be negative", p.GroupTimeout)
	}
	return nil
}

// Examination is what reconstructing a complete group found, under the staleness
// cut-off it was examined with. None of it depends on the token budget, so a group is
// examined again only when the cut-off rises past some of its trainable calls.
type Examination struct {
	// Invalid says why the group cannot be reconstructed ("" when it can).
	Invalid string
	// UsableSessions is how many of the group's sessions form its baseline (after the
	// failed-session policy, those batcher.InBaseline counts).
	UsableSessions int
	// OldestTrainable is the oldest policy version among the calls left trainable;
	// HasTrainable is false when none is.
	OldestTrainable int64
	HasTrainable    bool
	// LongestPath is the longest root-to-leaf path in rows, made by LongestSession: a
	// step packed with a smaller budget cannot hold the group.
	LongestPath    int64
	LongestSession string
}

// Group is one group as the planner sees it: its bookkeeping, and its examination once
// the sidecar has examined it.
type Group struct {
	trace.GroupState
	Exam *Examination // nil until examined
}

// State is what the planner knows when it is asked.
type State struct {
	// Groups in the order steps take them (the store's order, by id).
	Groups []Group
	// NextStep is the number the next formed step will carry.
	NextStep int64
	// TokenBudget is the budget a new step is formed with, at least.
	TokenBudget int
	// MaxTokenBudget is the largest budget a step may be formed with (-token-budget
	// auto's maximum): a step whose longest root-to-leaf path is longer than TokenBudget
	// is formed with a budget that holds that path, up to this, and only a group with a
	// path longer than this is dropped for it. 0: TokenBudget is fixed.
	MaxTokenBudget int
	// PadMultiple rounds a budget grown to a path up to a multiple of it (1 when 0).
	PadMultiple int
	// MinPolicyVersion is the staleness cut-off for calls of a new step: calls sampled
	// by an older policy are not trained on. 0: none.
	MinPolicyVersion int64
}

// Decision is one thing the sidecar must do. The concrete types are TimeOut, Examine,
// Drop and Form; they are to be applied in the order Plan returns them.
type Decision interface{ decision() }

// TimeOut ends an open group at the group timeout. Resume is set when the group was
// already marked timed out (a crash cut the first attempt short): only its running
// sessions remain to be finished.
type TimeOut struct {
	Group  string
	Age    time.Duration
	Resume bool
}

// Examine reconstructs a complete group with the cut-off given and reports an
// Examination in the next state. A group is examined once, when it completes, and again
// only when a weight sync since then made some of its trainable calls stale.
type Examine struct {
	Group            string
	MinPolicyVersion int64
}

// Drop sets a complete group aside for good, with the reason; Kind names the reason's
// class for metrics: too_few_sessions, invalid, nothing_to_train or path_too_long.
type Drop struct {
	Group  string
	Kind   string
	Reason string
}

// Form forms step Step from Groups, in order, and records it.
type Form struct {
	Step             int64
	Groups           []string
	TokenBudget      int
	MinPolicyVersion int64
}

func (TimeOut) decision() {}
func (Examine) decision() {}
func (Drop) decision()    {}
func (Form) decision()    {}

// Plan returns what to do now. Open groups past the timeout are timed out; complete
// groups not examined under the current cut-off and budget are examined; examined
// groups that cannot train are dropped; trainable groups are taken in order,
// GroupsPerStep at a time, into new steps. A step is never formed past a group still to
// be examined, so steps take groups in the same order whatever the timing of
// examinations.
func Plan(s State, p Policy, now time.Time) []Decision {
	var out []Decision
	for _, g := range s.Groups {
		if p.GroupTimeout > 0 && open(g.GroupState) && (g.TimedOut || now.Sub(g.Created) >= p.GroupTimeout) {
			out = append(out, TimeOut{Group: g.ID, Age: now.Sub(g.Created), Resume: g.TimedOut})
		}
	}
	var take []string
	var longest int64 // the longest path of the groups taken
	blocked := false  // a group before this one waits for its examination
	next := s.NextStep
	for _, g := range s.Groups {
		if !g.Complete() {
			continue
		}
		if stale(g.Exam, s) {
			out = append(out, Examine{Group: g.ID, MinPolicyVersion: s.MinPolicyVersion})
			blocked = true
			continue
		}
		if kind, reason := unusable(g.Exam, p, s); reason != "" {
			out = append(out, Drop{Group: g.ID, Kind: kind, Reason: reason})
			continue
		}
		if blocked {
			continue
		}
		take, longest = append(take, g.ID), max(longest, g.Exam.LongestPath)
		if len(take) == p.GroupsPerStep {
			out = append(out, Form{Step: next, Groups: take, TokenBudget: s.budgetFor(longest), MinPolicyVersion: s.MinPolicyVersion})
			next++
			take, longest = nil, 0
		}
	}
	return out
}

// maxBudget is the largest budget a step may be formed with.
func (s State) maxBudget() int {
	if s.MaxTokenBudget > 0 {
		return max(s.MaxTokenBudget, s.TokenBudget)
	}
	return s.TokenBudget
}

// budgetFor is the budget of a step whose longest root-to-leaf path is longest rows: the
// current budget, grown to hold the path (padded) when it is longer, never past the
// maximum.
func (s State) budgetFor(longest int64) int {
	if longest <= int64(s.TokenBudget) {
		return s.TokenBudget
	}
	pad := int64(max(s.PadMultiple, 1))
	grown := (longest + pad - 1) / pad * pad
	return int(min(grown, int64(s.maxBudget())))
}

// open: not yet complete, dropped or in a step.
func open(g trace.GroupState) bool {
	return !g.Dropped && g.Step < 0 && !g.Complete()
}

// stale says whether e no longer describes the group under s: never examined, or some
// of its trainable calls are older than the current cut-off.
func stale(e *Examination, s State) bool {
	return e == nil || (e.HasTrainable && e.OldestTrainable < s.MinPolicyVersion)
}

// unusable says why an examined group cannot go into a step under s (the reason's
// class and the reason), or "".
func unusable(e *Examination, p Policy, s State) (kind, reason string) {
	budget, which := s.maxBudget(), "token budget"
	if s.MaxTokenBudget > 0 {
		which = "largest token budget"
	}
	switch {
	case e.UsableSessions < p.MinGroupSize:
		return "too_few_sessions", fmt.Sprintf("%d usable sessions, fewer than the minimum %d", e.UsableSessions, p.MinGroupSize)
	case e.Invalid != "":
		return "invalid", e.Invalid
	case !e.HasTrainable:
		return "nothing_to_train", "nothing to train: no trainable call"
	case e.LongestPath > int64(budget):
		return "path_too_long", fmt.Sprintf("session %q: a root-to-leaf path of %d rows is longer than the %s of %d rows",
			e.LongestSession, e.LongestPath, which, budget)
	}
	return "", ""
}
