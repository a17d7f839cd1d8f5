package e2e

import "testing"

func TestAnsweredBy(t *testing.T) {
	call := []ScriptedCall{{Name: "bash", Arguments: "{}"}}
	tests := []struct {
		name string
		out  Output
		got  int
		want bool
	}{
		{"as scripted", Output{ToolCalls: call}, 1, true},
		{"a call missing", Output{ToolCalls: call}, 0, false},
		{"a call too many", Output{ToolCalls: call}, 2, false},
		{"a hermes call in the text, parsed", Output{Content: "fix:\n<tool_call>\n{}\n</tool_call>"}, 1, true},
		{"a hermes call in the text, left as text", Output{Content: "fix:\n<tool_call>\n{}\n</tool_call>"}, 0, true},
		{"a call after an unclosed think", Output{Content: "<think>\nmid-thought", ToolCalls: call}, 0, true},
		{"a closed think hides nothing", Output{Content: "<think>a</think>b", ToolCalls: call}, 0, false},
	}
	for _, tt := range tests {
		if got := tt.out.answeredBy(tt.got); got != tt.want {
			t.Errorf("%s: answeredBy(%d) = %v, want %v", tt.name, tt.got, got, tt.want)
		}
	}
}
