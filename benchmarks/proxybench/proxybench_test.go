package proxybench

import (
	"context"
	"strings"
	"testing"
	"time"
)

func TestRunReportsBothPathsAndNoErrors(t *testing.T) {
	rep, err := Run(context.Background(), Options{RequestBytes: 64 << 10, Requests: 20, StreamChunks: 16, Concurrency: 32, Duration: 300 * time.Millisecond})
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
	if table := rep.Table(); !strings.Contains(table, "| streaming |") || !strings.Contains(table, "32 concurrent streaming sessions") {
		t.Errorf("table:\n%s", table)
	}
}
