package tracetest

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/floe-rl/floe/trace"
)

// ArchiveStore is a Store that also plays the archive's roles (bolt).
type ArchiveStore interface {
	Store
	trace.ArchiveStore
	trace.Tombstones
}

// wentTo checks where ForgottenSession says each session went (ok false: never
// forgotten).
func wentTo(t *testing.T, s ArchiveStore, want map[string]trace.Forgotten) {
	t.Helper()
	for id, w := range want {
		f, ok, err := s.ForgottenSession(id)
		if err != nil || ok != (w != trace.Forgotten{}) || f != w {
			t.Errorf("ForgottenSession(%q) = %+v %v %v, want %+v (forgotten: %v)", id, f, ok, err, w, w != trace.Forgotten{})
		}
	}
}

// archiveGroup creates group gid of n sessions "<gid>-s<i>" (keys "key-<session>", task
// "t-<gid>"), records calls calls in each and finishes them; it returns the calls
// recorded, by session.
func archiveGroup(t *testing.T, s Store, gid string, n, calls int) map[string][]trace.Call {
	t.Helper()
	out := map[string][]trace.Call{}
	for i := range n {
		sid := fmt.Sprintf("%s-s%d", gid, i)
		must(t, s.CreateSession(trace.Session{ID: sid, TaskID: "t-" + gid, GroupID: gid}, "key-"+sid, n))
		for k := range calls {
			c := call(sid, 0, int32(i), int32(k), 5)
			must(t, s.Record(bg, c))
			out[sid] = append(out[sid], *c)
		}
		must(t, s.FinishSession(sid, float64(i), trace.StatusCompleted))
	}
	return out
}

// stepOf saves and commits step n of groups, with a decision for each of their sessions.
func stepOf(t *testing.T, s Store, n int64, groups ...string) trace.StepRecord {
	t.Helper()
	rec := trace.StepRecord{N: n, Groups: groups, Decisions: &trace.StepDecisions{Strategy: "prefix_merging", Advantage: "grpo"}}
	for _, gid := range groups {
		g, err := s.Group(gid)
		must(t, err)
		for i := range g.Sessions {
			rec.Decisions.Sessions = append(rec.Decisions.Sessions, trace.DecideSession(&g.Sessions[i], float64(i)-0.5, false))
		}
	}
	must(t, s.SaveStepRecord(rec))
	return rec
}

// gone checks that group gid and its sessions (with their keys) left the store, and
// that their ids stay taken.
func gone(t *testing.T, s Store, gid string, sessions ...string) {
	t.Helper()
	if _, err := s.Group(gid); !errors.Is(err, trace.ErrUnknownGroup) {
		t.Errorf("Group(%s) of a forgotten group: %v, want ErrUnknownGroup", gid, err)
	}
	all, err := s.Groups()
	must(t, err)
	for _, g := range all {
		if g.ID == gid {
			t.Errorf("Groups lists forgotten group %s: %+v", gid, g)
		}
	}
	for _, sid := range sessions {
		if _, err := s.Session(sid); !errors.Is(err, trace.ErrUnknownSession) {
			t.Errorf("Session(%s) of a forgotten session: %v, want ErrUnknownSession", sid, err)
		}
		if _, err := s.Resolve("key-" + sid); !errors.Is(err, trace.ErrUnknownSession) {
			t.Errorf("the key of forgotten session %s resolves: %v", sid, err)
		}
		wantErr(t, "CreateSession with a forgotten session's id", s.CreateSession(trace.Session{ID: sid}, "", 0), trace.ErrSessionExists)
	}
	if err := s.CreateSession(trace.Session{ID: "new-in-" + gid, TaskID: "t-" + gid, GroupID: gid}, "", 0); err == nil {
		t.Errorf("a session was created in forgotten group %s: a reused group would train again", gid)
	}
}

// kept checks that session sid still holds calls, as recorded, and its key.
func kept(t *testing.T, s Store, sid string, calls []trace.Call) {
	t.Helper()
	got, err := s.Session(sid)
	if err != nil {
		t.Fatalf("Session(%s) of a session not forgotten: %v", sid, err)
	}
	if len(got.Calls) != len(calls) {
		t.Fatalf("session %s holds %d calls, want %d", sid, len(got.Calls), len(calls))
	}
	for i := range calls {
		if err := equalCall(got.Calls[i], calls[i]); err != nil {
			t.Fatalf("session %s: %v", sid, err)
		}
	}
	if r, err := s.Resolve("key-" + sid); err != nil || r.ID != sid {
		t.Errorf("the key of session %s, not forgotten: %+v %v", sid, r, err)
	}
}

