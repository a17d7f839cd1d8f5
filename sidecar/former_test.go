package sidecar

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/gpu"
	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/bolt"
)

// countingStore counts how often each group is read in full: the step former must
// reconstruct a group once.
type countingStore struct {
	*bolt.Store
	mu    sync.Mutex
	reads map[string]int
}

func (c *countingStore) Group(id string) (trace.Group, error) {
	c.mu.Lock()
	c.reads[id]++
	c.mu.Unlock()
	return c.Store.Group(id)
}

// recordGroup creates group id with n finished sessions of one call each; a session's
// prompt is prefix followed by its own tokens, so the group forms a tree.
func recordGroup(t *testing.T, s *bolt.Store, id string, n, promptLen int) {
	t.Helper()
	for i := range n {
		sid := fmt.Sprintf("%s-s%d", id, i)
		if err := s.CreateSession(trace.Session{ID: sid, TaskID: "t-" + id, GroupID: id}, "key-"+sid, 0); err != nil {
			t.Fatal(err)
		}
		if err := s.SetGroupSize(id, n); err != nil {
			t.Fatal(err)
		}
		prompt := make([]int32, promptLen)
		for k := range prompt {
			prompt[k] = int32(k % 50)
		}
		prompt[promptLen-1] = int32(100 + i)
		c := trace.Call{SessionID: sid, PromptIDs: prompt, ResponseIDs: []int32{7, 8, int32(9 + i)},
			Logprobs: []float32{-0.5, -0.25, -1}, Trainable: true, FinishReason: "stop"}
		if err := s.Record(context.Background(), &c); err != nil {
			t.Fatal(err)
		}
		if err := s.FinishSession(sid, float64(i), trace.StatusCompleted); err != nil {
			t.Fatal(err)
		}
	}
}

func newTestFormer(t *testing.T, store FormerStore, cfg Config, first int64, budget int, now time.Time) *stepFormer {
	t.Helper()
	rb := NewReady(cfg.StepsAhead, first)
	t.Cleanup(rb.Shutdown)
	return &stepFormer{cfg: cfg, store: store, ready: rb, mem: memory.NewGoAllocator(),
		log: slog.New(slog.NewTextHandler(io.Discard, nil)), wake: make(chan struct{}, 1),
		now: func() time.Time { return now }, steps: newStepTracker(slog.New(slog.NewTextHandler(io.Discard, nil)), nil, nil, nil, budget),
		version: &policyVersion{}, metrics: NewMetrics(State{Ready: rb}), exams: map[string]*examined{}}
}

