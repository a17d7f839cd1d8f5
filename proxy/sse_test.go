package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net/http/httptest"
	"strings"
	"testing"

	gojson "github.com/goccy/go-json"
)

func FuzzReadSSE(f *testing.F) {
	f.Add([]byte("data: {\"a\":1}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("event: x\ndata: a\ndata: b\n\n: comment\ndata:c"))
	f.Fuzz(func(t *testing.T, in []byte) {
		var n int
		_ = ReadSSE(bytes.NewReader(in), nil, func(b []byte) error { n += len(b); return nil })
		if n > len(in) {
			t.Fatalf("read %d data bytes from %d input bytes", n, len(in))
		}
	})
}

// TestSSEEventsAreTheMarshalledJSON: an event's data is byte for byte what
// gojson.Marshal gives (HTML characters, U+2028, invalid UTF-8, maps' key order), and
// events written one after another do not run into each other.
func TestSSEEventsAreTheMarshalledJSON(t *testing.T) {
	values := []any{
		map[string]any{"z": "a<b>&c\u2028d\xff", "a": []any{1.5, nil, true}, "m": map[string]any{}},
		struct {
			ID    string   `json:"id"`
			Delta *string  `json:"delta,omitempty"`
			N     []int32  `json:"n"`
			F     *float64 `json:"f"`
		}{ID: "x\"y\\z\n"},
		"plain",
	}
	rec := httptest.NewRecorder()
	s := NewSSE(rec)
	var want bytes.Buffer
	for i, v := range values {
		name := ""
		if i%2 == 1 {
			name = "content_block_delta"
			want.WriteString("event: " + name + "\n")
		}
		if err := s.Event(name, v); err != nil {
			t.Fatal(err)
		}
		b, err := gojson.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		want.WriteString("data: " + string(b) + "\n\n")
	}
	if err := s.Raw("done", "[DONE]"); err != nil {
		t.Fatal(err)
	}
	want.WriteString("event: done\ndata: [DONE]\n\n")
	if got := rec.Body.String(); got != want.String() {
		t.Errorf("events:\n%q\nwant\n%q", got, want.String())
	}
}

// relayReader hands out its pieces one per Read, as an upstream's writes arrive, and
// fails a Read made while an event handed on since the last idle is still unflushed: the
// relay flushes in idle, and such a Read could block with the event held back.
type relayReader struct {
	pieces  []string
	next    int
	pending bool // an event was handed on since the last idle
}

func (r *relayReader) Read(p []byte) (int, error) {
	if r.pending {
		return 0, fmt.Errorf("read %d of the stream came with an event handed on since the last idle", r.next)
	}
	if r.next == len(r.pieces) {
		return 0, io.EOF
	}
	n := copy(p, r.pieces[r.next])
	r.next++
	return n, nil
}

// TestReadSSECallsIdleBeforeEveryBlockingRead: the relay flushes in idle, so events that
// arrived in one read are handed on without idle between them (one flush for all), and
// idle comes before every read that follows an event, also when the bytes at hand end in
// part of the next event (an event the upstream wrote in two pieces).
func TestReadSSECallsIdleBeforeEveryBlockingRead(t *testing.T) {
	for _, tc := range []struct {
		name   string
		pieces []string
		want   string
	}{
		{"events together", []string{"data: a\n\ndata: b\n\ndata: c\n\n"}, "idle a b c idle"},
		{"events apart", []string{"data: a\n\n", "data: b\n\n", "data: c\n\n"}, "idle a idle b idle c idle"},
		{"an event in two pieces after a whole one", []string{"data: a\n\ndata: b", "c\n\n"}, "idle a idle bc idle"},
		{"a line cut before its newline", []string{"data: a", "\n\ndata: b\n", "\n"}, "idle a idle b idle"},
		{"the blank line apart", []string{"data: a\n", "\ndata: b\n\n"}, "idle idle a b idle"},
		{"CRLF lines", []string{"data: a\r\n\r\ndata: b\r", "\n\r\n"}, "idle a idle b idle"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &relayReader{pieces: tc.pieces}
			var log []string
			idle := func() { log = append(log, "idle"); r.pending = false }
			err := ReadSSE(r, idle, func(b []byte) error { log = append(log, string(b)); r.pending = true; return nil })
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.Join(log, " "); got != tc.want {
				t.Errorf("calls %q, want %q", got, tc.want)
			}
		})
	}
}
