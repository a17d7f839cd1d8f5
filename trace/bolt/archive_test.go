package bolt

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
)

// fillGroup creates group gid of sessions sessions (keys "key-<session>"), records calls
// calls in each from rng, and finishes them. It returns the calls recorded, by session.
func fillGroup(t testing.TB, s *Store, gid string, sessions, calls int, rng *rand.Rand) map[string][]trace.Call {
	t.Helper()
	out := map[string][]trace.Call{}
	for i := range sessions {
		sid := fmt.Sprintf("%s-s%d", gid, i)
		if err := s.CreateSession(trace.Session{ID: sid, TaskID: "task-" + gid, GroupID: gid}, "key-"+sid, sessions); err != nil {
			t.Fatal(err)
		}
		prompt := toks(rng, 200)
		for range calls {
			c := call(sid, prompt, toks(rng, 50), rng)
			c.Request = []byte(fmt.Sprintf(`{"messages":%d}`, len(prompt)))
			if err := s.Record(context.Background(), &c); err != nil {
				t.Fatal(err)
			}
			out[sid] = append(out[sid], c)
			prompt = cat(prompt, c.ResponseIDs, toks(rng, 30))
		}
		if err := s.FinishSession(sid, float64(i), trace.StatusCompleted); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// TestForgetStep: a committed step's groups, sessions, calls and keys leave the store; the step stays committed (no second commit, no second save, the numbering
// goes on), also after a restart; other groups are untouched.
func TestForgetStep(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{})
	rng := rand.New(rand.NewPCG(1, 2))
	fillGroup(t, s, "g0", 2, 3, rng)
	kept := fillGroup(t, s, "g1", 2, 3, rng)
	if err := s.SaveStep(0, []string{"g0"}); err != nil {
		t.Fatal(err)
	}
	if err := s.ForgetStep(0); err == nil {
		t.Fatal("forgot an uncommitted step")
	}
	if err := s.CommitStep(0); err != nil {
		t.Fatal(err)
	}
	if got, err := s.ArchivableSteps(); err != nil || !slices.Equal(got, []int64{0}) {
		t.Fatalf("archivable %v %v, want [0]", got, err)
	}
	st, err := s.CommittedStepHead(0)
	if err != nil || !slices.Equal(st.Record.Groups, []string{"g0"}) || st.CommittedAt.IsZero() {
		t.Fatalf("committed step %+v %v", st, err)
	}
	g, times, err := s.GroupSessions("g0")
	if err != nil || len(g.Sessions) != 2 || len(g.Sessions[1].Calls) != 0 || times["g0-s1"].Finished.IsZero() {
		t.Fatalf("step group %+v %v %v", g, times, err)
	}
	calls := 0
	if err := s.EachCall("g0-s1", func(*trace.Call) error { calls++; return nil }); err != nil || calls != 3 {
		t.Fatalf("%d calls of g0-s1 (%v), want 3", calls, err)
	}
	before, _ := s.Usage()
	for range 2 { // the second is a no-op
		if err := s.ForgetStep(0); err != nil {
			t.Fatal(err)
		}
	}
	for round := range 2 {
		if round == 1 {
			s = reopen(t, s, dir)
		}
		if _, err := s.Resolve("key-g0-s0"); !errors.Is(err, ErrUnknownSession) {
			t.Fatalf("round %d: archived session's key resolves: %v", round, err)
		}
		if _, err := s.Session("g0-s0"); !errors.Is(err, ErrUnknownSession) {
			t.Fatalf("round %d: archived session reads: %v", round, err)
		}
		if _, err := s.Group("g0"); !errors.Is(err, ErrUnknownGroup) {
			t.Fatalf("round %d: archived group reads: %v", round, err)
		}
		gs, err := s.Groups()
		if err != nil || len(gs) != 1 || gs[0].ID != "g1" {
			t.Fatalf("round %d: groups %+v %v, want g1 only", round, gs, err)
		}
		if err := s.CommitStep(0); !errors.Is(err, ErrCommitted) {
			t.Fatalf("round %d: second commit: %v", round, err)
		}
		if err := s.SaveStep(0, []string{"g1"}); !errors.Is(err, ErrCommitted) {
			t.Fatalf("round %d: saving over an archived step: %v", round, err)
		}
		if un, last, err := s.Steps(); err != nil || len(un) != 0 || last != 0 {
			t.Fatalf("round %d: steps %v %d %v", round, un, last, err)
		}
		if c, err := s.StepCommitted(0); err != nil || !c {
			t.Fatalf("round %d: step 0 committed %v %v", round, c, err)
		}
		if got, err := s.ArchivableSteps(); err != nil || len(got) != 0 {
			t.Fatalf("round %d: archivable %v %v", round, got, err)
		}
		sess, err := s.Resolve("key-g1-s1")
		if err != nil || sess.ID != "g1-s1" {
			t.Fatalf("round %d: kept key: %+v %v", round, sess, err)
		}
		got, err := s.Session("g1-s1")
		if err != nil || len(got.Calls) != 3 {
			t.Fatalf("round %d: kept session %v", round, err)
		}
		for k := range got.Calls {
			if err := equalCall(&got.Calls[k], &kept["g1-s1"][k]); err != nil {
				t.Fatal(err)
			}
		}
		u, err := s.Usage()
		if err != nil || u.Sessions != before.Sessions-2 || u.Calls != before.Calls-6 || u.ArchivedCalls != 6 ||
			u.ArchivedSessions != 2 || u.ArchivedSteps != 1 || u.CallBytes >= before.CallBytes {
			t.Fatalf("round %d: usage %+v, before %+v", round, u, before)
		}
	}
	// The numbering goes on after the archived step.
	if err := s.SaveStep(1, []string{"g1"}); err != nil {
		t.Fatal(err)
	}
	if err := s.CommitStep(1); err != nil {
		t.Fatal(err)
	}
	if _, last, err := s.Steps(); err != nil || last != 1 {
		t.Fatalf("last committed %d %v", last, err)
	}
	testutil.Close(t, s)
}

// TestCompactShrinksAndKeeps: after most of the store is forgotten, CompactIfWorth
// rewrites it smaller, every kept call reads back the same, and writes made during the
// compaction land (they wait for it, in every commit mode).
func TestCompactShrinksAndKeeps(t *testing.T) {
	for _, mode := range []CommitMode{CommitGroup, CommitUpdate} {
		t.Run(fmt.Sprint(mode), func(t *testing.T) {
			dir := t.TempDir()
			s := open(t, dir, Options{Commit: mode})
			defer func() { testutil.Close(t, s) }()
			rng := rand.New(rand.NewPCG(3, 4))
			for i := range 20 {
				fillGroup(t, s, fmt.Sprintf("g%02d", i), 4, 8, rng)
				if err := s.SaveStep(int64(i), []string{fmt.Sprintf("g%02d", i)}); err != nil {
					t.Fatal(err)
				}
				if err := s.CommitStep(int64(i)); err != nil {
					t.Fatal(err)
				}
			}
			kept := fillGroup(t, s, "live", 2, 4, rng)
			if c, err := s.CompactIfWorth(trace.CompactPolicy{MinFileBytes: 1}, 0); err != nil || c.Compacted {
				t.Fatalf("compacted a store with nothing to gain: %+v %v", c, err)
			}
			for i := range 20 {
				if err := s.ForgetStep(int64(i)); err != nil {
					t.Fatal(err)
				}
			}
			// A session recording while the store compacts.
			if err := s.CreateSession(trace.Session{ID: "during", TaskID: "t", GroupID: "gd"}, "key-during", 0); err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			var recorded []trace.Call
			var recErr error
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(9, 9))
				for range 50 {
					c := call("during", toks(r, 100), toks(r, 10), r)
					if recErr = s.Record(context.Background(), &c); recErr != nil {
						return
					}
					recorded = append(recorded, c)
				}
			}()
			// Against the live size of a recent pass (the file's size), it does not pay.
			fi, _ := os.Stat(s.Path())
			if c, err := s.CompactIfWorth(trace.CompactPolicy{MinFileBytes: 1}, fi.Size()); err != nil || c.Compacted {
				t.Fatalf("compacted against a live floor of the file's size: %+v %v", c, err)
			}
			c, err := s.CompactIfWorth(trace.CompactPolicy{MinFileBytes: 1}, 0)
			wg.Wait()
			if err != nil || recErr != nil {
				t.Fatalf("compact: %v; record during it: %v", err, recErr)
			}
			if !c.Compacted || c.AfterBytes >= c.BeforeBytes || c.LiveBytes > c.AfterBytes {
				t.Fatalf("compaction %+v: want a smaller file", c)
			}
			fi, _ = os.Stat(s.Path())
			t.Logf("%+v; file now %d bytes", c, fi.Size())
			if _, err := os.Stat(s.Path() + compactSuffix); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("compaction copy left: %v", err)
			}
			check := func() {
				for sid, calls := range kept {
					got, err := s.Session(sid)
					if err != nil || len(got.Calls) != len(calls) {
						t.Fatalf("session %s after compaction: %v", sid, err)
					}
					for k := range calls {
						if err := equalCall(&got.Calls[k], &calls[k]); err != nil {
							t.Fatal(err)
						}
					}
				}
				got, err := s.Session("during")
				if err != nil || len(got.Calls) != len(recorded) {
					t.Fatalf("session recorded during compaction: %d calls, want %d (%v)", len(got.Calls), len(recorded), err)
				}
				if _, last, err := s.Steps(); err != nil || last != 19 {
					t.Fatalf("last committed %d %v", last, err)
				}
			}
			check()
			s = reopen(t, s, dir)
			check()
		})
	}
}

