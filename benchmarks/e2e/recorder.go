package e2e

import (
	"context"
	"sort"
	"sync"
	"time"

	"github.com/floe-rl/floe/arrowflight"
	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/gpu"
)

// Recorder is one run's timeline: floe's step events (it is a sidecar.StepObserver), the
// trainer's reports, and the GPU monitor's samples of the trainer's device. Times are
// seconds since Start.
type Recorder struct {
	Start   time.Time
	Monitor *gpu.Monitor // nil: no GPU timeline
	now     func() time.Time

	mu        sync.Mutex
	steps     map[int64]*Step
	committed map[int64]float64
	pids      map[int]int32
	gpu       []gpu.Sample
	lastGPU   time.Time
}

// NewRecorder starts a timeline at start; mon may be nil.
func NewRecorder(start time.Time, mon *gpu.Monitor) *Recorder {
	// lastGPU starts at start: a monitor shared with an earlier run holds its samples.
	return &Recorder{Start: start, Monitor: mon, now: time.Now, steps: map[int64]*Step{},
		committed: map[int64]float64{}, pids: map[int]int32{}, lastGPU: start}
}

func (r *Recorder) since(t time.Time) float64 { return t.Sub(r.Start).Seconds() }

func (r *Recorder) step(n int64) *Step {
	s, ok := r.steps[n]
	if !ok {
		s = &Step{Step: n}
		r.steps[n] = s
	}
	return s
}

// StepFormed implements sidecar.StepObserver.
func (r *Recorder) StepFormed(st *batcher.Step, took time.Duration) {
	at := r.since(r.now())
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.step(st.Number)
	s.FormedAt, s.FormSeconds = at, took.Seconds()
	s.Rows, s.PaddedRows, s.LossRows = st.Stats.Rows, st.Stats.PaddedRows, st.Stats.LossRows
	s.PerRequestRows, s.AttnCost = st.Stats.InputTokens, st.Stats.AttnCost
	s.MicroBatches, s.Fill, s.Imbalance = st.Stats.MicroBatches, st.Stats.Fill, st.Stats.Imbalance
}

// TrainerReport implements sidecar.StepObserver: the slowest rank's figures count, and
// its process joins the GPU monitor's trainer processes.
func (r *Recorder) TrainerReport(rep arrowflight.Report) {
	at := r.since(r.now())
	r.mu.Lock()
	s := r.step(rep.Step)
	if rep.StepSeconds >= s.StepSeconds {
		s.StepSeconds, s.WaitSeconds = rep.StepSeconds, rep.WaitSeconds
		s.TrainStart = at - rep.StepSeconds
	}
	s.PeakMemoryBytes = max(s.PeakMemoryBytes, uint64(max(rep.PeakMemoryBytes, 0)))
	if rep.Rank == 0 {
		s.Loss = rep.Loss
	}
	changed := rep.PID > 0 && r.pids[rep.Rank] != rep.PID
	if changed {
		r.pids[rep.Rank] = rep.PID
	}
	pids := make([]int32, 0, len(r.pids))
	for _, p := range r.pids {
		pids = append(pids, p)
	}
	r.mu.Unlock()
	if changed && r.Monitor != nil {
		r.Monitor.SetTrainerPIDs(pids)
	}
}

// StepCommitted implements sidecar.StepObserver.
func (r *Recorder) StepCommitted(n int64) {
	at := r.since(r.now())
	r.mu.Lock()
	r.committed[n] = at
	r.mu.Unlock()
}

// SampleGPU copies the monitor's new samples into the timeline every poll until ctx
// ends; the monitor samples at its own rate (10 Hz) into a ring buffer, which a poll
// every second drains long before it wraps.
func (r *Recorder) SampleGPU(ctx context.Context, poll time.Duration) error {
	if r.Monitor == nil || r.Monitor.DeviceCount() == 0 {
		return nil
	}
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		r.drainGPU()
		select {
		case <-ctx.Done():
			r.drainGPU()
			return nil
		case <-t.C:
		}
	}
}

// drainGPU keeps the samples newer than the last one taken.
func (r *Recorder) drainGPU() {
	samples := r.Monitor.Samples()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range samples {
		if s.Time.After(r.lastGPU) && len(s.Devices) > 0 {
			r.lastGPU = s.Time
			r.gpu = append(r.gpu, s)
		}
	}
}

// gpuTimeline is the trainer's device's samples: the first device any sample saw a
// trainer process on (its PIDs come with the first report, so earlier samples are
// attributed afterwards), device 0 when none was seen.
func (r *Recorder) gpuTimeline() []GPUSample {
	dev := -1
	for _, s := range r.gpu {
		for _, d := range s.Devices {
			if len(d.Procs) > 0 && dev < 0 {
				dev = d.Index
			}
		}
	}
	dev = max(dev, 0)
	var out []GPUSample
	for _, s := range r.gpu {
		for _, d := range s.Devices {
			if d.Index != dev {
				continue
			}
			g := GPUSample{T: r.since(s.Time), Utilization: float64(d.Util) / 100, MemoryUsed: d.MemoryUsed, MemoryTotal: d.MemoryTotal}
			for _, p := range d.Procs {
				g.ProcessMemory += p.MemoryUsed
				g.ProcessSMShare += float64(p.SMUtil) / 100
			}
			out = append(out, g)
		}
	}
	return out
}

// Run assembles the timeline into a Run: steps in order (only those the trainer
// reported on), GPU samples, and the wall and training times.
func (r *Recorder) Run(name, strategy string, setup Setup) Run {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := Run{Name: name, Strategy: strategy, Started: r.Start.UTC(), Setup: setup, GPU: r.gpuTimeline()}
	first, last := -1.0, 0.0
	for _, s := range r.steps {
		if s.StepSeconds == 0 && s.TrainStart == 0 {
			continue // formed, never trained in this run
		}
		out.Steps = append(out.Steps, *s)
		if first < 0 || s.TrainStart < first {
			first = s.TrainStart
		}
		last = max(last, s.TrainStart+s.StepSeconds)
	}
	sort.Slice(out.Steps, func(i, j int) bool { return out.Steps[i].Step < out.Steps[j].Step })
	for _, at := range r.committed {
		out.WallSeconds = max(out.WallSeconds, at)
	}
	if first >= 0 {
		out.TrainSeconds = last - first
	}
	return out
}
