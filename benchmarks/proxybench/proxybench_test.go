package proxybench

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestRunReportsBothPathsAndNoErrors: more concurrent callers than one session may have
// calls in flight (the proxy's per-session default, 32): each caller is its own session,
// as harnesses are, so none is refused.
func TestRunReportsBothPathsAndNoErrors(t *testing.T) {
	rep, err := Run(context.Background(), Options{RequestBytes: 64 << 10, Requests: 20, StreamChunks: 16, Concurrency: 40, Duration: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Latencies) != 2 || rep.Requests == 0 || rep.Errors != 0 {
		t.Fatalf("report %+v", rep)
	}
	for _, l := range rep.Latencies {
		if l.DirectP50 <= 0 || l.ProxyP50 <= 0 || l.ProxyP99 < l.ProxyP50 {
			t.Errorf("%s: %+v", l.Mode, l)
		}
	}
	if table := rep.Table(); !strings.Contains(table, "| streaming |") || !strings.Contains(table, "40 concurrent streaming sessions") {
		t.Errorf("table:\n%s", table)
	}
}