// TestForgetDroppedGroup: a dropped group reads back with its reason, leaves the store
// with its sessions and keys in one write, and forgetting it again is a no-op; a group
// not dropped is refused.
func TestForgetDroppedGroup(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{})
	defer func() { testutil.Close(t, s) }()
	rng := rand.New(rand.NewPCG(7, 8))
	fillGroup(t, s, "gd", 2, 2, rng)
	kept := fillGroup(t, s, "gk", 2, 2, rng)
	if err := s.ForgetDroppedGroup("gd"); err == nil {
		t.Fatal("forgot a group not dropped")
	}
	if _, err := s.DroppedGroup("gd"); err == nil {
		t.Fatal("read a group not dropped as dropped")
	}
	if err := s.DropGroup("gd", "too few usable sessions"); err != nil {
		t.Fatal(err)
	}
	d, err := s.DroppedGroup("gd")
	if err != nil || d.Reason != "too few usable sessions" || len(d.Group.Sessions) != 2 ||
		d.Times["gd-s1"].Finished.IsZero() || d.Seq == 0 {
		t.Fatalf("dropped group %+v %v", d, err)
	}
	calls := 0
	if err := s.EachCall(d.Group.Sessions[0].ID, func(*trace.Call) error { calls++; return nil }); err != nil || calls != 2 {
		t.Fatalf("%d calls of the dropped group's first session (%v), want 2", calls, err)
	}
	for range 2 {
		if err := s.ForgetDroppedGroup("gd"); err != nil {
			t.Fatal(err)
		}
	}
	s = reopen(t, s, dir)
	if _, err := s.Resolve("key-gd-s0"); !errors.Is(err, ErrUnknownSession) {
		t.Fatalf("forgotten key resolves: %v", err)
	}
	gs, err := s.Groups()
	if err != nil || len(gs) != 1 || gs[0].ID != "gk" {
		t.Fatalf("groups %+v %v", gs, err)
	}
	if got, err := s.Session("gk-s0"); err != nil || len(got.Calls) != len(kept["gk-s0"]) {
		t.Fatalf("kept session %v", err)
	}
	if u, err := s.Usage(); err != nil || u.Sessions != 2 || u.ArchivedSessions != 2 || u.ArchivedCalls != 4 || u.ArchivedSteps != 0 {
		t.Fatalf("usage %+v %v", u, err)
	}
}

