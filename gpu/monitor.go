package gpu

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"time"
)

// Defaults of MonitorConfig.
const (
	DefaultInterval = 100 * time.Millisecond // 10 Hz
	DefaultCapacity = 6000                   // 10 minutes at 10 Hz
)

// procUtilStale is how long a process's last utilization sample is carried forward when
// the driver has nothing newer (it samples every 1/6 s to 1 s, slower than we poll).
const procUtilStale = time.Second

// errLogEvery rate-limits repeated sampling errors of one device.
const errLogEvery = time.Minute

// MonitorConfig configures a Monitor. The zero value samples at 10 Hz into a ring of
// DefaultCapacity samples, reads the host with gopsutil and logs to slog.Default.
type MonitorConfig struct {
	Interval time.Duration // sampling period; DefaultInterval when zero
	Capacity int           // ring buffer size in samples; DefaultCapacity when zero
	Host     HostReader    // nil: GopsutilHost
	Logger   *slog.Logger  // nil: slog.Default()
	// Ticks, when set, drives Run instead of a time.Ticker: each value received is one
	// sample at that time (fake time in tests).
	Ticks <-chan time.Time
}

// DeviceInfo describes one device, read once at start.
type DeviceInfo struct {
	Index       int
	Name        string
	UUID        string
	MemoryTotal uint64
}

// ProcSample is one trainer process on one device.
type ProcSample struct {
	PID        int32
	MemoryUsed uint64 // bytes; 0 when the driver does not say
	SMUtil     uint32 // %, the driver's latest sample (carried forward up to 1 s)
	MemUtil    uint32 // %
}

// DeviceSample is one device at one sample.
type DeviceSample struct {
	Index       int
	MemoryUsed  uint64 // bytes, whole device
	MemoryTotal uint64 // bytes
	Util        uint32 // % of the driver's sample period with a kernel running
	MemUtil     uint32 // % with device memory being read or written
	Procs       []ProcSample
	Err         string // first error of this sample, "" when all queries succeeded
}

// Sample is one tick: every device and the host.
type Sample struct {
	Time    time.Time
	Devices []DeviceSample // empty without a GPU
	Host    HostSample
}

// Monitor samples the GPUs and the host into a fixed-size ring buffer. Its methods are
// safe for concurrent use; Run (or SampleAt) is the only sampler.
type Monitor struct {
	cfg MonitorConfig
	log *slog.Logger
	lib Lib // nil after a failed Init: NVML is never called again

	devs  []Device
	infos []DeviceInfo

	sampleMu sync.Mutex // the sampler's own state
	procLast []map[int32]procUtilSeen
	lastTS   []uint64
	closed   bool // NVML shut down: devices are no longer sampled
	failing  []failState
	hostFail failState

	mu    sync.Mutex
	pids  []int32
	ring  []Sample
	next  int // slot of the next sample
	count int
}

type procUtilSeen struct {
	at     time.Time
	sm, mu uint32
}

type failState struct {
	failing bool
	lastLog time.Time
}

// NewMonitor initializes lib and reads the devices. When Init fails (no driver) it logs
// once that GPU monitoring is off and runs with zero devices, never calling lib again;
// a device that cannot be opened is skipped with a warning.
func NewMonitor(lib Lib, cfg MonitorConfig) *Monitor {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.Capacity <= 0 {
		cfg.Capacity = DefaultCapacity
	}
	if cfg.Host == nil {
		cfg.Host = GopsutilHost{}
	}
	m := &Monitor{cfg: cfg, log: cfg.Logger, ring: make([]Sample, cfg.Capacity)}
	if m.log == nil {
		m.log = slog.Default()
	}
	m.log = m.log.With("component", "gpu")
	if lib == nil {
		m.log.Info("no NVIDIA driver: GPU monitoring off", "err", "no NVML library")
		return m
	}
	if err := lib.Init(); err != nil {
		m.log.Info("no NVIDIA driver: GPU monitoring off", "err", err)
		return m
	}
	n, err := lib.DeviceCount()
	if err != nil {
		m.log.Warn("NVML device count failed: GPU monitoring off", "err", err)
		_ = lib.Shutdown()
		return m
	}
	for i := range n {
		d, err := lib.Device(i)
		if err != nil {
			m.log.Warn("NVML device skipped", "device", i, "err", err)
			continue
		}
		info := DeviceInfo{Index: i}
		info.Name, _ = d.Name()
		info.UUID, _ = d.UUID()
		if _, total, err := d.Memory(); err == nil {
			info.MemoryTotal = total
		}
		m.devs = append(m.devs, d)
		m.infos = append(m.infos, info)
	}
	m.lib = lib
	m.procLast = make([]map[int32]procUtilSeen, len(m.devs))
	for i := range m.procLast {
		m.procLast[i] = map[int32]procUtilSeen{}
	}
	m.lastTS = make([]uint64, len(m.devs))
	m.failing = make([]failState, len(m.devs))
	m.log.Info("GPU monitoring on", "devices", len(m.devs), "interval", cfg.Interval)
	return m
}

