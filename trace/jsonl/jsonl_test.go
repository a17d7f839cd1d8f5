package jsonl

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/tracetest"
)

func newRecorder(t *testing.T, path string) *Recorder {
	t.Helper()
	r, err := NewRecorder(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { testutil.Close(t, r) })
	return r
}

// fixture is the suite's view of a Recorder: calls read back from its file.
func fixture(r *Recorder) tracetest.RecorderStore {
	return tracetest.RecorderStore{
		CallRecorder: r,
		Calls: func(session string) ([]trace.Call, error) {
			all, err := ReadCalls(r.Path())
			var out []trace.Call
			for _, c := range all {
				if c.SessionID == session {
					out = append(out, c)
				}
			}
			return out, err
		},
	}
}

func TestConformance(t *testing.T) {
	tracetest.Recorder(t, tracetest.Factory[tracetest.RecorderStore]{
		New: func(t *testing.T) tracetest.RecorderStore {
			return fixture(newRecorder(t, filepath.Join(t.TempDir(), "calls.jsonl")))
		},
		Reopen: func(t *testing.T, f tracetest.RecorderStore) tracetest.RecorderStore {
			r := f.CallRecorder.(*Recorder)
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
			return fixture(newRecorder(t, r.Path()))
		},
	})
}

func rec(t *testing.T, r *Recorder, session string, choice int) {
	t.Helper()
	c := &trace.Call{SessionID: session, Choice: choice, PromptIDs: []int32{1}, ResponseIDs: []int32{2}, Logprobs: []float32{-1}, Trainable: true}
	if err := r.Record(context.Background(), c); err != nil {
		t.Fatal(err)
	}
}

// TestReadGroups: one group of every session in order of first appearance, calls in file
// order, completed.
func TestReadGroups(t *testing.T) {
	path := filepath.Join(t.TempDir(), "calls.jsonl")
	r := newRecorder(t, path)
	for _, s := range []string{"b", "a", "b", "c", "a"} {
		rec(t, r, s, 0)
	}
	rec(t, r, "a", 1)
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.Record(context.Background(), &trace.Call{SessionID: "a"}); !errors.Is(err, trace.ErrClosed) {
		t.Fatalf("Record after Close: %v", err)
	}
	gs, err := ReadGroups(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(gs) != 1 || gs[0].ID != "recorded" || gs[0].TaskID != "recorded" || len(gs[0].Sessions) != 3 {
		t.Fatalf("ReadGroups = %+v", gs)
	}
	for i, want := range []struct {
		id      string
		indexes []int
	}{{"b", []int{0, 1}}, {"a", []int{0, 1, 1}}, {"c", []int{0}}} {
		s := gs[0].Sessions[i]
		var got []int
		for _, c := range s.Calls {
			got = append(got, c.Index)
		}
		if s.ID != want.id || s.GroupID != "recorded" || s.TaskID != "recorded" || s.Status != trace.StatusCompleted ||
			!slices.Equal(got, want.indexes) {
			t.Errorf("session %d = %+v (indexes %v), want %s with indexes %v", i, s, got, want.id, want.indexes)
		}
	}
	if err := gs[0].Validate(); err != nil {
		t.Fatal(err)
	}
}

// TestReadErrors: every unreadable file is an error naming the file and the line.
func TestReadErrors(t *testing.T) {
	good := `{"session_id":"s","index":0,"prompt_ids":[1],"response_ids":[2],"logprobs":[-1]}`
	tests := []struct {
		name, content, want string
	}{
		{"empty", "", "no calls"},
		{"blank lines only", "\n\n", "no calls"},
		{"not JSON", good + "\n{oops\n", "line 2"},
		{"wrong type", good + "\n" + `{"session_id":"s","index":"zero"}` + "\n", "line 2"},
		{"old CamelCase format", `{"SessionID":"s","Index":0,"PromptIDs":[1]}` + "\n", "line 1: no session_id"},
		{"torn last line", good + "\n" + good[:20], "line 2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "calls.jsonl")
			if err := os.WriteFile(path, []byte(tt.content), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := ReadGroups(path)
			if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("ReadGroups: %v, want an error naming %s and %q", err, path, tt.want)
			}
		})
	}
	if _, err := ReadGroups(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing file: %v", err)
	}
}