// GroupReader checks trace.GroupReader: a group's sessions in creation order without
// their calls, with their times, and each session's calls in order, one at a time.
func GroupReader(t *testing.T, f Factory[ArchiveStore]) {
	t.Run("sessions and times", func(t *testing.T) {
		s := f.New(t)
		for _, id := range []string{"b", "a", "c"} {
			must(t, s.CreateSession(trace.Session{ID: id, TaskID: "t", GroupID: "g"}, "", 0))
		}
		must(t, s.Record(bg, call("a", 0, 1)))
		must(t, s.FinishSession("a", 0.5, trace.StatusCompleted))
		must(t, s.FinishSession("c", 0, trace.StatusFailed))
		g, times, err := s.GroupSessions("g")
		must(t, err)
		var ids []string
		for _, ss := range g.Sessions {
			ids = append(ids, ss.ID)
			if len(ss.Calls) != 0 {
				t.Errorf("GroupSessions read session %s with its %d calls, want none", ss.ID, len(ss.Calls))
			}
		}
		if g.ID != "g" || g.TaskID != "t" || !slices.Equal(ids, []string{"b", "a", "c"}) {
			t.Fatalf("GroupSessions(g) = %+v, want g of task t with b, a, c in creation order", g)
		}
		if a := g.Sessions[1]; a.Reward != 0.5 || a.Status != trace.StatusCompleted || a.GroupID != "g" || a.TaskID != "t" {
			t.Errorf("session a read as %+v, want reward 0.5, completed, in g", a)
		}
		if g.Sessions[0].Status != trace.StatusRunning || g.Sessions[2].Status != trace.StatusFailed {
			t.Errorf("statuses %q %q, want running and failed", g.Sessions[0].Status, g.Sessions[2].Status)
		}
		for _, id := range ids {
			tm, ok := times[id]
			if !ok || tm.Created.IsZero() {
				t.Errorf("session %s: times %+v (%v), want its creation", id, tm, ok)
			}
			if running := id == "b"; tm.Finished.IsZero() != running || (!running && tm.Finished.Before(tm.Created)) {
				t.Errorf("session %s: finished at %v, created %v (running %v)", id, tm.Finished, tm.Created, running)
			}
		}
		if len(times) != 3 {
			t.Errorf("times of %d sessions, want 3", len(times))
		}
		_, _, err = s.GroupSessions("nope")
		wantErr(t, "GroupSessions of an unknown group", err, trace.ErrUnknownGroup)
	})
	t.Run("each call", func(t *testing.T) {
		s := f.New(t)
		must(t, s.CreateSession(trace.Session{ID: "s", TaskID: "t", GroupID: "g"}, "", 0))
		must(t, s.CreateSession(trace.Session{ID: "empty", TaskID: "t", GroupID: "g"}, "", 0))
		var want []trace.Call
		for _, c := range []*trace.Call{call("s", 0, 1, 2), call("s", 0, 1, 2, 7, 8, 3), call("s", 1, 1, 2, 7, 8, 3), call("s", 0, 9)} {
			c.Request = []byte(fmt.Sprintf(`{"n":%d}`, len(want)))
			must(t, s.Record(bg, c))
			want = append(want, *c)
		}
		var got []trace.Call
		must(t, s.EachCall("s", func(c *trace.Call) error {
			cp := *c
			cp.PromptIDs, cp.ResponseIDs, cp.Logprobs, cp.Request = slices.Clone(c.PromptIDs), slices.Clone(c.ResponseIDs),
				slices.Clone(c.Logprobs), slices.Clone(c.Request)
			got = append(got, cp)
			return nil
		}))
		whole, err := s.Session("s")
		must(t, err)
		if len(got) != len(want) || len(whole.Calls) != len(want) {
			t.Fatalf("EachCall gave %d calls and Session %d, want %d", len(got), len(whole.Calls), len(want))
		}
		for i := range want {
			if err := equalCall(got[i], want[i]); err != nil {
				t.Errorf("call %d: %v", i, err)
			}
			if err := equalCall(got[i], whole.Calls[i]); err != nil {
				t.Errorf("call %d, as Session reads it: %v", i, err)
			}
		}
		stop := errors.New("stop")
		n := 0
		err = s.EachCall("s", func(*trace.Call) error { n++; return stop })
		if !errors.Is(err, stop) || n != 1 {
			t.Errorf("EachCall whose fn fails: %v after %d calls, want fn's error after 1", err, n)
		}
		must(t, s.EachCall("empty", func(c *trace.Call) error {
			t.Errorf("a session without calls gave call %+v", c)
			return nil
		}))
		wantErr(t, "EachCall of an unknown session", s.EachCall("nope", func(*trace.Call) error { return nil }), trace.ErrUnknownSession)
	})
}

