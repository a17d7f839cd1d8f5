//go:build cgo

package e2e

import (
	"math"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/floe-rl/floe/arrowflight"
	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/gpu"
)

// TestRecorderTimelineOnMockH200 drives the timeline with go-nvml's mock DGX H200: the
// trainer (PID 7001) runs on device 3, busy 92% while it trains step 0 and 5% before;
// the recorder must take device 3's samples (once the trainer's report names its PID),
// with the scripted utilization and memory, and the step's figures from floe's events
// and the report.
func TestRecorderTimelineOnMockH200(t *testing.T) {
	start := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	now := start
	training := func() bool { s := now.Sub(start); return s >= 2*time.Second && s < 4*time.Second }
	const gib = 1 << 30
	srv := dgxh200.New()
	for i, nd := range srv.Devices {
		d := nd.(*server.Device)
		total := d.MemoryInfo.Total
		d.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
			if i == 3 && training() {
				return nvml.Utilization{Gpu: 92, Memory: 40}, nvml.SUCCESS
			}
			return nvml.Utilization{Gpu: 5, Memory: 1}, nvml.SUCCESS
		}
		d.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) {
			used := uint64(1 * gib)
			if i == 3 {
				used = 30 * gib
			}
			return nvml.Memory{Total: total, Used: used, Free: total - used}, nvml.SUCCESS
		}
		d.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
			if i == 3 {
				return []nvml.ProcessInfo{{Pid: 7001, UsedGpuMemory: 28 * gib}}, nvml.SUCCESS
			}
			return nil, nvml.SUCCESS
		}
		d.GetProcessUtilizationFunc = func(uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
			return nil, nvml.ERROR_NOT_FOUND
		}
	}
	mon := gpu.NewMonitor(gpu.FromNVML(srv), gpu.MonitorConfig{Host: gpu.NoHost{}, Ticks: make(chan time.Time)})
	rec := NewRecorder(start, mon)
	rec.now = func() time.Time { return now }
	tick := func(d time.Duration) {
		for end := now.Add(d); now.Before(end); {
			now = now.Add(100 * time.Millisecond)
			mon.SampleAt(now)
		}
	}

	tick(time.Second)
	rec.StepFormed(&batcher.Step{Number: 0, Stats: batcher.Stats{Rows: 900, PaddedRows: 1024, LossRows: 300,
		InputTokens: 5000, AttnCost: 12345, MicroBatches: 2, Fill: 0.9, Imbalance: 1.01}}, 30*time.Millisecond)
	tick(3 * time.Second) // the trainer works from 2 s to 4 s
	rec.TrainerReport(arrowflight.Report{Step: 0, Rank: 0, StepSeconds: 2, WaitSeconds: 0.01, PeakMemoryBytes: 20 * gib, PID: 7001, Loss: 0.5})
	rec.StepCommitted(0)
	tick(time.Second)
	rec.drainGPU()
	rec.drainGPU() // a second drain adds nothing

	run := rec.Run("mock", "tree", Setup{Device: "cuda"})
	if len(run.Steps) != 1 {
		t.Fatalf("steps %+v", run.Steps)
	}
	want := Step{Step: 0, FormedAt: 1, FormSeconds: 0.03, Rows: 900, PaddedRows: 1024, LossRows: 300, PerRequestRows: 5000,
		AttnCost: 12345, MicroBatches: 2, Fill: 0.9, Imbalance: 1.01, TrainStart: 2, StepSeconds: 2, WaitSeconds: 0.01,
		PeakMemoryBytes: 20 * gib, Loss: 0.5}
	got := run.Steps[0]
	if math.Abs(got.FormedAt-1) > 1e-9 || math.Abs(got.TrainStart-2) > 1e-9 {
		t.Fatalf("times %+v", got)
	}
	got.FormedAt, got.TrainStart = want.FormedAt, want.TrainStart
	if got != want {
		t.Fatalf("step\n got %+v\nwant %+v", got, want)
	}
	if run.TrainSeconds != 2 || math.Abs(run.WallSeconds-4) > 1e-9 {
		t.Fatalf("train %v s, wall %v s", run.TrainSeconds, run.WallSeconds)
	}
	if len(run.GPU) != 50 {
		t.Fatalf("%d GPU samples over 5 s at 10 Hz, want 50", len(run.GPU))
	}
	// Every sample is device 3's, the trainer's, also those from before the report named
	// its process; the busy ones are exactly those of the 2 s the trainer worked.
	busy := 0
	for _, s := range run.GPU {
		if s.MemoryUsed != 30*gib || s.MemoryTotal == 0 {
			t.Fatalf("sample at %.1f s is not the trainer's device: %+v", s.T, s)
		}
		if s.T > 4 && s.ProcessMemory != 28*gib {
			t.Fatalf("sample at %.1f s lacks the trainer's process: %+v", s.T, s)
		}
		switch {
		case s.T >= 2 && s.T < 4 && s.Utilization == 0.92:
			busy++
		case s.Utilization != 0.05 && (s.T < 2 || s.T >= 4):
			t.Fatalf("sample at %.1f s: utilization %v", s.T, s.Utilization)
		}
	}
	if busy != 20 {
		t.Fatalf("%d busy samples, want the 20 of the 2 s the trainer worked", busy)
	}
}
