package sidecar

import (
	"context"
	"errors"
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
