package proxy

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// DefaultDrainTimeout is how long Pause waits for the calls in flight by default.
const DefaultDrainTimeout = 60 * time.Second

// Gate holds upstream calls back during a weight sync. Pause stops new calls (they wait
// in Admit) and waits for those in flight, at most DrainTimeout: then it cancels the
// stragglers (their upstream requests end, and they are recorded untrainable) and
// returns, so that no single harness ever holds a weight sync. Resume releases the
// waiting calls under a new policy version, which every call made after it records.
//
// The gate does not own the policy version: its owner (sidecar.Node) records each one
// durably and then tells the gate through Resume; the gate keeps a copy to stamp calls.
type Gate struct {
	// DrainTimeout bounds Pause's wait for the calls in flight; 0: DefaultDrainTimeout;
	// negative: no bound.
	DrainTimeout time.Duration
	// MaxPause bounds a pause: once one has lasted this long without a resume (a trainer
	// that crashed between pause and resume), the gate stops holding calls. Those waiting
	// in Admit and every new one fail with ErrPauseExpired at once, which the proxy
	// answers with its provider's overloaded error so that harnesses back off, and
	// OnPauseExpired is called once. 0 or negative: a pause holds calls for ever.
	MaxPause time.Duration
	// OnPauseExpired, when set, is called (from a timer's goroutine, without the gate's
	// lock) when a pause outlasts MaxPause, with how long it has lasted.
	OnPauseExpired func(paused time.Duration)

	mu       sync.Mutex
	paused   bool
	pausedAt time.Time
	expired  bool        // the pause has outlasted MaxPause
	expiry   *time.Timer // fires at pausedAt + MaxPause; nil when not armed
	version  int64
	calls    map[*admitted]struct{} // in flight
	drained  int64                  // calls cut off by a drain timeout, ever
	changed  chan struct{}          // closed and replaced on every change
}

// admitted is one call in flight.
type admitted struct {
	cancel context.CancelCauseFunc
}

func (g *Gate) notify() {
	if g.changed != nil {
		close(g.changed)
	}
	g.changed = make(chan struct{})
}

func (g *Gate) wait() <-chan struct{} {
	if g.changed == nil {
		g.changed = make(chan struct{})
	}
	return g.changed
}

// Admit waits while the gate is paused, then admits one call; the call must run under the
// returned context and call leave when its upstream request is over. It returns the
// policy version the call runs under. The context is cancelled with cause ErrDrained when
// a pause's DrainTimeout runs out before the call leaves.
func (g *Gate) Admit(ctx context.Context) (callCtx context.Context, version int64, leave func(), err error) {
	for {
		g.mu.Lock()
		if !g.paused {
			callCtx, cancel := context.WithCancelCause(ctx)
			a := &admitted{cancel: cancel}
			if g.calls == nil {
				g.calls = map[*admitted]struct{}{}
			}
			g.calls[a] = struct{}{}
			v := g.version
			g.mu.Unlock()
			var once sync.Once
			return callCtx, v, func() {
				once.Do(func() {
					g.mu.Lock()
					if _, ok := g.calls[a]; ok {
						delete(g.calls, a)
						g.notify()
					}
					g.mu.Unlock()
					cancel(nil)
				})
			}, nil
		}
		if g.expired {
			since := time.Since(g.pausedAt).Round(time.Second)
			g.mu.Unlock()
			return nil, 0, nil, fmt.Errorf("paused for %s: %w", since, ErrPauseExpired)
		}
		ch := g.wait()
		g.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, 0, nil, fmt.Errorf("waiting for the weight sync to end: %w", ctx.Err())
		}
	}
}

// Pause stops admitting calls and waits until none is in flight, or until DrainTimeout:
// then it cancels those left (with cause ErrDrained) and returns. If ctx ends first, it
// returns ctx's error and the gate stays paused. It returns the current policy version.
func (g *Gate) Pause(ctx context.Context) (int64, error) {
	g.mu.Lock()
	if !g.paused {
		g.paused, g.pausedAt, g.expired = true, time.Now(), false
		g.armExpiry()
	}
	g.notify()
	var timeout <-chan time.Time
	if d := g.drainTimeout(); d > 0 && len(g.calls) > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		timeout = t.C
	}
	for len(g.calls) > 0 {
		ch := g.wait()
		n := len(g.calls)
		g.mu.Unlock()
		select {
		case <-ch:
		case <-timeout:
			g.mu.Lock()
			for a := range g.calls {
				a.cancel(ErrDrained)
				delete(g.calls, a)
				g.drained++
			}
			g.notify()
			g.mu.Unlock()
		case <-ctx.Done():
			return 0, fmt.Errorf("pause: %d calls still in flight: %w", n, ctx.Err())
		}
		g.mu.Lock()
	}
	v := g.version
	g.mu.Unlock()
	return v, nil
}

func (g *Gate) drainTimeout() time.Duration {
	switch {
	case g.DrainTimeout == 0:
		return DefaultDrainTimeout
	case g.DrainTimeout < 0:
		return 0
	}
	return g.DrainTimeout
}

// Resume admits calls again under policy version v, which must not go backwards.
func (g *Gate) Resume(v int64) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if v < g.version {
		return fmt.Errorf("policy version %d is older than the current %d: %w", v, g.version, ErrOlderVersion)
	}
	g.paused, g.version, g.expired = false, v, false
	if g.expiry != nil {
		g.expiry.Stop()
		g.expiry = nil
	}
	g.notify()
	return nil
}

// ErrOlderVersion is what Resume fails with for a policy version older than the current
// one: versions never go backwards.
var ErrOlderVersion = errors.New("policy versions never go backwards")

// ErrPauseExpired is what Admit fails with while a pause has outlasted MaxPause.
var ErrPauseExpired = errors.New("the weight sync's pause outlasted its maximum (floe's -max-pause): the trainer has not resumed")

// armExpiry starts the MaxPause timer of a pause that just began; g.mu is held. The
// timer is the gate's: Resume stops it, and one that fires after a resume (or for an
// earlier pause) finds its pause over and does nothing.
func (g *Gate) armExpiry() {
	if g.MaxPause <= 0 {
		return
	}
	if g.expiry != nil {
		g.expiry.Stop()
	}
	began := g.pausedAt
	g.expiry = time.AfterFunc(g.MaxPause, func() {
		g.mu.Lock()
		if !g.paused || !g.pausedAt.Equal(began) || g.expired {
			g.mu.Unlock()
			return
		}
		g.expired = true
		g.notify() // the calls waiting in Admit fail now
		g.mu.Unlock()
		if g.OnPauseExpired != nil {
			g.OnPauseExpired(time.Since(began))
		}
	})
}

// PauseExpired reports whether the gate is paused and the pause has outlasted MaxPause.
func (g *Gate) PauseExpired() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.paused && g.expired
}

// PausedFor is how long the current pause has lasted (0 when not paused).
func (g *Gate) PausedFor() time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.paused {
		return 0
	}
	return time.Since(g.pausedAt)
}

// State reports whether the gate is paused, the policy version and the calls in flight.
func (g *Gate) State() (paused bool, version int64, inflight int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.paused, g.version, len(g.calls)
}

// Drained is how many calls pauses have cut off at their drain timeout.
func (g *Gate) Drained() int64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.drained
}
