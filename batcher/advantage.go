package batcher

import (
	"errors"
	"fmt"
	"math"

	"github.com/floe-rl/floe/trace"
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

// InBaseline reports whether a session's reward enters its group's baseline (the mean and
// deviation its advantages are taken against). A failed session does not: "failed" says
// the run broke (a harness or infrastructure error), so its reward measures nothing the
// policy did, and counting it (0 by convention) would raise every other session's
// advantage by an amount set by the failure rate. A timed-out session does: running out of
// time is an outcome of the policy, and its reward (0 when the group timeout ended it) is
// a real comparison. Neither trains its own tokens (floe serve marks their calls
// untrainable); -drop-failed removes both from the group altogether.
func InBaseline(s *trace.Session) bool { return s.Status != trace.StatusFailed }

// SessionAdvantages returns one advantage per session of a group: Advantages over the
// rewards of the sessions InBaseline, and 0 for the others. It refuses advantages that are
// not finite float32s (ErrNonFiniteAdvantage).
func SessionAdvantages(kind Advantage, sessions []trace.Session) ([]float64, error) {
	var rewards []float64
	for i := range sessions {
		if InBaseline(&sessions[i]) {
			rewards = append(rewards, sessions[i].Reward)
		}
	}
	adv, err := checkedAdvantages(kind, rewards)
	if err != nil {
		return nil, err
	}
	out := make([]float64, len(sessions))
	k := 0
	for i := range sessions {
		if InBaseline(&sessions[i]) {
			out[i] = adv[k]
			k++
		}
	}
	return out, nil
}

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
