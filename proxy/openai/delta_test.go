package openai

import (
	"testing"

	gojson "github.com/goccy/go-json"
)

// TestDeltaEventsAreTheBytesOfTheirMaps: the structs the streams encode their per-token
// events from give byte for byte what the maps they replace gave (a map's keys are
// encoded in order), HTML characters and all.
func TestDeltaEventsAreTheBytesOfTheirMaps(t *testing.T) {
	const text = "a<b>&c \"q\" \u2028 é\n"
	text1 := &respTextDelta{Delta: text, ItemID: "msg_1", Logprobs: []any{}, OutputIndex: 2, Type: "response.output_text.delta"}
	text1.number(7)
	sum := &respSummaryDelta{Delta: text, ItemID: "rs_1", OutputIndex: 1, Type: "response.reasoning_summary_text.delta"}
	sum.number(3)
	args := &respArgumentsDelta{Delta: `{"p":"<a>"}`, ItemID: "fc_1", OutputIndex: 0, Type: "response.function_call_arguments.delta"}
	args.number(9)
	calls := toolCallsDelta{[]toolCallDelta{
		{Function: toolCallFunctionDelta{Arguments: "", Name: "read"}, ID: "call_1", Index: 0, Type: "function"},
		{Function: toolCallFunctionDelta{Arguments: `{"p":`}, Index: 1},
	}}
	callMaps := map[string]any{"tool_calls": []map[string]any{
		{"index": 0, "function": map[string]any{"arguments": "", "name": "read"}, "id": "call_1", "type": "function"},
		{"index": 1, "function": map[string]any{"arguments": `{"p":`}},
	}}
	for name, c := range map[string]struct{ got, want any }{
		"chat content":   {contentDelta{text}, map[string]any{"content": text}},
		"chat reasoning": {reasoningDelta{text}, map[string]any{"reasoning_content": text}},
		"responses text": {text1, map[string]any{"item_id": "msg_1", "output_index": 2, "content_index": 0, "delta": text, "logprobs": []any{},
			"type": "response.output_text.delta", "sequence_number": 7}},
		"chat tool calls": {calls, callMaps},
		"responses arguments": {args, map[string]any{"item_id": "fc_1", "output_index": 0, "delta": `{"p":"<a>"}`,
			"type": "response.function_call_arguments.delta", "sequence_number": 9}},
		"responses reasoning": {sum, map[string]any{"item_id": "rs_1", "output_index": 1, "summary_index": 0, "delta": text,
			"type": "response.reasoning_summary_text.delta", "sequence_number": 3}},
	} {
		got, err := gojson.Marshal(c.got)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := gojson.Marshal(c.want)
		if string(got) != string(want) {
			t.Errorf("%s:\n%s\nwant\n%s", name, got, want)
		}
	}
}
