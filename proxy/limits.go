package proxy

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// Limits bound what one harness can hold of floe: the harness is the policy under
// training and runs arbitrary code, so no call of its own may stall floe for the others
// (the trainer's weight sync above all, which waits for the calls in flight). A zero
// field takes its default (DefaultLimits); a negative one means no limit.
type Limits struct {
	// UpstreamConnect bounds connecting to the inference server.
	UpstreamConnect time.Duration
	// UpstreamFirstByte bounds the wait from sending a call upstream to the first byte of
	// its answer's body. A non-streaming answer (and every SGLang call, which floe never
	// streams from upstream) arrives whole, so this bounds its whole generation.
	UpstreamFirstByte time.Duration
	// UpstreamIdle bounds the silence between two reads of an upstream answer's body once
	// it has begun (a stream's chunks).
	UpstreamIdle time.Duration
	// ClientIdle bounds each write to the caller: a harness that stops reading its answer
	// for this long is dropped, and its call is recorded as aborted (untrainable).
	ClientIdle time.Duration
	// MaxInflight caps the model calls served at once (from reading the body to the end of
	// the answer); a call past it is refused at once in its provider's overloaded shape.
	MaxInflight int
	// MaxInflightPerSession caps one session's calls served at once, so that one harness
	// cannot take all of MaxInflight from the others. An agent makes one call at a time,
	// or a few with parallel sub-agents.
	MaxInflightPerSession int
	// StoredRequestBytes bounds the caller's request as stored with each call
	// (trace.Call.Request): a larger body keeps only its top-level fields of at most
	// StoredFieldBytes, in order, up to this total, and says what it dropped under
	// "floe_truncated". The normalized request sent upstream, which holds everything the
	// model saw, is always stored whole.
	StoredRequestBytes int
	// BodyTimeout bounds the whole read of a request body, however steadily it trickles
	// (ClientIdle bounds only its silences). A body is read before the call takes its
	// MaxInflight slot, so a slow one holds none.
	BodyTimeout time.Duration
	// UnauthenticatedTimeout bounds a proxy connection from its accept to its first
	// request with a live session's key (ConnLimiter): a stranger's connection, idle or
	// trickling, is closed after it.
	UnauthenticatedTimeout time.Duration
	// MaxConns caps the proxy's connections (ConnLimiter); 0 derives the cap from the
	// process's descriptor limit (ConnCapFromNofile).
	MaxConns int
	// MaxN caps a request's n (choices per call): each is a whole generation upstream.
	MaxN int
	// MediaHosts are the hosts an image URL may name (host, or host:port); none: only
	// data: URLs pass, since the inference server would fetch any other (request forgery
	// from the inference host).
	MediaHosts []string
	// TemplateKwargs are the chat_template_kwargs keys a request may set; nil:
	// DefaultTemplateKwargs. An empty, non-nil list allows none.
	TemplateKwargs []string
	// MaxSessionBytes caps what one session stores (its calls' requests, answers and
	// tokens); past it the session's calls are refused. MinFreeDisk is the free space
	// (of the store's disk, Server.DiskFree) below which every call is refused before it
	// goes upstream. Both are 0 (off) unless set: floe serve sets them.
	MaxSessionBytes, MinFreeDisk int64
}

// StoredFieldBytes is the largest top-level field kept of a request over
// Limits.StoredRequestBytes.
const StoredFieldBytes = 64 << 10

// DefaultLimits are floe's defaults, chosen for long agent generations: a local
// inference server connects in milliseconds (10s is a dead server); a non-streamed
// answer of tens of thousands of tokens under load takes minutes (10m); a stream that
// has begun sends a chunk at least every few seconds, even with prefill of a long
// context queued behind it (2m); a live harness reads its stream as it comes (2m).
func DefaultLimits() Limits {
	return Limits{
		UpstreamConnect:        10 * time.Second,
		UpstreamFirstByte:      10 * time.Minute,
		UpstreamIdle:           2 * time.Minute,
		ClientIdle:             2 * time.Minute,
		MaxInflight:            1024,
		MaxInflightPerSession:  32,
		StoredRequestBytes:     1 << 20,
		BodyTimeout:            time.Minute,
		UnauthenticatedTimeout: 10 * time.Second,
		MaxN:                   16,
	}
}

