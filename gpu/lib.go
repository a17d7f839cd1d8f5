// Package gpu watches the GPUs the trainer runs on and sizes the token budget to them.
//
// The Monitor samples NVML (when a driver is present) and the host (gopsutil) at 10 Hz
// into a fixed-size ring buffer; Window summarizes a step's samples (GPU busy fraction,
// peak memory, per-trainer-process figures). The BudgetController turns per-step
// observations of rows and peak memory into the token budget B for `--token-budget auto`.
//
// NVML is reached through Lib, a few-method interface of this package. SystemNVML builds
// it from go-nvml's nvml.Interface when cgo is on; without cgo (or without a driver) Init
// fails and the Monitor runs with zero devices: no GPU is a device count of zero.
package gpu

import (
	"errors"
	"fmt"
)

// ErrNotSupported marks an NVML query the device or driver does not support. Adapters
// wrap it together with the underlying NVML error.
var ErrNotSupported = errors.New("not supported")

// Lib is the part of NVML floe uses. Every method but Init may be called only after a
// successful Init; the Monitor never calls anything on a Lib whose Init failed.
type Lib interface {
	Init() error
	Shutdown() error
	DeviceCount() (int, error)
	Device(index int) (Device, error)
}

// Device is the part of an NVML device handle floe uses.
type Device interface {
	Name() (string, error)
	UUID() (string, error)
	// Memory is the device's framebuffer memory in bytes.
	Memory() (used, total uint64, err error)
	// Utilization is the percentage of the last driver sample period in which a kernel
	// ran (gpu) and in which device memory was read or written (mem), both 0..100.
	Utilization() (gpu, mem uint32, err error)
	// ComputeProcesses lists the processes with a compute context on the device.
	ComputeProcesses() ([]ProcessMemory, error)
	// ProcessUtilization returns per-process samples newer than since (the driver's
	// microsecond timestamps); none (and no error) when there is nothing newer.
	ProcessUtilization(since uint64) ([]ProcessUtilization, error)
}

// ProcessMemory is one process's memory on a device. MemoryUsed is 0 when the driver
// cannot tell (for example without access to the host PID namespace).
type ProcessMemory struct {
	PID        int32
	MemoryUsed uint64
}

// ProcessUtilization is one driver sample of a process's SM and memory utilization (%).
type ProcessUtilization struct {
	PID       int32
	Timestamp uint64 // driver timestamp, microseconds
	SMUtil    uint32
	MemUtil   uint32
}

// failingLib is a Lib whose Init always fails; any other call is a bug and panics, so a
// test or a build without NVML notices a call after a failed Init.
type failingLib struct{ err error }

func (f failingLib) Init() error { return f.err }
func (f failingLib) Shutdown() error {
	panic(fmt.Sprintf("gpu: NVML Shutdown after a failed Init (%v)", f.err))
}
func (f failingLib) DeviceCount() (int, error) {
	panic(fmt.Sprintf("gpu: NVML DeviceCount after a failed Init (%v)", f.err))
}
func (f failingLib) Device(int) (Device, error) {
	panic(fmt.Sprintf("gpu: NVML Device after a failed Init (%v)", f.err))
}
