package plan

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/floe-rl/floe/trace"
)

var t0 = time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)

// group builds a group's bookkeeping: sessions created, finished and the size, created
// at t0.
func group(id string, sessions, finished, size int) Group {
	return Group{GroupState: trace.GroupState{ID: id, Size: size, Sessions: sessions, Finished: finished, Step: -1, Created: t0}}
}

func (g Group) exam(e Examination) Group { g.Exam = &e; return g }
func (g Group) with(fn func(*trace.GroupState)) Group {
	fn(&g.GroupState)
	return g
}

// fit is the examination of a healthy group of two sessions.
var fit = Examination{UsableSessions: 2, HasTrainable: true, OldestTrainable: 3, LongestPath: 100, LongestSession: "s"}

func TestPlan(t *testing.T) {
	policy := Policy{GroupsPerStep: 2, MinGroupSize: 2, GroupTimeout: time.Minute}
	tests := []struct {
		name   string
		state  State
		policy Policy
		now    time.Time
		want   []Decision
	}{
		{
			name:  "nothing complete, nothing to do",
			state: State{Groups: []Group{group("a", 2, 1, 2)}, TokenBudget: 256},
			now:   t0.Add(time.Second),
		},
		{
			name:  "a complete group is examined before anything else is decided about it",
			state: State{Groups: []Group{group("a", 2, 2, 2)}, TokenBudget: 256},
			now:   t0,
			want:  []Decision{Examine{Group: "a"}},
		},
		{
			name: "examined groups form steps in order, GroupsPerStep at a time",
			state: State{NextStep: 7, TokenBudget: 256, Groups: []Group{
				group("a", 2, 2, 2).exam(fit), group("b", 2, 2, 2).exam(fit), group("c", 2, 2, 2).exam(fit),
				group("d", 2, 2, 2).exam(fit), group("e", 2, 2, 2).exam(fit)}},
			now: t0,
			want: []Decision{
				Form{Step: 7, Groups: []string{"a", "b"}, TokenBudget: 256},
				Form{Step: 8, Groups: []string{"c", "d"}, TokenBudget: 256},
			},
		},
		{
			name: "no step forms past a group still to be examined, so the order never depends on timing",
			state: State{TokenBudget: 256, Groups: []Group{
				group("a", 2, 2, 2).exam(fit), group("b", 2, 2, 2), group("c", 2, 2, 2).exam(fit)}},
			now:  t0,
			want: []Decision{Examine{Group: "b"}},
		},
		{
			name: "an unusable group is dropped and the step is filled from the next",
			state: State{TokenBudget: 256, MinPolicyVersion: 2, Groups: []Group{
				group("a", 2, 2, 2).exam(fit),
				group("b", 2, 2, 2).exam(Examination{UsableSessions: 1, HasTrainable: true, OldestTrainable: 3}),
				group("c", 2, 2, 2).exam(Examination{UsableSessions: 2}),
				group("d", 2, 2, 2).exam(Examination{UsableSessions: 2, Invalid: "reward NaN"}),
				group("e", 2, 2, 2).exam(Examination{UsableSessions: 2, HasTrainable: true, OldestTrainable: 3, LongestPath: 300, LongestSession: "s9"}),
				group("f", 2, 2, 2).exam(fit)}},
			now: t0,
			want: []Decision{
				Drop{Group: "b", Kind: "too_few_sessions", Reason: "1 usable sessions, fewer than the minimum 2"},
				Drop{Group: "c", Kind: "nothing_to_train", Reason: "nothing to train: no trainable call"},
				Drop{Group: "d", Kind: "invalid", Reason: "reward NaN"},
				Drop{Group: "e", Kind: "path_too_long", Reason: `session "s9": a root-to-leaf path of 300 rows is longer than the token budget of 256 rows`},
				Form{Step: 0, Groups: []string{"a", "f"}, TokenBudget: 256, MinPolicyVersion: 2},
			},
		},
		{
			name: "a long group fits a larger budget: the verdict follows the budget, not the examination",
			state: State{TokenBudget: 512, Groups: []Group{
				group("a", 2, 2, 2).exam(fit),
				group("e", 2, 2, 2).exam(Examination{UsableSessions: 2, HasTrainable: true, LongestPath: 300})}},
			now:  t0,
			want: []Decision{Form{Step: 0, Groups: []string{"a", "e"}, TokenBudget: 512}},
		},
		{
			name: "auto budget: a step grows to its longest path (padded), a short step keeps the budget, only a path past the maximum drops its group",
			state: State{TokenBudget: 8192, MaxTokenBudget: 65536, PadMultiple: 128, Groups: []Group{
				// A 9,002-token call beside a 102-token session: the group is long.
				group("long", 2, 2, 2).exam(Examination{UsableSessions: 2, HasTrainable: true, LongestPath: 9005, LongestSession: "s-long"}),
				group("short", 2, 2, 2).exam(Examination{UsableSessions: 2, HasTrainable: true, LongestPath: 105}),
				group("huge", 2, 2, 2).exam(Examination{UsableSessions: 2, HasTrainable: true, LongestPath: 70000, LongestSession: "s-huge"}),
				group("short2", 2, 2, 2).exam(Examination{UsableSessions: 2, HasTrainable: true, LongestPath: 300}),
				group("short3", 2, 2, 2).exam(Examination{UsableSessions: 2, HasTrainable: true, LongestPath: 8192})}},
			policy: Policy{GroupsPerStep: 2, MinGroupSize: 2},
			now:    t0,
			want: []Decision{
				Form{Step: 0, Groups: []string{"long", "short"}, TokenBudget: 9088},
				Drop{Group: "huge", Kind: "path_too_long", Reason: `session "s-huge": a root-to-leaf path of 70000 rows is longer than the largest token budget of 65536 rows`},
				Form{Step: 1, Groups: []string{"short2", "short3"}, TokenBudget: 8192},
			},
		},
		{
			name: "auto budget: a workload of only long groups forms steps, up to the maximum",
			state: State{TokenBudget: 8192, MaxTokenBudget: 65536, PadMultiple: 128, Groups: []Group{
				group("a", 2, 2, 2).exam(Examination{UsableSessions: 2, HasTrainable: true, LongestPath: 20000}),
				group("b", 2, 2, 2).exam(Examination{UsableSessions: 2, HasTrainable: true, LongestPath: 65450})}},
			policy: Policy{GroupsPerStep: 1, MinGroupSize: 2},
			now:    t0,
			want: []Decision{
				Form{Step: 0, Groups: []string{"a"}, TokenBudget: 20096},
				Form{Step: 1, Groups: []string{"b"}, TokenBudget: 65536},
			},
		},
		{
			name: "a weight sync that makes trainable calls stale has the group examined again; one whose calls are all newer is not",
			state: State{TokenBudget: 256, MinPolicyVersion: 4, Groups: []Group{
				group("a", 2, 2, 2).exam(fit), // oldest trainable 3 < 4
				group("b", 2, 2, 2).exam(Examination{UsableSessions: 2, HasTrainable: true, OldestTrainable: 5, LongestPath: 10}),
				group("c", 2, 2, 2).exam(Examination{UsableSessions: 2, HasTrainable: false})}},
			now: t0,
			want: []Decision{
				Examine{Group: "a", MinPolicyVersion: 4},
				Drop{Group: "c", Kind: "nothing_to_train", Reason: "nothing to train: no trainable call"},
			},
		},
		{
			name: "the group timeout ends open groups at their age, not before",
			state: State{TokenBudget: 256, Groups: []Group{
				group("young", 2, 1, 2).with(func(g *trace.GroupState) { g.Created = t0.Add(30 * time.Second) }),
				group("old", 3, 1, 4),
			}},
			now:  t0.Add(time.Minute),
			want: []Decision{TimeOut{Group: "old", Age: time.Minute}},
		},
		{
			name: "a timeout cut short by a crash is finished whatever the clock says",
			state: State{TokenBudget: 256, Groups: []Group{
				group("g", 3, 1, 3).with(func(g *trace.GroupState) { g.TimedOut = true })}},
			now:  t0.Add(time.Second),
			want: []Decision{TimeOut{Group: "g", Age: time.Second, Resume: true}},
		},
		{
			name: "a timed-out group whose sessions all finished is complete with the sessions it has",
			state: State{TokenBudget: 256, Groups: []Group{
				group("g", 3, 3, 8).with(func(g *trace.GroupState) { g.TimedOut = true })}},
			now:  t0.Add(time.Hour),
			want: []Decision{Examine{Group: "g"}},
		},
		{
			name:   "no timeout without one set; dropped groups and groups in steps are never touched",
			policy: Policy{GroupsPerStep: 1, MinGroupSize: 1},
			state: State{TokenBudget: 256, Groups: []Group{
				group("open", 2, 1, 2),
				group("dropped", 2, 2, 2).with(func(g *trace.GroupState) { g.Dropped = true }),
				group("stepped", 2, 2, 2).with(func(g *trace.GroupState) { g.Step = 3 }),
			}},
			now: t0.Add(1000 * time.Hour),
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.policy
			if p == (Policy{}) {
				p = policy
			}
			got := Plan(tc.state, p, tc.now)
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("Plan:\n got %#v\nwant %#v", got, tc.want)
			}
		})
	}
}