// TestForgottenIDsStayTaken: once a step's or a dropped group's data leaves the store,
// its group and session ids cannot be created again (a reused group would train again,
// and the archive would hold two groups of one id), also after a restart; the refusal is
// a closed group's (the control API answers it 409). Each group dropped gets its own
// number, kept when it is dropped again.
func TestForgottenIDsStayTaken(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{})
	defer func() { testutil.Close(t, s) }()
	rng := rand.New(rand.NewPCG(3, 4))
	fillGroup(t, s, "g0", 2, 1, rng)
	fillGroup(t, s, "gd", 2, 1, rng)
	fillGroup(t, s, "gd2", 2, 1, rng)
	if err := s.SaveStep(0, []string{"g0"}); err != nil {
		t.Fatal(err)
	}
	if err := s.CommitStep(0); err != nil {
		t.Fatal(err)
	}
	for _, g := range []string{"gd", "gd2", "gd"} {
		if err := s.DropGroup(g, "too few"); err != nil {
			t.Fatal(err)
		}
	}
	d1, err1 := s.DroppedGroup("gd")
	d2, err2 := s.DroppedGroup("gd2")
	if err1 != nil || err2 != nil || d1.Seq == 0 || d2.Seq == 0 || d1.Seq == d2.Seq {
		t.Fatalf("drop numbers %d and %d (%v %v): want distinct, non-zero", d1.Seq, d2.Seq, err1, err2)
	}
	if err := s.ForgetStep(0); err != nil {
		t.Fatal(err)
	}
	if err := s.ForgetDroppedGroup("gd"); err != nil {
		t.Fatal(err)
	}
	for _, restart := range []bool{false, true} {
		if restart {
			s = reopen(t, s, dir)
		}
		tests := []struct {
			name string
			sess trace.Session
			want string // in the error; "" for success
		}{
			{"trained group", trace.Session{ID: "new-a", TaskID: "task-g0", GroupID: "g0"}, `group "g0" is closed`},
			{"dropped group", trace.Session{ID: "new-b", TaskID: "task-gd", GroupID: "gd"}, `group "gd" is closed`},
			{"trained session", trace.Session{ID: "g0-s1", TaskID: "task-x", GroupID: "x"}, "session already exists"},
			{"dropped session, no group", trace.Session{ID: "gd-s0"}, "session already exists"},
			{"dropped group not yet archived", trace.Session{ID: "new-c", TaskID: "task-gd2", GroupID: "gd2"}, `group "gd2" is closed`},
		}
		for _, tt := range tests {
			err := s.CreateSession(tt.sess, "", 0)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("restart %v: %s: create %+v: %v, want an error with %q", restart, tt.name, tt.sess, err, tt.want)
			}
		}
		if errors.Is(s.CreateSession(trace.Session{ID: "g0-s1"}, "", 0), ErrSessionExists) != true {
			t.Errorf("a forgotten session id is not ErrSessionExists")
		}
		fresh := fmt.Sprintf("fresh-%v", restart)
		if err := s.CreateSession(trace.Session{ID: fresh, TaskID: "t", GroupID: "g-" + fresh}, "", 0); err != nil {
			t.Errorf("a new id: %v", err)
		}
	}
}

