package batcher

import "math"

// advantageEps keeps GRPO finite for a group whose rewards are all equal.
const advantageEps = 1e-6

// Advantages returns one advantage per reward, computed within the group.
// A group of one session has nothing to compare against: its advantage is 0.
func Advantages(kind Advantage, rewards []float64) []float64 {
	n := len(rewards)
	out := make([]float64, n)
	if n < 2 {
		return out
	}
	var sum float64
	for _, r := range rewards {
		sum += r
	}
	mean := sum / float64(n)
	switch kind {
	case DrGRPO:
		for i, r := range rewards {
			out[i] = r - mean
		}
	case RLOO:
		// r_i - (sum - r_i)/(n-1) == n/(n-1) * (r_i - mean)
		scale := float64(n) / float64(n-1)
		for i, r := range rewards {
			out[i] = scale * (r - mean)
		}
	default: // GRPO
		var ss float64
		for _, r := range rewards {
			ss += (r - mean) * (r - mean)
		}
		std := math.Sqrt(ss / float64(n-1))
		for i, r := range rewards {
			out[i] = (r - mean) / (std + advantageEps)
		}
	}
	return out
}
