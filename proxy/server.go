package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/floe-rl/floe/trace"
)

// DefaultMaxBodyBytes bounds a request body (32 MiB): long agent histories with images
// fit, a runaway client does not exhaust memory.
const DefaultMaxBodyBytes = 32 << 20

// Dialects are the provider APIs the server speaks; a nil one is not served.
type Dialects struct {
	Anthropic, Chat, Responses, Gemini Dialect
}

// Server is the proxy's HTTP handler. Engine, Sessions and Recorder are required; a nil
// Gate never pauses, a nil Log logs to slog.Default, a nil Now reads the wall clock.
type Server struct {
	Dialects Dialects
	Engine   Engine
	Sessions trace.SessionKeys
	Recorder trace.CallRecorder
	Gate     *Gate
	// OpenSessions lets a call with an unknown key create its session instead of being
	// refused.
	OpenSessions bool
	MaxBodyBytes int64 // 0: DefaultMaxBodyBytes
	Log          *slog.Logger
	Now          func() time.Time
	// Metrics, when set, is told of every recorded call and every error answered; nil
	// counts nothing.
	Metrics Metrics
	// Sampling is the --sampling policy ("" is SamplingRecord).
	Sampling SamplingPolicy
}

// Metrics receives the proxy's counts (floe serve turns them into Prometheus metrics).
// Its methods are called concurrently and must not block.
type Metrics interface {
	// Recorded is called once per call recorded (one per choice): its API kind (the
	// dialect's Name) and whether it is trainable.
	Recorded(api string, trainable bool)
	// Upstream is called once per upstream call that answered, with its latency.
	Upstream(api string, latency time.Duration)
	// Failed is called once per error answered to a caller (or ending its stream), with
	// the error's kind.
	Failed(api string, kind ErrorKind)
}

type operation int

const (
	opGenerate operation = iota
	opCount
	opModels
	opUnknown
)

func (s *Server) log() *slog.Logger {
	if s.Log == nil {
		return slog.Default()
	}
	return s.Log
}

func (s *Server) now() time.Time {
	if s.Now == nil {
		return time.Now()
	}
	return s.Now()
}

// route picks the dialect and the operation: by path first, then by headers, then by
// the body's shape.
func (s *Server) route(r *http.Request, body []byte) (Dialect, operation) {
	p := r.URL.Path
	d := s.Dialects
	switch {
	case strings.HasSuffix(p, "/messages/count_tokens"):
		return d.Anthropic, opCount
	case strings.HasSuffix(p, "/messages"):
		return d.Anthropic, opGenerate
	case strings.HasSuffix(p, "/chat/completions"):
		return d.Chat, opGenerate
	case strings.HasSuffix(p, "/responses"):
		return d.Responses, opGenerate
	case strings.HasSuffix(p, ":generateContent"), strings.HasSuffix(p, ":streamGenerateContent"):
		return d.Gemini, opGenerate
	case strings.HasSuffix(p, ":countTokens"):
		return d.Gemini, opCount
	case strings.HasSuffix(p, "/models") && r.Method == http.MethodGet:
		switch {
		case r.Header.Get("anthropic-version") != "" || r.Header.Get("x-api-key") != "":
			return d.Anthropic, opModels
		case strings.Contains(p, "v1beta") || r.Header.Get("x-goog-api-key") != "":
			return d.Gemini, opModels
		default:
			return d.Chat, opModels
		}
	}
	switch {
	case r.Header.Get("anthropic-version") != "":
		return d.Anthropic, opUnknown
	case r.Header.Get("x-goog-api-key") != "" || r.URL.Query().Get("key") != "":
		return d.Gemini, opUnknown
	}
	var shape map[string]json.RawMessage
	if json.Unmarshal(body, &shape) == nil {
		switch {
		case shape["contents"] != nil:
			return d.Gemini, opUnknown
		case shape["input"] != nil:
			return d.Responses, opUnknown
		case shape["messages"] != nil && shape["max_tokens"] != nil && shape["system"] != nil:
			return d.Anthropic, opUnknown
		}
	}
	return d.Chat, opUnknown
}