// TestForgetStepGroupByGroup: a step's groups leave the store one write each; a store
// closed part way (a crash) keeps the step committed, marked files-written, with the
// groups not yet forgotten, and ForgetStep then finishes: every group gone, the usage
// counted once, the step a tombstone.
func TestForgetStepGroupByGroup(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{})
	defer func() { testutil.Close(t, s) }()
	rng := rand.New(rand.NewPCG(5, 6))
	groups := []string{"ga", "gb", "gc"}
	for _, g := range groups {
		fillGroup(t, s, g, 2, 2, rng)
	}
	if err := s.SaveStep(0, groups); err != nil {
		t.Fatal(err)
	}
	if err := s.CommitStep(0); err != nil {
		t.Fatal(err)
	}
	if err := s.ForgetStepGroup(0, "ga"); err == nil {
		t.Fatal("forgot a group of a step not marked files-written")
	}
	if err := s.MarkStepFilesWritten(0); err != nil {
		t.Fatal(err)
	}
	if err := s.ForgetStepGroup(0, "gx"); err == nil {
		t.Fatal("forgot a group not in the step")
	}
	for range 2 { // the second time: a no-op, as after a crash past its write
		if err := s.ForgetStepGroup(0, "ga"); err != nil {
			t.Fatal(err)
		}
	}
	s = reopen(t, s, dir)
	if steps, err := s.ArchivableSteps(); err != nil || !slices.Equal(steps, []int64{0}) {
		t.Fatalf("archivable %v %v: the step is not archived yet", steps, err)
	}
	head, err := s.CommittedStepHead(0)
	if err != nil || !head.FilesWritten || !slices.Equal(head.Record.Groups, groups) {
		t.Fatalf("head %+v %v", head, err)
	}
	gs, err := s.Groups()
	if err != nil || len(gs) != 2 {
		t.Fatalf("groups after forgetting one: %+v %v", gs, err)
	}
	if err := s.ForgetStep(0); err != nil {
		t.Fatal(err)
	}
	if steps, err := s.ArchivableSteps(); err != nil || len(steps) != 0 {
		t.Fatalf("archivable %v %v after ForgetStep", steps, err)
	}
	u, err := s.Usage()
	if err != nil || u.Sessions != 0 || u.Calls != 0 || u.ArchivedSessions != 6 || u.ArchivedCalls != 12 || u.ArchivedSteps != 1 {
		t.Fatalf("usage %+v %v", u, err)
	}
	if err := s.CommitStep(0); !errors.Is(err, ErrCommitted) {
		t.Fatalf("commit after forgetting: %v", err)
	}
}