// DefaultTemplateKwargs are the chat_template_kwargs keys a request may set by default:
// the reasoning switches floe's dialects set themselves. chat_template above all is
// refused (it replaces the whole template the model is trained under).
var DefaultTemplateKwargs = []string{"enable_thinking", "thinking"}

// withDefaults fills the zero fields from DefaultLimits and turns negative ones into 0
// (no limit).
func (l Limits) withDefaults() Limits {
	d := DefaultLimits()
	dur := func(v, def time.Duration) time.Duration {
		switch {
		case v == 0:
			return def
		case v < 0:
			return 0
		}
		return v
	}
	num := func(v, def int) int {
		switch {
		case v == 0:
			return def
		case v < 0:
			return 0
		}
		return v
	}
	return Limits{
		UpstreamConnect:        dur(l.UpstreamConnect, d.UpstreamConnect),
		UpstreamFirstByte:      dur(l.UpstreamFirstByte, d.UpstreamFirstByte),
		UpstreamIdle:           dur(l.UpstreamIdle, d.UpstreamIdle),
		ClientIdle:             dur(l.ClientIdle, d.ClientIdle),
		MaxInflight:            num(l.MaxInflight, d.MaxInflight),
		MaxInflightPerSession:  num(l.MaxInflightPerSession, d.MaxInflightPerSession),
		StoredRequestBytes:     num(l.StoredRequestBytes, d.StoredRequestBytes),
		BodyTimeout:            dur(l.BodyTimeout, d.BodyTimeout),
		UnauthenticatedTimeout: dur(l.UnauthenticatedTimeout, d.UnauthenticatedTimeout),
		MaxConns:               l.MaxConns,
		MaxN:                   num(l.MaxN, d.MaxN),
		MediaHosts:             l.MediaHosts,
		TemplateKwargs:         l.TemplateKwargs,
		MaxSessionBytes:        max(l.MaxSessionBytes, 0),
		MinFreeDisk:            max(l.MinFreeDisk, 0),
	}
}

func (l Limits) upstream() UpstreamTimeouts {
	return UpstreamTimeouts{Connect: l.UpstreamConnect, FirstByte: l.UpstreamFirstByte, Idle: l.UpstreamIdle}
}

// UpstreamTimeouts are the deadlines of one upstream call, carried in its context from
// the Server to the engine (WithUpstreamTimeouts); 0 is no limit.
type UpstreamTimeouts struct {
	Connect, FirstByte, Idle time.Duration
}

type timeoutsKey struct{}

// WithUpstreamTimeouts returns ctx carrying t for the upstream calls made under it.
func WithUpstreamTimeouts(ctx context.Context, t UpstreamTimeouts) context.Context {
	return context.WithValue(ctx, timeoutsKey{}, t)
}

// UpstreamTimeoutsFrom returns the timeouts ctx carries (none: all zero).
func UpstreamTimeoutsFrom(ctx context.Context) UpstreamTimeouts {
	t, _ := ctx.Value(timeoutsKey{}).(UpstreamTimeouts)
	return t
}

// TimeoutError is the error an upstream call that ran past one of its deadlines ends
// with: 504, which every provider's SDK reads as a gateway timeout (Anthropic's
// timeout_error, OpenAI's server_error with code timeout, Gemini's DEADLINE_EXCEEDED).
// SDKs retry it a bounded number of times with backoff, and these deadlines are minutes
// long, so a hung upstream never becomes a storm of retries.
func TimeoutError(what string, after time.Duration, flag string) *Error {
	return &Error{Status: http.StatusGatewayTimeout, Kind: ErrTimeout,
		Message: fmt.Sprintf("the inference server %s within %s (floe's -%s)", what, after, flag)}
}

