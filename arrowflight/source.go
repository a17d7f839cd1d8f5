// Package arrowflight serves formed training steps to the trainer over Arrow Flight. It
// knows steps only through the small Step and Source interfaces below, so it depends on
// neither the batcher nor the sidecar that wires them together. The protocol — tickets,
// actions, metadata and error codes — is docs/flight.md.
package arrowflight

import (
	"context"
	"errors"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

// Step is one formed, READY training step.
type Step interface {
	Number() int64
	NumRanks() int
	NumMicroBatches(rank int) int
	// MicroBatch encodes micro-batch i of rank and returns it with its metadata as JSON.
	// The caller releases the record.
	MicroBatch(mem memory.Allocator, rank, i int) (arrow.RecordBatch, []byte, error)
	// Samples encodes the step's sample table. The caller releases the record.
	Samples(mem memory.Allocator) (arrow.RecordBatch, error)
	Schema() *arrow.Schema // of every micro-batch
	// Info is the JSON object sent as FlightInfo app_metadata.
	Info() []byte
	// Release frees what the step keeps encoded ahead; the source calls it once the step
	// is committed and will never be served again.
	Release()
}

// Errors a Source returns; the server maps them to gRPC codes.
var (
	// ErrCommitted: the step was committed and is never served again.
	ErrCommitted = errors.New("step was committed")
	// ErrNoSuchStep: the step does not exist and never will (the source is finished).
	ErrNoSuchStep = errors.New("no such step")

	// The classes of a Control's errors, mapped to the same answer on every door: Flight
	// (InvalidArgument, FailedPrecondition, Unavailable) and the control API (400, 409,
	// 503). Any other error is Internal (500).

	// ErrInvalid: the request itself is wrong (a negative field).
	ErrInvalid = errors.New("invalid request")
	// ErrRefused: the request is well-formed but floe's state refuses it (a policy
	// version older than the current one).
	ErrRefused = errors.New("refused")
	// ErrUnavailable: the request could not finish now and may be tried again (a pause
	// whose caller stopped waiting for the calls in flight).
	ErrUnavailable = errors.New("unavailable")
)

// Source is the READY buffer as the Flight service sees it.
type Source interface {
	// Step returns step n once it is READY, waiting until then or until ctx is done (then
	// it returns ctx's error). It returns an error wrapping ErrCommitted for a committed
	// step and ErrNoSuchStep for a step that will never be formed.
	Step(ctx context.Context, n int64) (Step, error)
	// Next returns the oldest uncommitted step, waiting like Step.
	Next(ctx context.Context) (Step, error)
	// Commit marks step n consumed, exactly once: a second commit returns an error
	// wrapping ErrCommitted; a step not READY yet cannot be committed.
	Commit(ctx context.Context, n int64) error
}

// Report is what a trainer rank says about a step it finished.
type Report struct {
	Step            int64   `json:"step"`
	Rank            int     `json:"rank"`
	PeakMemoryBytes int64   `json:"peak_memory_bytes"`
	StepSeconds     float64 `json:"step_seconds"`
	WaitSeconds     float64 `json:"wait_seconds"`
	// PID is the rank's process id, optional (0: not given); floe serve watches the
	// GPU memory and utilization of the processes it names.
	PID int32 `json:"pid,omitempty"`
	// Loss is the step's training loss as the rank computed it, optional; floe only
	// passes it on to observers (benchmark timelines).
	Loss float64 `json:"loss,omitempty"`
}

// Control receives the trainer's control actions: weight-sync pause/resume, reports and
// the status, typed S (the service only encodes it as JSON). Its errors wrap ErrInvalid,
// ErrRefused or ErrUnavailable to choose their gRPC code; any other is Internal.
type Control[S any] interface {
	// Pause stops new rollout calls and waits for those in flight; it returns the current
	// policy version.
	Pause(ctx context.Context) (int64, error)
	// Resume releases paused calls under a new policy version.
	Resume(ctx context.Context, policyVersion int64) error
	Report(ctx context.Context, r Report) error
	// Status is the status action's whole answer, also sent with a "not READY yet" error.
	Status(ctx context.Context) S
}
