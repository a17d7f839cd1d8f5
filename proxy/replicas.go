package proxy

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultHealthInterval is how often a Pool checks its replicas by default.
const DefaultHealthInterval = 5 * time.Second

// FailedChecksToMarkDown is how many health checks in a row a replica must fail before
// the checks mark it down: one check lost to a busy or restarting server's blip does not
// move its sessions off their prefix cache.
const FailedChecksToMarkDown = 2

// Replica is one inference server of a Pool: its base URL and the engine that talks to it.
type Replica struct {
	URL    string
	Engine Engine
}

// ReplicaMetrics receives a Pool's counts per replica, labelled by ReplicaLabel (never a
// secret). Its methods are called concurrently and must not block.
type ReplicaMetrics interface {
	// ReplicaCalled is called once per upstream call a replica was sent (each attempt of
	// a call that failed over counts on its own replica); failed says it failed for the
	// replica's sake (unreachable, a 5xx, a timeout, a broken stream), latency is set
	// when it answered.
	ReplicaCalled(upstream string, latency time.Duration, failed bool)
	// ReplicaFailover is called when a call leaves upstream for the next replica.
	ReplicaFailover(upstream string)
	// ReplicaHealth is called with every replica's state at start and on each change.
	ReplicaHealth(upstream string, healthy bool)
}

// ReplicaStatus is one replica as floe's status shows it.
type ReplicaStatus struct {
	URL     string `json:"url"`
	Healthy bool   `json:"healthy"`
	// Reason says why it is down, when it is.
	Reason string `json:"reason,omitempty"`
}

// Pool is the proxy's Engine over several inference replicas. A session's calls stick to
// one replica, for its prefix cache: rendezvous (highest-random-weight) hashing of the
// session id over the healthy replicas, so that a replica going down moves only its own
// sessions, and they come back when it recovers.
//
// A call fails over only while nothing of its answer has reached the caller, and what a
// request can provoke costs at most one extra replica: a replica that could not be
// reached (the dial failed: the request never left floe) is marked down and the call
// goes on to the next, through every candidate; an answer the request may have caused
// (a 5xx, a 429 or 503, the connection dropped after the request was sent, a stream
// broken before its first delta) moves the call to the next replica once per call and
// marks nothing down. A connection dropped with no answer (most often the keep-alive
// race) is first retried once on the same replica; when that retry cannot connect, the
// replica is marked down and the next one is the call's one fail-over (the request may
// be what killed it). Health checks mark a replica down after FailedChecksToMarkDown
// failures in a row, and up after one pass.
//
// What a harness sends never chooses a replica: the session id is floe's, not the
// caller's. A replica is marked down only when it cannot be connected to or fails its
// checks, so a request can take a replica away from the other sessions only by killing
// its server, and then only the replicas it reached: two at most.
type Pool struct {
	replicas []*replica
	// HealthInterval is how often Run checks every replica's GET /health; 0:
	// DefaultHealthInterval; negative: no checks (and no replica is ever marked down).
	HealthInterval time.Duration
	// Client makes the health checks; nil: http.DefaultClient.
	Client  *http.Client
	Metrics ReplicaMetrics
	Log     *slog.Logger
}

type replica struct {
	Replica
	label   string
	healthy atomic.Bool
	mu      sync.Mutex
	reason  string
	// failedChecks counts the health checks failed since the last pass.
	failedChecks int
}

// NewPool returns the pool of replicas, all healthy until a call or a check says
// otherwise. It refuses none, or two with the same URL.
func NewPool(replicas ...Replica) (*Pool, error) {
	if len(replicas) == 0 {
		return nil, errors.New("a pool needs at least one replica")
	}
	p := &Pool{}
	seen := map[string]bool{}
	for _, r := range replicas {
		label := ReplicaLabel(r.URL)
		if seen[label] {
			return nil, fmt.Errorf("replica %s is given twice", label)
		}
		seen[label] = true
		rp := &replica{Replica: r, label: label}
		rp.healthy.Store(true)
		p.replicas = append(p.replicas, rp)
	}
	return p, nil
}

var _ Engine = (*Pool)(nil)

