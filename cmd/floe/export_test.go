package main

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/archive"
	"github.com/floe-rl/floe/trace/bolt"
)

// exportDataDir records two groups (one in a committed step, one in none) and a session
// without a group into a fresh data dir, and returns the calls recorded by session.
func exportDataDir(t *testing.T, dir string) map[string][]trace.Call {
	t.Helper()
	s, err := bolt.New(dir, bolt.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer testutil.Close(t, s)
	out := map[string][]trace.Call{}
	for _, sess := range []trace.Session{
		{ID: "a0", TaskID: "ta", GroupID: "ga"}, {ID: "a1", TaskID: "ta", GroupID: "ga"},
		{ID: "b0", TaskID: "tb", GroupID: "gb"}, {ID: "lone"},
	} {
		if err := s.CreateSession(sess, "key-"+sess.ID, 0); err != nil {
			t.Fatal(err)
		}
		prompt := []int32{1, 2, 3}
		for i := range 3 {
			c := trace.Call{SessionID: sess.ID, PromptIDs: prompt, ResponseIDs: []int32{int32(10 + i), 11},
				Logprobs: []float32{-0.25, -1}, FinishReason: "stop", Trainable: true, API: "anthropic",
				Request: []byte(fmt.Sprintf(`{"call":%d}`, i)), Started: time.Now().UTC()}
			if err := s.Record(context.Background(), &c); err != nil {
				t.Fatal(err)
			}
			out[sess.ID] = append(out[sess.ID], c)
			prompt = slices.Concat(prompt, c.ResponseIDs, []int32{9})
		}
		if err := s.FinishSession(sess.ID, 1, trace.StatusCompleted); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.SaveStepRecord(trace.StepRecord{N: 0, Groups: []string{"ga"}}); err != nil {
		t.Fatal(err)
	}
	if err := s.CommitStep(0); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestExportWritesEveryCall: floe export writes every call of the store once, with its
// tokens, its group's step (null in none) and its request.
func TestExportWritesEveryCall(t *testing.T) {
	data, out := t.TempDir(), t.TempDir()
	recorded := exportDataDir(t, data)
	var stderr bytes.Buffer
	if code := run(context.Background(), []string{"export", "-data-dir", data, "-out", out}, &bytes.Buffer{}, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if !strings.Contains(stderr.String(), "wrote 12 calls of 4 sessions") {
		t.Fatalf("stderr: %s", stderr.String())
	}
	mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
	defer mem.AssertSize(t, 0)
	rows, err := archive.ReadCallsFile(filepath.Join(out, "calls", "part-0.parquet"), mem)
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 12 {
		t.Fatalf("%d rows, want 12", len(rows))
	}
	seen := map[string]int{}
	for _, r := range rows {
		want := recorded[r.SessionID][r.Index]
		seen[r.SessionID]++
		inStep := r.GroupID == "ga"
		if !slices.Equal(r.PromptIDs, want.PromptIDs) || !slices.Equal(r.ResponseIDs, want.ResponseIDs) ||
			!slices.Equal(r.Logprobs, want.Logprobs) || string(r.Request) != string(want.Request) ||
			(r.Step != nil) != inStep || (inStep && *r.Step != 0) {
			t.Fatalf("row %+v differs from %+v", r, want)
		}
	}
	for sid := range recorded {
		if seen[sid] != 3 {
			t.Fatalf("session %s: %d rows, want 3", sid, seen[sid])
		}
	}
}

// TestExportRefusesALockedStore: a store a running floe holds is refused after the lock
// timeout, saying so.
func TestExportRefusesALockedStore(t *testing.T) {
	data := t.TempDir()
	exportDataDir(t, data)
	s, err := bolt.New(data, bolt.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer testutil.Close(t, s)
	var stderr bytes.Buffer
	code := run(context.Background(), []string{"export", "-data-dir", data, "-out", t.TempDir(), "-lock-timeout", "100ms"}, &bytes.Buffer{}, &stderr)
	if code != 1 || !strings.Contains(stderr.String(), "another floe running on this data dir") {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
}
