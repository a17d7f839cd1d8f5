package mem

import (
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