// ReplicaLabel is a replica's URL as metrics, logs and the status show it: scheme, host
// and path only, so that credentials in its user info or query never leave floe.
func ReplicaLabel(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return "invalid-url"
	}
	return u.Scheme + "://" + u.Host + strings.TrimRight(u.Path, "/")
}

func (p *Pool) log() *slog.Logger {
	if p.Log == nil {
		return slog.Default()
	}
	return p.Log
}

// weight is the session's rendezvous weight on a replica: a hash of both, mixed so that
// near-equal inputs give unrelated weights.
func weight(session, label string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(label))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(session))
	x := h.Sum64()
	// splitmix64's finalizer
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// Order returns the replicas' labels in session's rendezvous order, healthy or not.
func (p *Pool) Order(session string) []string {
	var out []string
	for _, r := range p.order(session) {
		out = append(out, r.label)
	}
	return out
}

func (p *Pool) order(session string) []*replica {
	if len(p.replicas) == 1 {
		return p.replicas
	}
	type weighted struct {
		r *replica
		w uint64
	}
	ws := make([]weighted, len(p.replicas))
	for i, r := range p.replicas {
		ws[i] = weighted{r, weight(session, r.label)}
	}
	slices.SortFunc(ws, func(a, b weighted) int {
		switch {
		case a.w > b.w:
			return -1
		case a.w < b.w:
			return 1
		}
		return strings.Compare(a.r.label, b.r.label)
	})
	rs := make([]*replica, len(ws))
	for i, x := range ws {
		rs[i] = x.r
	}
	return rs
}

// candidates are the replicas a call of session tries, in turn: the healthy ones in its
// rendezvous order; when none is healthy, every one in that order, since a replica may
// have recovered since it was last checked.
func (p *Pool) candidates(session string) []*replica {
	all := p.order(session)
	var healthy []*replica
	for _, r := range all {
		if r.healthy.Load() {
			healthy = append(healthy, r)
		}
	}
	if len(healthy) == 0 {
		return all
	}
	return healthy
}

// Choose returns the label of the replica session's next call goes to first.
func (p *Pool) Choose(session string) string { return p.candidates(session)[0].label }

// Status returns every replica's health, in the order they were given.
func (p *Pool) Status() []ReplicaStatus {
	out := make([]ReplicaStatus, 0, len(p.replicas))
	for _, r := range p.replicas {
		r.mu.Lock()
		reason := r.reason
		r.mu.Unlock()
		ok := r.healthy.Load()
		if ok {
			reason = ""
		}
		out = append(out, ReplicaStatus{URL: r.label, Healthy: ok, Reason: reason})
	}
	return out
}

// SetHealthy marks the replica labelled label up or down (reason says why), as a check
// or a call found it.
func (p *Pool) SetHealthy(label string, healthy bool, reason string) {
	for _, r := range p.replicas {
		if r.label == label {
			p.mark(r, healthy, reason)
		}
	}
}

func (p *Pool) mark(r *replica, healthy bool, reason string) {
	if p.HealthInterval < 0 && !healthy {
		return // nothing would ever mark it up again
	}
	r.mu.Lock()
	r.reason = reason
	r.mu.Unlock()
	if r.healthy.Swap(healthy) == healthy {
		return
	}
	if healthy {
		p.log().Info("inference replica up", "upstream", r.label)
	} else {
		p.log().Warn("inference replica down", "upstream", r.label, "reason", reason)
	}
	if p.Metrics != nil {
		p.Metrics.ReplicaHealth(r.label, healthy)
	}
}

