package bolt

import (
	"path/filepath"
	"testing"

	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/tracetest"
)

// newStore opens an empty store in a fresh directory, closed when the test ends.
func newStore(t *testing.T) *Store {
	s := open(t, t.TempDir(), Options{})
	t.Cleanup(func() { testutil.Close(t, s) })
	return s
}

// restart closes s and opens its file again, closed when the test ends.
func restart(t *testing.T, s *Store) *Store {
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	again := open(t, filepath.Dir(s.Path()), s.opt)
	t.Cleanup(func() { testutil.Close(t, again) })
	return again
}

func TestConformance(t *testing.T) {
	stores := tracetest.Factory[tracetest.Store]{
		New:    func(t *testing.T) tracetest.Store { return newStore(t) },
		Reopen: func(t *testing.T, s tracetest.Store) tracetest.Store { return restart(t, s.(*Store)) },
	}
	t.Run("Recorder", func(t *testing.T) {
		tracetest.Recorder(t, tracetest.Factory[tracetest.RecorderStore]{
			New: func(t *testing.T) tracetest.RecorderStore { return tracetest.StoreRecorder(newStore(t)) },
			Reopen: func(t *testing.T, r tracetest.RecorderStore) tracetest.RecorderStore {
				return tracetest.StoreRecorder(restart(t, r.CallRecorder.(*Store)))
			},
		})
	})
	t.Run("Sessions", func(t *testing.T) { tracetest.Sessions(t, stores) })
	t.Run("Groups", func(t *testing.T) { tracetest.Groups(t, stores) })
	t.Run("Steps", func(t *testing.T) { tracetest.Steps(t, stores) })
	archives := tracetest.Factory[tracetest.ArchiveStore]{
		New:    func(t *testing.T) tracetest.ArchiveStore { return newStore(t) },
		Reopen: func(t *testing.T, s tracetest.ArchiveStore) tracetest.ArchiveStore { return restart(t, s.(*Store)) },
	}
	t.Run("GroupReader", func(t *testing.T) { tracetest.GroupReader(t, archives) })
	t.Run("StepArchive", func(t *testing.T) { tracetest.StepArchive(t, archives) })
	t.Run("DroppedArchive", func(t *testing.T) { tracetest.DroppedArchive(t, archives) })
	t.Run("Compactor", func(t *testing.T) { tracetest.Compactor(t, archives) })
	t.Run("PolicyVersions", func(t *testing.T) {
		tracetest.PolicyVersions(t, tracetest.Factory[trace.PolicyVersions]{
			New:    func(t *testing.T) trace.PolicyVersions { return newStore(t) },
			Reopen: func(t *testing.T, p trace.PolicyVersions) trace.PolicyVersions { return restart(t, p.(*Store)) },
		})
	})
}