// TestFormerExaminesEachGroupOnceAndRecordsTheBudget: groups completing one at a time
// are each read and reconstructed once; every step records the budget it was packed
// with; a group whose path outgrows the budget is dropped with the reason; after a
// restart with another fixed budget, an uncommitted step is formed again with its own
// budget, identical to the first time.
func TestFormerExaminesEachGroupOnceAndRecordsTheBudget(t *testing.T) {
	dir := t.TempDir()
	bs, err := bolt.New(dir, bolt.Options{})
	if err != nil {
		t.Fatal(err)
	}
	store := &countingStore{Store: bs, reads: map[string]int{}}
	cfg := DefaultConfig()
	cfg.GroupsPerStep, cfg.MinGroupSize, cfg.StepsAhead = 2, 2, 8
	cfg.Batcher.PadMultiple, cfg.Batcher.TokenBudget = 16, 4096
	const budget = 96 // not the fixed one: as a -token-budget auto step would be
	f := newTestFormer(t, store, cfg, 0, budget, time.Now())
	ctx := context.Background()

	for i, g := range []string{"g0", "g1", "g2", "g3", "g4"} {
		promptLen := 40
		if g == "g2" {
			promptLen = 200 // longer than the budget
		}
		recordGroup(t, bs, g, 2, promptLen)
		if err := f.advance(ctx); err != nil {
			t.Fatalf("after %s: %v", g, err)
		}
		if want := int64((i + 1) / 2); g != "g2" && g != "g3" && f.ready.NextNumber() != want {
			t.Fatalf("after %s: next step %d, want %d", g, f.ready.NextNumber(), want)
		}
	}
	for _, g := range []string{"g0", "g1", "g2", "g3", "g4"} {
		if n := store.reads[g]; n != 1 {
			t.Errorf("group %s read %d times, want once", g, n)
		}
	}
	gs, err := bs.Groups()
	if err != nil {
		t.Fatal(err)
	}
	if !gs[2].Dropped || gs[2].DropReason != `session "g2-s0": a root-to-leaf path of 203 rows is longer than the token budget of 96 rows` {
		t.Fatalf("g2: dropped %v, reason %q", gs[2].Dropped, gs[2].DropReason)
	}
	pending, _, err := bs.Steps()
	if err != nil {
		t.Fatal(err)
	}
	if len(pending) != 2 || !reflect.DeepEqual(pending[0].Groups, []string{"g0", "g1"}) || !reflect.DeepEqual(pending[1].Groups, []string{"g3", "g4"}) {
		t.Fatalf("saved steps %+v, want [g0 g1] and [g3 g4]", pending)
	}
	for _, rec := range pending {
		if rec.TokenBudget != budget {
			t.Fatalf("step %d recorded budget %d, want %d", rec.N, rec.TokenBudget, budget)
		}
	}
	first, err := f.ready.Step(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	want := first.(*flightStep).st

	// Restart: a former with another fixed budget recovers the uncommitted steps.
	cfg.Batcher.TokenBudget = 4096
	again := newTestFormer(t, store, cfg, 0, cfg.Batcher.TokenBudget, time.Now())
	for _, rec := range pending {
		if err := again.recover(ctx, rec); err != nil {
			t.Fatal(err)
		}
	}
	got, err := again.ready.Step(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if !sameStep(want, got.(*flightStep).st) {
		t.Fatalf("step 1 formed again differs: %+v, first %+v", got.(*flightStep).st.Stats, want.Stats)
	}
	if err := bs.Close(); err != nil {
		t.Fatal(err)
	}
}

// sameStep compares what the trainer would receive of two formed steps.
func sameStep(a, b *batcher.Step) bool {
	if a.Stats != b.Stats || !reflect.DeepEqual(a.Samples, b.Samples) || len(a.Ranks) != len(b.Ranks) {
		return false
	}
	for r := range a.Ranks {
		if len(a.Ranks[r]) != len(b.Ranks[r]) {
			return false
		}
		for i := range a.Ranks[r] {
			x, y := a.Ranks[r][i], b.Ranks[r][i]
			if x.Rows != y.Rows || x.PaddedRows != y.PaddedRows || x.LossRows != y.LossRows {
				return false
			}
		}
	}
	return true
}

// recordSessions creates group id with one finished session per prompt length, each
// with one call of that prompt (distinct per session) and a 3-token response.
func recordSessions(t *testing.T, s *bolt.Store, id string, promptLens ...int) {
	t.Helper()
	for i, n := range promptLens {
		sid := fmt.Sprintf("%s-s%d", id, i)
		if err := s.CreateSession(trace.Session{ID: sid, TaskID: "t-" + id, GroupID: id}, "key-"+sid, len(promptLens)); err != nil {
			t.Fatal(err)
		}
		prompt := make([]int32, n)
		for k := range prompt {
			prompt[k] = int32((k*7 + i) % 500)
		}
		c := trace.Call{SessionID: sid, PromptIDs: prompt, ResponseIDs: []int32{7, 8, 9},
			Logprobs: []float32{-0.5, -0.25, -1}, Trainable: true, FinishReason: "stop"}
		if err := s.Record(context.Background(), &c); err != nil {
			t.Fatal(err)
		}
		if err := s.FinishSession(sid, float64(i), trace.StatusCompleted); err != nil {
			t.Fatal(err)
		}
	}
}

// TestFormerAutoBudgetGrowsToTheLongestPath: under -token-budget auto, whose budget
// starts at its minimum (8192), a group holding a 9,002-token call beside a 102-token
// session forms a step, with a budget grown to hold its longest path; a workload of only
// long groups forms steps; only a path past the maximum drops its group, counted by
// reason and listed in the status.
func TestFormerAutoBudgetGrowsToTheLongestPath(t *testing.T) {
	bs, err := bolt.New(t.TempDir(), bolt.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer testutil.Close(t, bs)
	cfg := DefaultConfig()
	cfg.GroupsPerStep, cfg.MinGroupSize, cfg.StepsAhead = 1, 2, 8
	cfg.Batcher.PadMultiple, cfg.Batcher.TokenBudget = 128, 8192
	cfg.TokenBudgetAuto, cfg.TokenBudgetMin, cfg.TokenBudgetMax = true, 8192, 65536
	ctl, err := gpu.NewBudgetController(gpu.BudgetConfig{PadMultiple: 128, Min: 8192, Max: 65536, MemoryTotal: 80 << 30})
	if err != nil {
		t.Fatal(err)
	}
	f := newTestFormer(t, bs, cfg, 0, 0, time.Now())
	f.steps = newStepTracker(slog.New(slog.NewTextHandler(io.Discard, nil)), f.metrics, nil, ctl, 0)
	if f.steps.Budget() != 8192 {
		t.Fatalf("the auto budget starts at %d, want its minimum 8192", f.steps.Budget())
	}

	recordSessions(t, bs, "g0-mixed", 9002, 102)
	recordSessions(t, bs, "g1-long", 20000, 19000)
	recordSessions(t, bs, "g2-huge", 70000, 500)
	recordSessions(t, bs, "g3-long", 30000, 12000)
	if err := f.advance(context.Background()); err != nil {
		t.Fatal(err)
	}
	pending, _, err := bs.Steps()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, rec := range pending {
		got = append(got, fmt.Sprintf("%v@%d", rec.Groups, rec.TokenBudget))
	}
	want := []string{"[g0-mixed]@9088", "[g1-long]@20096", "[g3-long]@30080"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("steps %v, want %v", got, want)
	}
	dropped := f.droppedGroups()
	if len(dropped) != 1 || dropped[0].Group != "g2-huge" || dropped[0].Kind != "path_too_long" ||
		dropped[0].Reason != `session "g2-huge-s0": a root-to-leaf path of 70003 rows is longer than the largest token budget of 65536 rows` {
		t.Fatalf("dropped %+v", dropped)
	}
	rec := httptest.NewRecorder()
	f.metrics.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if n := metric(rec.Body.String(), `floe_groups_dropped_total{reason="path_too_long"}`); n != 1 {
		t.Fatalf(`floe_groups_dropped_total{reason="path_too_long"} = %v, want 1`, n)
	}
}
