// Package tracetest is the conformance suite of trace's store contract: one function per
// role, each checking what trace/store.go documents for it, errors.Is on every sentinel
// included. Every implementation of a role runs the role's function from its tests
// (trace/bolt, trace/mem, trace/jsonl), so that they agree with the contract and with
// each other.
//
// A suite takes a Factory: how to make an empty store, and for durable stores how to
// close one and open it again on the same storage, which adds the restart checks.
package tracetest

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"

	"github.com/floe-rl/floe/trace"
)

// Factory makes the stores a suite runs on.
type Factory[S any] struct {
	// New returns an empty store; the test cleans it up (t.Cleanup).
	New func(t *testing.T) S
	// Reopen closes s and opens the same store again, as a restart does. Nil for stores
	// that keep nothing across a restart: the restart checks are skipped.
	Reopen func(t *testing.T, s S) S
}

// Store is a store playing the session, group and step roles (bolt, mem).
type Store interface {
	trace.CallRecorder
	trace.SessionKeys
	trace.SessionStore
	trace.GroupStore
	trace.StepStore
}

// StoreRecorder is the RecorderStore of a Store: sessions created with CreateSession (no
// group), finished as completed, read back with Session.
func StoreRecorder(s Store) RecorderStore {
	return RecorderStore{
		CallRecorder: s,
		Create:       func(id string) error { return s.CreateSession(trace.Session{ID: id, TaskID: "t"}, "", 0) },
		Finish:       func(id string) error { return s.FinishSession(id, 1, trace.StatusCompleted) },
		Calls: func(id string) ([]trace.Call, error) {
			sess, err := s.Session(id)
			return sess.Calls, err
		},
	}
}

// RecorderStore is a CallRecorder and how the suite drives and reads it.
type RecorderStore struct {
	trace.CallRecorder
	// Create makes session id take calls; nil when the recorder takes calls of any
	// session (it knows no sessions).
	Create func(id string) error
	// Finish finishes running session id; nil when the recorder knows no sessions.
	Finish func(id string) error
	// Calls reads back session's recorded calls in the order they were recorded.
	Calls func(session string) ([]trace.Call, error)
}

var bg = context.Background()

func call(session string, choice int, prompt ...int32) *trace.Call {
	return &trace.Call{SessionID: session, Choice: choice, PromptIDs: prompt, ResponseIDs: []int32{7, 8},
		Logprobs: []float32{-0.5, -0.25}, FinishReason: "stop", Trainable: true, API: "openai_chat"}
}

