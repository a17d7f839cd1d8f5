package gpu

import "time"

// Summary condenses the samples of a window (typically one training step).
type Summary struct {
	From, To time.Time
	Samples  int

	// Devices has one entry per device seen in the window; empty without a GPU.
	Devices []DeviceSummary
	// TrainerDevices are the indices of the devices on which a trainer process was
	// seen in the window. The aggregate figures below cover these devices, or every
	// device when no trainer process was seen.
	TrainerDevices []int

	// BusyFraction is the mean GPU utilization over the window and devices, 0..1: the
	// "GPU busy fraction over the step". MaxUtil is the largest single reading, 0..1.
	BusyFraction float64
	MaxUtil      float64
	// PeakMemoryUsed is the largest device memory in use at any sample on any covered
	// device, MemoryTotal the smallest total among them (the device that runs out first).
	PeakMemoryUsed uint64
	MemoryTotal    uint64
	// PeakTrainerMemory is the largest memory of one trainer process on one device.
	PeakTrainerMemory uint64

	HostCPUMean, HostCPUMax float64 // %
	HostMemPeak             uint64  // bytes
}

// DeviceSummary condenses one device's samples.
type DeviceSummary struct {
	Index             int
	Samples           int     // samples with a reading of this device
	MeanUtil, MaxUtil float64 // 0..1
	PeakMemoryUsed    uint64
	MemoryTotal       uint64
	PeakTrainerMemory uint64  // largest single trainer process on this device
	MeanTrainerSMUtil float64 // 0..1, sum over trainer processes, mean over samples
	TrainerSeen       bool
}

// Summarize condenses samples (any order) of the window [from, to].
func Summarize(from, to time.Time, samples []Sample) Summary {
	sum := Summary{From: from, To: to, Samples: len(samples)}
	pos := map[int]int{} // device index -> position in sum.Devices
	utilSum := []float64{}
	smSum := []float64{}
	for _, s := range samples {
		sum.HostCPUMean += s.Host.CPUPercent
		sum.HostCPUMax = max(sum.HostCPUMax, s.Host.CPUPercent)
		sum.HostMemPeak = max(sum.HostMemPeak, s.Host.MemUsed)
		for _, d := range s.Devices {
			k, ok := pos[d.Index]
			if !ok {
				k = len(sum.Devices)
				pos[d.Index] = k
				sum.Devices = append(sum.Devices, DeviceSummary{Index: d.Index})
				utilSum = append(utilSum, 0)
				smSum = append(smSum, 0)
			}
			ds := &sum.Devices[k]
			ds.Samples++
			u := float64(d.Util) / 100
			utilSum[k] += u
			ds.MaxUtil = max(ds.MaxUtil, u)
			ds.PeakMemoryUsed = max(ds.PeakMemoryUsed, d.MemoryUsed)
			if d.MemoryTotal > 0 && (ds.MemoryTotal == 0 || d.MemoryTotal < ds.MemoryTotal) {
				ds.MemoryTotal = d.MemoryTotal
			}
			var sm float64
			for _, p := range d.Procs {
				ds.TrainerSeen = true
				ds.PeakTrainerMemory = max(ds.PeakTrainerMemory, p.MemoryUsed)
				sm += float64(p.SMUtil) / 100
			}
			smSum[k] += min(sm, 1)
		}
	}
	if len(samples) > 0 {
		sum.HostCPUMean /= float64(len(samples))
	}
	for k := range sum.Devices {
		ds := &sum.Devices[k]
		ds.MeanUtil = utilSum[k] / float64(ds.Samples)
		ds.MeanTrainerSMUtil = smSum[k] / float64(ds.Samples)
		if ds.TrainerSeen {
			sum.TrainerDevices = append(sum.TrainerDevices, ds.Index)
		}
	}
	var n int
	for k := range sum.Devices {
		ds := &sum.Devices[k]
		if len(sum.TrainerDevices) > 0 && !ds.TrainerSeen {
			continue
		}
		n += ds.Samples
		sum.BusyFraction += utilSum[k]
		sum.MaxUtil = max(sum.MaxUtil, ds.MaxUtil)
		sum.PeakMemoryUsed = max(sum.PeakMemoryUsed, ds.PeakMemoryUsed)
		if ds.MemoryTotal > 0 && (sum.MemoryTotal == 0 || ds.MemoryTotal < sum.MemoryTotal) {
			sum.MemoryTotal = ds.MemoryTotal
		}
		sum.PeakTrainerMemory = max(sum.PeakTrainerMemory, ds.PeakTrainerMemory)
	}
	if n > 0 {
		sum.BusyFraction /= float64(n)
	}
	return sum
}
