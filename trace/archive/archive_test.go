package archive

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/trace"
)

func checkedMem(t *testing.T) memory.Allocator {
	mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
	t.Cleanup(func() { mem.AssertSize(t, 0) })
	return mem
}

func f64(v float64) *float64 { return &v }

// testStep is a step of two groups with every column's cases: sampling present and
// absent, an untrainable call, a session without advantage, an n > 1 request.
func testStep() *Step {
	at := time.Date(2026, 12, 1, 12, 0, 0, 123456000, time.UTC)
	k := 20
	mk := func(sess string, idx, choice int, trainable bool) trace.Call {
		c := trace.Call{SessionID: sess, Index: idx, Choice: choice, PromptIDs: []int32{1, 2, int32(idx)},
			ResponseIDs: []int32{7, int32(choice)}, Logprobs: []float32{-0.5, -1.25}, FinishReason: "stop",
			PolicyVersion: 3, Trainable: trainable, API: "anthropic", Started: at, Finished: at.Add(time.Second),
			UpstreamLatency: 900 * time.Millisecond, Request: json.RawMessage(`{"model":"m"}`),
			UpstreamRequest: json.RawMessage(`{"messages":[]}`), Response: json.RawMessage(`{"role":"assistant"}`)}
		if !trainable {
			c.MarkUntrainable("no token ids")
			c.Request = nil
		}
		if idx == 1 {
			c.Sampling = &trace.Sampling{Temperature: f64(0.7), TopP: f64(0.95), TopK: &k}
		}
		return c
	}
	return &Step{
		Record:    trace.StepRecord{N: 42, Groups: []string{"g1", "g2"}, MinPolicyVersion: 2, TokenBudget: 8192, Committed: true, Saved: at},
		Committed: at.Add(time.Minute),
		Groups: []trace.Group{
			{ID: "g1", TaskID: "t1", Sessions: []trace.Session{
				{ID: "s1", TaskID: "t1", GroupID: "g1", Reward: 1, Status: trace.StatusCompleted,
					Calls: []trace.Call{mk("s1", 0, 0, true), mk("s1", 1, 0, true), mk("s1", 1, 1, false)}},
				{ID: "s2", TaskID: "t1", GroupID: "g1", Reward: 0, Status: trace.StatusFailed},
			}},
			{ID: "g2", TaskID: "t2", Sessions: []trace.Session{
				{ID: "s3", TaskID: "t2", GroupID: "g2", Reward: 0.5, Status: trace.StatusTimeout,
					Calls: []trace.Call{mk("s3", 0, 0, true)}},
			}},
		},
		Sessions: map[string]SessionInfo{
			"s1": {Created: at, Finished: at.Add(2 * time.Second), Advantage: f64(0.7071)},
			"s3": {Created: at, Finished: at.Add(3 * time.Second), Advantage: f64(0)},
		},
	}
}

// TestWriteStepRoundTrip: what WriteStep writes reads back as the step's calls, sessions
// and record, field for field.
func TestWriteStepRoundTrip(t *testing.T) {
	mem := checkedMem(t)
	root := t.TempDir()
	st := testStep()
	var stages []Stage
	if err := WriteStep(root, st, mem, func(s Stage) { stages = append(stages, s) }); err != nil {
		t.Fatal(err)
	}
	if want := []Stage{StageCalls, StageSessions, StageSteps}; !reflect.DeepEqual(stages, want) {
		t.Fatalf("stages %v, want %v", stages, want)
	}
	calls, err := ReadCalls(root, mem)
	if err != nil {
		t.Fatal(err)
	}
	var want []CallRow
	for _, g := range st.Groups {
		for _, s := range g.Sessions {
			for _, c := range s.Calls {
				n := st.Record.N
				want = append(want, CallRow{Step: &n, GroupID: g.ID, TaskID: s.TaskID, Call: c})
			}
		}
	}
	if !reflect.DeepEqual(calls, want) {
		t.Fatalf("calls read back:\n%+v\nwant\n%+v", calls, want)
	}
	sess, err := ReadSessions(root, mem)
	if err != nil {
		t.Fatal(err)
	}
	if len(sess) != 3 || sess[0].Session.ID != "s1" || sess[0].Step == nil || *sess[0].Step != 42 || sess[0].DropReason != "" || *sess[0].Advantage != 0.7071 || sess[0].Calls != 3 ||
		sess[1].Advantage != nil || sess[1].Session.Status != trace.StatusFailed || sess[2].Session.Reward != 0.5 ||
		!sess[2].Finished.Equal(st.Sessions["s3"].Finished) || !sess[1].Created.IsZero() {
		t.Fatalf("sessions read back: %+v", sess)
	}
	steps, err := ReadSteps(root, mem)
	if err != nil {
		t.Fatal(err)
	}
	if len(steps) != 1 || !reflect.DeepEqual(steps[0].Record, st.Record) || steps[0].Sessions != 3 || steps[0].Calls != 4 ||
		!steps[0].Committed.Equal(st.Committed) {
		t.Fatalf("steps read back: %+v, want %+v", steps, st.Record)
	}
}

