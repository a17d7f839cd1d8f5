package proxy_test

import (
	"fmt"
	"io"
	"strings"
	"testing"
)

// A call whose upstream log-probs hold vLLM's -inf sentinel (-9999) is recorded, and
// marked untrainable with the reason, streaming or not (issue 13 item 4).
func TestSentinelLogprobMarksTheCallUntrainable(t *testing.T) {
	pieces := answer()
	pieces[2].logprobs = []float32{-9999}
	up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: pieces, finish: "stop"}
	f := newFixture(t, up)
	for _, extra := range []string{"", `,"stream":true`} {
		resp := f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, extra))
		_, _ = io.ReadAll(resp.Body)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	calls := f.store.Calls("sess-1")
	if len(calls) != 2 {
		t.Fatalf("recorded %d calls, want 2", len(calls))
	}
	for _, c := range calls {
		if c.Trainable || !strings.Contains(c.UntrainableReason, "logprobs[3] = -9999 is below the floor") {
			t.Errorf("call %d recorded as trainable=%v %q", c.Index, c.Trainable, c.UntrainableReason)
		}
	}
}
