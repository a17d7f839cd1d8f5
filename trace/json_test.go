package trace_test

import (
	"encoding/json"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/floe-rl/floe/trace"
)

func fullCall() trace.Call {
	return trace.Call{
		SessionID: "s1", Index: 3, Choice: 1, PromptIDs: []int32{1, 2, 3}, ResponseIDs: []int32{4, 5},
		Logprobs: []float32{-0.25, -1.5}, FinishReason: "stop", PolicyVersion: 7,
		Trainable: false, UntrainableReason: "logprobs missing", API: "openai_chat",
		Started:         time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC),
		Finished:        time.Date(2026, 1, 2, 3, 4, 6, 0, time.UTC),
		UpstreamLatency: 1500 * time.Millisecond,
		Request:         json.RawMessage(`{"model":"m"}`),
		UpstreamRequest: json.RawMessage(`{"prompt":[1,2,3]}`),
		Response:        json.RawMessage(`{"role":"assistant","content":"hi"}`),
	}
}

func keys(t *testing.T, raw []byte) []string {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// TestCallJSON pins the recorded-call wire format (docs/trace.md): the field names, the
// latency as integer nanoseconds, the optional fields left out when empty, and a round
// trip that keeps every field.
func TestCallJSON(t *testing.T) {
	all := []string{"api", "choice", "finish_reason", "finished", "index", "logprobs", "policy_version", "prompt_ids",
		"request", "response", "response_ids", "session_id", "started", "trainable", "untrainable_reason",
		"upstream_latency_ns", "upstream_request"}
	bare := []string{"api", "choice", "finish_reason", "finished", "index", "logprobs", "policy_version", "prompt_ids",
		"response_ids", "session_id", "started", "trainable", "upstream_latency_ns"}
	tests := []struct {
		name string
		call trace.Call
		keys []string
	}{
		{"every field", fullCall(), all},
		{"optional fields empty", trace.Call{SessionID: "s", PromptIDs: []int32{1}, ResponseIDs: []int32{2},
			Logprobs: []float32{-1}, Trainable: true}, bare},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			raw, err := json.Marshal(tt.call)
			if err != nil {
				t.Fatal(err)
			}
			if got := keys(t, raw); !slices.Equal(got, tt.keys) {
				t.Fatalf("keys %v, want %v\n%s", got, tt.keys, raw)
			}
			var back trace.Call
			if err := json.Unmarshal(raw, &back); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(back, tt.call) {
				t.Fatalf("round trip:\n got %+v\nwant %+v", back, tt.call)
			}
		})
	}
	raw, _ := json.Marshal(fullCall())
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	if m["upstream_latency_ns"] != 1.5e9 || m["started"] != "2026-01-02T03:04:05.000006Z" {
		t.Fatalf("latency %v, started %v: want integer ns and RFC 3339", m["upstream_latency_ns"], m["started"])
	}
}

// TestStoreTypesJSON: Session, Group, GroupState and StepRecord use snake_case names and
// round-trip.
func TestStoreTypesJSON(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	sess := trace.Session{ID: "s1", TaskID: "t", GroupID: "g", Calls: []trace.Call{fullCall()}, Reward: 0.5, Status: trace.StatusCompleted}
	tests := []struct {
		name string
		v    any
		new  func() any
		keys []string
	}{
		{"Session", sess, func() any { return new(trace.Session) },
			[]string{"calls", "group_id", "id", "reward", "status", "task_id"}},
		{"Group", trace.Group{ID: "g", TaskID: "t", Sessions: []trace.Session{sess}}, func() any { return new(trace.Group) },
			[]string{"id", "sessions", "task_id"}},
		{"GroupState", trace.GroupState{ID: "g", TaskID: "t", Size: 4, Sessions: 3, Finished: 2, Step: -1, Dropped: true,
			DropReason: "too few", Created: at, TimedOut: true}, func() any { return new(trace.GroupState) },
			[]string{"created", "drop_reason", "dropped", "finished", "id", "sessions", "size", "step", "task_id", "timed_out"}},
		{"StepRecord", trace.StepRecord{N: 4, Groups: []string{"a", "b"}, MinPolicyVersion: 2, TokenBudget: 8192, Committed: true, Saved: at},
			func() any { return new(trace.StepRecord) },
			[]string{"committed", "groups", "min_policy_version", "n", "saved", "token_budget"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			raw, err := json.Marshal(tt.v)
			if err != nil {
				t.Fatal(err)
			}
			if got := keys(t, raw); !slices.Equal(got, tt.keys) {
				t.Fatalf("keys %v, want %v", got, tt.keys)
			}
			back := tt.new()
			if err := json.Unmarshal(raw, back); err != nil {
				t.Fatal(err)
			}
			if got := reflect.ValueOf(back).Elem().Interface(); !reflect.DeepEqual(got, tt.v) {
				t.Fatalf("round trip:\n got %+v\nwant %+v", got, tt.v)
			}
		})
	}
}
