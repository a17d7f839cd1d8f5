package gpu

import (
	"context"
	"fmt"

	"github.com/shirou/gopsutil/v4/cpu"
	"github.com/shirou/gopsutil/v4/mem"
)

// HostSample is the host's CPU and memory at one sample.
type HostSample struct {
	CPUPercent float64 // all CPUs, 0..100, since the previous read
	MemUsed    uint64  // bytes
	MemTotal   uint64  // bytes
}

// HostReader reads host CPU and memory.
type HostReader interface {
	ReadHost(ctx context.Context) (HostSample, error)
}

// GopsutilHost reads the host through gopsutil. CPU% is measured between successive
// reads (the first read is against boot).
type GopsutilHost struct{}

// ReadHost implements HostReader.
func (GopsutilHost) ReadHost(ctx context.Context) (HostSample, error) {
	var h HostSample
	pct, err := cpu.PercentWithContext(ctx, 0, false)
	if err != nil {
		return h, fmt.Errorf("host cpu: %w", err)
	}
	if len(pct) > 0 {
		h.CPUPercent = pct[0]
	}
	vm, err := mem.VirtualMemoryWithContext(ctx)
	if err != nil {
		return h, fmt.Errorf("host memory: %w", err)
	}
	h.MemUsed, h.MemTotal = vm.Used, vm.Total
	return h, nil
}

// NoHost reads nothing (zero host figures); for tests.
type NoHost struct{}

// ReadHost implements HostReader.
func (NoHost) ReadHost(context.Context) (HostSample, error) { return HostSample{}, nil }
