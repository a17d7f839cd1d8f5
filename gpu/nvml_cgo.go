//go:build cgo

package gpu

import (
	"errors"
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// SystemNVML is the machine's NVML, loaded from the driver at Init. On a machine without
// the driver Init fails and the Monitor runs with zero devices.
func SystemNVML() Lib { return FromNVML(nvml.New()) }

// FromNVML narrows an nvml.Interface (the real library or one of go-nvml's mock
// machines) to Lib.
func FromNVML(lib nvml.Interface) Lib { return nvmlLib{lib} }

type nvmlLib struct{ lib nvml.Interface }

// nvmlErr wraps a non-success Return with the operation; NOT_SUPPORTED also wraps
// ErrNotSupported so callers need not import nvml.
func nvmlErr(op string, ret nvml.Return) error {
	if ret == nvml.SUCCESS {
		return nil
	}
	if errors.Is(ret, nvml.ERROR_NOT_SUPPORTED) {
		return fmt.Errorf("nvml %s: %w: %w", op, ErrNotSupported, ret)
	}
	return fmt.Errorf("nvml %s: %w", op, ret)
}

func (l nvmlLib) Init() error     { return nvmlErr("init", l.lib.Init()) }
func (l nvmlLib) Shutdown() error { return nvmlErr("shutdown", l.lib.Shutdown()) }

func (l nvmlLib) DeviceCount() (int, error) {
	n, ret := l.lib.DeviceGetCount()
	return n, nvmlErr("device count", ret)
}

func (l nvmlLib) Device(index int) (Device, error) {
	d, ret := l.lib.DeviceGetHandleByIndex(index)
	if err := nvmlErr(fmt.Sprintf("device %d handle", index), ret); err != nil {
		return nil, err
	}
	return nvmlDevice{d}, nil
}

type nvmlDevice struct{ d nvml.Device }

func (d nvmlDevice) Name() (string, error) {
	s, ret := d.d.GetName()
	return s, nvmlErr("name", ret)
}

func (d nvmlDevice) UUID() (string, error) {
	s, ret := d.d.GetUUID()
	return s, nvmlErr("uuid", ret)
}

func (d nvmlDevice) Memory() (used, total uint64, err error) {
	m, ret := d.d.GetMemoryInfo()
	return m.Used, m.Total, nvmlErr("memory info", ret)
}

func (d nvmlDevice) Utilization() (gpu, mem uint32, err error) {
	u, ret := d.d.GetUtilizationRates()
	return u.Gpu, u.Memory, nvmlErr("utilization rates", ret)
}

// valueNotAvailable is NVML_VALUE_NOT_AVAILABLE as an unsigned long long.
const valueNotAvailable = ^uint64(0)

func (d nvmlDevice) ComputeProcesses() ([]ProcessMemory, error) {
	ps, ret := d.d.GetComputeRunningProcesses()
	if err := nvmlErr("compute running processes", ret); err != nil {
		return nil, err
	}
	out := make([]ProcessMemory, len(ps))
	for i, p := range ps {
		used := p.UsedGpuMemory
		if used == valueNotAvailable {
			used = 0
		}
		out[i] = ProcessMemory{PID: int32(p.Pid), MemoryUsed: used}
	}
	return out, nil
}

func (d nvmlDevice) ProcessUtilization(since uint64) ([]ProcessUtilization, error) {
	ss, ret := d.d.GetProcessUtilization(since)
	if errors.Is(ret, nvml.ERROR_NOT_FOUND) {
		return nil, nil // no sample newer than since
	}
	if err := nvmlErr("process utilization", ret); err != nil {
		return nil, err
	}
	out := make([]ProcessUtilization, len(ss))
	for i, s := range ss {
		out[i] = ProcessUtilization{PID: int32(s.Pid), Timestamp: s.TimeStamp, SMUtil: s.SmUtil, MemUtil: s.MemUtil}
	}
	return out, nil
}
