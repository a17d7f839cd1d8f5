package proxy

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/floe-rl/floe/trace"
)

// DefaultMaxBodyBytes bounds a request body (32 MiB): long agent histories with images
// fit, a runaway client does not exhaust memory.
const DefaultMaxBodyBytes = 32 << 20

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
	// Limits bound each call's deadlines, the calls served at once and the stored copy of
	// requests; zero fields take DefaultLimits.
	Limits Limits
	// Health, when set, is asked by /healthz; an error makes it answer 503 with the
	// error's text, which the harness sees (so it must name no session or path).
	Health func() error
	// SessionHeader, when set, names the header every upstream call carries its session
	// id in (never the API key), for a router in front of the replicas to keep a session
	// on one of them.
	SessionHeader string

	slots        inflight
	sessionSlots sessionInflight
	guard        guardState // proxy/admit.go
	// DiskFree, when set, reports the free bytes of the store's disk, for
	// Limits.MinFreeDisk.
	DiskFree func() (uint64, error)
	storeErr atomic.Pointer[string] // why the last write to the store failed; nil when it succeeded
	// Sampling is the --sampling policy ("" is SamplingRecord).
	Sampling SamplingPolicy
	// TrainTruncated (-train-truncated) keeps calls sampled with truncation (top_p < 1,
	// top_k > 0, min_p > 0, greedy) trainable, for users who accept the biased ratio;
	// by default they are recorded untrainable. Constrained decoding is untrainable
	// either way (untrainableSampling).
	TrainTruncated bool
	// warnedSampling notes that the one log line about calls made untrainable by their
	// sampling was written: a harness that always sends top_p 0.95 would otherwise log a
	// warning per call (the metric counts them all).
	warnedSampling atomic.Bool
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

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	lim := s.Limits.withDefaults()
	raw := w
	var dw *deadlineWriter
	if lim.ClientIdle > 0 {
		dw = newDeadlineWriter(w, lim.ClientIdle)
		w = dw
	}
	if r.URL.Path == "/healthz" {
		s.healthz(w)
		return
	}
	limit := s.MaxBodyBytes
	if limit <= 0 {
		limit = DefaultMaxBodyBytes
	}
	d, op := s.route(r, nil)
	if op == opUnknown {
		// A path floe does not serve: its 404 takes the shape the body points to, read only
		// as far as that needs, and it holds no slot.
		body, _ := readBody(raw, r, unknownPathBodyBytes, lim.ClientIdle, strangerBodyTimeout(lim))
		d, _ = s.route(r, body)
		s.writeError(w, d, &Error{Status: http.StatusNotFound, Kind: ErrNotFound, Message: fmt.Sprintf("floe serves no %s %s", r.Method, r.URL.Path)})
		return
	}
	if op != OpModels && r.Method != http.MethodPost {
		s.writeError(w, d, &Error{Status: http.StatusNotFound, Kind: ErrNotFound, Message: fmt.Sprintf("floe serves no %s %s", r.Method, r.URL.Path)})
		return
	}
	// The key is checked before any slot is taken or any of the body is read: a caller
	// without a live session's key holds nothing of floe, however slowly it sends.
	session, aerr := s.authenticate(r, d)
	if aerr != nil {
		s.writeError(w, d, aerr)
		return
	}
	markAuthenticated(r.Context())
	// The body is read before the call takes a slot (proxy/admit.go).
	body, release, ok := s.admit(w, raw, r, d, op, session, limit, lim)
	if !ok {
		return
	}
	defer release()
	ctx := WithSession(WithUpstreamTimeouts(r.Context(), lim.upstream()), upstreamSessionID(session, d.Key(r)), s.SessionHeader)
	switch op {
	case OpModels:
		models, err := s.Engine.Models(ctx)
		if err != nil {
			s.fail(w, d, err)
			return
		}
		d.WriteModels(w, models)
		return
	case OpCount:
		counter, ok := d.(TokenCounter)
		if !ok {
			s.writeError(w, d, &Error{Status: http.StatusNotFound, Kind: ErrNotFound, Message: "this API has no token counting"})
			return
		}
		req, err := s.decode(d, r, body, lim)
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
	req, err := s.decode(d, r, body, lim)
	if err != nil {
		s.fail(w, d, err)
		return
	}
	s.generate(w, r, d, req, session, storedRequest(body, lim.StoredRequestBytes), dw, lim)
}

