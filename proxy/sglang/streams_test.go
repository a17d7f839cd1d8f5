package sglang

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/floe-rl/floe/proxy"
)

// Stream readers copied from the core and anthropic tests: those live in other packages now.

func sseData(t *testing.T, r io.Reader) []string {
	t.Helper()
	var out []string
	if err := proxy.ReadSSE(r, nil, func(b []byte) error { out = append(out, string(b)); return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

type anthSSEEvent struct {
	name string
	data map[string]any
}

// anthParseSSE splits an event stream into events, checking each is "event:" + "data:".
func anthParseSSE(t *testing.T, body string) []anthSSEEvent {
	t.Helper()
	if !strings.HasSuffix(body, "\n\n") {
		t.Fatalf("stream does not end with a blank line: %q", body)
	}
	var out []anthSSEEvent
	for _, chunk := range strings.Split(strings.TrimSuffix(body, "\n\n"), "\n\n") {
		lines := strings.Split(chunk, "\n")
		if len(lines) != 2 || !strings.HasPrefix(lines[0], "event: ") || !strings.HasPrefix(lines[1], "data: ") {
			t.Fatalf("malformed SSE event %q", chunk)
		}
		ev := anthSSEEvent{name: strings.TrimPrefix(lines[0], "event: ")}
		if err := json.Unmarshal([]byte(strings.TrimPrefix(lines[1], "data: ")), &ev.data); err != nil {
			t.Fatalf("event %s data: %v", ev.name, err)
		}
		if ev.data["type"] != ev.name {
			t.Errorf("event %s has data type %v", ev.name, ev.data["type"])
		}
		out = append(out, ev)
	}
	return out
}

// anthEventSummary names an event with its block index and block or delta type.
func anthEventSummary(ev anthSSEEvent) string {
	s := ev.name
	if idx, ok := ev.data["index"]; ok {
		s += fmt.Sprintf(" %v", idx)
	}
	if cb, ok := ev.data["content_block"].(map[string]any); ok {
		s += " " + cb["type"].(string)
	}
	if d, ok := ev.data["delta"].(map[string]any); ok && ev.name == "content_block_delta" {
		s += " " + d["type"].(string)
	}
	return s
}