func wantErr(t *testing.T, what string, err, sentinel error) {
	t.Helper()
	if !errors.Is(err, sentinel) {
		t.Errorf("%s: %v, want an error wrapping %q", what, err, sentinel)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// Recorder checks trace.CallRecorder: call indexes per session (n>1 choices share one),
// the call read back as recorded, its slices not retained, concurrent recording, refusals
// of sessions that take no calls (recorders that know sessions), and indexes going on
// after a restart (durable recorders).
func Recorder(t *testing.T, f Factory[RecorderStore]) {
	create := func(t *testing.T, r RecorderStore, ids ...string) {
		t.Helper()
		for _, id := range ids {
			if r.Create != nil {
				must(t, r.Create(id))
			}
		}
	}
	record := func(t *testing.T, r RecorderStore, c *trace.Call) int {
		t.Helper()
		must(t, r.Record(bg, c))
		return c.Index
	}
	t.Run("indexes", func(t *testing.T) {
		r := f.New(t)
		create(t, r, "a", "b")
		// a: one call, an n=3 request, one call; b interleaved, independent.
		steps := []struct {
			session string
			choice  int
			want    int
		}{
			{"a", 0, 0}, {"b", 0, 0}, {"a", 0, 1}, {"a", 1, 1}, {"a", 2, 1}, {"b", 0, 1}, {"b", 1, 1}, {"a", 0, 2},
		}
		for i, s := range steps {
			if got := record(t, r, call(s.session, s.choice, int32(i), 1)); got != s.want {
				t.Fatalf("call %d (session %s choice %d): index %d, want %d", i, s.session, s.choice, got, s.want)
			}
		}
		calls, err := r.Calls("a")
		must(t, err)
		var got [][2]int
		for _, c := range calls {
			got = append(got, [2]int{c.Index, c.Choice})
		}
		if want := [][2]int{{0, 0}, {1, 0}, {1, 1}, {1, 2}, {2, 0}}; !slices.Equal(got, want) {
			t.Fatalf("session a read back as (index, choice) %v, want %v", got, want)
		}
	})
	t.Run("read back as recorded", func(t *testing.T) {
		r := f.New(t)
		create(t, r, "s")
		c := call("s", 0, 1, 2, 3)
		c.PolicyVersion, c.UntrainableReason, c.Trainable = 4, "why", false
		c.Request = []byte(`{"a":1}`)
		c.Index = 99 // the recorder assigns it
		must(t, r.Record(bg, c))
		if c.Index != 0 {
			t.Fatalf("Record left index %d, want 0", c.Index)
		}
		want := *c
		want.PromptIDs, want.Request = slices.Clone(c.PromptIDs), slices.Clone(c.Request)
		c.PromptIDs[0], c.Request[2] = 42, 'X' // the recorder keeps no reference to the caller's slices
		calls, err := r.Calls("s")
		must(t, err)
		if len(calls) != 1 {
			t.Fatalf("%d calls read back, want 1", len(calls))
		}
		if err := equalCall(calls[0], want); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("refusals", func(t *testing.T) {
		r := f.New(t)
		if err := r.Record(bg, call("", 0, 1)); err == nil {
			t.Error("a call without a session was recorded")
		}
		create(t, r, "s")
		if err := r.Record(bg, call("s", 1, 1)); err == nil {
			t.Error("choice 1 with no call before it was recorded")
		}
		ctx, cancel := context.WithCancel(bg)
		cancel()
		wantErr(t, "Record with a cancelled context", r.Record(ctx, call("s", 0, 1)), context.Canceled)
		if got := record(t, r, call("s", 0, 1)); got != 0 {
			t.Errorf("a refused call took index 0: the next got %d", got)
		}
		if r.Create == nil {
			return
		}
		wantErr(t, "Record in an unknown session", r.Record(bg, call("nope", 0, 1)), trace.ErrUnknownSession)
		must(t, r.Finish("s"))
		wantErr(t, "Record in a finished session", r.Record(bg, call("s", 0, 1)), trace.ErrSessionFinished)
	})
	t.Run("concurrent", func(t *testing.T) {
		r := f.New(t)
		const sessions, workers, each = 3, 4, 10
		for s := 0; s < sessions; s++ {
			create(t, r, fmt.Sprint("s", s))
		}
		var wg sync.WaitGroup
		errs := make(chan error, sessions*workers*each)
		for s := 0; s < sessions; s++ {
			for w := 0; w < workers; w++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := 0; i < each; i++ {
						errs <- r.Record(bg, call(fmt.Sprint("s", s), 0, int32(w), int32(i)))
					}
				}()
			}
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			must(t, err)
		}
		for s := 0; s < sessions; s++ {
			calls, err := r.Calls(fmt.Sprint("s", s))
			must(t, err)
			for i, c := range calls {
				if c.Index != i {
					t.Fatalf("session s%d: call %d read back with index %d (indexes must be 0..n-1 in recording order)", s, i, c.Index)
				}
			}
			if len(calls) != workers*each {
				t.Fatalf("session s%d: %d calls, want %d", s, len(calls), workers*each)
			}
		}
	})
	if f.Reopen == nil {
		return
	}
	t.Run("indexes go on after a restart", func(t *testing.T) {
		r := f.New(t)
		create(t, r, "s")
		record(t, r, call("s", 0, 1))
		record(t, r, call("s", 0, 2))
		record(t, r, call("s", 1, 2))
		r = f.Reopen(t, r)
		if got := record(t, r, call("s", 2, 2)); got != 1 {
			t.Errorf("choice 2 of call 1 after a restart: index %d, want 1", got)
		}
		if got := record(t, r, call("s", 0, 3)); got != 2 {
			t.Errorf("call after a restart: index %d, want 2", got)
		}
		calls, err := r.Calls("s")
		must(t, err)
		if len(calls) != 5 {
			t.Fatalf("%d calls after a restart, want 5", len(calls))
		}
	})
}

// equalCall compares what a recorder must keep of a call.
func equalCall(got, want trace.Call) error {
	switch {
	case got.SessionID != want.SessionID || got.Index != want.Index || got.Choice != want.Choice:
		return fmt.Errorf("call %s/%d/%d read back as %s/%d/%d", want.SessionID, want.Index, want.Choice, got.SessionID, got.Index, got.Choice)
	case !slices.Equal(got.PromptIDs, want.PromptIDs) || !slices.Equal(got.ResponseIDs, want.ResponseIDs):
		return fmt.Errorf("tokens %v %v read back as %v %v", want.PromptIDs, want.ResponseIDs, got.PromptIDs, got.ResponseIDs)
	case !slices.Equal(got.Logprobs, want.Logprobs):
		return fmt.Errorf("logprobs %v read back as %v", want.Logprobs, got.Logprobs)
	case got.FinishReason != want.FinishReason || got.PolicyVersion != want.PolicyVersion || got.Trainable != want.Trainable ||
		got.UntrainableReason != want.UntrainableReason || got.API != want.API:
		return fmt.Errorf("call %+v read back as %+v", want, got)
	case string(got.Request) != string(want.Request):
		return fmt.Errorf("request %s read back as %s", want.Request, got.Request)
	}
	return nil
}

// Sessions checks trace.SessionKeys and trace.SessionStore (with the CallRecorder the
// sessions take calls through): keys, creation, finishing, group sizes, open sessions.
func Sessions(t *testing.T, f Factory[Store]) {
	t.Run("create, resolve, read", func(t *testing.T) {
		s := f.New(t)
		must(t, s.CreateSession(trace.Session{ID: "s1", TaskID: "t", GroupID: "g"}, "k1", 0))
		if got, err := s.Resolve("k1"); err != nil || got.ID != "s1" || got.TaskID != "t" || got.GroupID != "g" || !got.Running() {
			t.Errorf("Resolve(k1) = %+v %v, want s1 running", got, err)
		}
		if got, err := s.Resolve("nope"); !errors.Is(err, trace.ErrUnknownSession) {
			t.Errorf("Resolve of an unknown key = %+v %v, want ErrUnknownSession", got, err)
		}
		if got, err := s.Resolve("s1"); !errors.Is(err, trace.ErrUnknownSession) {
			t.Errorf("a session's id resolves as a key: %+v %v", got, err)
		}
		wantErr(t, "CreateSession of a taken id", s.CreateSession(trace.Session{ID: "s1", TaskID: "t", GroupID: "g"}, "k2", 0), trace.ErrSessionExists)
		if err := s.CreateSession(trace.Session{ID: "s2", TaskID: "t"}, "k1", 0); err == nil {
			t.Error("CreateSession with another session's key succeeded")
		}
		must(t, s.Record(bg, call("s1", 0, 1)))
		got, err := s.Session("s1")
		must(t, err)
		if got.ID != "s1" || got.TaskID != "t" || got.GroupID != "g" || got.Status != trace.StatusRunning || len(got.Calls) != 1 {
			t.Errorf("Session(s1) = %+v", got)
		}
		_, err = s.Session("nope")
		wantErr(t, "Session of an unknown id", err, trace.ErrUnknownSession)
	})
	t.Run("finish", func(t *testing.T) {
		s := f.New(t)
		must(t, s.CreateSession(trace.Session{ID: "s", TaskID: "t", GroupID: "g"}, "", 0))
		for _, bad := range []struct {
			reward float64
			status trace.Status
		}{{1, trace.StatusRunning}, {1, "done"}, {math.NaN(), trace.StatusCompleted}, {math.Inf(1), trace.StatusCompleted}} {
			if err := s.FinishSession("s", bad.reward, bad.status); err == nil {
				t.Errorf("FinishSession(%v, %q) succeeded", bad.reward, bad.status)
			}
		}
		must(t, s.FinishSession("s", 0.5, trace.StatusFailed))
		wantErr(t, "a second finish", s.FinishSession("s", 1, trace.StatusCompleted), trace.ErrSessionFinished)
		wantErr(t, "finish of an unknown session", s.FinishSession("nope", 1, trace.StatusCompleted), trace.ErrUnknownSession)
		got, err := s.Session("s")
		must(t, err)
		if got.Reward != 0.5 || got.Status != trace.StatusFailed {
			t.Errorf("finished session = %+v, want reward 0.5 failed (the first finish)", got)
		}
		wantErr(t, "Record in a finished session", s.Record(bg, call("s", 0, 1)), trace.ErrSessionFinished)
		must(t, s.CreateSession(trace.Session{ID: "k", TaskID: "t", GroupID: "g"}, "key-k", 0))
		if got, err := s.Resolve("key-k"); err != nil || !got.Running() {
			t.Errorf("Resolve of a running session's key = %+v %v", got, err)
		}
		must(t, s.FinishSession("k", -1, trace.StatusTimeout))
		if got, err := s.Resolve("key-k"); err != nil || got.ID != "k" || got.Running() || got.Status != trace.StatusTimeout {
			t.Errorf("Resolve of a timed-out session's key = %+v %v, want k, not running", got, err)
		}
		wantErr(t, "Record in an unknown session", s.Record(bg, call("nope", 0, 1)), trace.ErrUnknownSession)
	})
	t.Run("group size", func(t *testing.T) {
		s := f.New(t)
		must(t, s.CreateSession(trace.Session{ID: "s", TaskID: "t", GroupID: "g"}, "", 0))
		must(t, s.SetGroupSize("g", 4))
		must(t, s.SetGroupSize("g", 4))
		wantErr(t, "another size", s.SetGroupSize("g", 2), trace.ErrGroupSize)
		wantErr(t, "size of an unknown group", s.SetGroupSize("nope", 2), trace.ErrUnknownGroup)
		if gs, ok := s.(trace.GroupStore); ok {
			all, err := gs.Groups()
			must(t, err)
			if len(all) != 1 || all[0].Size != 4 {
				t.Errorf("Groups = %+v, want g with the first size, 4", all)
			}
		}
	})
	t.Run("group size given with a session", func(t *testing.T) {
		s := f.New(t)
		must(t, s.CreateSession(trace.Session{ID: "a", TaskID: "t", GroupID: "g"}, "ka", 3))
		must(t, s.CreateSession(trace.Session{ID: "b", TaskID: "t", GroupID: "g"}, "kb", 3))
		must(t, s.CreateSession(trace.Session{ID: "c", TaskID: "t", GroupID: "g"}, "kc", 0))
		wantErr(t, "a session with another group size", s.CreateSession(trace.Session{ID: "d", TaskID: "t", GroupID: "g"}, "kd", 5), trace.ErrGroupSize)
		if _, err := s.Session("d"); !errors.Is(err, trace.ErrUnknownSession) {
			t.Errorf("the refused session exists: %v", err)
		}
		if _, err := s.Resolve("kd"); !errors.Is(err, trace.ErrUnknownSession) {
			t.Error("the refused session's key resolves")
		}
		wantErr(t, "a second size through SetGroupSize", s.SetGroupSize("g", 5), trace.ErrGroupSize)
		if gs, ok := s.(trace.GroupStore); ok {
			all, err := gs.Groups()
			must(t, err)
			if len(all) != 1 || all[0].Size != 3 || all[0].Sessions != 3 {
				t.Errorf("Groups = %+v, want g of size 3 with its 3 sessions, not the refused one", all)
			}
			must(t, s.FinishSession("a", 1, trace.StatusCompleted))
			one, err := gs.GroupState("g")
			if err != nil || one.ID != "g" || one.Size != 3 || one.Sessions != 3 || one.Finished != 1 || one.Step != -1 || one.Complete() {
				t.Errorf("GroupState(g) = %+v %v, want g of size 3, 3 sessions, 1 finished, in no step", one, err)
			}
			if via, err := gs.SessionGroupState("b"); err != nil || via != one {
				t.Errorf("SessionGroupState(b) = %+v %v, want %+v", via, err, one)
			}
			if _, err := gs.SessionGroupState("nope"); !errors.Is(err, trace.ErrUnknownSession) {
				t.Errorf("SessionGroupState of an unknown session: %v, want ErrUnknownSession", err)
			}
			if _, err := gs.GroupState("nope"); !errors.Is(err, trace.ErrUnknownGroup) {
				t.Errorf("GroupState of an unknown group: %v, want ErrUnknownGroup", err)
			}
		}
	})
	t.Run("open sessions", func(t *testing.T) {
		s := f.New(t)
		if _, err := s.Open(""); err == nil {
			t.Error("Open of an empty key succeeded")
		}
		id, err := s.Open("fresh")
		must(t, err)
		if again, err := s.Open("fresh"); err != nil || again != id {
			t.Errorf("Open again = %q %v, want %q", again, err, id)
		}
		if got, err := s.Resolve("fresh"); err != nil || got.ID != id || !got.Running() {
			t.Errorf("Resolve after Open = %+v %v", got, err)
		}
		must(t, s.Record(bg, call(id, 0, 1)))
		must(t, s.CreateSession(trace.Session{ID: "known", TaskID: "t"}, "known-key", 0))
		if got, err := s.Open("known-key"); err != nil || got != "known" {
			t.Errorf("Open of a known key = %q %v, want its session", got, err)
		}
	})
	if f.Reopen == nil {
		return
	}
	t.Run("kept across a restart", func(t *testing.T) {
		s := f.New(t)
		must(t, s.CreateSession(trace.Session{ID: "a", TaskID: "t", GroupID: "g"}, "ka", 0))
		must(t, s.SetGroupSize("g", 3))
		must(t, s.Record(bg, call("a", 0, 1)))
		must(t, s.CreateSession(trace.Session{ID: "b", TaskID: "t", GroupID: "g"}, "kb", 0))
		must(t, s.FinishSession("b", 1, trace.StatusCompleted))
		s = f.Reopen(t, s)
		if got, err := s.Resolve("ka"); err != nil || got.ID != "a" || !got.Running() {
			t.Errorf("Resolve after a restart = %+v %v", got, err)
		}
		if got, err := s.Resolve("kb"); err != nil || got.ID != "b" || got.Running() {
			t.Errorf("Resolve of a finished session's key after a restart = %+v %v", got, err)
		}
		wantErr(t, "a second finish after a restart", s.FinishSession("b", 1, trace.StatusCompleted), trace.ErrSessionFinished)
		wantErr(t, "another group size after a restart", s.SetGroupSize("g", 2), trace.ErrGroupSize)
		wantErr(t, "a taken id after a restart", s.CreateSession(trace.Session{ID: "a", TaskID: "t"}, "", 0), trace.ErrSessionExists)
		got, err := s.Session("a")
		must(t, err)
		if got.Status != trace.StatusRunning || len(got.Calls) != 1 {
			t.Errorf("Session(a) after a restart = %+v", got)
		}
	})
}

// Groups checks trace.GroupStore: groups formed from sessions' GroupID, their state and
// completeness, sessions in creation order, drop, and the group timeout.
func Groups(t *testing.T, f Factory[Store]) {
	state := func(t *testing.T, s Store, id string) trace.GroupState {
		t.Helper()
		all, err := s.Groups()
		must(t, err)
		for i, g := range all {
			if i > 0 && all[i-1].ID >= g.ID {
				t.Fatalf("Groups not by id: %q before %q", all[i-1].ID, g.ID)
			}
			if g.ID == id {
				return g
			}
		}
		t.Fatalf("group %q not in Groups %+v", id, all)
		return trace.GroupState{}
	}
	t.Run("state and completeness", func(t *testing.T) {
		s := f.New(t)
		for _, id := range []string{"b2", "a1", "c3"} {
			must(t, s.CreateSession(trace.Session{ID: id, TaskID: "t", GroupID: "g"}, "", 0))
		}
		must(t, s.CreateSession(trace.Session{ID: "o", TaskID: "u", GroupID: "other"}, "", 0))
		if err := s.CreateSession(trace.Session{ID: "x", TaskID: "not-t", GroupID: "g"}, "", 0); err == nil {
			t.Error("a session of another task joined the group")
		}
		must(t, s.SetGroupSize("g", 4))
		must(t, s.Record(bg, call("a1", 0, 1)))
		must(t, s.FinishSession("b2", 1, trace.StatusCompleted))
		g := state(t, s, "g")
		if g.TaskID != "t" || g.Size != 4 || g.Sessions != 3 || g.Finished != 1 || g.Step != -1 || g.Dropped || g.TimedOut || g.Created.IsZero() {
			t.Errorf("group state %+v", g)
		}
		if g.Complete() {
			t.Error("a group with running sessions is complete")
		}
		must(t, s.FinishSession("a1", 0, trace.StatusFailed))
		must(t, s.FinishSession("c3", 0.5, trace.StatusCompleted))
		if state(t, s, "g").Complete() {
			t.Error("a group short of its size is complete")
		}
		must(t, s.CreateSession(trace.Session{ID: "d4", TaskID: "t", GroupID: "g"}, "", 0))
		must(t, s.FinishSession("d4", 1, trace.StatusCompleted))
		if g := state(t, s, "g"); !g.Complete() {
			t.Errorf("a finished group of its size is not complete: %+v", g)
		}
		grp, err := s.Group("g")
		must(t, err)
		var ids []string
		for _, ss := range grp.Sessions {
			ids = append(ids, ss.ID)
		}
		if grp.ID != "g" || grp.TaskID != "t" || !slices.Equal(ids, []string{"b2", "a1", "c3", "d4"}) || len(grp.Sessions[1].Calls) != 1 ||
			grp.Sessions[2].Reward != 0.5 {
			t.Errorf("Group(g) = %+v, want sessions in creation order with calls and rewards", grp)
		}
		_, err = s.Group("nope")
		wantErr(t, "Group of an unknown id", err, trace.ErrUnknownGroup)
	})
	t.Run("drop", func(t *testing.T) {
		s := f.New(t)
		must(t, s.CreateSession(trace.Session{ID: "s", TaskID: "t", GroupID: "g"}, "", 0))
		must(t, s.FinishSession("s", 1, trace.StatusCompleted))
		must(t, s.DropGroup("g", "too few usable sessions"))
		if g := state(t, s, "g"); !g.Dropped || g.DropReason != "too few usable sessions" || g.Complete() {
			t.Errorf("dropped group %+v", g)
		}
		wantErr(t, "DropGroup of an unknown id", s.DropGroup("nope", "x"), trace.ErrUnknownGroup)
		if err := s.CreateSession(trace.Session{ID: "late", TaskID: "t", GroupID: "g"}, "", 0); err == nil {
			t.Error("a dropped group took a new session")
		}
	})
	t.Run("time out", func(t *testing.T) {
		s := f.New(t)
		for _, id := range []string{"done", "hung"} {
			must(t, s.CreateSession(trace.Session{ID: id, TaskID: "t", GroupID: "g"}, "", 0))
		}
		must(t, s.SetGroupSize("g", 4))
		must(t, s.FinishSession("done", 1, trace.StatusCompleted))
		ended, err := s.TimeOutGroup("g")
		must(t, err)
		if !slices.Equal(ended, []string{"hung"}) {
			t.Errorf("TimeOutGroup ended %v, want [hung]", ended)
		}
		g := state(t, s, "g")
		if !g.TimedOut || g.Finished != 2 || !g.Complete() {
			t.Errorf("timed-out group %+v: want timed out and complete though short", g)
		}
		hung, err := s.Session("hung")
		must(t, err)
		if hung.Status != trace.StatusTimeout || hung.Reward != 0 {
			t.Errorf("timed-out session %+v", hung)
		}
		if done, _ := s.Session("done"); done.Status != trace.StatusCompleted || done.Reward != 1 {
			t.Errorf("a finished session was changed by the timeout: %+v", done)
		}
		wantErr(t, "Record in a timed-out session", s.Record(bg, call("hung", 0, 1)), trace.ErrSessionFinished)
		if err := s.CreateSession(trace.Session{ID: "late", TaskID: "t", GroupID: "g"}, "", 0); err == nil {
			t.Error("a timed-out group took a new session")
		}
		again, err := s.TimeOutGroup("g")
		if err != nil || len(again) != 0 {
			t.Errorf("TimeOutGroup again = %v %v, want nothing", again, err)
		}
		_, err = s.TimeOutGroup("nope")
		wantErr(t, "TimeOutGroup of an unknown id", err, trace.ErrUnknownGroup)
	})
}

// Steps checks trace.StepStore: steps saved once (the same record again a no-op, any
// other conflicting), committed exactly once (also concurrently and across a restart),
// and the records read back with their cut-off, budget and decisions.
func Steps(t *testing.T, f Factory[Store]) {
	groups := func(t *testing.T, s Store, ids ...string) {
		t.Helper()
		for _, g := range ids {
			must(t, s.CreateSession(trace.Session{ID: g + "-s", TaskID: "t-" + g, GroupID: g}, "", 0))
			must(t, s.FinishSession(g+"-s", 1, trace.StatusCompleted))
		}
	}
	t.Run("save and commit", func(t *testing.T) {
		s := f.New(t)
		if un, last, err := s.Steps(); err != nil || len(un) != 0 || last != -1 {
			t.Fatalf("Steps of an empty store = %+v %d %v, want none and -1", un, last, err)
		}
		groups(t, s, "g0", "g1", "g2", "g3")
		r0 := trace.StepRecord{N: 0, Groups: []string{"g1", "g0"}, MinPolicyVersion: 2, TokenBudget: 4096, Decisions: decisions("g1-s", "g0-s")}
		r1 := trace.StepRecord{N: 1, Groups: []string{"g2"}}
		otherAdvantage := r0.Clone()
		otherAdvantage.Decisions.Sessions[1].Advantage = -0.5
		otherMark := r0.Clone()
		otherMark.Decisions.Sessions[0].Untrained = nil
		otherStrategy := r0.Clone()
		otherStrategy.Decisions.Strategy = "per_request"
		undecided := r0.Clone()
		undecided.Decisions = nil
		must(t, s.SaveStepRecord(r0))
		must(t, s.SaveStepRecord(r1))
		must(t, s.SaveStepRecord(r0)) // the same record again
		tests := []struct {
			name string
			rec  trace.StepRecord
			want error // nil: any error
		}{
			{"other groups", trace.StepRecord{N: 1, Groups: []string{"g3"}}, trace.ErrStepConflict},
			{"other cut-off", trace.StepRecord{N: 0, Groups: []string{"g1", "g0"}, MinPolicyVersion: 3, TokenBudget: 4096}, trace.ErrStepConflict},
			{"other budget", trace.StepRecord{N: 0, Groups: []string{"g1", "g0"}, MinPolicyVersion: 2, Decisions: r0.Decisions}, trace.ErrStepConflict},
			{"other advantage", otherAdvantage, trace.ErrStepConflict},
			{"other call marks", otherMark, trace.ErrStepConflict},
			{"other strategy", otherStrategy, trace.ErrStepConflict},
			{"no decisions", undecided, trace.ErrStepConflict},
			{"group in another step", trace.StepRecord{N: 2, Groups: []string{"g3", "g1"}}, trace.ErrStepConflict},
			{"unknown group", trace.StepRecord{N: 2, Groups: []string{"g3", "zz"}}, trace.ErrUnknownGroup},
			{"no groups", trace.StepRecord{N: 2}, nil},
			{"negative step", trace.StepRecord{N: -1, Groups: []string{"g3"}}, nil},
		}
		for _, tt := range tests {
			err := s.SaveStepRecord(tt.rec)
			if err == nil || (tt.want != nil && !errors.Is(err, tt.want)) {
				t.Errorf("%s: %v, want %v", tt.name, err, tt.want)
			}
		}
		all, err := s.Groups()
		must(t, err)
		steps := map[string]int64{}
		for _, g := range all {
			steps[g.ID] = g.Step
		}
		if want := map[string]int64{"g0": 0, "g1": 0, "g2": 1, "g3": -1}; fmt.Sprint(steps) != fmt.Sprint(want) {
			t.Errorf("groups' steps %v, want %v (a failed save claims no group)", steps, want)
		}
		un, last, err := s.Steps()
		must(t, err)
		if len(un) != 2 || last != -1 || !sameRecord(un[0], r0) || !sameRecord(un[1], r1) || un[0].Saved.IsZero() {
			t.Fatalf("Steps = %+v %d, want %+v %+v and -1", un, last, r0, r1)
		}
		wantErr(t, "commit of a step never saved", s.CommitStep(9), trace.ErrUnknownStep)
		must(t, s.CommitStep(0))
		wantErr(t, "a second commit", s.CommitStep(0), trace.ErrCommitted)
		wantErr(t, "a save of a committed step", s.SaveStepRecord(r0), trace.ErrCommitted)
		un, last, err = s.Steps()
		must(t, err)
		if len(un) != 1 || un[0].N != 1 || last != 0 {
			t.Fatalf("Steps after commit = %+v %d, want step 1 and last committed 0", un, last)
		}
		// Exactly once under concurrency too.
		var wg sync.WaitGroup
		errs := make([]error, 8)
		for i := range errs {
			wg.Add(1)
			go func() { defer wg.Done(); errs[i] = s.CommitStep(1) }()
		}
		wg.Wait()
		ok := 0
		for _, err := range errs {
			switch {
			case err == nil:
				ok++
			case !errors.Is(err, trace.ErrCommitted):
				t.Errorf("concurrent commit: %v", err)
			}
		}
		if ok != 1 {
			t.Errorf("%d of 8 concurrent commits of one step succeeded, want 1", ok)
		}
		if un, last, _ := s.Steps(); len(un) != 0 || last != 1 {
			t.Errorf("Steps = %+v %d, want none and 1", un, last)
		}
	})
	if f.Reopen == nil {
		return
	}
	t.Run("exactly once across a restart", func(t *testing.T) {
		s := f.New(t)
		groups(t, s, "g0", "g1")
		r1 := trace.StepRecord{N: 1, Groups: []string{"g1"}, MinPolicyVersion: 1, TokenBudget: 1024, Decisions: decisions("g1-s")}
		must(t, s.SaveStepRecord(trace.StepRecord{N: 0, Groups: []string{"g0"}}))
		must(t, s.SaveStepRecord(r1))
		must(t, s.CommitStep(0))
		s = f.Reopen(t, s)
		wantErr(t, "a commit after a restart", s.CommitStep(0), trace.ErrCommitted)
		wantErr(t, "a save of a committed step after a restart", s.SaveStepRecord(trace.StepRecord{N: 0, Groups: []string{"g0"}}), trace.ErrCommitted)
		un, last, err := s.Steps()
		must(t, err)
		if len(un) != 1 || !sameRecord(un[0], r1) || last != 0 {
			t.Fatalf("Steps after a restart = %+v %d, want %+v and 0", un, last, r1)
		}
		must(t, s.SaveStepRecord(r1))
		must(t, s.CommitStep(1))
	})
}

func sameRecord(a, b trace.StepRecord) bool {
	return a.Same(b) && a.Committed == b.Committed
}

// decisions are a step's decisions on sessions, one each: settings other than the
// defaults, an advantage that only a float64 holds exactly, and a run of untrained calls.
func decisions(sessions ...string) *trace.StepDecisions {
	d := &trace.StepDecisions{Strategy: "prefix_merging", Advantage: "rloo", PadMultiple: 64, PassCost: 512.5}
	for i, id := range sessions {
		d.Sessions = append(d.Sessions, trace.SessionDecision{ID: id, Advantage: 0.1 + float64(i)/3, Calls: 4,
			Untrained: []trace.UntrainedCalls{{First: 1, Count: 2, Reason: "stale: policy version 1, older than 2"}}})
	}
	return d
}

// PolicyVersions checks trace.PolicyVersions: 0 until set, then the last version set,
// kept across a restart.
func PolicyVersions(t *testing.T, f Factory[trace.PolicyVersions]) {
	p := f.New(t)
	if v, err := p.PolicyVersion(); err != nil || v != 0 {
		t.Fatalf("PolicyVersion of an empty store = %d %v, want 0", v, err)
	}
	for _, v := range []int64{5, 3, 1 << 40} {
		must(t, p.SetPolicyVersion(v))
		if got, err := p.PolicyVersion(); err != nil || got != v {
			t.Fatalf("PolicyVersion = %d %v, want %d (the last set)", got, err, v)
		}
	}
	if f.Reopen == nil {
		return
	}
	p = f.Reopen(t, p)
	if got, err := p.PolicyVersion(); err != nil || got != 1<<40 {
		t.Fatalf("PolicyVersion after a restart = %d %v, want %d", got, err, int64(1<<40))
	}
}