// TestRecorderOpensExistingFile: indexes go on per session; a torn last line (a crash in
// a write) is removed, a last line without its newline is ended, any other bad line
// refuses the open.
func TestRecorderOpensExistingFile(t *testing.T) {
	good := `{"session_id":"s","index":4,"prompt_ids":[1],"response_ids":[2],"logprobs":[-1]}`
	tests := []struct {
		name, content string
		wantErr       string // "" to open
		wantLines     int    // after one more call of session s
	}{
		{"torn last line", good + "\n" + good[:30], "", 2},
		{"last line without newline", good, "", 2},
		{"bad line inside", "{oops\n" + good + "\n", "line 1", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "calls.jsonl")
			if err := os.WriteFile(path, []byte(tt.content), 0o644); err != nil {
				t.Fatal(err)
			}
			r, err := NewRecorder(path)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("NewRecorder: %v, want an error naming %s and %q", err, path, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer testutil.Close(t, r)
			c := &trace.Call{SessionID: "s", PromptIDs: []int32{1}, ResponseIDs: []int32{2}, Logprobs: []float32{-1}}
			if err := r.Record(context.Background(), c); err != nil || c.Index != 5 {
				t.Fatalf("Record: index %d %v, want 5 (after the file's index 4)", c.Index, err)
			}
			calls, err := ReadCalls(path)
			if err != nil || len(calls) != tt.wantLines {
				t.Fatalf("ReadCalls = %d calls %v, want %d", len(calls), err, tt.wantLines)
			}
		})
	}
}

func ExampleRecorder() {
	dir, _ := os.MkdirTemp("", "jsonl")
	defer func() { _ = os.RemoveAll(dir) }() // a temporary directory: best effort
	r, err := NewRecorder(filepath.Join(dir, "calls.jsonl"))
	if err != nil {
		panic(err)
	}
	defer func() { _ = r.Close() }() // Record fsynced the line
	started := time.Date(2026, 12, 1, 19, 45, 0, 0, time.UTC)
	c := &trace.Call{
		SessionID: "sess-3f2a9c1d", Choice: 0, PromptIDs: []int32{151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30},
		ResponseIDs: []int32{19, 151645}, Logprobs: []float32{-0.0123, -0.0005}, FinishReason: "stop",
		PolicyVersion: 3, Trainable: true, API: "openai_chat",
		Started: started, Finished: started.Add(182 * time.Millisecond), UpstreamLatency: 171 * time.Millisecond,
		Request:         json.RawMessage(`{"model":"m","messages":[{"role":"user","content":"What is 2+2?"}]}`),
		UpstreamRequest: json.RawMessage(`{"model":"m","prompt":[151644,872,198,3838,374,220,17,10,17,30],"logprobs":0}`),
		Response:        json.RawMessage(`{"role":"assistant","content":"4"}`),
	}
	if err := r.Record(context.Background(), c); err != nil {
		panic(err)
	}
	line, _ := os.ReadFile(r.Path())
	fmt.Print(string(line))
	// Output:
	// {"session_id":"sess-3f2a9c1d","index":0,"choice":0,"prompt_ids":[151644,872,198,3838,374,220,17,10,17,30],"response_ids":[19,151645],"logprobs":[-0.0123,-0.0005],"finish_reason":"stop","policy_version":3,"trainable":true,"api":"openai_chat","started":"2026-12-01T19:45:00Z","finished":"2026-12-01T19:45:00.182Z","upstream_latency_ns":171000000,"request":{"model":"m","messages":[{"role":"user","content":"What is 2+2?"}]},"upstream_request":{"model":"m","prompt":[151644,872,198,3838,374,220,17,10,17,30],"logprobs":0},"response":{"role":"assistant","content":"4"}}
}
