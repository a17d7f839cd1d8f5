// Package ssetest reads server-sent event streams in tests, as a client would: the data
// payloads of any stream, and the named events of an Anthropic-style stream.
package ssetest

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/floe-rl/floe/proxy"
)

// Data returns the data payloads of the stream r, in order.
func Data(t testing.TB, r io.Reader) []string {
	t.Helper()
	var out []string
	if err := proxy.ReadSSE(r, nil, func(b []byte) error { out = append(out, string(b)); return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// Event is one named event: its name and its JSON data.
type Event struct {
	Name string
	Data map[string]any
}

// Events splits a stream of named events, checking that each is one "event:" line and
// one "data:" line whose JSON "type" is the event's name, and that the stream ends with
// a blank line.
func Events(t testing.TB, body string) []Event {
	t.Helper()
	if !strings.HasSuffix(body, "\n\n") {
		t.Fatalf("stream does not end with a blank line: %q", body)
	}
	var out []Event
	for _, chunk := range strings.Split(strings.TrimSuffix(body, "\n\n"), "\n\n") {
		lines := strings.Split(chunk, "\n")
		if len(lines) != 2 || !strings.HasPrefix(lines[0], "event: ") || !strings.HasPrefix(lines[1], "data: ") {
			t.Fatalf("malformed SSE event %q", chunk)
		}
		ev := Event{Name: strings.TrimPrefix(lines[0], "event: ")}
		if err := json.Unmarshal([]byte(strings.TrimPrefix(lines[1], "data: ")), &ev.Data); err != nil {
			t.Fatalf("event %s data: %v", ev.Name, err)
		}
		if ev.Data["type"] != ev.Name {
			t.Errorf("event %s has data type %v", ev.Name, ev.Data["type"])
		}
		out = append(out, ev)
	}
	return out
}

// Summary names an Anthropic event with its block index and block or delta type, e.g.
// "content_block_delta 1 text_delta".
func Summary(ev Event) string {
	s := ev.Name
	if idx, ok := ev.Data["index"]; ok {
		s += fmt.Sprintf(" %v", idx)
	}
	if cb, ok := ev.Data["content_block"].(map[string]any); ok {
		s += " " + cb["type"].(string)
	}
	if d, ok := ev.Data["delta"].(map[string]any); ok && ev.Name == "content_block_delta" {
		s += " " + d["type"].(string)
	}
	return s
}
