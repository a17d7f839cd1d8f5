package sidecar

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/batcher"
)

// feedSteps puts formed steps into ready in order, waiting while ready is full, and then
// closes ready. mem encodes each rank's first micro-batch ahead (see FlightStep).
func feedSteps(ctx context.Context, ready *Ready, steps []*batcher.Step, mem memory.Allocator, log *slog.Logger) error {
	defer ready.Close()
	for _, st := range steps {
		fs, err := FlightStep(st, mem)
		if err != nil {
			return err
		}
		if err := ready.Put(ctx, fs); err != nil {
			fs.Release()
			return err
		}
		log.Info("step READY", "step", st.Number, "groups", st.Stats.Groups, "micro_batches", st.Stats.MicroBatches,
			"rows", st.Stats.Rows, "loss_tokens", st.Stats.LossRows, "fill", fmt.Sprintf("%.3f", st.Stats.Fill))
	}
	return nil
}