// StepArchive checks trace.StepArchive, and trace.Tombstones of its steps: only
// committed steps are archivable; a step is marked files-written before its groups may
// leave, group by group or all at once; a forgotten step stays committed (no second
// commit or save, the numbering goes on), its groups' and sessions' ids stay taken and
// its sessions say where they went, also across a restart; what is not in the step is
// untouched.
func StepArchive(t *testing.T, f Factory[ArchiveStore]) {
	t.Run("refusals before a commit", func(t *testing.T) {
		s := f.New(t)
		archiveGroup(t, s, "g0", 1, 1)
		stepOf(t, s, 0, "g0")
		if got, err := s.ArchivableSteps(); err != nil || len(got) != 0 {
			t.Errorf("ArchivableSteps with no step committed = %v %v, want none", got, err)
		}
		if _, err := s.CommittedStepHead(0); err == nil {
			t.Error("CommittedStepHead of an uncommitted step succeeded")
		}
		if err := s.MarkStepFilesWritten(0); err == nil {
			t.Error("MarkStepFilesWritten of an uncommitted step succeeded")
		}
		if err := s.ForgetStepGroup(0, "g0"); err == nil {
			t.Error("ForgetStepGroup of an uncommitted step succeeded")
		}
		if err := s.ForgetStep(0); err == nil {
			t.Error("ForgetStep of an uncommitted step succeeded")
		}
		_, err := s.CommittedStepHead(9)
		wantErr(t, "CommittedStepHead of an unknown step", err, trace.ErrUnknownStep)
		wantErr(t, "MarkStepFilesWritten of an unknown step", s.MarkStepFilesWritten(9), trace.ErrUnknownStep)
		wantErr(t, "ForgetStepGroup of an unknown step", s.ForgetStepGroup(9, "g0"), trace.ErrUnknownStep)
		wantErr(t, "ForgetStep of an unknown step", s.ForgetStep(9), trace.ErrUnknownStep)
		if _, err := s.Group("g0"); err != nil {
			t.Errorf("a refused forget touched the group: %v", err)
		}
		must(t, s.CommitStep(0))
	})
	t.Run("group by group", func(t *testing.T) {
		s := f.New(t)
		g0 := archiveGroup(t, s, "g0", 2, 2)
		archiveGroup(t, s, "g1", 2, 1)
		live := archiveGroup(t, s, "g2", 2, 3)
		r0 := stepOf(t, s, 0, "g1", "g0")
		r1 := stepOf(t, s, 1, "g2")
		must(t, s.CommitStep(0))
		if got, err := s.ArchivableSteps(); err != nil || !slices.Equal(got, []int64{0}) {
			t.Fatalf("ArchivableSteps = %v %v, want [0]", got, err)
		}
		head, err := s.CommittedStepHead(0)
		must(t, err)
		if !head.Record.Same(r0) || head.CommittedAt.IsZero() || head.FilesWritten {
			t.Fatalf("CommittedStepHead(0) = %+v, want %+v committed, files not written", head, r0)
		}
		if err := s.ForgetStepGroup(0, "g0"); err == nil {
			t.Fatal("ForgetStepGroup of a step not marked files-written succeeded")
		}
		kept(t, s, "g0-s1", g0["g0-s1"])
		must(t, s.MarkStepFilesWritten(0))
		must(t, s.MarkStepFilesWritten(0)) // again: a no-op
		if head, err := s.CommittedStepHead(0); err != nil || !head.FilesWritten || !head.Record.Same(r0) {
			t.Fatalf("CommittedStepHead(0) after the mark = %+v %v, want files written", head, err)
		}
		if err := s.ForgetStepGroup(0, "g2"); err == nil {
			t.Error("ForgetStepGroup of a group of another step succeeded")
		}
		must(t, s.ForgetStepGroup(0, "g1"))
		must(t, s.ForgetStepGroup(0, "g1")) // again: a no-op
		gone(t, s, "g1", "g1-s0", "g1-s1")
		kept(t, s, "g0-s0", g0["g0-s0"])
		wentTo(t, s, map[string]trace.Forgotten{"g1-s1": {Known: true, Step: 0}, "g0-s0": {}, "never": {}})
		if got, err := s.ArchivableSteps(); err != nil || !slices.Equal(got, []int64{0}) {
			t.Fatalf("ArchivableSteps with a group left = %v %v, want [0]", got, err)
		}
		if f.Reopen != nil { // a crash part way: the mark holds, the forgotten group stays gone
			s = f.Reopen(t, s)
			if head, err := s.CommittedStepHead(0); err != nil || !head.FilesWritten {
				t.Fatalf("CommittedStepHead(0) after a restart = %+v %v, want files written", head, err)
			}
			gone(t, s, "g1", "g1-s0", "g1-s1")
		}
		must(t, s.ForgetStep(0)) // finishes: g0 leaves, the step becomes a tombstone
		must(t, s.ForgetStep(0)) // again: a no-op
		forgotten := func(t *testing.T, s ArchiveStore) {
			t.Helper()
			gone(t, s, "g0", "g0-s0", "g0-s1")
			gone(t, s, "g1", "g1-s0", "g1-s1")
			for sid, calls := range live {
				kept(t, s, sid, calls)
			}
			wentTo(t, s, map[string]trace.Forgotten{"g0-s0": {Known: true, Step: 0}, "g1-s1": {Known: true, Step: 0}, "g2-s0": {}})
			if got, err := s.ArchivableSteps(); err != nil || len(got) != 0 {
				t.Errorf("ArchivableSteps after ForgetStep = %v %v, want none", got, err)
			}
			if _, err := s.CommittedStepHead(0); err == nil {
				t.Error("CommittedStepHead of a forgotten step succeeded")
			}
			wantErr(t, "a commit of a forgotten step", s.CommitStep(0), trace.ErrCommitted)
			wantErr(t, "a save of a forgotten step", s.SaveStepRecord(r0), trace.ErrCommitted)
			un, last, err := s.Steps()
			must(t, err)
			if len(un) != 1 || !un[0].Same(r1) || last != 0 {
				t.Errorf("Steps after ForgetStep = %+v %d, want step 1 and last committed 0", un, last)
			}
		}
		forgotten(t, s)
		if f.Reopen != nil {
			s = f.Reopen(t, s)
			forgotten(t, s)
		}
		must(t, s.CommitStep(1)) // the numbering goes on
		if got, err := s.ArchivableSteps(); err != nil || !slices.Equal(got, []int64{1}) {
			t.Errorf("ArchivableSteps = %v %v, want [1]", got, err)
		}
	})
	t.Run("at once", func(t *testing.T) {
		s := f.New(t)
		archiveGroup(t, s, "g0", 2, 2)
		live := archiveGroup(t, s, "g1", 1, 2)
		stepOf(t, s, 0, "g0")
		must(t, s.CommitStep(0))
		must(t, s.ForgetStep(0)) // marks the step itself
		gone(t, s, "g0", "g0-s0", "g0-s1")
		kept(t, s, "g1-s0", live["g1-s0"])
		if got, err := s.ArchivableSteps(); err != nil || len(got) != 0 {
			t.Errorf("ArchivableSteps = %v %v, want none", got, err)
		}
	})
}