// TestPlanRun drives the planner as the sidecar does, on logical time: groups complete
// and time out as the clock moves, decisions are applied to the state, and every group
// is examined exactly once.
func TestPlanRun(t *testing.T) {
	p := Policy{GroupsPerStep: 2, MinGroupSize: 2, GroupTimeout: 10 * time.Minute}
	s := State{TokenBudget: 256}
	// A group exists once its first session is created (the store's order is by id).
	start := func(id string, at time.Time) {
		g := group(id, 0, 0, 4)
		g.Created = at
		s.Groups = append(s.Groups, g)
	}
	examined := map[string]int{}
	var formed [][]string
	apply := func(now time.Time) {
		for range 10 { // every round moves a group on; 10 is far more than needed
			ds := Plan(s, p, now)
			if len(ds) == 0 {
				return
			}
			for _, d := range ds {
				switch d := d.(type) {
				case TimeOut:
					g := find(s.Groups, d.Group)
					g.TimedOut, g.Finished = true, g.Sessions
				case Examine:
					examined[d.Group]++
					usable := find(s.Groups, d.Group).Finished
					find(s.Groups, d.Group).Exam = &Examination{UsableSessions: usable, HasTrainable: true, LongestPath: 10}
				case Drop:
					find(s.Groups, d.Group).Dropped = true
				case Form:
					if d.Step != s.NextStep {
						t.Fatalf("step %d formed, want %d", d.Step, s.NextStep)
					}
					for _, id := range d.Groups {
						find(s.Groups, id).Step = d.Step
					}
					s.NextStep++
					formed = append(formed, d.Groups)
				}
			}
		}
		t.Fatal("the planner did not settle")
	}
	progress := func(id string, sessions, finished int) {
		g := find(s.Groups, id)
		g.Sessions, g.Finished = sessions, finished
	}
	// Minute 1: g0..g2 start; g0 and g2 finish; g1 has one straggler.
	for _, id := range []string{"g0", "g1", "g2"} {
		start(id, t0.Add(time.Minute))
	}
	progress("g0", 4, 4)
	progress("g1", 4, 3)
	progress("g2", 4, 4)
	apply(t0.Add(2 * time.Minute))
	if want := [][]string{{"g0", "g2"}}; !reflect.DeepEqual(formed, want) {
		t.Fatalf("after minute 2: steps %v, want %v", formed, want)
	}
	// Minute 12: g1's straggler is past the timeout; g3 started at minute 5 and finished
	// one session of four.
	start("g3", t0.Add(5*time.Minute))
	progress("g3", 1, 1)
	apply(t0.Add(12 * time.Minute))
	if !find(s.Groups, "g1").TimedOut || find(s.Groups, "g3").TimedOut {
		t.Fatalf("timeouts: g1 %v (want true), g3 %v (want false)", find(s.Groups, "g1").TimedOut, find(s.Groups, "g3").TimedOut)
	}
	// Minute 16: g3 times out with one usable session: dropped.
	apply(t0.Add(16 * time.Minute))
	if !find(s.Groups, "g3").Dropped {
		t.Fatalf("g3 with 1 usable session of a minimum 2 was not dropped")
	}
	// g1 waits alone for a partner; g4 completes.
	start("g4", t0.Add(16*time.Minute))
	progress("g4", 4, 4)
	apply(t0.Add(17 * time.Minute))
	if want := [][]string{{"g0", "g2"}, {"g1", "g4"}}; !reflect.DeepEqual(formed, want) {
		t.Fatalf("steps %v, want %v", formed, want)
	}
	for id, n := range examined {
		if n != 1 {
			t.Errorf("group %s examined %d times, want once", id, n)
		}
	}
	if len(examined) != 5 {
		t.Errorf("examined %v, want each of g0..g4", examined)
	}
}

func find(gs []Group, id string) *Group {
	for i := range gs {
		if gs[i].ID == id {
			return &gs[i]
		}
	}
	panic("no group " + id)
}

func TestPolicyValidate(t *testing.T) {
	for _, p := range []Policy{{GroupsPerStep: 0, MinGroupSize: 1}, {GroupsPerStep: 1, MinGroupSize: 0}, {GroupsPerStep: 1, MinGroupSize: 1, GroupTimeout: -time.Second}} {
		if err := p.Validate(); err == nil || !strings.Contains(err.Error(), "must") {
			t.Errorf("Validate(%+v) = %v, want an error", p, err)
		}
	}
	if err := (Policy{GroupsPerStep: 1, MinGroupSize: 1}).Validate(); err != nil {
		t.Errorf("a valid policy: %v", err)
	}
}