// upstreamSessionID is how a call's session is named upstream (to a replica pool and in
// the session header): its id, or, for a session whose id is its caller's key (one
// opened by -open-sessions), a digest of it, since the key must never leave floe.
func upstreamSessionID(session, key string) string {
	if session != key {
		return session
	}
	sum := sha256.Sum256([]byte("floe-session\x00" + session))
	return "sess-" + hex.EncodeToString(sum[:12])
}

// healthz answers ok, or 503 with the reason while the store cannot write (its last write
// failed, or Health says so).
func (s *Server) healthz(w http.ResponseWriter) {
	reason := ""
	if s.Health != nil {
		if err := s.Health(); err != nil {
			reason = err.Error()
		}
	}
	if p := s.storeErr.Load(); p != nil && reason == "" {
		reason = *p
	}
	if reason != "" {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = io.WriteString(w, "unavailable: "+reason+"\n")
		return
	}
	w.WriteHeader(http.StatusOK)
	_, _ = io.WriteString(w, "ok\n")
}

// storeFailed notes whether the last write to the store failed, for /healthz. The
// reason names no session or path: the harness can read /healthz.
func (s *Server) storeFailed(err error) {
	if err == nil {
		if s.storeErr.Load() != nil {
			s.storeErr.Store(nil)
		}
		return
	}
	if errors.Is(err, trace.ErrSessionFinished) || errors.Is(err, trace.ErrUnknownSession) ||
		errors.Is(err, trace.ErrInvalidCall) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return // the call's fault, not the store's
	}
	reason := "the trace store cannot write (floe's log says why)"
	if errors.Is(err, syscall.ENOSPC) {
		reason = "the trace store cannot write: no space left on device"
	}
	s.storeErr.Store(&reason)
}

// authenticate resolves the caller's key to its session before anything goes upstream.
// An unknown key, and the key of a session that was finished (completed, failed or timed
// out), are refused with the provider's authentication error (401, which SDKs do not
// retry); the answer names no session and no path.
func (s *Server) authenticate(r *http.Request, d Dialect) (string, *Error) {
	unknown := &Error{Status: http.StatusUnauthorized, Kind: ErrAuthentication,
		Message: "unknown API key: use the api_key of a session created for this rollout"}
	k := d.Key(r)
	if k == "" {
		return "", unknown
	}
	sess, err := s.Sessions.Resolve(k)
	switch {
	case err == nil && sess.Running():
		return sess.ID, nil
	case err == nil:
		return "", &Error{Status: http.StatusUnauthorized, Kind: ErrAuthentication,
			Message: "this API key's session has finished and takes no more calls"}
	case !errors.Is(err, trace.ErrUnknownSession):
		s.log().Error("resolving an API key", "err", err)
		return "", &Error{Status: http.StatusServiceUnavailable, Kind: ErrOverloaded,
			Message: "floe cannot check the API key now; its log says why"}
	case !s.OpenSessions:
		return "", unknown
	}
	id, err := s.Sessions.Open(k)
	if err != nil {
		s.log().Error("opening a session", "err", err)
		return "", unknown
	}
	return id, nil
}