// TestForgottenSessionSaysWhereItWent: an archived session's tombstone keeps the step it
// trained in, or its dropped group's number, across a restart, so that floe can say
// where its rows are; a live or unknown id was never forgotten; a tombstone from before
// the fate was kept reads as forgotten, fate unknown.
func TestForgottenSessionSaysWhereItWent(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{})
	defer func() { testutil.Close(t, s) }()
	rng := rand.New(rand.NewPCG(5, 6))
	for _, g := range []string{"g0", "g1", "gd", "glive"} {
		fillGroup(t, s, g, 2, 1, rng)
	}
	for n, g := range []string{"g0", "g1"} {
		if err := s.SaveStep(int64(n), []string{g}); err != nil {
			t.Fatal(err)
		}
		if err := s.CommitStep(int64(n)); err != nil {
			t.Fatal(err)
		}
		if err := s.ForgetStep(int64(n)); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.DropGroup("gd", "too few usable sessions"); err != nil {
		t.Fatal(err)
	}
	d, err := s.DroppedGroup("gd")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.ForgetDroppedGroup("gd"); err != nil {
		t.Fatal(err)
	}
	if err := s.write(func(tx *bolt.Tx) error { return bury(tx, tombSession, "from-an-older-floe", []byte{1}) }); err != nil {
		t.Fatal(err)
	}
	want := map[string]struct {
		f  trace.Forgotten
		ok bool
	}{
		"g0-s1":              {trace.Forgotten{Known: true, Step: 0}, true},
		"g1-s0":              {trace.Forgotten{Known: true, Step: 1}, true},
		"gd-s1":              {trace.Forgotten{Known: true, Step: -1, Dropped: true, DropSeq: d.Seq}, true},
		"glive-s0":           {trace.Forgotten{}, false},
		"never":              {trace.Forgotten{}, false},
		"from-an-older-floe": {trace.Forgotten{}, true},
	}
	for round := range 2 {
		if round == 1 {
			s = reopen(t, s, dir)
		}
		for id, w := range want {
			f, ok, err := s.ForgottenSession(id)
			if err != nil || ok != w.ok || f != w.f {
				t.Errorf("round %d: ForgottenSession(%q) = %+v, %v, %v; want %+v, %v", round, id, f, ok, err, w.f, w.ok)
			}
		}
	}
}
