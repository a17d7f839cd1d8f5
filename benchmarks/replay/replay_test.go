package replay

import (
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/benchmarks/e2e"
	"github.com/floe-rl/floe/internal/corpus"
)

func TestPythonJSON(t *testing.T) {
	tests := []struct {
		in, want string
		ok       bool
	}{
		{`{"a":1,"b":[true,null,"x"]}`, `{"a": 1, "b": [true, null, "x"]}`, true},
		{`{"z": 1, "a": 2}`, `{"z": 1, "a": 2}`, true}, // key order kept
		{`{"s":"caf\u00e9 \u2014 <b>&\n\t\"q\" \\"}`, `{"s": "café — <b>&\n\t\"q\" \\"}`, true},
		{`{"c":"\u0001"}`, `{"c": "\u0001"}`, true},
		{`{"e":{}, "l":[]}`, `{"e": {}, "l": []}`, true},
		{`{"n": 1.50}`, `{"n": 1.50}`, true},
		{`not json`, ``, false},
		{`{"a": 1} {"b": 2}`, ``, false},
	}
	for _, tt := range tests {
		got, ok := pythonJSON(tt.in)
		if ok != tt.ok || got != tt.want {
			t.Errorf("pythonJSON(%s) = %s, %v; want %s, %v", tt.in, got, ok, tt.want, tt.ok)
		}
	}
}

func TestSplitThink(t *testing.T) {
	tests := []struct {
		reasoning, content, wantR, wantC string
	}{
		{"", "<think>\nplan\n</think>\n\nTHOUGHT: go", "plan", "THOUGHT: go"},
		{"", "plan only</think>answer", "plan only", "answer"},
		{"", "text with </think> later", "text with ", " later"}, // as the template splits it
		{"item", "<think>inline</think>\nx", "item\n\ninline", "x"},
		{"", "no reasoning", "", "no reasoning"},
	}
	for _, tt := range tests {
		r, c := splitThink(tt.reasoning, tt.content)
		if r != tt.wantR || c != tt.wantC {
			t.Errorf("splitThink(%q, %q) = %q, %q; want %q, %q", tt.reasoning, tt.content, r, c, tt.wantR, tt.wantC)
		}
	}
}

