package sidecar

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/bolt"
)

// panickyStore is a store whose group reads panic for the groups in bad, as a bug in
// archiving one step would.
type panickyStore struct {
	*bolt.Store
	bad map[string]bool
}

func (p panickyStore) GroupSessions(gid string) (trace.Group, map[string]trace.SessionTimes, error) {
	if p.bad[gid] {
		var offsets []int
		n := -len(gid)
		_ = offsets[:n] // slice bounds out of range, as the 2 GiB batch did
	}
	return p.Store.GroupSessions(gid)
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
	defer testutil.Close(t, s)
	recordStep(t, s, 0)
	a := NewArchiver(panickyStore{s, map[string]bool{"g000": true}}, dir+"/archive", mem, quietLog())
	if _, err := a.ArchiveCommitted(context.Background()); err == nil || !strings.Contains(err.Error(), "panic") {
		t.Fatalf("ArchiveCommitted: %v, want the panic as an error", err)
	}
	if st := a.Status(); st.Failures != 1 || !slices.Equal(st.Failing, []string{"step 0"}) ||
		!strings.Contains(st.LastError, "slice bounds out of range") || strings.Contains(st.LastError, "\n") {
		t.Fatalf("status %+v: want step 0 failing, the panic's first line", st)
	}
	// floe serve's archiver, meeting the same step.
	var runLogs syncBuffer
	a = NewArchiver(panickyStore{s, map[string]bool{"g000": true}}, dir+"/archive", mem,
		slog.New(slog.NewTextHandler(&runLogs, nil)))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	for !strings.Contains(runLogs.String(), "panic") {
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

// failingStore fails (or, with cancel set, cancels the pass's context at) reading the
// groups in bad.
type failingStore struct {
	*bolt.Store
	mu     sync.Mutex
	bad    map[string]bool
	cancel context.CancelFunc
}

func (f *failingStore) GroupSessions(gid string) (trace.Group, map[string]trace.SessionTimes, error) {
	f.mu.Lock()
	bad, cancel := f.bad[gid], f.cancel
	f.mu.Unlock()
	if bad && cancel != nil {
		cancel() // a SIGTERM while the step is being written
	} else if bad {
		return trace.Group{}, nil, errors.New("disk full")
	}
	return f.Store.GroupSessions(gid)
}

// TestArchiveSkipsFailingStep: a step that fails to archive holds back none after it; it
// is left for RetryAfter, then tried again; the status and the metrics say what failed.
func TestArchiveSkipsFailingStep(t *testing.T) {
	mem := checkedMem(t)
	dir := t.TempDir()
	s, err := bolt.New(dir, bolt.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer testutil.Close(t, s)
	for k := range 3 {
		recordStep(t, s, k)
	}
	fs := &failingStore{Store: s, bad: map[string]bool{"g000": true}}
	a := NewArchiver(fs, dir+"/archive", mem, quietLog())
	m := NewMetrics(State{})
	a.Metrics = m
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	a.now = func() time.Time { return now }
	ctx := context.Background()

	done, err := a.ArchiveCommitted(ctx)
	if !slices.Equal(done, []int64{1, 2}) || err == nil || !strings.Contains(err.Error(), "disk full") {
		t.Fatalf("first pass archived %v (%v): want steps 1 and 2, and step 0's error", done, err)
	}
	want := ArchiveStatus{StepsArchived: 2, Failures: 1, Failing: []string{"step 0"}}
	if st := a.Status(); st.StepsArchived != want.StepsArchived || st.Failures != want.Failures ||
		!slices.Equal(st.Failing, want.Failing) || !strings.Contains(st.LastError, "disk full") {
		t.Fatalf("status %+v, want %+v", st, want)
	}
	if got := counterValue(t, m, "floe_archive_failures_total", "step"); got != 1 {
		t.Fatalf("floe_archive_failures_total{kind=step} %v, want 1", got)
	}
	if got := counterValue(t, m, "floe_archive_steps_total", "step"); got != 2 {
		t.Fatalf("floe_archive_steps_total{kind=step} %v, want 2", got)
	}

	// Within RetryAfter the step is not tried again.
	fs.mu.Lock()
	fs.bad = nil
	fs.mu.Unlock()
	now = now.Add(30 * time.Second)
	if done, err := a.ArchiveCommitted(ctx); len(done) != 0 || err != nil {
		t.Fatalf("second pass, within the retry wait: archived %v, %v", done, err)
	}
	now = now.Add(time.Minute)
	if done, err := a.ArchiveCommitted(ctx); !slices.Equal(done, []int64{0}) || err != nil {
		t.Fatalf("after the retry wait: archived %v, %v; want step 0", done, err)
	}
	if st := a.Status(); st.StepsArchived != 3 || st.Failures != 1 || len(st.Failing) != 0 {
		t.Fatalf("status %+v after the retry", st)
	}
	if steps, err := s.ArchivableSteps(); err != nil || len(steps) != 0 {
		t.Fatalf("left in the store: %v %v", steps, err)
	}
}

// TestArchiveReturnsOnCancel: a pass whose context ends (SIGTERM during a backlog)
// returns at the next group, archives nothing after, and counts no failure; the next
// start archives everything, the interrupted step included.
func TestArchiveReturnsOnCancel(t *testing.T) {
	mem := checkedMem(t)
	dir := t.TempDir()
	s, err := bolt.New(dir, bolt.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer testutil.Close(t, s)
	recorded := map[callKey]trace.Call{}
	for k := range 4 {
		calls, _ := recordStep(t, s, k)
		for ck, c := range calls {
			recorded[ck] = c
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fs := &failingStore{Store: s, bad: map[string]bool{"g001": true}, cancel: cancel}
	a := NewArchiver(fs, dir+"/archive", mem, quietLog())
	done, err := a.ArchiveCommitted(ctx)
	if !slices.Equal(done, []int64{0}) || !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled pass archived %v (%v): want step 0 only, and the cancellation", done, err)
	}
	if st := a.Status(); st.Failures != 0 {
		t.Fatalf("a cancelled step counted as a failure: %+v", st)
	}
	if steps, err := s.ArchivableSteps(); err != nil || !slices.Equal(steps, []int64{1, 2, 3}) {
		t.Fatalf("left in the store %v %v", steps, err)
	}
	a = NewArchiver(s, dir+"/archive", mem, quietLog())
	if done, err := a.ArchiveCommitted(context.Background()); err != nil || !slices.Equal(done, []int64{1, 2, 3}) {
		t.Fatalf("next start archived %v, %v", done, err)
	}
	checkArchive(t, dir+"/archive", recorded, 4, mem)
}

// counterValue is the value of counter name{kind} in m's registry, as /metrics shows it.
func counterValue(t *testing.T, m *Metrics, name, kind string) float64 {
	t.Helper()
	mfs, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, mt := range mf.GetMetric() {
			for _, l := range mt.GetLabel() {
				if l.GetName() == "kind" && l.GetValue() == kind {
					return mt.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}
