package trace_test

import (
	"testing"
	"time"

	"github.com/floe-rl/floe/trace"
)

// TestRetryWait: the first failure waits RetryAfter, each one after doubles it up to
// MaxRetryAfter, and zero fields take the defaults (1 minute, 30 minutes).
func TestRetryWait(t *testing.T) {
	tests := []struct {
		name     string
		r        trace.Retention
		failures int
		want     time.Duration
	}{
		{"defaults, first failure", trace.Retention{}, 1, time.Minute},
		{"defaults, third failure", trace.Retention{}, 3, 4 * time.Minute},
		{"defaults, capped", trace.Retention{}, 10, 30 * time.Minute},
		{"defaults, many failures", trace.Retention{}, 1 << 20, 30 * time.Minute},
		{"set, first failure", trace.Retention{RetryAfter: time.Second, MaxRetryAfter: 5 * time.Second}, 1, time.Second},
		{"set, second failure", trace.Retention{RetryAfter: time.Second, MaxRetryAfter: 5 * time.Second}, 2, 2 * time.Second},
		{"set, capped", trace.Retention{RetryAfter: time.Second, MaxRetryAfter: 5 * time.Second}, 4, 5 * time.Second},
		{"only the first set", trace.Retention{RetryAfter: 20 * time.Minute}, 2, 30 * time.Minute},
	}
	for _, tt := range tests {
		if got := tt.r.RetryWait(tt.failures); got != tt.want {
			t.Errorf("%s: RetryWait(%d) = %v, want %v", tt.name, tt.failures, got, tt.want)
		}
	}
}

// TestCompactWorth: a file is compacted when it is at least MinFileBytes and Factor times
// its compacted size; zero fields (and a factor of 1 or less) take the defaults, 1 MiB
// and 2.
func TestCompactWorth(t *testing.T) {
	tests := []struct {
		name            string
		p               trace.CompactPolicy
		file, compacted int64
		want            bool
	}{
		{"defaults, twice", trace.CompactPolicy{}, 2 << 20, 1 << 20, true},
		{"defaults, under twice", trace.CompactPolicy{}, 2<<20 - 1, 1 << 20, false},
		{"defaults, under 1 MiB", trace.CompactPolicy{}, 1<<20 - 1, 1, false},
		{"defaults, 1 MiB", trace.CompactPolicy{}, 1 << 20, 1, true},
		{"small floor", trace.CompactPolicy{MinFileBytes: 1}, 64, 32, true},
		{"factor 4", trace.CompactPolicy{MinFileBytes: 1, Factor: 4}, 3 << 20, 1 << 20, false},
		{"factor 1 takes the default", trace.CompactPolicy{MinFileBytes: 1, Factor: 1}, 3 << 20, 2 << 20, false},
	}
	for _, tt := range tests {
		if got := tt.p.Worth(tt.file, tt.compacted); got != tt.want {
			t.Errorf("%s: %+v.Worth(%d, %d) = %v, want %v", tt.name, tt.p, tt.file, tt.compacted, got, tt.want)
		}
	}
}