// fail writes err in the caller's shape; anything that is not an *Error is floe's own
// failure and is logged, never shown as a stack trace.
func (s *Server) fail(w http.ResponseWriter, d Dialect, err error) {
	var e *Error
	switch {
	case errors.As(err, &e):
	case errors.Is(err, trace.ErrSessionFinished):
		// The session finished (or timed out) while its call was in flight: the call is
		// not recorded, and the key takes no more calls. An authentication error, as for
		// any later call with the key, and not a 5xx that SDKs retry.
		s.log().Warn("a call ended after its session finished", "err", err)
		e = &Error{Status: http.StatusUnauthorized, Kind: ErrAuthentication, Message: "this API key's session has finished and takes no more calls"}
	default:
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
// before the harness sees its end. body is the request as stored (storedRequest); dw,
// when set, is w's write-deadline wrapper.
func (s *Server) generate(w http.ResponseWriter, r *http.Request, d Dialect, req *Request, session string, body []byte,
	dw *deadlineWriter, lim Limits) {
	ctx := r.Context()
	started := s.now()
	s.applySampling(d, req)
	var version int64
	if s.Gate != nil {
		c, v, leave, err := s.Gate.Admit(ctx)
		if errors.Is(err, ErrPauseExpired) { // -max-pause: refused, so that its SDK backs off
			w.Header().Set("Retry-After", "5")
			s.writeError(w, d, pauseExpiredError())
			return
		}
		if err != nil {
			return // the caller went away while paused
		}
		defer leave()
		ctx, version = c, v
	}
	upCtx := WithSession(WithUpstreamTimeouts(ctx, lim.upstream()), upstreamSessionID(session, d.Key(r)), s.SessionHeader)
	rec := func(res *Result, problem string) error {
		// The caller's context, not the call's: a call the upstream finished is recorded
		// even if a drain cut it off just after.
		return s.record(r.Context(), d, req, res, session, version, started, body, problem)
	}
	// recFailed records a call that ended early, with what it generated (nothing, if it
	// has no choices), as untrainable; it outlives the call's context.
	recFailed := func(res *Result, problem string) {
		if res == nil || len(res.Response.Choices) == 0 {
			res = &Result{Response: Response{Choices: []Choice{{Message: ChatMessage{Role: "assistant", Content: ""}}}}}
		}
		if err := s.record(context.WithoutCancel(ctx), d, req, res, session, version, started, body, problem); err != nil {
			s.log().Error("recording an aborted call", "err", err)
		}
	}
	if !req.Stream {
		res, err := s.Engine.Complete(upCtx, &req.Chat)
		var timeout *Error
		switch {
		case err == nil:
		case ctx.Err() != nil:
			reason, e := abortReason(ctx, dw, lim)
			if e != nil { // drained: the caller is still there
				recFailed(nil, reason)
				s.writeError(w, d, e)
			}
			return
		case errors.As(err, &timeout) && timeout.Kind == ErrTimeout:
			recFailed(nil, "upstream timeout: "+timeout.Message)
			s.writeError(w, d, timeout)
			return
		default:
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
		// Sent before the call lets go of the gate, as a streamed answer's end is.
		batchingWriter{w}.flushNow()
		return
	}
	sink := &streamSink{w: batchingWriter{w}, d: d, req: req}
	res, err := s.Engine.Stream(upCtx, &req.Chat, sink)
	stream := sink.stream
	// The last events (or the error) leave before the call lets go of the gate: a weight
	// sync's pause returns only once every call in flight has been answered whole, not
	// when net/http gets round to the chunked encoding's end after the handler returns.
	defer sink.Flush()
	var timeout *Error
	switch {
	case errors.Is(err, ErrCallerGone) || ctx.Err() != nil:
		// Record what was generated: the tokens were sampled, but the harness never saw
		// the whole answer, so they are not trained on.
		reason, e := abortReason(ctx, dw, lim)
		if e == nil { // the caller is gone
			if res != nil && len(res.Response.Choices) > 0 {
				recFailed(res, reason)
			}
			return
		}
		recFailed(res, reason)
		s.countError(d, e.Kind)
		if stream == nil {
			d.WriteError(w, e)
		} else {
			_ = stream.Fail(e)
		}
		return
	case err != nil:
		if errors.As(err, &timeout) && timeout.Kind == ErrTimeout {
			recFailed(res, "upstream timeout: "+timeout.Message)
		} else if res != nil && len(res.Response.Choices) > 0 {
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
		switch {
		case stream == nil:
			s.fail(w, d, err)
		case errors.Is(err, trace.ErrSessionFinished):
			s.log().Warn("a streamed call ended after its session finished", "err", err)
			s.countError(d, ErrAuthentication)
			_ = stream.Fail(&Error{Status: http.StatusUnauthorized, Kind: ErrAuthentication, Message: "this API key's session has finished and takes no more calls"})
		default:
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
	if err := stream.End(c.Finish(), res.Response.Usage); err != nil {
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
	samplingProblem := untrainableSampling(&req.Chat, s.TrainTruncated)
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
			Request: body, UpstreamRequest: validUTF8(res.Upstream), Response: msg,
		}
		switch {
		case problem != "":
			c.MarkUntrainable(problem)
		case td.Problem != "":
			c.MarkUntrainable(td.Problem)
		default:
			if err := c.Validate(); err != nil {
				c.MarkUntrainable(err.Error())
			} else if samplingProblem != "" {
				c.MarkUntrainable(samplingProblem)
			}
		}
		switch {
		case c.Trainable:
		case samplingProblem != "" && c.UntrainableReason == samplingProblem:
			// The harness's choice, not a fault: said once, counted by the metrics.
			if s.warnedSampling.CompareAndSwap(false, true) {
				s.log().Warn("calls are recorded untrainable for how they were sampled (this is logged once; floe_calls_recorded_total counts them)",
					"session", session, "reason", c.UntrainableReason)
			}
		default:
			s.log().Warn("call recorded as untrainable", "session", session, "reason", c.UntrainableReason)
		}
		err := s.Recorder.Record(ctx, &c)
		s.storeFailed(err)
		if err != nil {
			return fmt.Errorf("recording a call of session %s: %w", session, err)
		}
		s.charge(session, &c) // -max-session-bytes
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
