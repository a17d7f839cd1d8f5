package sidecar

import (
	"encoding/json"
	"fmt"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/arrowflight"
	"github.com/floe-rl/floe/batcher"
)

// flightStep shows a formed batcher step to the Flight service.
type flightStep struct {
	st   *batcher.Step
	info []byte
}

var _ arrowflight.Step = (*flightStep)(nil)

// StepInfo is the FlightInfo app_metadata of a step.
type StepInfo struct {
	Step                int64  `json:"step"`
	NumRanks            int    `json:"num_ranks"`
	MicroBatchesPerRank int    `json:"micro_batches_per_rank"`
	LossTokensGlobal    int64  `json:"loss_tokens_global"`
	PolicyVersionMin    int64  `json:"policy_version_min"`
	PolicyVersionMax    int64  `json:"policy_version_max"`
	Strategy            string `json:"strategy"`
	NumSamples          int    `json:"num_samples"`
}

// FlightStep adapts a formed step for arrowflight.
func FlightStep(st *batcher.Step) arrowflight.Step {
	info, _ := json.Marshal(StepInfo{
		Step: st.Number, NumRanks: len(st.Ranks), MicroBatchesPerRank: len(st.Ranks[0]),
		LossTokensGlobal: st.Stats.LossRows, PolicyVersionMin: st.PolicyVersionMin, PolicyVersionMax: st.PolicyVersionMax,
		Strategy: string(st.Strategy), NumSamples: len(st.Samples),
	})
	return &flightStep{st: st, info: info}
}

func (f *flightStep) Number() int64                { return f.st.Number }
func (f *flightStep) NumRanks() int                { return len(f.st.Ranks) }
func (f *flightStep) NumMicroBatches(rank int) int { return len(f.st.Ranks[rank]) }
func (f *flightStep) Schema() *arrow.Schema        { return batcher.MicroBatchSchema() }
func (f *flightStep) Info() []byte                 { return f.info }

func (f *flightStep) MicroBatch(mem memory.Allocator, rank, i int) (arrow.RecordBatch, []byte, error) {
	rec, err := f.st.Record(mem, rank, i)
	if err != nil {
		return nil, nil, err
	}
	meta, ok := rec.(arrow.RecordBatchWithMetadata).Metadata().GetValue(batcher.MetadataKey)
	if !ok {
		rec.Release()
		return nil, nil, fmt.Errorf("step %d rank %d micro-batch %d: record lacks %q metadata", f.st.Number, rank, i, batcher.MetadataKey)
	}
	return rec, []byte(meta), nil
}

func (f *flightStep) Samples(mem memory.Allocator) (arrow.RecordBatch, error) {
	return f.st.SampleTable(mem), nil
}
