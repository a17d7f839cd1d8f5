package proxy

import (
	"fmt"
	"net/http"

	// goccy/go-json encodes and decodes like encoding/json, two to three times faster;
	// the proxy spends most of its time on JSON.
	gojson "github.com/goccy/go-json"
)

// sseWriter writes Server-Sent Events to a caller, flushing each event as it is written so
// that nothing is buffered between the model and the harness.
type sseWriter struct {
	w http.ResponseWriter
	f http.Flusher
}

// newSSE sends the event-stream headers with status 200.
func newSSE(w http.ResponseWriter) *sseWriter {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("Connection", "keep-alive")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	f, _ := w.(http.Flusher)
	s := &sseWriter{w: w, f: f}
	s.flush()
	return s
}

func (s *sseWriter) flush() {
	if s.f != nil {
		s.f.Flush()
	}
}

// event writes "event: name" and "data: <json of v>"; an empty name writes data only.
func (s *sseWriter) event(name string, v any) error {
	b, err := gojson.Marshal(v)
	if err != nil {
		return fmt.Errorf("sse event %q: %w", name, err)
	}
	return s.raw(name, string(b))
}

// raw writes an event whose data is given verbatim (e.g. "[DONE]").
func (s *sseWriter) raw(name, data string) error {
	var err error
	if name != "" {
		_, err = fmt.Fprintf(s.w, "event: %s\ndata: %s\n\n", name, data)
	} else {
		_, err = fmt.Fprintf(s.w, "data: %s\n\n", data)
	}
	if err != nil {
		return fmt.Errorf("sse write: %w", err)
	}
	s.flush()
	return nil
}

// writeJSON writes v as a JSON response with status.
func writeJSON(w http.ResponseWriter, status int, v any) error {
	b, err := gojson.Marshal(v)
	if err != nil {
		return fmt.Errorf("encoding response: %w", err)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, err = w.Write(b)
	return err
}
