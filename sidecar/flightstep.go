package sidecar

import (
	"encoding/json"
	"fmt"
	"sync"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/arrowflight"
	"github.com/floe-rl/floe/batcher"
)

// flightStep shows a formed batcher step to the Flight service. Each rank's first
// micro-batch is encoded when the step is made READY, so a trainer asking for the step
// gets its first batch without waiting for the encoder; the rest are encoded as they are
// sent, so a READY step costs one micro-batch per rank in memory, not its whole size.
type flightStep struct {
	st   *batcher.Step
	info []byte

	mu    sync.Mutex
	first []arrow.RecordBatch // per rank; nil once released
	meta  [][]byte            // per rank, of first
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

// FlightStep adapts a formed step for arrowflight, encoding each rank's first micro-batch
// with mem, which must be managed by Go's garbage collector (arrowflight sends record
// memory zero-copy). It fails if a micro-batch cannot be encoded.
func FlightStep(st *batcher.Step, mem memory.Allocator) (arrowflight.Step, error) {
	info, _ := json.Marshal(StepInfo{
		Step: st.Number, NumRanks: len(st.Ranks), MicroBatchesPerRank: len(st.Ranks[0]),
		LossTokensGlobal: st.Stats.LossRows, PolicyVersionMin: st.PolicyVersionMin, PolicyVersionMax: st.PolicyVersionMax,
		Strategy: string(st.Strategy), NumSamples: len(st.Samples),
	})
	f := &flightStep{st: st, info: info, first: make([]arrow.RecordBatch, len(st.Ranks)), meta: make([][]byte, len(st.Ranks))}
	for r := range st.Ranks {
		rec, meta, err := f.encode(mem, r, 0)
		if err != nil {
			f.Release()
			return nil, err
		}
		f.first[r], f.meta[r] = rec, meta
	}
	return f, nil
}

// Release drops the pre-encoded first micro-batches.
func (f *flightStep) Release() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for r, rec := range f.first {
		if rec != nil {
			rec.Release()
			f.first[r] = nil
		}
	}
}

func (f *flightStep) Number() int64                { return f.st.Number }
func (f *flightStep) NumRanks() int                { return len(f.st.Ranks) }
func (f *flightStep) NumMicroBatches(rank int) int { return len(f.st.Ranks[rank]) }
func (f *flightStep) Schema() *arrow.Schema        { return batcher.MicroBatchSchema() }
func (f *flightStep) Info() []byte                 { return f.info }

func (f *flightStep) MicroBatch(mem memory.Allocator, rank, i int) (arrow.RecordBatch, []byte, error) {
	if i == 0 {
		f.mu.Lock()
		if rank >= 0 && rank < len(f.first) && f.first[rank] != nil {
			rec := f.first[rank]
			rec.Retain()
			f.mu.Unlock()
			return rec, f.meta[rank], nil
		}
		f.mu.Unlock()
	}
	return f.encode(mem, rank, i)
}

func (f *flightStep) encode(mem memory.Allocator, rank, i int) (arrow.RecordBatch, []byte, error) {
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