// DeviceCount is the number of devices watched; 0 without a GPU.
func (m *Monitor) DeviceCount() int { return len(m.devs) }

// Devices describes the devices watched.
func (m *Monitor) Devices() []DeviceInfo { return slices.Clone(m.infos) }

// Interval is the sampling period.
func (m *Monitor) Interval() time.Duration { return m.cfg.Interval }

// SetTrainerPIDs sets the processes whose per-device memory and utilization are
// recorded (the PIDs trainer ranks give in their reports), replacing earlier ones.
func (m *Monitor) SetTrainerPIDs(pids []int32) {
	p := slices.Clone(pids)
	slices.Sort(p)
	p = slices.Compact(p)
	m.mu.Lock()
	m.pids = p
	m.mu.Unlock()
}

// TrainerPIDs returns the processes being watched.
func (m *Monitor) TrainerPIDs() []int32 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.pids)
}

// Run samples every Interval (or on each value of MonitorConfig.Ticks) until ctx ends,
// then shuts NVML down and returns nil. It owns its ticker.
func (m *Monitor) Run(ctx context.Context) error {
	ticks := m.cfg.Ticks
	if ticks == nil {
		t := time.NewTicker(m.cfg.Interval)
		defer t.Stop()
		ticks = t.C
	}
	defer m.shutdown()
	for {
		select {
		case <-ctx.Done():
			return nil
		case now, ok := <-ticks:
			if !ok {
				return nil
			}
			m.sample(ctx, now)
		}
	}
}

func (m *Monitor) shutdown() {
	m.sampleMu.Lock()
	defer m.sampleMu.Unlock()
	if m.lib == nil {
		return
	}
	if err := m.lib.Shutdown(); err != nil {
		m.log.Warn("NVML shutdown", "err", err)
	}
	m.lib, m.closed = nil, true
}

// SampleAt takes one sample stamped now, stores it and returns it. Run calls it on every
// tick; tests and callers without Run may call it directly (one sampler at a time).
func (m *Monitor) SampleAt(now time.Time) Sample {
	return m.sample(context.Background(), now)
}

func (m *Monitor) sample(ctx context.Context, now time.Time) Sample {
	m.sampleMu.Lock()
	defer m.sampleMu.Unlock()
	pids := m.TrainerPIDs()

	s := Sample{Time: now}
	if len(m.devs) > 0 && !m.closed {
		s.Devices = make([]DeviceSample, len(m.devs))
		for i, d := range m.devs {
			s.Devices[i] = m.sampleDevice(i, d, now, pids)
		}
	}
	h, err := m.cfg.Host.ReadHost(ctx)
	m.noteErr(&m.hostFail, now, err, "host")
	s.Host = h

	m.mu.Lock()
	m.ring[m.next] = s
	m.next = (m.next + 1) % len(m.ring)
	m.count = min(m.count+1, len(m.ring))
	m.mu.Unlock()
	return s
}