// key returns the credential a harness sent, in the order DESIGN.md gives.
func key(r *http.Request) string {
	if v := r.Header.Get("x-floe-session"); v != "" {
		return v
	}
	if v := r.Header.Get("x-api-key"); v != "" {
		return v
	}
	if v, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok && v != "" {
		return strings.TrimSpace(v)
	}
	if v := r.Header.Get("x-goog-api-key"); v != "" {
		return v
	}
	return r.URL.Query().Get("key")
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/healthz" {
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, "ok\n")
		return
	}
	limit := s.MaxBodyBytes
	if limit <= 0 {
		limit = DefaultMaxBodyBytes
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	d, op := s.route(r, body)
	if d == nil {
		d = s.fallbackDialect()
	}
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			s.writeError(w, d, &Error{Status: http.StatusRequestEntityTooLarge, Kind: ErrTooLarge,
				Message: fmt.Sprintf("request body is larger than the limit of %d bytes", limit)})
			return
		}
		s.writeError(w, d, &Error{Status: http.StatusBadRequest, Kind: ErrInvalidRequest, Message: "reading the request body: " + err.Error()})
		return
	}
	if op == opUnknown || (op != opModels && r.Method != http.MethodPost) {
		s.writeError(w, d, &Error{Status: http.StatusNotFound, Kind: ErrNotFound, Message: fmt.Sprintf("floe serves no %s %s", r.Method, r.URL.Path)})
		return
	}
	session, ok := s.authenticate(r)
	if !ok {
		s.writeError(w, d, &Error{Status: http.StatusUnauthorized, Kind: ErrAuthentication,
			Message: "unknown API key: create a session with POST /floe/v1/sessions and use its api_key"})
		return
	}
	ctx := r.Context()
	switch op {
	case opModels:
		models, err := s.Engine.Models(ctx)
		if err != nil {
			s.fail(w, d, err)
			return
		}
		d.WriteModels(w, models)
		return
	case opCount:
		counter, ok := d.(TokenCounter)
		if !ok {
			s.writeError(w, d, &Error{Status: http.StatusNotFound, Kind: ErrNotFound, Message: "this API has no token counting"})
			return
		}
		req, err := d.Decode(r, body)
		if err != nil {
			s.fail(w, d, err)
			return
		}
		n, err := s.Engine.CountTokens(ctx, &req.Chat)
		if err != nil {
			s.fail(w, d, err)
			return
		}
		counter.WriteCount(w, req, n)
		return
	}
	req, err := d.Decode(r, body)
	if err != nil {
		s.fail(w, d, err)
		return
	}
	s.generate(w, r, d, req, session, body)
}

func (s *Server) fallbackDialect() Dialect {
	for _, d := range []Dialect{s.Dialects.Chat, s.Dialects.Anthropic, s.Dialects.Responses, s.Dialects.Gemini} {
		if d != nil {
			return d
		}
	}
	return nil
}

func (s *Server) authenticate(r *http.Request) (string, bool) {
	k := key(r)
	if k == "" {
		return "", false
	}
	if session, ok := s.Sessions.Resolve(k); ok {
		return session, true
	}
	if !s.OpenSessions {
		return "", false
	}
	session, err := s.Sessions.Open(k)
	if err != nil {
		s.log().Error("opening a session", "err", err)
		return "", false
	}
	return session, true
}

// fail writes err in the caller's shape; anything that is not an *Error is floe's own
// failure and is logged, never shown as a stack trace.
func (s *Server) fail(w http.ResponseWriter, d Dialect, err error) {
	var e *Error
	if !errors.As(err, &e) {
		// floe's own errors name sessions and store paths, which the harness must not see.
		s.log().Error("request failed", "err", err)
		e = &Error{Status: http.StatusInternalServerError, Kind: ErrInternal, Message: "floe failed to serve the call; its log says why"}
	}
	s.writeError(w, d, e)
}

// writeError answers e in the caller's shape and counts it.
func (s *Server) writeError(w http.ResponseWriter, d Dialect, e *Error) {
	s.countError(d, e.Kind)
	d.WriteError(w, e)
}

func (s *Server) countError(d Dialect, kind ErrorKind) {
	if s.Metrics != nil {
		s.Metrics.Failed(d.Name(), kind)
	}
}

