// Package e2e is floe's end-to-end utilization benchmark: it replays agent sessions
// through a running floe against the reference inference server while a trainer consumes
// the steps, once per reconstruction strategy, and reports what each strategy costs.
package e2e

import "time"

// Run is one strategy's run of the benchmark, as `floe-bench e2e` writes it to
// <out>/runs/<strategy>.json and `floe-bench report` reads it. Times are seconds since
// Started unless a field says otherwise.
type Run struct {
	Name     string    `json:"name"`     // the benchmark's name (the results folder)
	Strategy string    `json:"strategy"` // per_request, prefix_merging or tree
	Started  time.Time `json:"started"`
	// WallSeconds is from the first replayed request to the trainer's last commit.
	WallSeconds float64 `json:"wall_seconds"`
	// TrainSeconds is from the trainer's first step start to its last step end: the time
	// the trainer needed for the run's samples.
	TrainSeconds float64 `json:"train_seconds"`
	Setup        Setup   `json:"setup"`

	Steps []Step `json:"steps"`
	// GPU holds NVML samples (10 Hz) of the trainer's device; empty without a GPU.
	GPU []GPUSample `json:"gpu,omitempty"`
}

// Setup says what ran, so that anyone can rerun it.
type Setup struct {
	Machine string `json:"machine"` // CPU model and cores, GPU name when there is one
	Device  string `json:"device"`  // the trainer's torch device: cpu, cuda
	Model   string `json:"model"`   // the trained model: architecture and size
	Corpus  string `json:"corpus"`  // which sessions were replayed
	Seed    int64  `json:"seed"`
	Command string `json:"command"` // the command line that produced the run
	// Calls and Sessions replayed through the proxy.
	Calls    int `json:"calls"`
	Sessions int `json:"sessions"`
	// TokenBudget is rows per micro-batch; DPSize the data-parallel ranks.
	TokenBudget int `json:"token_budget"`
	DPSize      int `json:"dp_size"`
}

// Step is one training step of a run: how floe formed it and how the trainer spent it.
type Step struct {
	Step int64 `json:"step"`
	// FormedAt is when the step was READY; FormSeconds how long forming it took.
	FormedAt    float64 `json:"formed_at"`
	FormSeconds float64 `json:"form_seconds"`

	Rows           int64   `json:"rows"` // rows forwarded (cut repeats included, no padding)
	PaddedRows     int64   `json:"padded_rows"`
	LossRows       int64   `json:"loss_rows"`        // sampled tokens trained
	PerRequestRows int64   `json:"per_request_rows"` // rows per_request would forward for the same calls
	AttnCost       float64 `json:"attn_cost"`        // Σ(depth+1) over forwarded rows
	MicroBatches   int     `json:"micro_batches"`
	Fill           float64 `json:"fill"`
	Imbalance      float64 `json:"imbalance"`

	// TrainStart is when the trainer began the step (its data wait included);
	// StepSeconds the trainer's time for the step and WaitSeconds the part of it spent
	// waiting for data, both as the slowest rank reported them.
	TrainStart  float64 `json:"train_start"`
	StepSeconds float64 `json:"step_seconds"`
	WaitSeconds float64 `json:"wait_seconds"`
	// PeakMemoryBytes is the highest peak any rank reported.
	PeakMemoryBytes uint64  `json:"peak_memory_bytes"`
	Loss            float64 `json:"loss"`
}

// GPUSample is one NVML reading of the trainer's device.
type GPUSample struct {
	T              float64 `json:"t"`
	Utilization    float64 `json:"utilization"` // busy fraction, 0..1
	MemoryUsed     uint64  `json:"memory_used"`
	MemoryTotal    uint64  `json:"memory_total"`
	ProcessMemory  uint64  `json:"process_memory,omitempty"` // the trainer processes' memory
	ProcessSMShare float64 `json:"process_sm,omitempty"`     // the trainer processes' SM share, 0..1
}
