// Package sidecar is floe's composition root: it wires the batcher, the Flight service and
// (as they land) the proxy, the trace store and the GPU monitor into one process, and owns
// what none of them should: the clock, the READY buffer of formed steps, lifecycle.
package sidecar

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/floe-rl/floe/arrowflight"
)

// Ready is the READY buffer: formed steps waiting for the trainer, at most Ahead of them
// uncommitted. The producer blocks in Put while it is full (backpressure: nothing is
// dropped); the trainer takes steps by number and commits each exactly once.
type Ready struct {
	ahead int

	mu        sync.Mutex
	changed   chan struct{} // closed and replaced on every change, to wake waiters
	steps     map[int64]arrowflight.Step
	committed map[int64]bool
	// committing holds the steps whose commit the Node is making durable now, outside
	// the lock: the disk write must not hold Step, Next, Put or Status behind it.
	committing map[int64]bool
	first      int64 // number of the first step this buffer holds
	next       int64 // number of the next step Put accepts
	end        int64 // no step at or past end will be formed; -1 while unknown
	closed     bool
}

// NewReady returns an empty buffer of at most ahead uncommitted steps, whose first step
// will be number first; the steps below first count as committed (a restarted floe
// resumes after them).
func NewReady(ahead int, first int64) *Ready {
	return &Ready{
		ahead: max(ahead, 1), changed: make(chan struct{}), first: first, next: first, end: -1,
		steps: map[int64]arrowflight.Step{}, committed: map[int64]bool{}, committing: map[int64]bool{},
	}
}

func (r *Ready) notify() {
	close(r.changed)
	r.changed = make(chan struct{})
}

// NextNumber is the number the next formed step must carry.
func (r *Ready) NextNumber() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.next
}

// Put adds the next step, waiting while the buffer is full.
func (r *Ready) Put(ctx context.Context, st arrowflight.Step) error {
	for {
		r.mu.Lock()
		switch {
		case r.closed:
			r.mu.Unlock()
			return fmt.Errorf("READY buffer: put step %d after close", st.Number())
		case r.end >= 0 && st.Number() >= r.end:
			r.mu.Unlock()
			return fmt.Errorf("READY buffer: put step %d past the declared end %d", st.Number(), r.end)
		case st.Number() != r.next:
			n := r.next
			r.mu.Unlock()
			return fmt.Errorf("READY buffer: put step %d, want step %d", st.Number(), n)
		case len(r.steps) < r.ahead:
			r.steps[st.Number()] = st
			r.next++
			r.notify()
			r.mu.Unlock()
			return nil
		}
		ch := r.changed
		r.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("READY buffer: waiting for room for step %d: %w", st.Number(), ctx.Err())
		}
	}
}

// Close says no more steps will come: waiters for later steps get ErrNoSuchStep.
func (r *Ready) Close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	r.end = r.next
	r.notify()
}

// Skip records that step n, the next number, was committed before a restart: it is never
// formed or served again.
func (r *Ready) Skip(n int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if n != r.next {
		return fmt.Errorf("READY buffer: skip step %d, want step %d", n, r.next)
	}
	r.committed[n] = true
	r.next++
	r.notify()
	return nil
}

// Shutdown closes the buffer and releases every step it still holds; later requests
// for them get ErrNoSuchStep. Call it once nothing serves from the buffer any more.
func (r *Ready) Shutdown() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for n, st := range r.steps {
		st.Release()
		delete(r.steps, n)
	}
	r.closed = true
	r.end = r.next
	r.notify()
}

// EndAt says no step numbered end or later will be formed, so requests for them fail at
// once instead of waiting; a source that knows its length calls it up front.
func (r *Ready) EndAt(end int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.end = end
	r.notify()
}

