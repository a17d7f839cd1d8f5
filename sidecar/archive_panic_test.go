package sidecar

import (
	"bytes"
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/bolt"
)

// panickyStore is a store whose group reads panic for the groups in bad, as a bug in
// archiving one step would.
type panickyStore struct {
	*bolt.Store
	bad map[string]bool
}

func (p panickyStore) StepGroup(gid string) (trace.Group, map[string]bolt.SessionTimes, error) {
	if p.bad[gid] {
		var offsets []int
		n := -len(gid)
		_ = offsets[:n] // slice bounds out of range, as the 2 GiB batch did
	}
	return p.Store.StepGroup(gid)
}

// syncBuffer is a log sink a test reads while Run writes it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestArchivePanicIsAnError: a panic while archiving a step is logged as that step's
// error; Run goes on (floe serve lives) and stops when asked, and the step stays in the
// store to be tried again.
func TestArchivePanicIsAnError(t *testing.T) {
	mem := checkedMem(t)
	dir := t.TempDir()
	s, err := bolt.New(dir, bolt.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	recordStep(t, s, 0)
	var logs syncBuffer
	a := NewArchiver(panickyStore{s, map[string]bool{"g000": true}}, dir+"/archive", DefaultConfig(), mem,
		slog.New(slog.NewTextHandler(&logs, nil)))
	if _, err := a.ArchiveCommitted(); err == nil || !strings.Contains(err.Error(), "panic") {
		t.Fatalf("ArchiveCommitted: %v, want the panic as an error", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	for !strings.Contains(logs.String(), "panic") {
		select {
		case err := <-done:
			t.Fatalf("Run returned %v before it was stopped", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	steps, err := s.ArchivableSteps()
	if err != nil || !slices.Equal(steps, []int64{0}) {
		t.Fatalf("archivable steps %v (%v), want step 0 still in the store", steps, err)
	}
}

// TestLiveWindow: compaction is measured against the largest live size of the latest
// liveWindowLen passes, so one pass with little in flight does not trigger it.
func TestLiveWindow(t *testing.T) {
	tests := []struct {
		name string
		adds []int64
		want int64
	}{
		{"none", nil, 0},
		{"one", []int64{5}, 5},
		{"peak kept", []int64{100, 3, 4}, 100},
		{"peak forgotten after the window", append([]int64{100}, slices.Repeat([]int64{7}, liveWindowLen)...), 7},
		{"peak at the window's edge", append([]int64{100}, slices.Repeat([]int64{7}, liveWindowLen-1)...), 100},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var w liveWindow
			for _, v := range tt.adds {
				w.add(v)
			}
			if got := w.max(); got != tt.want {
				t.Fatalf("max %d, want %d", got, tt.want)
			}
		})
	}
}
