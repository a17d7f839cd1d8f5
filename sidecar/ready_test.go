package sidecar

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/arrowflight"
)

// fakeStep is a step with a number and nothing else: the buffer never looks inside.
type fakeStep int64

func (s fakeStep) Number() int64         { return int64(s) }
func (fakeStep) NumRanks() int           { return 1 }
func (fakeStep) NumMicroBatches(int) int { return 0 }
func (fakeStep) Schema() *arrow.Schema   { return nil }
func (fakeStep) Info() []byte            { return nil }
func (fakeStep) Release()                {}
func (fakeStep) Samples(memory.Allocator) (arrow.RecordBatch, error) {
	return nil, nil
}
func (fakeStep) MicroBatch(memory.Allocator, int, int) (arrow.RecordBatch, []byte, error) {
	return nil, nil, nil
}

func TestReadyBackpressureAndCommit(t *testing.T) {
	r := NewReady(2, 0)
	ctx := context.Background()
	for n := range 2 {
		if err := r.Put(ctx, fakeStep(n)); err != nil {
			t.Fatal(err)
		}
	}
	// Full: the third step waits until a commit makes room.
	put := make(chan error, 1)
	go func() { put <- r.Put(ctx, fakeStep(2)) }()
	select {
	case err := <-put:
		t.Fatalf("Put into a full buffer returned %v without waiting", err)
	case <-time.After(50 * time.Millisecond):
	}
	if st, err := r.Next(ctx); err != nil || st.Number() != 0 {
		t.Fatalf("Next = %v, %v; want step 0", st, err)
	}
	if err := r.Commit(0); err != nil {
		t.Fatal(err)
	}
	if err := <-put; err != nil {
		t.Fatal(err)
	}
	if err := r.Commit(0); !errors.Is(err, arrowflight.ErrCommitted) || !strings.Contains(err.Error(), "already committed") {
		t.Errorf("second commit: %v", err)
	}
	if _, err := r.Step(ctx, 0); !errors.Is(err, arrowflight.ErrCommitted) {
		t.Errorf("Step(0) after commit: %v", err)
	}
	if err := r.Commit(7); err == nil || !strings.Contains(err.Error(), "step 7 is not READY (READY: [1 2])") {
		t.Errorf("commit of an unformed step: %v", err)
	}
	if st, err := r.Next(ctx); err != nil || st.Number() != 1 {
		t.Errorf("Next = %v, %v; want step 1", st, err)
	}
	if err := r.Put(ctx, fakeStep(9)); err == nil || !strings.Contains(err.Error(), "want step 3") {
		t.Errorf("out-of-order Put: %v", err)
	}
	got := r.Snapshot()
	if len(got.Ready) != 2 || got.NextStep != 3 || got.Committed != 1 || got.Closed {
		t.Errorf("status %+v", got)
	}
}

func TestReadyWaitsAndCloses(t *testing.T) {
	r := NewReady(1, 5)
	ctx := context.Background()
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if _, err := r.Step(short, 5); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Step on an empty buffer: %v", err)
	}
	got := make(chan arrowflight.Step, 1)
	go func() {
		st, _ := r.Step(ctx, 5)
		got <- st
	}()
	if err := r.Put(ctx, fakeStep(5)); err != nil {
		t.Fatal(err)
	}
	if st := <-got; st == nil || st.Number() != 5 {
		t.Fatalf("waiter got %v", st)
	}
	if _, err := r.Step(ctx, 4); !errors.Is(err, arrowflight.ErrCommitted) {
		t.Errorf("Step before the first: %v", err)
	}
	r.Close()
	if _, err := r.Step(ctx, 6); !errors.Is(err, arrowflight.ErrNoSuchStep) {
		t.Errorf("Step past the end: %v", err)
	}
	if err := r.Commit(5); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Next(ctx); !errors.Is(err, arrowflight.ErrNoSuchStep) {
		t.Errorf("Next after the last commit: %v", err)
	}
	if err := r.Put(ctx, fakeStep(6)); err == nil {
		t.Error("Put after Close succeeded")
	}
}