// DroppedArchive checks trace.DroppedArchive, and trace.Tombstones of its groups: a
// dropped group reads back with its sessions, their times, its reason and its own
// number, and leaves the store in one write, its ids staying taken and its sessions
// saying where they went (also across a restart); a group not dropped is refused.
func DroppedArchive(t *testing.T, f Factory[ArchiveStore]) {
	s := f.New(t)
	archiveGroup(t, s, "gd", 2, 2)
	archiveGroup(t, s, "gd2", 1, 1)
	live := archiveGroup(t, s, "gk", 2, 1)
	if _, err := s.DroppedGroup("gd"); err == nil {
		t.Error("DroppedGroup of a group not dropped succeeded")
	}
	if err := s.ForgetDroppedGroup("gd"); err == nil {
		t.Error("ForgetDroppedGroup of a group not dropped succeeded")
	}
	_, err := s.DroppedGroup("nope")
	wantErr(t, "DroppedGroup of an unknown group", err, trace.ErrUnknownGroup)
	must(t, s.ForgetDroppedGroup("nope")) // unknown: forgotten already
	must(t, s.DropGroup("gd", "too few usable sessions"))
	must(t, s.DropGroup("gd2", "too few usable sessions"))
	d, err := s.DroppedGroup("gd")
	must(t, err)
	var ids []string
	for _, ss := range d.Group.Sessions {
		ids = append(ids, ss.ID)
		if len(ss.Calls) != 0 {
			t.Errorf("DroppedGroup read session %s with its calls", ss.ID)
		}
		if tm := d.Times[ss.ID]; tm.Created.IsZero() || tm.Finished.IsZero() {
			t.Errorf("session %s: times %+v, want created and finished", ss.ID, tm)
		}
	}
	if d.Group.ID != "gd" || d.Group.TaskID != "t-gd" || d.Reason != "too few usable sessions" || !slices.Equal(ids, []string{"gd-s0", "gd-s1"}) {
		t.Errorf("DroppedGroup(gd) = %+v", d)
	}
	d2, err := s.DroppedGroup("gd2")
	must(t, err)
	if d.Seq == 0 || d2.Seq == 0 || d.Seq == d2.Seq {
		t.Errorf("drop numbers %d and %d, want distinct and non-zero", d.Seq, d2.Seq)
	}
	must(t, s.ForgetDroppedGroup("gd"))
	must(t, s.ForgetDroppedGroup("gd")) // again: a no-op
	check := func(t *testing.T, s ArchiveStore) {
		t.Helper()
		gone(t, s, "gd", "gd-s0", "gd-s1")
		for sid, calls := range live {
			kept(t, s, sid, calls)
		}
		wentTo(t, s, map[string]trace.Forgotten{"gd-s1": {Known: true, Step: -1, Dropped: true, DropSeq: d.Seq}, "gd2-s0": {}, "gk-s0": {}})
		if again, err := s.DroppedGroup("gd2"); err != nil || again.Seq != d2.Seq {
			t.Errorf("DroppedGroup(gd2) = %+v %v, want its number %d", again, err, d2.Seq)
		}
	}
	check(t, s)
	if f.Reopen != nil {
		check(t, f.Reopen(t, s))
	}
}