// Run checks every replica's GET /health each HealthInterval until ctx ends (at once
// with a negative interval). FailedChecksToMarkDown checks in a row that do not answer
// 200 within the interval mark the replica down; one that does marks it up.
func (p *Pool) Run(ctx context.Context) error {
	if p.Metrics != nil {
		for _, r := range p.replicas {
			p.Metrics.ReplicaHealth(r.label, r.healthy.Load())
		}
	}
	every := p.HealthInterval
	if every < 0 {
		<-ctx.Done()
		return nil
	}
	if every == 0 {
		every = DefaultHealthInterval
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		p.CheckAll(ctx, every)
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// CheckAll checks every replica at once, each within timeout, and returns once all have
// answered. A failed check marks its replica down when it is the FailedChecksToMarkDown-th
// in a row (or the replica is down already: the check's reason replaces the older one); a
// passing one marks it up.
func (p *Pool) CheckAll(ctx context.Context, timeout time.Duration) {
	var wg sync.WaitGroup
	for _, r := range p.replicas {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := p.check(ctx, r, timeout)
			if ctx.Err() != nil {
				return // stopping: a cancelled check says nothing of the replica
			}
			r.mu.Lock()
			if err != nil {
				r.failedChecks++
			} else {
				r.failedChecks = 0
			}
			failed := r.failedChecks
			r.mu.Unlock()
			switch {
			case err == nil:
				p.mark(r, true, "")
			case failed >= FailedChecksToMarkDown || !r.healthy.Load():
				p.mark(r, false, "health check: "+err.Error())
			}
		}()
	}
	wg.Wait()
}

func (p *Pool) check(ctx context.Context, r *replica, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(r.URL, "/")+"/health", nil)
	if err != nil {
		return err
	}
	c := p.Client
	if c == nil {
		c = http.DefaultClient
	}
	resp, err := c.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // the URL may hold credentials
		}
		return err
	}
	_ = resp.Body.Close() // only the status is wanted
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET /health answered %d", resp.StatusCode)
	}
	return nil
}

// UnreachableError is an upstream call's error when the request never reached the
// server: the dial failed (connection refused, no route, no connection within the
// connect timeout). Engines return it so that a Pool knows the replica, not the request,
// is at fault: it marks the replica down and fails over.
type UnreachableError struct{ Err *Error }

func (e *UnreachableError) Error() string { return e.Err.Error() }
func (e *UnreachableError) Unwrap() error { return e.Err }

// DroppedError is an upstream call's error when the connection broke before any answer
// came back (a reset, an EOF, the server closing the kept-alive connection the call was
// sent on). The request may never have been read: most often it is the keep-alive race,
// the server closing an idle connection (uvicorn's 5 s keep-alive) just as floe sends on
// it. It may also be the request's own doing, so it marks nothing down: a Pool retries
// the same replica once (the broken connection is gone, so the retry goes on another),
// then counts it as a failed answer, which fails over once.
type DroppedError struct{ Err *Error }

func (e *DroppedError) Error() string { return e.Err.Error() }
func (e *DroppedError) Unwrap() error { return e.Err }

// answerFailed says whether a call that failed with err, before any of its answer reached
// the caller, got an answer the request itself may have provoked but another replica may
// serve: a 5xx, a 429 or 503, a dropped connection (once retried), a stream broken
// before its first delta. A Pool sends such a call to one more replica, not more,
// and marks none down. A deadline is not one: it is the caller's to spend once, not once
// per replica.
func answerFailed(err error) bool {
	var e *Error
	if !errors.As(err, &e) {
		return false
	}
	return e.Kind == ErrUpstreamUnavailable || e.Kind == ErrOverloaded
}

// replicaFault says whether err counts against the replica in its metrics.
func replicaFault(err error) bool {
	var e *Error
	if !errors.As(err, &e) {
		return false
	}
	switch e.Kind {
	case ErrUpstreamUnavailable, ErrOverloaded, ErrTimeout:
		return true
	}
	return false
}