// generate runs one model call: wait for the gate, call upstream (streaming to the caller
// as it goes), record the call, and only then finish the answer, so that a call is durable
// before the harness sees its end.
func (s *Server) generate(w http.ResponseWriter, r *http.Request, d Dialect, req *Request, session string, body []byte) {
	ctx := r.Context()
	started := s.now()
	s.applySampling(d, req)
	var version int64
	if s.Gate != nil {
		v, leave, err := s.Gate.Enter(ctx)
		if err != nil {
			return // the caller went away while paused
		}
		defer leave()
		version = v
	}
	rec := func(res *Result, problem string) error {
		return s.record(ctx, d, req, res, session, version, started, body, problem)
	}
	if !req.Stream {
		res, err := s.Engine.Complete(ctx, &req.Chat)
		if err != nil {
			s.fail(w, d, err)
			return
		}
		if err := rec(res, ""); err != nil {
			s.fail(w, d, err)
			return
		}
		if err := d.WriteResponse(w, req, &res.Response); err != nil {
			s.log().Warn("writing the answer", "session", session, "err", err)
		}
		return
	}
	sink := &streamSink{w: batchingWriter{w}, d: d, req: req}
	res, err := s.Engine.Stream(ctx, &req.Chat, sink)
	stream := sink.stream
	defer sink.Flush()
	switch {
	case errors.Is(err, ErrCallerGone) || ctx.Err() != nil:
		// Record what was generated: the tokens were sampled, but the harness never saw
		// the whole answer, so they are not trained on.
		if res != nil {
			_ = s.record(context.WithoutCancel(ctx), d, req, res, session, version, started, body,
				"aborted: the caller disconnected mid-stream")
		}
		return
	case err != nil:
		if res != nil && len(res.Response.Choices) > 0 {
			_ = rec(res, "the upstream stream broke: "+err.Error())
		}
		if stream == nil {
			s.fail(w, d, err)
			return
		}
		var e *Error
		if !errors.As(err, &e) {
			e = &Error{Status: http.StatusBadGateway, Kind: ErrUpstreamUnavailable, Message: err.Error()}
		}
		s.countError(d, e.Kind)
		_ = stream.Fail(e)
		return
	}
	if err := rec(res, ""); err != nil {
		if stream == nil {
			s.fail(w, d, err)
		} else {
			s.log().Error("recording a streamed call", "err", err)
			s.countError(d, ErrInternal)
			_ = stream.Fail(&Error{Status: http.StatusInternalServerError, Kind: ErrInternal, Message: "floe could not record the call; its log says why"})
		}
		return
	}
	if stream == nil {
		stream = d.NewStream(sink.w, req)
	}
	c := res.Response.Choices[0]
	if err := stream.End(c.FinishReason, res.Response.Usage); err != nil {
		s.log().Warn("finishing the stream", "session", session, "err", err)
	}
}

// record stores one trace.Call per choice of res. problem, when set, marks them all
// untrainable; otherwise each is checked and marked untrainable if its token data is
// missing or inconsistent.
func (s *Server) record(ctx context.Context, d Dialect, req *Request, res *Result, session string, version int64,
	started time.Time, body []byte, problem string) error {
	finished := s.now()
	if s.Metrics != nil {
		s.Metrics.Upstream(d.Name(), res.Latency)
	}
	for i, ch := range res.Response.Choices {
		var td TokenData
		if i < len(res.Choices) {
			td = res.Choices[i]
		}
		msg, _ := json.Marshal(ch.Message)
		c := trace.Call{
			SessionID: session, Choice: i,
			PromptIDs: res.PromptIDs, ResponseIDs: td.ResponseIDs, Logprobs: td.Logprobs,
			FinishReason: ch.FinishReason, PolicyVersion: version, Trainable: true, Sampling: samplingOf(&req.Chat),
			API: d.Name(), Started: started, Finished: finished, UpstreamLatency: res.Latency,
			Request: body, UpstreamRequest: res.Upstream, Response: msg,
		}
		switch {
		case problem != "":
			c.MarkUntrainable(problem)
		case td.Problem != "":
			c.MarkUntrainable(td.Problem)
		default:
			if err := c.Validate(); err != nil {
				c.MarkUntrainable(err.Error())
			}
		}
		if !c.Trainable {
			s.log().Warn("call recorded as untrainable", "session", session, "reason", c.UntrainableReason)
		}
		if err := s.Recorder.Record(ctx, &c); err != nil {
			return fmt.Errorf("recording a call of session %s: %w", session, err)
		}
		if s.Metrics != nil {
			s.Metrics.Recorded(d.Name(), c.Trainable)
			if m, ok := s.Metrics.(SamplingMetrics); ok && !c.Sampling.Reproducible() {
				m.SampledTruncated(d.Name())
			}
		}
	}
	return nil
}

// streamSink opens the caller's stream at the first delta, so that an upstream refusing
// the call still gets a proper HTTP error status.
type streamSink struct {
	w      batchingWriter
	d      Dialect
	req    *Request
	stream Stream
}

func (s *streamSink) Delta(d Delta) error {
	if s.stream == nil {
		s.stream = s.d.NewStream(s.w, s.req)
	}
	return s.stream.Delta(d)
}

// Flush sends what the stream has written; before the stream exists there is nothing to
// send, and flushing would commit a 200 status that an upstream error must still be able
// to replace.
func (s *streamSink) Flush() {
	if s.stream != nil {
		s.w.flushNow()
	}
}

// batchingWriter holds back the flushes dialects make after every event; the proxy
// flushes when the upstream has nothing more at hand, so events that arrive together
// leave in one write instead of one each.
type batchingWriter struct{ http.ResponseWriter }

func (batchingWriter) Flush() {}

func (b batchingWriter) flushNow() {
	if f, ok := b.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (b batchingWriter) Unwrap() http.ResponseWriter { return b.ResponseWriter }