// commitLog is a store that remembers what it committed.
type commitLog struct{ steps []int64 }

func (c *commitLog) CommitStep(n int64) error {
	c.steps = append(c.steps, n)
	return nil
}

// blockingCommits wraps a store's CommitStep: each commit says it entered, then waits for
// a release, so a test holds the disk write open for as long as it likes.
type blockingCommits struct {
	store   interface{ CommitStep(int64) error }
	entered chan int64
	release chan struct{}
}

func (b *blockingCommits) CommitStep(n int64) error {
	b.entered <- n
	<-b.release
	return b.store.CommitStep(n)
}

// TestReadyCommitLeavesTheLock holds a commit's store write open and checks that Status,
// Next, Step and a second commit of another step are answered meanwhile: the disk is not
// under the READY lock. Every wait is on an event; nothing sleeps.
func TestReadyCommitLeavesTheLock(t *testing.T) {
	ctx := t.Context()
	store := &commitLog{}
	disk := &blockingCommits{store: store, entered: make(chan int64), release: make(chan struct{})}
	r := NewReady(2, 0)
	r.OnCommit = disk.CommitStep
	for n := range 2 {
		if err := r.Put(ctx, fakeStep(n)); err != nil {
			t.Fatal(err)
		}
	}
	committed := make(chan error, 1)
	go func() { committed <- r.Commit(0) }()
	if n := <-disk.entered; n != 0 {
		t.Fatalf("store write for step %d, want 0", n)
	}
	// The write of step 0 is in progress: these must all answer now.
	if got := r.Snapshot(); len(got.Ready) != 2 || got.Committed != 0 {
		t.Errorf("status during the commit: %+v, want both steps READY and none committed", got)
	}
	if st, err := r.Next(ctx); err != nil || st.Number() != 1 {
		t.Errorf("Next during step 0's commit = %v, %v; want step 1 (0 is on its way out)", st, err)
	}
	if st, err := r.Step(ctx, 1); err != nil || st.Number() != 1 {
		t.Errorf("Step(1) during step 0's commit = %v, %v", st, err)
	}
	node := NewNode(NodeConfig{Ready: r})
	if got := node.Status(ctx); got.NextStep != 2 {
		t.Errorf("trainer status during the commit: %+v", got)
	}
	close(disk.release)
	if err := <-committed; err != nil {
		t.Fatal(err)
	}
	if got := r.Snapshot(); len(got.Ready) != 1 || got.Committed != 1 {
		t.Errorf("status after the commit: %+v", got)
	}
	go func() { <-disk.entered }() // step 1's write goes through (release is closed)
	if err := r.Commit(1); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(store.steps, []int64{0, 1}) {
		t.Errorf("store committed %v, want [0 1]", store.steps)
	}
}

// TestReadyCommitFailureKeepsTheStep: a store write that fails leaves the step READY, and
// a second commit of the same step waits for the first's outcome rather than racing it.
func TestReadyCommitFailureKeepsTheStep(t *testing.T) {
	ctx := t.Context()
	entered, release := make(chan struct{}), make(chan error)
	r := NewReady(1, 0)
	r.OnCommit = func(int64) error {
		entered <- struct{}{}
		return <-release
	}
	if err := r.Put(ctx, fakeStep(0)); err != nil {
		t.Fatal(err)
	}
	first := make(chan error, 1)
	go func() { first <- r.Commit(0) }()
	<-entered
	second := make(chan error, 1)
	go func() { second <- r.Commit(0) }()
	release <- errors.New("disk full")
	if err := <-first; err == nil || !strings.Contains(err.Error(), "disk full") {
		t.Fatalf("first commit: %v, want the store's error", err)
	}
	// The step is READY again, and the second commit now runs its own write.
	<-entered
	release <- nil
	if err := <-second; err != nil {
		t.Fatalf("second commit after a failed first: %v", err)
	}
	if _, err := r.Step(ctx, 0); !errors.Is(err, arrowflight.ErrCommitted) {
		t.Errorf("Step(0) after the commit: %v", err)
	}
}
