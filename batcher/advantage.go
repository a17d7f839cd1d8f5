package batcher

import (
	"errors"
	"fmt"
	"math"
)

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

// ErrNonFiniteAdvantage is wrapped by the error of a group whose advantages cannot be
// represented: a reward so large that the group's mean, its deviation or an advantage
// overflows (float64, or the float32 of the Arrow column).
var ErrNonFiniteAdvantage = errors.New("non-finite advantage")

// checkedAdvantages is Advantages, refusing what would train on ±Inf or on a silent 0:
// non-finite rewards, an overflowing mean or deviation, an advantage beyond float32.
func checkedAdvantages(kind Advantage, rewards []float64) ([]float64, error) {
	var sum, ss float64
	for _, r := range rewards {
		sum += r
	}
	mean := sum / float64(max(len(rewards), 1))
	for _, r := range rewards {
		ss += (r - mean) * (r - mean)
	}
	if math.IsInf(sum, 0) || math.IsNaN(sum) || math.IsInf(ss, 0) || math.IsNaN(ss) {
		return nil, fmt.Errorf("%w: the rewards %v overflow the group's mean or deviation", ErrNonFiniteAdvantage, rewards)
	}
	adv := Advantages(kind, rewards)
	for i, a := range adv {
		if f := float32(a); math.IsInf(float64(f), 0) || math.IsNaN(float64(f)) {
			return nil, fmt.Errorf("%w: session %d's advantage %v (reward %v) is not a finite float32",
				ErrNonFiniteAdvantage, i, a, rewards[i])
		}
	}
	return adv, nil
}