// Step returns step n once READY.
func (r *Ready) Step(ctx context.Context, n int64) (arrowflight.Step, error) {
	return r.wait(ctx, func() (arrowflight.Step, error) {
		if r.committed[n] {
			return nil, fmt.Errorf("step %d was committed: %w", n, arrowflight.ErrCommitted)
		}
		if st, ok := r.steps[n]; ok {
			return st, nil
		}
		if n < r.first {
			return nil, fmt.Errorf("step %d was committed (before a restart): %w", n, arrowflight.ErrCommitted)
		}
		if r.end >= 0 && n >= r.end {
			return nil, fmt.Errorf("step %d: %w: steps end at %d", n, arrowflight.ErrNoSuchStep, r.end-1)
		}
		return nil, nil
	})
}

// Next returns the oldest uncommitted step once READY.
func (r *Ready) Next(ctx context.Context) (arrowflight.Step, error) {
	return r.wait(ctx, func() (arrowflight.Step, error) {
		// A step being committed is on its way out: the next one is the oldest after it
		// (if its commit fails it is READY again, and the waiters are woken).
		for _, n := range r.readyLocked() {
			if !r.committing[n] {
				return r.steps[n], nil
			}
		}
		if r.closed && len(r.steps) == 0 {
			return nil, fmt.Errorf("next step: %w: every step up to %d was committed", arrowflight.ErrNoSuchStep, r.next-1)
		}
		return nil, nil
	})
}

// wait calls try under the lock until it returns a step or an error, or ctx ends.
func (r *Ready) wait(ctx context.Context, try func() (arrowflight.Step, error)) (arrowflight.Step, error) {
	for {
		r.mu.Lock()
		st, err := try()
		ch := r.changed
		r.mu.Unlock()
		if st != nil || err != nil {
			return st, err
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// claim marks step n as being committed (Node.Commit): it stays in the buffer, Next
// passes over it, and Step, Put and Status go on answering while the Node makes the
// commit durable. A second commit of the same step waits for the first's outcome, as it
// did when the write ran under the lock. Every claim is settled.
func (r *Ready) claim(n int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for r.committing[n] {
		ch := r.changed
		r.mu.Unlock()
		<-ch
		r.mu.Lock()
	}
	if r.committed[n] {
		return fmt.Errorf("step %d is already committed: %w", n, arrowflight.ErrCommitted)
	}
	if _, ok := r.steps[n]; !ok {
		return fmt.Errorf("step %d is not READY (READY: %v)", n, r.readyLocked())
	}
	r.committing[n] = true
	return nil
}

// settle ends claim(n) with the durable write's outcome: on success the step is
// released and never served again; on failure it is READY again.
func (r *Ready) settle(n int64, err error) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.committing, n)
	defer r.notify() // wake a second commit, and Next, whatever the outcome
	if err != nil {
		return fmt.Errorf("step %d: %w", n, err)
	}
	if st, ok := r.steps[n]; ok { // gone if Shutdown ran meanwhile, which released it
		st.Release()
		delete(r.steps, n)
	}
	r.committed[n] = true
	return nil
}

func (r *Ready) readyLocked() []int64 {
	ready := make([]int64, 0, len(r.steps))
	for n := range r.steps {
		ready = append(ready, n)
	}
	slices.Sort(ready)
	return ready
}

// ReadyStatus is the buffer's part of the status action.
type ReadyStatus struct {
	Ready      []int64 `json:"ready"`
	NextStep   int64   `json:"next_step"` // number the next formed step will carry
	Committed  int     `json:"committed"`
	StepsAhead int     `json:"steps_ahead"`
	Closed     bool    `json:"closed"`
}

// Snapshot is the buffer's state now.
func (r *Ready) Snapshot() ReadyStatus {
	r.mu.Lock()
	defer r.mu.Unlock()
	return ReadyStatus{Ready: r.readyLocked(), NextStep: r.next, Committed: len(r.committed), StepsAhead: r.ahead, Closed: r.closed}
}

// Depth is the number of READY steps: formed, not committed.
func (r *Ready) Depth() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.steps)
}
