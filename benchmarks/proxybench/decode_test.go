package proxybench

import (
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"testing"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/providers"
)

func dialectOf(d Dialect) proxy.Dialect {
	all := providers.Dialects()
	switch d {
	case Responses:
		return all.Responses
	case Anthropic:
		return all.Anthropic
	case Gemini:
		return all.Gemini
	}
	return all.Chat
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
				for b.Loop() {
					req, err := dl.Decode(r, body)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := json.Marshal(&req.Chat); err != nil {
						b.Fatal(err)
					}
				}
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