func readTiny(t *testing.T, opt Options) *Rollouts {
	t.Helper()
	f, err := os.Open("testdata/tiny_rollouts.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }() // read only
	ro, err := Read(f, opt)
	if err != nil {
		t.Fatal(err)
	}
	return ro
}

// TestReadRebuildsCalls: each run of model outputs is one call whose request is every
// item before it; the rollouts of a task are one group.
func TestReadRebuildsCalls(t *testing.T) {
	ro := readTiny(t, Options{})
	if ro.Groups != 2 || len(ro.Sessions) != 4 || ro.Calls != 12 || ro.Agent != "anyswe_pi" {
		t.Fatalf("groups %d sessions %d calls %d agent %q; want 2, 4, 12, anyswe_pi", ro.Groups, len(ro.Sessions), ro.Calls, ro.Agent)
	}
	s := ro.Sessions[0]
	if s.Group != "task0" || s.Reward != 1 || s.Task != "tiny__calc-1" || len(s.Calls) != 3 {
		t.Fatalf("session 0: %+v", s)
	}
	// Call 1's request: the problem statement, the first answer, its tool output.
	c := s.Calls[1]
	roles := []string{}
	for _, m := range c.Messages {
		roles = append(roles, m.Role)
	}
	if strings.Join(roles, ",") != "user,assistant,tool" || !strings.HasPrefix(c.Messages[0].Content, "The function `add(a, b)`") {
		t.Fatalf("call 1 request: %v %q", roles, c.Messages[0].Content)
	}
	if got := c.Messages[1].ToolCalls[0].Function.Arguments; got != `{"path": "/testbed/calc.py"}` || c.Messages[2].ToolCallID != "call_1" {
		t.Errorf("history tool call %q, tool message for %q", got, c.Messages[2].ToolCallID)
	}
	// Its answer: a reasoning item, a message and a call make one output.
	if o := c.Output; o.Reasoning != "add subtracts; the fix is one character." || o.Content != "The bug is in `add`: it subtracts." || len(o.ToolCalls) != 1 || o.ToolCalls[0].Name != "edit" {
		t.Errorf("call 1 output: %+v", o)
	}
	// Parallel calls: one answer with two tool calls, both outputs in the next request.
	par := ro.Sessions[2].Calls[1]
	if len(par.Output.ToolCalls) != 2 || len(ro.Sessions[2].Calls[2].Messages) != 6 {
		t.Errorf("parallel calls: %d tool calls, next request %d messages", len(par.Output.ToolCalls), len(ro.Sessions[2].Calls[2].Messages))
	}
	// The mini-swe style rollout: its own system and user messages, inline <think> split,
	// non-ASCII arguments in json.dumps(ensure_ascii=False) form.
	m := ro.Sessions[3]
	if m.Group != "task1" || m.Task != "tiny__greet-2" || m.Calls[0].Messages[0].Role != "system" || m.Calls[0].Output.Reasoning != "Find the greeting first." ||
		m.Calls[0].Output.Content != "THOUGHT: search for it." {
		t.Errorf("mini-swe session: %+v", m.Calls[0])
	}
	if got := m.Calls[1].Output.ToolCalls[0].Arguments; got != `{"command": "sed -i 's/Helo/Hello/' app.py && echo done → ok"}` {
		t.Errorf("arguments %s", got)
	}
	// Without a harness, every called function is offered by name.
	var tools []struct {
		Function struct{ Name string } `json:"function"`
	}
	if err := json.Unmarshal(c.Tools, &tools); err != nil || len(tools) != 3 || tools[0].Function.Name != "bash" {
		t.Errorf("tools %s: %v", c.Tools, err)
	}
}

func TestReadWithHarness(t *testing.T) {
	for _, name := range []string{"claude-code", "pi"} {
		h, err := LoadHarness(name)
		if err != nil {
			t.Fatal(err)
		}
		if h.Version == "" || len(h.Tools) < 10 {
			t.Fatalf("%s: capture without version or tools", name)
		}
		ro := readTiny(t, Options{Harness: h})
		first := ro.Sessions[0].Calls[0].Messages
		if len(first) != len(h.Messages) || first[0].Role != "system" || string(ro.Sessions[0].Calls[0].Tools) != string(h.Tools) {
			t.Fatalf("%s: first request %d messages (capture %d)", name, len(first), len(h.Messages))
		}
		var withTask int
		for _, m := range first {
			if strings.Contains(m.Content, TaskPlaceholder) {
				t.Errorf("%s: placeholder left in %s message", name, m.Role)
			}
			if strings.Contains(m.Content, "The function `add(a, b)`") {
				withTask++
			}
		}
		// The mini-swe rollout's own system message gives way to the harness's.
		mini := ro.Sessions[3].Calls[0].Messages
		if withTask != 1 || strings.Contains(mini[0].Content, "You are a helpful assistant that can interact") {
			t.Errorf("%s: task in %d messages; mini-swe first message %q", name, withTask, mini[0].Content[:40])
		}
	}
	if _, err := LoadHarness("codex"); err == nil || !strings.Contains(err.Error(), "claude-code, pi") {
		t.Errorf("unknown harness: %v", err)
	}
	for agent, want := range map[string]string{"anyswe_claude_code": "claude-code", "anyswe_pi": "pi", "mini_swe_agent_2": ""} {
		if got := HarnessFor(agent); got != want {
			t.Errorf("HarnessFor(%q) = %q, want %q", agent, got, want)
		}
	}
}

func TestReadErrors(t *testing.T) {
	tests := []struct{ in, want string }{
		{"", "no rollouts"},
		{"{", "line 1"},
		{`{"responses_create_params":{"input":[]},"response":{"output":[{"type":"message","role":"assistant","content":"hi"}]}}`, "task is unknown"},
		{`{"responses_create_params":{"input":"do it"},"response":{"output":[]}}`, "no model output"},
	}
	for _, tt := range tests {
		if _, err := Read(strings.NewReader(tt.in), Options{}); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Read(%q): %v, want %q", tt.in, err, tt.want)
		}
	}
}

// TestMeasureSyntheticGroups: the measurement's own loss-term check holds on a corpus
// with every history event, and a tampered step is caught.
func TestMeasureSyntheticGroups(t *testing.T) {
	cfg := corpus.Small()
	cfg.Groups = 2
	groups, err := corpus.Generate(cfg, 3)
	if err != nil {
		t.Fatal(err)
	}
	m, err := Measure(t.Context(), groups, []Setting{{16384, 1}, {16384, 4}}, 1)
	if err != nil {
		t.Fatal(err)
	}
	if !m.LossTermsEqual() || m.PerRequestTerms == 0 {
		t.Fatalf("loss terms differ: %+v", m.Cells)
	}
	for _, set := range []Setting{{16384, 1}, {16384, 4}} {
		pr, _ := m.Cell(batcher.PerRequest, set)
		pm, _ := m.Cell(batcher.PrefixMerging, set)
		tr, _ := m.Cell(batcher.Tree, set)
		if !(tr.PaddedRows <= pm.PaddedRows && pm.PaddedRows <= pr.PaddedRows) || tr.Passes*set.DP != tr.MicroBatches {
			t.Errorf("%+v: rows tree %d prefix_merging %d per_request %d", set, tr.PaddedRows, pm.PaddedRows, pr.PaddedRows)
		}
	}
	// Changing one recorded log-prob changes the definition, not the packed step.
	want := PerRequestTerms(groups, batcher.GRPO)
	groups[0].Sessions[0].Calls[0].Logprobs[0] -= 0.5
	got := PerRequestTerms(groups, batcher.GRPO)
	if missing, extra := got.Diff(want); missing != 1 || extra != 1 {
		t.Errorf("a changed log-prob: %d missing, %d extra; want 1, 1", missing, extra)
	}
	if s := (Result{File: "x.jsonl", Harness: "none", Dialects: []string{"responses"}, M: m}).Summary(); s.Rows["tree"] != 0 || !s.LossTermsEqual {
		t.Errorf("summary at a setting not measured: %+v", s)
	}
}

var _ = e2e.Session{}
