package sidecar

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/floe-rl/floe/arrowflight"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/mem"
)

// blockingCommits is a store whose CommitStep says it entered, then waits for the test to
// answer it: a test holds the durable write open for as long as it likes, and chooses its
// outcome. Everything else is a mem.Store's.
type blockingCommits struct {
	*mem.Store
	entered   chan int64
	answer    chan error
	committed []int64
}

func newBlockingCommits() *blockingCommits {
	return &blockingCommits{Store: &mem.Store{}, entered: make(chan int64), answer: make(chan error)}
}

func (b *blockingCommits) CommitStep(n int64) error {
	b.entered <- n
	if err := <-b.answer; err != nil {
		return err
	}
	b.committed = append(b.committed, n)
	return nil
}

// TestNodeCommitLeavesTheReadyLock holds a commit's store write open and checks that the
// READY buffer's Status, Next and Step, and the Node's status, are answered meanwhile:
// the disk is not under the READY lock. Every wait is on an event; nothing sleeps.
func TestNodeCommitLeavesTheReadyLock(t *testing.T) {
	ctx := t.Context()
	store := newBlockingCommits()
	r := NewReady(2, 0)
	node := newTestNode(t, NodeConfig{Ready: r, Store: store})
	for n := range 2 {
		if err := r.Put(ctx, fakeStep(n)); err != nil {
			t.Fatal(err)
		}
	}
	committed := make(chan error, 1)
	go func() { committed <- node.Commit(ctx, 0) }()
	if n := <-store.entered; n != 0 {
		t.Fatalf("store write for step %d, want 0", n)
	}
	// The write of step 0 is in progress: these must all answer now.
	if got := r.Snapshot(); len(got.Ready) != 2 || got.Committed != 0 {
		t.Errorf("buffer status during the commit: %+v, want both steps READY and none committed", got)
	}
	if st, err := r.Next(ctx); err != nil || st.Number() != 1 {
		t.Errorf("Next during step 0's commit = %v, %v; want step 1 (0 is on its way out)", st, err)
	}
	if st, err := r.Step(ctx, 1); err != nil || st.Number() != 1 {
		t.Errorf("Step(1) during step 0's commit = %v, %v", st, err)
	}
	if got := node.Status(ctx); got.NextStep != 2 || len(got.Ready) != 2 {
		t.Errorf("node status during the commit: %+v", got)
	}
	store.answer <- nil
	if err := <-committed; err != nil {
		t.Fatal(err)
	}
	if got := r.Snapshot(); len(got.Ready) != 1 || got.Committed != 1 {
		t.Errorf("status after the commit: %+v", got)
	}
	go func() {
		<-store.entered
		store.answer <- nil
	}()
	if err := node.Commit(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(store.committed, []int64{0, 1}) {
		t.Errorf("store committed %v, want [0 1]", store.committed)
	}
}

// TestNodeCommitFailureKeepsTheStep: a store write that fails leaves the step READY, and
// a second commit of the same step waits for the first's outcome rather than racing it.
func TestNodeCommitFailureKeepsTheStep(t *testing.T) {
	ctx := t.Context()
	store := newBlockingCommits()
	r := NewReady(1, 0)
	node := newTestNode(t, NodeConfig{Ready: r, Store: store})
	if err := r.Put(ctx, fakeStep(0)); err != nil {
		t.Fatal(err)
	}
	first := make(chan error, 1)
	go func() { first <- node.Commit(ctx, 0) }()
	<-store.entered
	second := make(chan error, 1)
	go func() { second <- node.Commit(ctx, 0) }()
	store.answer <- errors.New("disk full")
	if err := <-first; err == nil || !strings.Contains(err.Error(), "disk full") {
		t.Fatalf("first commit: %v, want the store's error", err)
	}
	// The step is READY again, and the second commit now runs its own write.
	<-store.entered
	store.answer <- nil
	if err := <-second; err != nil {
		t.Fatalf("second commit after a failed first: %v", err)
	}
	if _, err := r.Step(ctx, 0); !errors.Is(err, arrowflight.ErrCommitted) {
		t.Errorf("Step(0) after the commit: %v", err)
	}
}

// TestNodeOwnsThePolicyVersion: the Node starts at the store's version and tells the
// gate; a resume is recorded before the gate hears of it, and an older version is
// refused without touching either.
func TestNodeOwnsThePolicyVersion(t *testing.T) {
	ctx := t.Context()
	store := &mem.Store{}
	if err := store.SetPolicyVersion(3); err != nil {
		t.Fatal(err)
	}
	node := newTestNode(t, NodeConfig{Store: store})
	if got := node.Status(ctx).PolicyVersion; got != 3 {
		t.Fatalf("gate starts at version %d, want the store's 3", got)
	}
	if err := node.Resume(ctx, 5, ViaControl); err != nil {
		t.Fatal(err)
	}
	if v, _ := store.PolicyVersion(); v != 5 || node.Status(ctx).PolicyVersion != 5 {
		t.Errorf("after resume 5: store %d, gate %d", v, node.Status(ctx).PolicyVersion)
	}
	err := node.Resume(ctx, 4, ViaFlight)
	if !errors.Is(err, arrowflight.ErrRefused) {
		t.Fatalf("resume to an older version: %v, want ErrRefused", err)
	}
	if v, _ := store.PolicyVersion(); v != 5 || node.Status(ctx).PolicyVersion != 5 {
		t.Errorf("a refused resume moved the version: store %d, gate %d", v, node.Status(ctx).PolicyVersion)
	}
}

var _ trace.PolicyVersions = (*mem.Store)(nil)
