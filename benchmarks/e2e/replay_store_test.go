package e2e

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/bolt"
)

// TestFromStoreReplaysRecordedRequests records two sessions the way floe serve does (the
// normalized upstream request and the assistant message of every call) and reads them
// back as sessions to replay: messages with text parts flattened, tools as recorded (none
// when the request had none), tool_choice carried, the answer as the scripted output;
// a running session and an ungrouped one are left out, and the data dir is only read.
func TestFromStoreReplaysRecordedRequests(t *testing.T) {
	dir := t.TempDir()
	st, err := bolt.New(dir, bolt.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"a", "b", "running"} {
		must(st.CreateSession(trace.Session{ID: id, TaskID: "t", GroupID: "g"}, "", 0))
	}
	must(st.CreateSession(trace.Session{ID: "alone", TaskID: "u"}, "", 0))
	rec := func(sess, req, answer, finish string) {
		must(st.Record(ctx, &trace.Call{SessionID: sess, PromptIDs: []int32{1, 2}, ResponseIDs: []int32{3, 4}, Logprobs: []float32{-1, -1},
			FinishReason: finish, Trainable: true, UpstreamRequest: json.RawMessage(req), Response: json.RawMessage(answer)}))
	}
	tools := `[{"type":"function","function":{"name":"read_file","parameters":{"type":"object"}}}]`
	rec("a", `{"model":"m","messages":[{"role":"system","content":"sys"},{"role":"user","content":[{"type":"text","text":"fix"},{"type":"text","text":"it"}]}],"tools":`+tools+`,"tool_choice":"auto","max_tokens":100}`,
		`{"role":"assistant","content":null,"reasoning_content":"look first","tool_calls":[{"id":"c1","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"x\"}"}}]}`, "tool_calls")
	rec("a", `{"model":"m","messages":[{"role":"system","content":"sys"},{"role":"user","content":"fix it"},{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"x\"}"}}]},{"role":"tool","tool_call_id":"c1","content":"data"}],"tools":`+tools+`,"max_tokens":100}`,
		`{"role":"assistant","content":"done"}`, "length")
	rec("b", `{"model":"m","messages":[{"role":"user","content":"fix it"}]}`, `{"role":"assistant","content":"no"}`, "stop")
	rec("alone", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, `{"role":"assistant","content":"hello"}`, "stop")
	must(st.FinishSession("a", 1, trace.StatusCompleted))
	must(st.FinishSession("b", 0, trace.StatusFailed))
	must(st.FinishSession("alone", 1, trace.StatusCompleted))
	must(st.Close())

	ss, err := FromStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ss) != 2 || ss[0].ID != "a" || ss[1].ID != "b" || ss[1].Status != "failed" || ss[0].Reward != 1 {
		t.Fatalf("sessions %+v", ss)
	}
	a := ss[0]
	if len(a.Calls) != 2 {
		t.Fatalf("session a: %d calls", len(a.Calls))
	}
	c0 := a.Calls[0]
	if c0.Messages[1].Content != "fix\nit "+a.Tag || c0.Output.Reasoning != "look first" || len(c0.Output.ToolCalls) != 1 ||
		c0.Output.ToolCalls[0].Name != "read_file" || c0.Output.ToolCalls[0].Arguments != `{"path":"x"}` || string(c0.ToolChoice) != `"auto"` {
		t.Fatalf("call 0: %+v", c0)
	}
	if c1 := a.Calls[1]; c1.Output.Finish != "length" || c1.MaxTokens != 2 || c1.Messages[3].Role != "tool" || c1.Messages[3].ToolCallID != "c1" {
		t.Fatalf("call 1: %+v", c1)
	}
	body, err := ss[1].Calls[0].Body("m")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(body), `"tools":[]`) {
		t.Fatalf("a request without tools is replayed with some: %s", body)
	}
	body, _ = c0.Body("m")
	if !strings.Contains(string(body), `"read_file"`) || strings.Contains(string(body), `"run"`) {
		t.Fatalf("the recorded tools are not the replayed ones: %s", body)
	}
	if _, err := FromStore(t.TempDir()); err == nil {
		t.Fatal("an empty folder gave sessions")
	}
}
