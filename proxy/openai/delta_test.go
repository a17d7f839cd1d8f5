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
	for name, c := range map[string]struct{ got, want any }{
		"chat content":   {contentDelta{text}, map[string]any{"content": text}},
		"chat reasoning": {reasoningDelta{text}, map[string]any{"reasoning_content": text}},
		"responses text": {text1, map[string]any{"item_id": "msg_1", "output_index": 2, "content_index": 0, "delta": text, "logprobs": []any{},
			"type": "response.output_text.delta", "sequence_number": 7}},
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
