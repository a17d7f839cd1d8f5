package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"

	// goccy/go-json encodes and decodes like encoding/json, two to three times faster;
	// the proxy spends most of its time on JSON.
	gojson "github.com/goccy/go-json"
)

// SSEWriter writes Server-Sent Events to a caller, flushing each event as it is written so
// that nothing is buffered between the model and the harness.
type SSEWriter struct {
	w http.ResponseWriter
	f http.Flusher
	// buf holds one event at a time, written to w in one Write; enc encodes into it (as
	// gojson.Marshal does, with a newline after).
	buf bytes.Buffer
	enc *gojson.Encoder
}

// NewSSE sends the event-stream headers with status 200.
func NewSSE(w http.ResponseWriter) *SSEWriter {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("Connection", "keep-alive")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	f, _ := w.(http.Flusher)
	s := &SSEWriter{w: w, f: f}
	s.flush()
	return s
}

func (s *SSEWriter) flush() {
	if s.f != nil {
		s.f.Flush()
	}
}

// Event writes "event: name" and "data: <json of v>"; an empty name writes data only.
// A stream writes one event per token or so: the event is built in the writer's own
// buffer and written whole, without formatting or copies of its JSON.
func (s *SSEWriter) Event(name string, v any) error {
	s.head(name)
	if s.enc == nil {
		s.enc = gojson.NewEncoder(&s.buf)
	}
	if err := s.enc.Encode(v); err != nil { // the JSON, then "\n"
		s.buf.Reset()
		return fmt.Errorf("sse event %q: %w", name, err)
	}
	s.buf.WriteByte('\n')
	return s.write()
}

// Raw writes an event whose data is given verbatim (e.g. "[DONE]").
func (s *SSEWriter) Raw(name, data string) error {
	s.head(name)
	s.buf.WriteString(data)
	s.buf.WriteString("\n\n")
	return s.write()
}

// head starts an event in buf: "event: name\n" when it has a name, then "data: ".
func (s *SSEWriter) head(name string) {
	s.buf.Reset()
	if name != "" {
		s.buf.WriteString("event: ")
		s.buf.WriteString(name)
		s.buf.WriteByte('\n')
	}
	s.buf.WriteString("data: ")
}

// write sends the event in buf and flushes it.
func (s *SSEWriter) write() error {
	_, err := s.w.Write(s.buf.Bytes())
	s.buf.Reset()
	if err != nil {
		return fmt.Errorf("sse write: %w", err)
	}
	s.flush()
	return nil
}

// lineBuffered says whether br holds a whole line, which its next ReadSlice returns
// without reading: the search stops at the line's end, as ReadSlice's own does.
func lineBuffered(br *bufio.Reader) bool {
	n := br.Buffered()
	if n == 0 {
		return false
	}
	b, _ := br.Peek(n) // no read: n bytes are buffered
	return bytes.IndexByte(b, '\n') >= 0
}

// WriteJSON writes v as a JSON response with status.
func WriteJSON(w http.ResponseWriter, status int, v any) error {
	b, err := gojson.Marshal(v)
	if err != nil {
		return fmt.Errorf("encoding response: %w", err)
	}
	return WriteJSONBytes(w, status, b)
}

// WriteJSONBytes writes b, encoded JSON, as the response with status. With its length
// declared, the answer leaves with its headers in one write and no chunked framing;
// without, net/http frames any answer over 2 KiB in chunks and sends the last chunk in a
// write of its own when the handler returns.
func WriteJSONBytes(w http.ResponseWriter, status int, b []byte) error {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, err := w.Write(b)
	return err
}

// ErrCallerGone is what an Engine's Stream returns when the sink refused a delta: the
// caller went away, and the call is recorded as aborted.
var ErrCallerGone = errors.New("the caller went away")

// sseReaders are ReadSSE's buffers, reused: each stream would otherwise allocate (and
// clear) 64 KiB, as much as a long request's body, for the garbage collector to reclaim.
var sseReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 64<<10) }}

// maxSSELine bounds one line of an upstream stream.
const maxSSELine = 64 << 20

// ReadSSE calls onData with the data of each event of an SSE stream until the stream
// ends or onData returns an error. Multi-line data fields are joined with newlines. idle,
// when not nil, is called before every read of r that may block: whenever no whole line is
// left of the bytes read so far. Events that arrived together are handed to onData
// without idle between them (their writes can leave in one flush), and none waits on a
// read of the next: an event split across the upstream's writes is not held behind it.
func ReadSSE(r io.Reader, idle func(), onData func([]byte) error) error {
	br := sseReaders.Get().(*bufio.Reader)
	br.Reset(r)
	defer func() {
		br.Reset(nil) // holds no reference to the stream while pooled
		sseReaders.Put(br)
	}()
	var data, long []byte
	have := false
	for {
		if idle != nil && !lineBuffered(br) {
			idle()
		}
		line, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			long = append(long[:0], line...)
			for errors.Is(err, bufio.ErrBufferFull) && len(long) <= maxSSELine {
				line, err = br.ReadSlice('\n')
				long = append(long, line...)
			}
			if len(long) > maxSSELine {
				return fmt.Errorf("an SSE line is longer than %d bytes", maxSSELine)
			}
			line = long
		}
		if err != nil && !(errors.Is(err, io.EOF) && len(line) > 0) {
			if errors.Is(err, io.EOF) {
				break
			}
			return err
		}
		line = bytes.TrimRight(line, "\r\n")
		if len(line) == 0 {
			if have {
				if err := onData(data); err != nil {
					return err
				}
				data, have = data[:0], false
			}
			continue
		}
		if rest, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			rest = bytes.TrimPrefix(rest, []byte(" "))
			if have {
				data = append(data, '\n')
			}
			data = append(data, rest...)
			have = true
		}
		// event:, id:, retry: and comments carry nothing the proxy needs.
		if err != nil { // a last line without newline
			break
		}
	}
	if have {
		return onData(data)
	}
	return nil
}
