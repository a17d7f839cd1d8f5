package corpus

import (
	"math"
	"math/rand/v2"
)

func (r Range) sample(rng *rand.Rand) int {
	return r.Min + rng.IntN(r.Max-r.Min+1)
}

// sample draws a length and reports whether it was cut at Max, which for responses is
// what max_tokens does: the response finishes with "length".
func (s Skewed) sample(rng *rand.Rand) (n int, cut bool) {
	x := s.Median * math.Exp(s.Sigma*rng.NormFloat64())
	switch {
	case x > float64(s.Max):
		return s.Max, true
	case x < float64(s.Min):
		return s.Min, false
	}
	return int(math.Round(x)), false
}

// logprob draws a rollout log-probability: mostly confident tokens, some greedy-certain
// ones at exactly 0, as sampling at temperature 1 produces.
func logprob(rng *rand.Rand) float32 {
	if rng.Float64() < 0.1 {
		return 0
	}
	return float32(-rng.ExpFloat64() * 0.5)
}

// clone returns a copy in its own exactly sized backing array: a recorder stores each
// call's token data separately, and benchmarks must not profit from shared arrays.
func clone[T any](s []T) []T {
	if s == nil {
		return nil
	}
	c := make([]T, len(s))
	copy(c, s)
	return c
}
