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
	"runtime/metrics"
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
// raise the proxy's live heap by at most one body each when the bulk is a field floe
// ignores (a hostile harness's padding: it is neither decoded, nor sent upstream, nor
// stored), and by at most two when it is message text (the body, then the decoded text,
// then the text and the upstream request: two at a time). A twentieth of a body per
// request is allowed for connections, buffers and goroutines.
func TestPeakMemoryPerMaximumSizeRequest(t *testing.T) {
	if testing.Short() || raceEnabled {
		t.Skip("sends hundreds of MiB; heap peaks mean nothing under the race detector")
	}
	const n, size = 4, proxy.DefaultMaxBodyBytes
	for _, tt := range []struct {
		name    string
		unknown bool
		want    float64 // the most live heap per request, in bodies
	}{
		{"unknown field", true, 1},
		{"message text", false, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if per := peakPerRequest(t, n, size, tt.unknown); per > tt.want+0.05 {
				t.Errorf("peak live heap per request is %.2f bodies; want at most %.0f", per, tt.want)
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

	// The live heap is what the collector marked at the end of its last cycle; HeapAlloc
	// also counts what died since, and a request's dead body (read, decoded, no longer
	// referenced) is still there when the next body-sized buffer is allocated on a machine
	// with cores to spare (a quarter of a body per request at GOMAXPROCS 4, 2.26 bodies
	// read where 2.01 were live). At GOGC 5 each body-sized allocation starts a cycle, so
	// the marks fall right after the allocations that make the peaks. Two cycles inside one
	// 2 ms sleep of the sampler hide the first: that can only read lower.
	defer debug.SetGCPercent(debug.SetGCPercent(5))
	runtime.GC()
	base := liveHeap()
	var peak atomic.Uint64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			if v := liveHeap(); v > peak.Load() {
				peak.Store(v)
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
	t.Logf("%d concurrent %d MiB requests (%s): peak live heap %.0f MiB above the start, %.3f bodies per request",
		n, size>>20, label, float64(peak.Load()-base)/(1<<20), per)
	return per
}

// liveHeap is the heap the collector marked live at the end of its last cycle.
func liveHeap() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}
