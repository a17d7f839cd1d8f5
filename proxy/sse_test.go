package proxy

import (
	"bytes"
	"net/http/httptest"
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
