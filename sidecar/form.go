package sidecar

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/trace"
)

// FormSteps forms one step from each batch of groups, in order, and puts it into ready,
// waiting while ready is full; then it closes ready. Steps are numbered from
// ready.NextNumber().
func FormSteps(ctx context.Context, ready *Ready, steps [][]trace.Group, cfg batcher.Config, log *slog.Logger) error {
	defer ready.Close()
	for _, groups := range steps {
		n := ready.NextNumber()
		st, err := batcher.FormStep(n, groups, cfg)
		if err != nil {
			return fmt.Errorf("forming step %d: %w", n, err)
		}
		if err := ready.Put(ctx, FlightStep(st)); err != nil {
			return err
		}
		log.Info("step READY", "step", n, "groups", len(groups), "micro_batches", st.Stats.MicroBatches,
			"rows", st.Stats.Rows, "loss_tokens", st.Stats.LossRows, "fill", fmt.Sprintf("%.3f", st.Stats.Fill))
	}
	return nil
}