func (m *Monitor) sampleDevice(i int, d Device, now time.Time, pids []int32) DeviceSample {
	ds := DeviceSample{Index: m.infos[i].Index, MemoryTotal: m.infos[i].MemoryTotal}
	var firstErr error
	keep := func(err error) {
		if err != nil && firstErr == nil {
			firstErr = err
		}
	}
	used, total, err := d.Memory()
	keep(err)
	if err == nil {
		ds.MemoryUsed, ds.MemoryTotal = used, total
	}
	u, mu, err := d.Utilization()
	keep(err)
	if err == nil {
		ds.Util, ds.MemUtil = u, mu
	}
	if len(pids) > 0 {
		ds.Procs, err = m.sampleProcs(i, d, now, pids)
		keep(err)
	}
	if firstErr != nil {
		ds.Err = firstErr.Error()
	}
	m.noteErr(&m.failing[i], now, firstErr, "device", "device", ds.Index)
	return ds
}

// sampleProcs returns the trainer processes present on device i with their memory and
// latest utilization.
func (m *Monitor) sampleProcs(i int, d Device, now time.Time, pids []int32) ([]ProcSample, error) {
	procs, err := d.ComputeProcesses()
	if err != nil {
		return nil, err
	}
	var out []ProcSample
	for _, p := range procs {
		if _, ok := slices.BinarySearch(pids, p.PID); ok {
			out = append(out, ProcSample{PID: p.PID, MemoryUsed: p.MemoryUsed})
		}
	}
	if len(out) == 0 {
		return nil, nil
	}
	utils, uerr := d.ProcessUtilization(m.lastTS[i])
	if uerr != nil && !errors.Is(uerr, ErrNotSupported) {
		err = uerr
	}
	seen := m.procLast[i]
	for _, u := range utils {
		if u.Timestamp > m.lastTS[i] {
			m.lastTS[i] = u.Timestamp
		}
		if prev, ok := seen[u.PID]; ok && prev.at.Equal(now) {
			// several driver samples in one poll: keep the largest
			u.SMUtil, u.MemUtil = max(u.SMUtil, prev.sm), max(u.MemUtil, prev.mu)
		}
		seen[u.PID] = procUtilSeen{at: now, sm: u.SMUtil, mu: u.MemUtil}
	}
	for j := range out {
		if last, ok := seen[out[j].PID]; ok && now.Sub(last.at) <= procUtilStale {
			out[j].SMUtil, out[j].MemUtil = last.sm, last.mu
		}
	}
	for pid, last := range seen {
		if now.Sub(last.at) > procUtilStale {
			delete(seen, pid)
		}
	}
	return out, err
}

// noteErr logs a sampling error at most once per errLogEvery while it persists, and
// once "recovered" when it heals.
func (m *Monitor) noteErr(f *failState, now time.Time, err error, what string, args ...any) {
	switch {
	case err != nil && (!f.failing || now.Sub(f.lastLog) >= errLogEvery):
		m.log.Warn(what+" sampling failed", append(args, "err", err)...)
		f.failing, f.lastLog = true, now
	case err == nil && f.failing:
		m.log.Info(what+" sampling recovered", args...)
		f.failing = false
	}
}

// Latest returns the newest sample, if any.
func (m *Monitor) Latest() (Sample, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.count == 0 {
		return Sample{}, false
	}
	return m.ring[(m.next-1+len(m.ring))%len(m.ring)], true
}

// Samples returns every sample held, oldest first.
func (m *Monitor) Samples() []Sample {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Sample, 0, m.count)
	start := (m.next - m.count + len(m.ring)) % len(m.ring)
	for k := range m.count {
		out = append(out, m.ring[(start+k)%len(m.ring)])
	}
	return out
}

// Window returns the samples with from <= Time <= to, oldest first, and their summary.
// Samples older than the ring's capacity are gone; Summary.Samples says how many were
// found.
func (m *Monitor) Window(from, to time.Time) ([]Sample, Summary) {
	var in []Sample
	for _, s := range m.Samples() {
		if !s.Time.Before(from) && !s.Time.After(to) {
			in = append(in, s)
		}
	}
	return in, Summarize(from, to, in)
}