// Compactor checks trace.Compactor: no compaction when the policy says it does not pay,
// the live bytes reported either way; a store that forgot most of what it held compacts
// smaller, and keeps every call, step and key it holds, also across a restart.
func Compactor(t *testing.T, f Factory[ArchiveStore]) {
	s := f.New(t)
	// 40 calls of 16k distinct tokens each: megabytes, nearly all forgotten below.
	const groups, calls, tokens = 10, 4, 16 << 10
	for g := range groups {
		gid := fmt.Sprintf("g%d", g)
		sid := gid + "-s"
		must(t, s.CreateSession(trace.Session{ID: sid, TaskID: "t", GroupID: gid}, "", 1))
		for k := range calls {
			prompt := make([]int32, tokens)
			for i := range prompt {
				prompt[i] = int32((g*calls+k)*tokens + i)
			}
			must(t, s.Record(bg, call(sid, 0, prompt...)))
		}
		must(t, s.FinishSession(sid, 1, trace.StatusCompleted))
		stepOf(t, s, int64(g), gid)
		must(t, s.CommitStep(int64(g)))
	}
	live := archiveGroup(t, s, "live", 2, 2)
	c, err := s.CompactIfWorth(trace.CompactPolicy{MinFileBytes: 1 << 62}, 0)
	must(t, err)
	if c.Compacted || c.BeforeBytes <= 0 || c.AfterBytes != c.BeforeBytes || c.LiveBytes <= 0 || c.LiveBytes > c.BeforeBytes {
		t.Fatalf("CompactIfWorth under the file floor = %+v, want no compaction and the sizes", c)
	}
	for g := range groups {
		must(t, s.ForgetStep(int64(g)))
	}
	c, err = s.CompactIfWorth(trace.CompactPolicy{MinFileBytes: 1}, c.BeforeBytes)
	must(t, err)
	if c.Compacted {
		t.Fatalf("compacted against a live floor of the file's size: %+v", c)
	}
	c, err = s.CompactIfWorth(trace.CompactPolicy{MinFileBytes: 1}, 0)
	must(t, err)
	if !c.Compacted || c.AfterBytes >= c.BeforeBytes || c.LiveBytes > c.AfterBytes {
		t.Fatalf("CompactIfWorth after forgetting nearly everything = %+v, want a smaller file", c)
	}
	must(t, s.CreateSession(trace.Session{ID: "after", TaskID: "t", GroupID: "g-after"}, "key-after", 0))
	after := call("after", 0, 1, 2)
	must(t, s.Record(bg, after))
	live["after"] = []trace.Call{*after}
	check := func(t *testing.T, s ArchiveStore) {
		t.Helper()
		for sid, calls := range live {
			kept(t, s, sid, calls)
		}
		if _, last, err := s.Steps(); err != nil || last != groups-1 {
			t.Errorf("last committed %d %v, want %d", last, err, groups-1)
		}
		wantErr(t, "a commit of a forgotten step", s.CommitStep(0), trace.ErrCommitted)
	}
	check(t, s)
	if f.Reopen != nil {
		check(t, f.Reopen(t, s))
	}
}
