//go:build cgo

package gpu

import (
	"bytes"
	"context"
	"log/slog"
	"math"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// fakeClock is the fake time the scripted curves read.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) get() time.Time  { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *fakeClock) set(t time.Time) { c.mu.Lock(); c.now = t; c.mu.Unlock() }

type fakeHost struct{ clock *fakeClock }

func (h fakeHost) ReadHost(context.Context) (HostSample, error) {
	s := h.clock.get().Sub(t0).Seconds()
	return HostSample{CPUPercent: 10 + s, MemUsed: uint64(s * gib), MemTotal: 512 * gib}, nil
}

// Scripted machine: an H200 DGX (8 devices). Trainer rank 0 (PID 4242) runs on device 0
// and rank 1 (PID 4243) on device 1; an inference server (PID 999) holds device 2.
// During the "step" [2s, 4s) devices 0 and 1 are 90% busy, 10% otherwise; device 2 is
// always 50% busy. Device memory ramps linearly in the step and drops after it.
const (
	stepStart = 2 * time.Second
	stepEnd   = 4 * time.Second
)

func inStep(d time.Duration) bool { return d >= stepStart && d < stepEnd }

func scriptMachine(t *testing.T, clock *fakeClock) *server.Server {
	t.Helper()
	srv := dgxh200.New()
	for i, nd := range srv.Devices {
		d := nd.(*server.Device)
		total := d.MemoryInfo.Total
		d.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
			el := clock.get().Sub(t0)
			switch {
			case i == 2:
				return nvml.Utilization{Gpu: 50, Memory: 30}, nvml.SUCCESS
			case i < 2 && inStep(el):
				return nvml.Utilization{Gpu: 90, Memory: 40}, nvml.SUCCESS
			default:
				return nvml.Utilization{Gpu: 10, Memory: 5}, nvml.SUCCESS
			}
		}
		d.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) {
			used := uint64(2 * gib)
			if el := clock.get().Sub(t0); i < 2 && inStep(el) {
				used = uint64(20*gib + float64(el-stepStart)/float64(time.Second)*30*gib)
			}
			if i == 2 {
				used = 100 * gib
			}
			return nvml.Memory{Total: total, Used: used, Free: total - used}, nvml.SUCCESS
		}
		d.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
			switch i {
			case 0, 1:
				used := uint64(1 * gib)
				if inStep(clock.get().Sub(t0)) {
					used = 40 * gib
				}
				return []nvml.ProcessInfo{{Pid: uint32(4242 + i), UsedGpuMemory: used}}, nvml.SUCCESS
			case 2:
				return []nvml.ProcessInfo{{Pid: 999, UsedGpuMemory: 99 * gib}}, nvml.SUCCESS
			}
			return nil, nvml.SUCCESS
		}
		// The driver produces a per-process sample every 300 ms (slower than 10 Hz).
		d.GetProcessUtilizationFunc = func(since uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
			el := clock.get().Sub(t0)
			ts := uint64(el/(300*time.Millisecond)) * 300_000 // µs
			if ts <= since || i > 2 {
				return nil, nvml.ERROR_NOT_FOUND
			}
			sm := uint32(5)
			if inStep(el) {
				sm = 80
			}
			pid := uint32(4242 + i)
			if i == 2 {
				pid = 999
			}
			return []nvml.ProcessUtilizationSample{{Pid: pid, TimeStamp: ts, SmUtil: sm, MemUtil: sm / 2}}, nvml.SUCCESS
		}
	}
	return srv
}

