package proxybench

import (
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"syscall"
	"testing"
	"time"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/providers"
)

// processCPU is the process's user and system time so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func dialectOf(d Dialect) proxy.Dialect {
	all := providers.Dialects()
	for _, pd := range all {
		if pd.Name() == string(d) {
			return pd
		}
	}
	return all[0]
}

// BenchmarkTranslate is each dialect's share of a call's CPU besides forwarding: decoding
// the caller's request into the normalized chat one and encoding that as JSON, as the
// engine sends it upstream (profile with -cpuprofile).
func BenchmarkTranslate(b *testing.B) {
	for _, d := range AllDialects {
		for _, size := range []int{64 << 10, 512 << 10} {
			b.Run(fmt.Sprintf("%s/%dKiB", d, size>>10), func(b *testing.B) {
				body := Body(d, size, true)
				r := httptest.NewRequest("POST", d.path(true), nil)
				dl := dialectOf(d)
				b.SetBytes(int64(len(body)))
				b.ReportAllocs()
				// CPU time besides wall time: on a shared machine the process waits for a
				// core, and its own CPU time is the cost it adds.
				cpu0 := processCPU()
				for b.Loop() {
					req, err := dl.Decode(r, body)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := json.Marshal(&req.Chat); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(processCPU()-cpu0)/float64(b.N), "cpu-ns/op")
			})
		}
	}
}

// TestEveryDialectTranslatesTheBenchmarkBodies: the bodies decode into the same history
// in every dialect: the same number of tool calls and tool results.
func TestEveryDialectTranslatesTheBenchmarkBodies(t *testing.T) {
	count := func(d Dialect) (calls, results int) {
		req, err := dialectOf(d).Decode(httptest.NewRequest("POST", d.path(false), nil), Body(d, 64<<10, false))
		if err != nil {
			t.Fatalf("%s: %v", d, err)
		}
		for _, m := range req.Chat.Messages {
			calls += len(m.ToolCalls)
			if m.Role == "tool" {
				results++
			}
		}
		return calls, results
	}
	for _, d := range AllDialects {
		calls, results := count(d)
		if calls == 0 || calls != results {
			t.Errorf("%s: %d tool calls, %d tool results", d, calls, results)
		}
	}
}
