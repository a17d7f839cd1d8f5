package mem

import (
	"context"
	"slices"
	"testing"

	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/tracetest"
)

func TestConformance(t *testing.T) {
	stores := tracetest.Factory[tracetest.Store]{New: func(*testing.T) tracetest.Store { return &Store{} }}
	t.Run("Recorder", func(t *testing.T) {
		tracetest.Recorder(t, tracetest.Factory[tracetest.RecorderStore]{
			New: func(*testing.T) tracetest.RecorderStore { return tracetest.StoreRecorder(&Store{}) },
		})
	})
	t.Run("Sessions", func(t *testing.T) { tracetest.Sessions(t, stores) })
	t.Run("Groups", func(t *testing.T) { tracetest.Groups(t, stores) })
	t.Run("Steps", func(t *testing.T) { tracetest.Steps(t, stores) })
	t.Run("PolicyVersions", func(t *testing.T) {
		tracetest.PolicyVersions(t, tracetest.Factory[trace.PolicyVersions]{
			New: func(*testing.T) trace.PolicyVersions { return &Store{} },
		})
	})
}

// TestConformanceWithRetention: a limit no test reaches changes nothing of the contract.
func TestConformanceWithRetention(t *testing.T) {
	stores := tracetest.Factory[tracetest.Store]{New: func(*testing.T) tracetest.Store { return &Store{Retention: trace.Retention{MaxStoredBytes: 1 << 30}} }}
	t.Run("Recorder", func(t *testing.T) {
		tracetest.Recorder(t, tracetest.Factory[tracetest.RecorderStore]{
			New: func(*testing.T) tracetest.RecorderStore {
				return tracetest.StoreRecorder(&Store{Retention: trace.Retention{MaxStoredBytes: 1 << 30}})
			},
		})
	})
	t.Run("Sessions", func(t *testing.T) { tracetest.Sessions(t, stores) })
	t.Run("Groups", func(t *testing.T) { tracetest.Groups(t, stores) })
}

// TestRetentionDropsOldestCalls records calls of 1 KiB (plus overhead) in turn to two
// sessions under a limit, and checks which calls are left, their indexes and the counts.
func TestRetentionDropsOldestCalls(t *testing.T) {
	const size = 1024 + callOverhead
	for _, tc := range []struct {
		name      string
		limit     int64
		calls     int   // recorded, alternating sessions a and b
		wantA     []int // indexes of a's calls kept
		wantB     []int
		dropCalls int64
	}{
		{name: "unbounded", limit: 0, calls: 6, wantA: []int{0, 1, 2}, wantB: []int{0, 1, 2}},
		{name: "under the limit", limit: 6 * size, calls: 6, wantA: []int{0, 1, 2}, wantB: []int{0, 1, 2}},
		{name: "room for three", limit: 3 * size, calls: 6, wantA: []int{2}, wantB: []int{1, 2}, dropCalls: 3},
		{name: "room for one and a half", limit: size + size/2, calls: 5, wantA: []int{2}, dropCalls: 4},
		{name: "a call larger than the limit is kept alone", limit: 10, calls: 3, wantA: []int{1}, dropCalls: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := &Store{Retention: trace.Retention{MaxStoredBytes: tc.limit}}
			m.AddSession("ka", "a")
			m.AddSession("kb", "b")
			for i := 0; i < tc.calls; i++ {
				id := []string{"a", "b"}[i%2]
				if err := m.Record(context.Background(), &trace.Call{SessionID: id, Request: make([]byte, 1024)}); err != nil {
					t.Fatal(err)
				}
			}
			for id, want := range map[string][]int{"a": tc.wantA, "b": tc.wantB} {
				var got []int
				for _, c := range m.Calls(id) {
					got = append(got, c.Index)
					if len(c.Request) != 1024 {
						t.Errorf("session %s call %d: request of %d bytes", id, c.Index, len(c.Request))
					}
				}
				if !slices.Equal(got, want) {
					t.Errorf("session %s keeps calls %v, want %v", id, got, want)
				}
			}
			stored, dropped := m.Retained()
			if dropped.Calls != tc.dropCalls || dropped.Bytes != tc.dropCalls*size {
				t.Errorf("dropped %+v, want %d calls of %d bytes", dropped, tc.dropCalls, size)
			}
			if kept := int64(len(tc.wantA)+len(tc.wantB)) * size; tc.limit > 0 && stored != kept {
				t.Errorf("stored %d bytes, want %d", stored, kept)
			}
		})
	}
}
