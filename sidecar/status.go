package sidecar

import (
	"github.com/floe-rl/floe/arrowflight"
	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/bolt"
)

// Status is floe's state as GET /floe/v1/status and the Flight status action both
// answer it (docs/control.md, docs/flight.md): the gate, the READY buffer, the token
// budget, the last finished step, the trainer's reports and the store.
type Status struct {
	Paused        bool  `json:"paused"`
	PolicyVersion int64 `json:"policy_version"`
	// PauseExpired: the pause has outlasted -max-pause, and calls are refused until a
	// resume.
	PauseExpired bool `json:"pause_expired,omitempty"`
	// Inflight is the number of upstream calls in flight.
	Inflight int `json:"inflight"`
	// Sessions is how many sessions the control API created since floe started; absent
	// where floe takes no sessions (corpus-serve).
	Sessions *int `json:"sessions,omitempty"`
	ReadyStatus
	TokenBudget         int             `json:"token_budget,omitempty"`
	TokenBudgetMode     string          `json:"token_budget_mode,omitempty"` // fixed or auto
	TokenBudgetDecision *budgetDecision `json:"token_budget_decision,omitempty"`
	// LastStep is the latest step committed and reported on by every rank.
	LastStep    *stepOutcome `json:"last_step,omitempty"`
	TrainerPIDs []int32      `json:"trainer_pids,omitempty"`
	// GPUDevices is how many devices NVML shows floe; absent where floe watches none.
	GPUDevices *int `json:"gpu_devices,omitempty"`
	// Groups counts the groups the store holds by state; absent where floe takes no
	// sessions.
	Groups *GroupCounts `json:"groups,omitempty"`
	// DroppedGroups are the latest groups set aside without training, oldest first
	// (floe serve keeps the last 16).
	DroppedGroups []DroppedGroup `json:"dropped_groups,omitempty"`
	// Reports holds each rank's last report, in rank order.
	Reports []arrowflight.Report `json:"reports"`
	// Upstreams are the inference replicas and their health, in -upstream's order.
	Upstreams []proxy.ReplicaStatus `json:"upstreams,omitempty"`
	// Store is what the durable store holds and costs on disk.
	Store *bolt.Usage `json:"store,omitempty"`
	// Archive is what the archiver did since floe started and what keeps failing; absent
	// with -archive=false.
	Archive *ArchiveStatus `json:"archive,omitempty"`
}

// GroupCounts counts groups by state: waiting for sessions to finish, complete and
// waiting for a step, in a step not yet archived, dropped and not yet archived.
type GroupCounts struct {
	Waiting  int `json:"waiting"`
	Complete int `json:"complete"`
	InStep   int `json:"in_step"`
	Dropped  int `json:"dropped"`
}

// DroppedGroup is a group set aside without training: its id, the reason's class (as in
// floe_groups_dropped_total) and the reason.
type DroppedGroup struct {
	Group  string `json:"group"`
	Kind   string `json:"kind"`
	Reason string `json:"reason"`
}

// groupStates is a trace.SessionStore that reads a group's bookkeeping (mem and bolt do).
type groupStates interface {
	SessionGroupState(id string) (trace.GroupState, error)
	Groups() ([]trace.GroupState, error)
}

// groupCounts counts the store's groups by state, for the status.
func groupCounts(gs []trace.GroupState) *GroupCounts {
	var n GroupCounts
	for _, g := range gs {
		switch groupFate(g) {
		case "waiting":
			n.Waiting++
		case "complete":
			n.Complete++
		case "in_step":
			n.InStep++
		case "dropped":
			n.Dropped++
		}
	}
	return &n
}

// stepOutcome is the status action's "last_step": the latest finished step.
type stepOutcome struct {
	Step              int64   `json:"step"`
	TokenBudget       int     `json:"token_budget"`
	MaxMicroBatchRows int     `json:"max_micro_batch_rows"`
	Rows              int64   `json:"rows"`
	PerRequestTokens  int64   `json:"per_request_tokens"`
	TokensSaved       int64   `json:"tokens_saved"`
	Fill              float64 `json:"fill"`
	Imbalance         float64 `json:"imbalance"`
	WaitSeconds       float64 `json:"wait_seconds"` // the largest over ranks
	StepSeconds       float64 `json:"step_seconds"` // the largest over ranks
	PeakMemoryBytes   int64   `json:"peak_memory_bytes"`
	// GPU figures over the window from the first micro-batch served to the commit;
	// absent without a GPU.
	GPUSamples          int     `json:"gpu_samples,omitempty"`
	GPUBusyFraction     float64 `json:"gpu_busy_fraction,omitempty"`
	GPUPeakMemoryBytes  uint64  `json:"gpu_peak_memory_bytes,omitempty"`
	GPUMemoryTotalBytes uint64  `json:"gpu_memory_total_bytes,omitempty"`
}

// budgetDecision is the status action's "token_budget_decision".
type budgetDecision struct {
	Budget         int    `json:"budget"`
	Previous       int    `json:"previous"`
	Reason         string `json:"reason"`
	PeakBytes      uint64 `json:"peak_bytes"`
	LimitBytes     uint64 `json:"limit_bytes"`
	PredictedBytes uint64 `json:"predicted_bytes"`
}

// groupFate is a group's state as a harness runner sees it: waiting for sessions,
// complete (waiting for a step), in a step, or dropped.
func groupFate(g trace.GroupState) string {
	switch {
	case g.Dropped:
		return "dropped"
	case g.Step >= 0:
		return "in_step"
	case g.Complete():
		return "complete"
	}
	return "waiting"
}