// try runs call on session's candidates in turn until one answers, or the call may not
// go on: the error is not one to fail over on, sent reports that some of the answer
// reached the caller, or the call has had its one extra replica for a failed answer
// (unreachable replicas, which the request never reached, do not count). So a request
// reaches at most two replicas that read it, and three calls: one retried after a
// dropped connection, one failed over.
func try[T any](p *Pool, ctx context.Context, sent func() bool, call func(context.Context, Engine) (T, error)) (T, error) {
	session, _ := SessionFrom(ctx)
	var (
		out T
		err error
	)
	cands := p.candidates(session)
	answerFailedOver, dropRetried := false, false
	retrying := false // this try is the retry of a dropped connection
	for i := 0; i < len(cands); {
		r := cands[i]
		start := time.Now()
		out, err = call(ctx, r.Engine)
		wasRetry := retrying
		retrying = false
		if err == nil {
			if p.Metrics != nil {
				p.Metrics.ReplicaCalled(r.label, time.Since(start), false)
			}
			return out, nil
		}
		if ctx.Err() != nil || errors.Is(err, ErrCallerGone) {
			return out, err // the caller went, or a weight sync cut the call off
		}
		var (
			un      *UnreachableError
			dropped *DroppedError
		)
		retry := errors.As(err, &dropped) && !dropRetried && (sent == nil || !sent())
		if p.Metrics != nil {
			// A dropped connection retried is most often the keep-alive race: the replica's
			// error only if the retry fails too.
			p.Metrics.ReplicaCalled(r.label, 0, !retry && replicaFault(err))
		}
		if sent != nil && sent() {
			return out, err
		}
		switch {
		case retry:
			dropRetried, retrying = true, true
			p.log().Debug("retrying the same inference replica after a dropped connection", "upstream", r.label, "err", err)
			continue
		case errors.As(err, &un) && wasRetry:
			// The replica dropped the call and is gone now: it may be the request that
			// killed it, so the next replica is the call's one fail-over, not a free one.
			p.mark(r, false, un.Err.Message)
			if answerFailedOver {
				return out, err
			}
			answerFailedOver = true
		case errors.As(err, &un):
			p.mark(r, false, un.Err.Message)
		case answerFailed(err) && !answerFailedOver:
			answerFailedOver = true
		default:
			return out, err
		}
		if i == len(cands)-1 {
			return out, err
		}
		if p.Metrics != nil {
			p.Metrics.ReplicaFailover(r.label)
		}
		p.log().Warn("failing over to the next inference replica", "from", r.label, "to", cands[i+1].label, "err", err)
		i++
	}
	return out, err
}

func (p *Pool) Complete(ctx context.Context, req *ChatRequest) (*Result, error) {
	return try(p, ctx, nil, func(ctx context.Context, e Engine) (*Result, error) { return e.Complete(ctx, req) })
}

// Stream fails over only while no delta has gone to sink: once one has, the caller's
// stream has begun and the call ends where it is.
func (p *Pool) Stream(ctx context.Context, req *ChatRequest, sink StreamSink) (*Result, error) {
	s := &sentSink{StreamSink: sink}
	return try(p, ctx, s.sent.Load, func(ctx context.Context, e Engine) (*Result, error) { return e.Stream(ctx, req, s) })
}

func (p *Pool) CountTokens(ctx context.Context, req *ChatRequest) (int, error) {
	return try(p, ctx, nil, func(ctx context.Context, e Engine) (int, error) { return e.CountTokens(ctx, req) })
}

// Models asks the session's first healthy replica (failing over as a call does).
func (p *Pool) Models(ctx context.Context) ([]string, error) {
	return try(p, ctx, nil, func(ctx context.Context, e Engine) ([]string, error) { return e.Models(ctx) })
}

// sentSink notes that a delta went to the caller's stream.
type sentSink struct {
	StreamSink
	sent atomic.Bool
}

func (s *sentSink) Delta(d Delta) error {
	s.sent.Store(true)
	return s.StreamSink.Delta(d)
}

// upstreamSession is the session an upstream call is made for, and the header that
// names it to the inference server (a router's affinity key; "" sends none).
type upstreamSession struct{ id, header string }

type sessionKey struct{}

// WithSession returns ctx carrying the session of the upstream calls made under it: a
// Pool routes them by it, and the engines send it in header (none when "") for a router
// in front of the replicas.
func WithSession(ctx context.Context, id, header string) context.Context {
	return context.WithValue(ctx, sessionKey{}, upstreamSession{id: id, header: header})
}

// SessionFrom returns the session ctx carries and the header to send it in.
func SessionFrom(ctx context.Context) (id, header string) {
	s, _ := ctx.Value(sessionKey{}).(upstreamSession)
	return s.id, s.header
}