// TestWriteStepAgainReplaces: archiving a step a second time (after a crash) leaves one
// file per table, holding the step once, and no temporary file.
func TestWriteStepAgainReplaces(t *testing.T) {
	mem := checkedMem(t)
	root := t.TempDir()
	st := testStep()
	// A temporary file left by a write killed part way.
	dir := PartitionDir(root, CallsTable, 42)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "."+PartFile+".tmp"), []byte("PAR1 half"), 0o644); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := WriteStep(root, st, mem, nil); err != nil {
			t.Fatal(err)
		}
	}
	calls, err := ReadCalls(root, mem)
	if err != nil || len(calls) != 4 {
		t.Fatalf("%d calls after writing the step twice, want 4 (err %v)", len(calls), err)
	}
	var names []string
	err = filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
		if err == nil && !fi.IsDir() {
			rel, _ := filepath.Rel(root, p)
			names = append(names, rel)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"calls/step-000042/part-0.parquet", "sessions/step-000042/part-0.parquet", "steps/step-000042/part-0.parquet"}
	if !reflect.DeepEqual(names, want) {
		t.Fatalf("files %v, want %v", names, want)
	}
}

// TestWriteCallsStreams: WriteCalls cuts row groups and reads back every call, with a
// null step for calls in none.
func TestWriteCallsStreams(t *testing.T) {
	mem := checkedMem(t)
	path := filepath.Join(t.TempDir(), "calls", "part-0.parquet")
	st := testStep()
	const copies = batchRows/4 + 10 // more rows than one batch
	err := WriteCalls(path, mem, func(add AddCall) error {
		for k := range copies {
			for _, g := range st.Groups {
				for _, s := range g.Sessions {
					for _, c := range s.Calls {
						var step *int64
						if k%2 == 0 {
							n := int64(k)
							step = &n
						}
						c.Index = k
						if err := add(step, g.ID, s.TaskID, &c); err != nil {
							return err
						}
					}
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	rows, err := ReadCallsFile(path, mem)
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 4*copies {
		t.Fatalf("%d rows, want %d", len(rows), 4*copies)
	}
	for i, r := range rows {
		k := i / 4
		if r.Index != k || (k%2 == 0) != (r.Step != nil) || (r.Step != nil && *r.Step != int64(k)) {
			t.Fatalf("row %d: index %d step %v", i, r.Index, r.Step)
		}
	}
}

// TestWriteCallsFailureLeavesNothing: an export that fails leaves no file behind.
func TestWriteCallsFailureLeavesNothing(t *testing.T) {
	mem := checkedMem(t)
	dir := t.TempDir()
	path := filepath.Join(dir, "part-0.parquet")
	err := WriteCalls(path, mem, func(add AddCall) error {
		c := testStep().Groups[0].Sessions[0].Calls[0]
		if err := add(nil, "g", "t", &c); err != nil {
			return err
		}
		return os.ErrDeadlineExceeded
	})
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("err = %v", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("left %v", ents)
	}
}

// TestWriteDroppedGroup: a dropped group's calls and sessions read back with a null step
// and the reason, beside the steps' partitions, and writing it again replaces them.
func TestWriteDroppedGroup(t *testing.T) {
	mem := checkedMem(t)
	root := t.TempDir()
	st := testStep()
	if err := WriteStep(root, st, mem, nil); err != nil {
		t.Fatal(err)
	}
	g := st.Groups[1]
	g.ID = "weird/id with spaces"
	for range 2 {
		if err := WriteDroppedGroup(root, DroppedDir(g.ID, 3), "1 usable session, fewer than 2",
			func(r *Rows) error { return r.Group(&g, nil) }, mem, WriteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	calls, err := ReadCalls(root, mem)
	if err != nil || len(calls) != 5 {
		t.Fatalf("%d calls, want 4 of the step and 1 of the dropped group (%v)", len(calls), err)
	}
	var dropped []CallRow
	for _, c := range calls {
		if c.Step == nil {
			dropped = append(dropped, c)
		}
	}
	if len(dropped) != 1 || dropped[0].GroupID != g.ID || !reflect.DeepEqual(dropped[0].Call, g.Sessions[0].Calls[0]) {
		t.Fatalf("dropped group's calls %+v", dropped)
	}
	sess, err := ReadSessions(root, mem)
	if err != nil || len(sess) != 4 {
		t.Fatalf("%d sessions (%v)", len(sess), err)
	}
	last := sess[len(sess)-1]
	if _, err := os.Stat(filepath.Join(root, SessionsTable, DroppedDir(g.ID, 3))); err != nil {
		t.Fatal(err)
	}
	found := false
	for _, s := range sess {
		if s.Step == nil {
			found = s.GroupID == g.ID && s.DropReason == "1 usable session, fewer than 2" && s.Advantage == nil
		}
	}
	if !found {
		t.Fatalf("dropped session row missing: %+v", last)
	}
	if steps, err := ReadSteps(root, mem); err != nil || len(steps) != 1 {
		t.Fatalf("steps %v %v: a dropped group has no step row", steps, err)
	}
}