// ErrDrained is the cause a call is cancelled with when a weight sync's pause outlasted
// the gate's DrainTimeout.
var ErrDrained = errors.New("cut off by a weight sync: the call was still in flight when the drain timeout ran out")

// drainedError is what a caller whose call was cut off by a weight sync sees: an
// overloaded error, which SDKs retry after a backoff, by when the new weights serve.
func drainedError() *Error {
	return &Error{Status: http.StatusServiceUnavailable, Kind: ErrOverloaded,
		Message: "floe cut this call off for a weight sync of the model; retry it"}
}

// capacityError is what a call past MaxInflight sees.
func capacityError(max int) *Error {
	return &Error{Kind: ErrCapacity, Message: fmt.Sprintf("floe is serving its maximum of %d concurrent calls; retry shortly", max)}
}

func sessionCapacityError(max int) *Error {
	return &Error{Kind: ErrCapacity, Message: fmt.Sprintf("this API key already has its maximum of %d calls in flight; retry shortly", max)}
}

// unknownPathBodyBytes is as much of a request to a path floe does not serve as is read
// to shape its 404.
const unknownPathBodyBytes = 64 << 10

// deadlineWriter sets a write deadline before each write to the caller, so that a
// harness that stops reading its answer is dropped after Limits.ClientIdle instead of
// holding its call (and with it a weight sync) for ever. The deadline is moved forward
// at most every eighth of the limit, so a write always has at least 7/8 of it. The
// deadline also bounds what net/http writes after the handler returns (the end of a
// chunked answer); net/http then clears it before the connection's next request.
type deadlineWriter struct {
	http.ResponseWriter
	rc       *http.ResponseController
	limit    time.Duration
	next     int64 // unix nanoseconds after which the deadline is moved again
	timedOut atomic.Bool
}

func newDeadlineWriter(w http.ResponseWriter, limit time.Duration) *deadlineWriter {
	d := &deadlineWriter{ResponseWriter: w, rc: http.NewResponseController(w), limit: limit}
	d.arm()
	return d
}

func (d *deadlineWriter) arm() {
	now := time.Now()
	if now.UnixNano() < d.next {
		return
	}
	if d.rc.SetWriteDeadline(now.Add(d.limit)) != nil {
		d.next = 1<<63 - 1 // the connection has no deadlines (a test recorder): never try again
		return
	}
	d.next = now.Add(d.limit / 8).UnixNano()
}

func (d *deadlineWriter) check(err error) {
	if err != nil && errors.Is(err, os.ErrDeadlineExceeded) {
		d.timedOut.Store(true)
	}
}

func (d *deadlineWriter) Write(p []byte) (int, error) {
	d.arm()
	n, err := d.ResponseWriter.Write(p)
	d.check(err)
	return n, err
}

func (d *deadlineWriter) WriteHeader(code int) {
	d.arm()
	d.ResponseWriter.WriteHeader(code)
}

func (d *deadlineWriter) Flush() {
	d.arm()
	d.check(d.rc.Flush())
}

func (d *deadlineWriter) Unwrap() http.ResponseWriter { return d.ResponseWriter }

// inflight is the MaxInflight counter.
type inflight struct{ n atomic.Int64 }

func (c *inflight) acquire(max int) bool {
	if max <= 0 {
		return true
	}
	if c.n.Add(1) > int64(max) {
		c.n.Add(-1)
		return false
	}
	return true
}

func (c *inflight) release(max int) {
	if max > 0 {
		c.n.Add(-1)
	}
}

// sessionInflight counts each session's calls in flight.
type sessionInflight struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *sessionInflight) acquire(session string, max int) bool {
	if max <= 0 {
		return true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n[session] >= max {
		return false
	}
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[session]++
	return true
}

func (c *sessionInflight) release(session string, max int) {
	if max <= 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n[session]--; c.n[session] <= 0 {
		delete(c.n, session)
	}
}
