package proxy

import (
	"context"
	"fmt"
	"sync"
)

// Gate holds upstream calls back during a weight sync. Pause stops new calls (they wait
// in Enter) and waits for those in flight; Resume releases the waiting calls under a new
// policy version, which every call made after it records.
type Gate struct {
	// Persist, when set, records a new policy version durably before Resume applies it;
	// if it fails, Resume fails and the gate stays as it was.
	Persist func(version int64) error

	mu       sync.Mutex
	paused   bool
	version  int64
	inflight int
	changed  chan struct{} // closed and replaced on every change
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

// Enter waits while the gate is paused, then admits one call; the call must call leave
// when its upstream request is over. It returns the policy version the call runs under.
func (g *Gate) Enter(ctx context.Context) (version int64, leave func(), err error) {
	for {
		g.mu.Lock()
		if !g.paused {
			g.inflight++
			v := g.version
			g.mu.Unlock()
			var once sync.Once
			return v, func() {
				once.Do(func() {
					g.mu.Lock()
					g.inflight--
					g.notify()
					g.mu.Unlock()
				})
			}, nil
		}
		ch := g.wait()
		g.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return 0, nil, fmt.Errorf("waiting for the weight sync to end: %w", ctx.Err())
		}
	}
}

// Pause stops admitting calls and waits until none is in flight, or until ctx ends (the
// gate stays paused then). It returns the current policy version.
func (g *Gate) Pause(ctx context.Context) (int64, error) {
	g.mu.Lock()
	g.paused = true
	g.notify()
	for g.inflight > 0 {
		ch := g.wait()
		n := g.inflight
		g.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return 0, fmt.Errorf("pause: %d calls still in flight: %w", n, ctx.Err())
		}
		g.mu.Lock()
	}
	v := g.version
	g.mu.Unlock()
	return v, nil
}

// Resume admits calls again under policy version v, which must not go backwards.
func (g *Gate) Resume(v int64) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if v < g.version {
		return fmt.Errorf("policy version %d is older than the current %d", v, g.version)
	}
	if g.Persist != nil && v != g.version {
		if err := g.Persist(v); err != nil {
			return fmt.Errorf("recording policy version %d: %w", v, err)
		}
	}
	g.paused, g.version = false, v
	g.notify()
	return nil
}

// State reports whether the gate is paused, the policy version and the calls in flight.
func (g *Gate) State() (paused bool, version int64, inflight int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.paused, g.version, g.inflight
}