func newLogger(buf *bytes.Buffer) *slog.Logger {
	return slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// tick advances the fake clock by the monitor's interval and samples.
func tick(m *Monitor, clock *fakeClock, n int) {
	for range n {
		clock.set(clock.get().Add(m.Interval()))
		m.SampleAt(clock.get())
	}
}

func TestMonitorOnMockH200(t *testing.T) {
	clock := &fakeClock{now: t0}
	srv := scriptMachine(t, clock)
	var logs bytes.Buffer
	m := NewMonitor(FromNVML(srv), MonitorConfig{Capacity: 60, Host: fakeHost{clock}, Logger: newLogger(&logs)})
	if m.DeviceCount() != 8 {
		t.Fatalf("devices: %d, want 8", m.DeviceCount())
	}
	info := m.Devices()[0]
	if !strings.Contains(info.Name, "H200") || !strings.HasPrefix(info.UUID, "GPU-") || info.MemoryTotal != 144384*mib {
		t.Fatalf("device 0: %+v", info)
	}
	m.SetTrainerPIDs([]int32{4243, 4242, 4242})

	tick(m, clock, 50) // t0+0.1s .. t0+5.0s

	// Ring buffer.
	all := m.Samples()
	if len(all) != 50 || !all[0].Time.Equal(t0.Add(100*time.Millisecond)) || !all[49].Time.Equal(t0.Add(5*time.Second)) {
		t.Fatalf("ring: %d samples from %v to %v", len(all), all[0].Time, all[len(all)-1].Time)
	}
	tick(m, clock, 30) // 80 samples through a ring of 60
	all = m.Samples()
	if len(all) != 60 || !all[0].Time.Equal(t0.Add(2100*time.Millisecond)) || !all[59].Time.Equal(t0.Add(8*time.Second)) {
		t.Fatalf("ring after wrap: %d samples from %v to %v", len(all), all[0].Time.Sub(t0), all[len(all)-1].Time.Sub(t0))
	}
	for i := 1; i < len(all); i++ {
		if !all[i].Time.After(all[i-1].Time) {
			t.Fatalf("ring out of order at %d", i)
		}
	}
	if last, ok := m.Latest(); !ok || !last.Time.Equal(all[59].Time) {
		t.Fatalf("latest: %v", last.Time)
	}

	// Per-PID figures: the trainer processes only, carried between driver samples.
	s := all[10] // t0+3.1s, in the step
	if got := s.Devices[0].Procs; len(got) != 1 || got[0].PID != 4242 || got[0].MemoryUsed != 40*gib || got[0].SMUtil != 80 {
		t.Fatalf("device 0 trainer processes at %v: %+v", s.Time.Sub(t0), got)
	}
	if got := s.Devices[1].Procs; len(got) != 1 || got[0].PID != 4243 {
		t.Fatalf("device 1 trainer processes: %+v", got)
	}
	if got := s.Devices[2].Procs; len(got) != 0 {
		t.Fatalf("device 2 (inference) must show no trainer process: %+v", got)
	}
	for _, s := range all {
		if el := s.Time.Sub(t0); inStep(el) && el >= stepStart+300*time.Millisecond && s.Devices[0].Procs[0].SMUtil != 80 {
			t.Fatalf("at %v: trainer SM util %d, want 80 carried between driver samples", el, s.Devices[0].Procs[0].SMUtil)
		}
	}

	// The step's window: [2s, 4s) has 20 samples, 2.1s .. 3.9s (+ the 4.0s boundary).
	samples, sum := m.Window(t0.Add(stepStart), t0.Add(stepEnd-time.Millisecond))
	if len(samples) != 19 || sum.Samples != 19 {
		t.Fatalf("window: %d samples", len(samples))
	}
	if len(sum.TrainerDevices) != 2 || sum.TrainerDevices[0] != 0 || sum.TrainerDevices[1] != 1 {
		t.Fatalf("trainer devices: %v", sum.TrainerDevices)
	}
	if math.Abs(sum.BusyFraction-0.9) > 1e-9 || sum.MaxUtil != 0.9 {
		t.Fatalf("busy fraction %v max %v, want 0.9 (inference device excluded)", sum.BusyFraction, sum.MaxUtil)
	}
	wantPeak := uint64(20*gib + 1.9*30*gib) // ramp at 3.9s
	if sum.PeakMemoryUsed < wantPeak-mib || sum.PeakMemoryUsed > wantPeak+mib || sum.MemoryTotal != 144384*mib {
		t.Fatalf("peak memory %d of %d, want ~%d", sum.PeakMemoryUsed, sum.MemoryTotal, wantPeak)
	}
	if sum.PeakTrainerMemory != 40*gib {
		t.Fatalf("peak trainer memory %d", sum.PeakTrainerMemory)
	}
	if len(sum.Devices) != 8 || sum.Devices[2].MeanUtil != 0.5 || sum.Devices[2].TrainerSeen {
		t.Fatalf("device 2 summary: %+v", sum.Devices[2])
	}
	if d0 := sum.Devices[0]; d0.MeanTrainerSMUtil < 0.79 || d0.MeanTrainerSMUtil > 0.81 {
		t.Fatalf("device 0 trainer SM util %v", d0.MeanTrainerSMUtil)
	}
	if sum.HostCPUMax < 13.8 || sum.HostCPUMean < 12 || sum.HostMemPeak == 0 {
		t.Fatalf("host: %+v", sum)
	}

	// A window across the step's end: busy fraction mixes 0.9 and 0.1.
	_, sum = m.Window(t0.Add(3*time.Second), t0.Add(5*time.Second-time.Millisecond))
	if math.Abs(sum.BusyFraction-(10*0.9+10*0.1)/20) > 1e-9 {
		t.Fatalf("busy fraction across the step end: %v", sum.BusyFraction)
	}
	// Without trainer PIDs every device counts.
	m.SetTrainerPIDs(nil)
	tick(m, clock, 10)
	_, sum = m.Window(clock.get().Add(-900*time.Millisecond), clock.get())
	if len(sum.TrainerDevices) != 0 || math.Abs(sum.BusyFraction-(7*0.1+0.5)/8) > 1e-9 {
		t.Fatalf("all devices: busy %v trainer devices %v", sum.BusyFraction, sum.TrainerDevices)
	}
	// Outside the ring: nothing.
	if got, sum := m.Window(t0, t0.Add(time.Second)); len(got) != 0 || sum.Samples != 0 || sum.BusyFraction != 0 {
		t.Fatalf("window before the ring: %d samples", len(got))
	}
	if strings.Contains(logs.String(), "level=WARN") {
		t.Fatalf("unexpected warnings:\n%s", logs.String())
	}
}

func TestMonitorRunOwnsTicker(t *testing.T) {
	clock := &fakeClock{now: t0}
	srv := scriptMachine(t, clock)
	ticks := make(chan time.Time)
	m := NewMonitor(FromNVML(srv), MonitorConfig{Capacity: 16, Host: fakeHost{clock}, Logger: newLogger(&bytes.Buffer{}), Ticks: ticks})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- m.Run(ctx) }()
	for i := 1; i <= 20; i++ {
		at := t0.Add(time.Duration(i) * 100 * time.Millisecond)
		clock.set(at)
		ticks <- at
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := m.Samples(); len(got) != 16 || !got[15].Time.Equal(t0.Add(2*time.Second)) {
		t.Fatalf("after Run: %d samples, last %v", len(got), got[len(got)-1].Time.Sub(t0))
	}
	if n := len(srv.ShutdownCalls()); n != 1 {
		t.Fatalf("Shutdown called %d times, want 1", n)
	}
	// After Run, samples carry no devices and NVML is not called.
	calls := len(srv.Devices[0].(*server.Device).GetMemoryInfoCalls())
	if s := m.SampleAt(t0.Add(time.Hour)); len(s.Devices) != 0 {
		t.Fatalf("sample after shutdown has %d devices", len(s.Devices))
	}
	if got := len(srv.Devices[0].(*server.Device).GetMemoryInfoCalls()); got != calls {
		t.Fatalf("NVML called after shutdown")
	}
}

func TestMonitorNoDriver(t *testing.T) {
	srv := dgxh200.New()
	srv.InitFunc = func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }
	var logs bytes.Buffer
	ticks := make(chan time.Time)
	m := NewMonitor(FromNVML(srv), MonitorConfig{Host: NoHost{}, Logger: newLogger(&logs), Ticks: ticks})
	if m.DeviceCount() != 0 || len(m.Devices()) != 0 {
		t.Fatalf("devices without a driver: %d", m.DeviceCount())
	}
	m.SetTrainerPIDs([]int32{1, 2})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- m.Run(ctx) }()
	for i := range 25 {
		ticks <- t0.Add(time.Duration(i) * 100 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	s := m.SampleAt(t0.Add(time.Minute))
	if len(s.Devices) != 0 {
		t.Fatalf("sample has %d devices", len(s.Devices))
	}
	_, sum := m.Window(t0, t0.Add(time.Hour))
	if sum.Samples != 26 || len(sum.Devices) != 0 || sum.BusyFraction != 0 || sum.PeakMemoryUsed != 0 {
		t.Fatalf("summary without a GPU: %+v", sum)
	}
	if n := strings.Count(logs.String(), "no NVIDIA driver: GPU monitoring off"); n != 1 || strings.Count(logs.String(), "\n") != 1 {
		t.Fatalf("want exactly one log line, got:\n%s", logs.String())
	}
	if !strings.Contains(logs.String(), "ERROR_LIBRARY_NOT_FOUND") {
		t.Errorf("log line does not say why: %s", logs.String())
	}
	if len(srv.InitCalls()) != 1 || len(srv.DeviceGetCountCalls()) != 0 || len(srv.DeviceGetHandleByIndexCalls()) != 0 || len(srv.ShutdownCalls()) != 0 {
		t.Fatalf("NVML calls after a failed Init: init %d count %d handle %d shutdown %d",
			len(srv.InitCalls()), len(srv.DeviceGetCountCalls()), len(srv.DeviceGetHandleByIndexCalls()), len(srv.ShutdownCalls()))
	}
	for i, nd := range srv.Devices {
		d := nd.(*server.Device)
		if len(d.GetMemoryInfoCalls())+len(d.GetUtilizationRatesCalls())+len(d.GetNameCalls())+len(d.GetUUIDCalls()) != 0 {
			t.Fatalf("device %d queried after a failed Init", i)
		}
	}
}

func TestMonitorDeviceErrorsAreRateLimited(t *testing.T) {
	clock := &fakeClock{now: t0}
	srv := scriptMachine(t, clock)
	d0 := srv.Devices[0].(*server.Device)
	var broken bool
	d0.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
		if broken {
			return nvml.Utilization{}, nvml.ERROR_GPU_IS_LOST
		}
		return nvml.Utilization{Gpu: 33}, nvml.SUCCESS
	}
	var logs bytes.Buffer
	m := NewMonitor(FromNVML(srv), MonitorConfig{Host: NoHost{}, Logger: newLogger(&logs)})
	broken = true
	tick(m, clock, 50)
	last, _ := m.Latest()
	if !strings.Contains(last.Devices[0].Err, "ERROR_GPU_IS_LOST") || last.Devices[1].Err != "" {
		t.Fatalf("errors: %q %q", last.Devices[0].Err, last.Devices[1].Err)
	}
	broken = false
	tick(m, clock, 5)
	if n := strings.Count(logs.String(), "device sampling failed"); n != 1 {
		t.Fatalf("%d failure lines in 5 s, want 1:\n%s", n, logs.String())
	}
	if n := strings.Count(logs.String(), "device sampling recovered"); n != 1 {
		t.Fatalf("%d recovered lines, want 1", n)
	}
	if last, _ := m.Latest(); last.Devices[0].Util != 33 || last.Devices[0].Err != "" {
		t.Fatalf("after recovery: %+v", last.Devices[0])
	}
}

// TestSystemNVML runs against this machine's driver: zero devices where there is none.
// FLOE_REQUIRE_GPU=1 (on a GPU machine) makes a missing GPU a failure.
func TestSystemNVML(t *testing.T) {
	var logs bytes.Buffer
	m := NewMonitor(SystemNVML(), MonitorConfig{Logger: newLogger(&logs)})
	s := m.SampleAt(time.Now())
	t.Logf("devices %d: %+v\nhost %+v\n%s", m.DeviceCount(), m.Devices(), s.Host, logs.String())
	if os.Getenv("FLOE_REQUIRE_GPU") == "1" {
		if m.DeviceCount() == 0 || s.Devices[0].MemoryTotal == 0 {
			t.Fatalf("FLOE_REQUIRE_GPU=1 but no device: %s", logs.String())
		}
		m.SetTrainerPIDs([]int32{int32(os.Getpid())})
		time.Sleep(200 * time.Millisecond)
		s = m.SampleAt(time.Now())
		t.Logf("device 0: %+v", s.Devices[0])
	}
	if s.Host.MemTotal == 0 {
		t.Fatalf("no host memory from gopsutil")
	}
}
