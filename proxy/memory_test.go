package proxy_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/openai"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/mem"
)

// discardRecorder keeps nothing, so that the memory measured is the proxy's own.
type discardRecorder struct{}

func (discardRecorder) Record(context.Context, *trace.Call) error { return nil }

// bodyReader streams a chat request of size bytes whose bulk is one field (unknown or the
// message text), so that the client holds none of it in memory.
func bodyReader(size int, unknown bool) io.Reader {
	const tools = `"tools":[{"type":"function","function":{"name":"read","parameters":{"type":"object"}}}],"tool_choice":"auto"`
	head, tail := `{"model":"m",`+tools+`,"messages":[{"role":"user","content":"`, `"}]}`
	if unknown {
		head, tail = `{"model":"m",`+tools+`,"messages":[{"role":"user","content":"hi"}],"junk":"`, `"}`
	}
	n := size - len(head) - len(tail)
	return io.MultiReader(strings.NewReader(head), io.LimitReader(repeatReader('x'), int64(n)), strings.NewReader(tail))
}

type repeatReader byte

func (r repeatReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = byte(r)
	}
	return len(p), nil
}

// TestPeakMemoryPerMaximumSizeRequest: N concurrent requests of the maximum body size
// raise the proxy's live heap by at most twice their bodies when the bulk is a field floe
// ignores (a hostile harness's padding: it is neither decoded, nor sent upstream, nor
// stored) and when it is message text (the body, then the decoded text, then the text and
// the upstream request: two at a time). A twentieth of a body per request is allowed
// for connections, buffers and goroutines.
func TestPeakMemoryPerMaximumSizeRequest(t *testing.T) {
	if testing.Short() || raceEnabled {
		t.Skip("sends hundreds of MiB; heap peaks mean nothing under the race detector")
	}
	const n, size = 4, proxy.DefaultMaxBodyBytes
	for _, tt := range []struct {
		name    string
		unknown bool
		want    float64 // the most heap per request, in bodies
	}{
		{"unknown field", true, 2},
		{"message text", false, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// A peak above the bound can be the collector falling behind on a busy machine
			// rather than memory the proxy holds: the better of two tries counts.
			per := peakPerRequest(t, n, size, tt.unknown)
			if per > tt.want+0.05 {
				per = min(per, peakPerRequest(t, n, size, tt.unknown))
			}
			if per > tt.want+0.05 {
				t.Errorf("peak heap per request is %.2f bodies; want at most %.0f", per, tt.want)
			}
		})
	}
}

// peakPerRequest sends n concurrent requests of size bytes and returns the peak rise of
// the live heap per request, in bodies.
func peakPerRequest(t *testing.T, n, size int, unknown bool) float64 {
	return peakPerRequestOf(t, n, size, func() io.Reader { return bodyReader(size, unknown) }, fmt.Sprintf("unknown field: %v", unknown))
}

// peakPerRequestOf is peakPerRequest for bodies of size bytes that body streams.
func peakPerRequestOf(t *testing.T, n, size int, body func() io.Reader, label string) float64 {
	var arrived atomic.Int32
	release := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if arrived.Add(1) == int32(n) {
			close(release)
		}
		<-release
		_, _ = io.WriteString(w, `{"id":"c","prompt_token_ids":[1],"choices":[{"index":0,"finish_reason":"stop","token_ids":[2],"logprobs":{"content":[{"logprob":-0.5}]},"message":{"role":"assistant","content":"ok"}}]}`)
	}))
	defer up.Close()
	store := &mem.Store{}
	store.AddSession("k", "s")
	px := httptest.NewServer(&proxy.Server{Dialects: proxy.Dialects{openai.Chat{}}, Engine: &vllm.Engine{BaseURL: up.URL, Model: "m"},
		Sessions: store, Recorder: discardRecorder{}, Log: slog.New(slog.DiscardHandler)})
	defer px.Close()

	defer debug.SetGCPercent(debug.SetGCPercent(5)) // garbage does not count: measure what is live
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.HeapAlloc
	var peak atomic.Uint64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		var ms runtime.MemStats
		for {
			runtime.ReadMemStats(&ms)
			if ms.HeapAlloc > peak.Load() {
				peak.Store(ms.HeapAlloc)
			}
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest(http.MethodPost, px.URL+"/v1/chat/completions", body())
			req.ContentLength = int64(size)
			req.Header.Set("Authorization", "Bearer k")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Errorf("status %d: %s", resp.StatusCode, b)
			}
		}()
	}
	wg.Wait()
	close(stop)
	<-sampled
	per := float64(peak.Load()-base) / float64(n) / float64(size)
	t.Logf("%d concurrent %d MiB requests (%s): peak heap %.0f MiB above the start, %.3f bodies per request",
		n, size>>20, label, float64(peak.Load()-base)/(1<<20), per)
	return per
}
