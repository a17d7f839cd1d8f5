// Package proxybench measures what the proxy adds to a model call: each request goes both
// straight to a zero-latency fake vLLM and through floe's proxy in front of it, side by
// side in one run, and the difference is the proxy's cost.
package proxybench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/openai"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/mem"
)

// Options sizes the run.
type Options struct {
	RequestBytes int           // request body size (64 KiB)
	Requests     int           // sequential requests per mode for the latency figures
	StreamChunks int           // chunks in a streamed answer
	Concurrency  int           // concurrent streaming sessions for the throughput figure
	Duration     time.Duration // how long the concurrent phase runs
	Progress     io.Writer
}

// Latency is one mode's figures, in milliseconds.
type Latency struct {
	Mode                 string
	DirectP50, DirectP99 float64
	ProxyP50, ProxyP99   float64
}

// Report is the whole run.
type Report struct {
	Options    Options
	Latencies  []Latency
	Requests   int64   // streaming requests completed through the proxy in the concurrent phase
	Errors     int64   // of those, failed
	PerSecond  float64 // completed per second
	Concurrent int
}

// upstream answers every chat request at once with a fixed answer carrying token ids.
func upstream(chunks int) http.Handler {
	ids := make([]int32, chunks)
	for i := range ids {
		ids[i] = int32(100 + i)
	}
	lps := make([]map[string]any, chunks)
	for i := range lps {
		lps[i] = map[string]any{"token": "x", "logprob": -0.5}
	}
	full, _ := json.Marshal(map[string]any{
		"id": "c", "prompt_token_ids": []int32{1, 2, 3},
		"choices": []any{map[string]any{"index": 0, "finish_reason": "stop", "token_ids": ids,
			"message": map[string]any{"role": "assistant", "content": strings.Repeat("x", chunks)}, "logprobs": map[string]any{"content": lps}}},
		"usage": map[string]int{"prompt_tokens": 3, "completion_tokens": chunks, "total_tokens": chunks + 3},
	})
	var stream strings.Builder
	head, _ := json.Marshal(map[string]any{"id": "c", "prompt_token_ids": []int32{1, 2, 3}, "choices": []any{map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}}}})
	fmt.Fprintf(&stream, "data: %s\n\n", head)
	for i := 0; i < chunks; i++ {
		c, _ := json.Marshal(map[string]any{"id": "c", "choices": []any{map[string]any{"index": 0, "delta": map[string]any{"content": "x"},
			"token_ids": []int32{ids[i]}, "logprobs": map[string]any{"content": lps[i : i+1]}}}})
		fmt.Fprintf(&stream, "data: %s\n\n", c)
	}
	fmt.Fprintf(&stream, "data: %s\n\ndata: [DONE]\n\n", `{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"data":[{"id":"m"}]}`)
	})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Stream bool `json:"stream"`
		}
		_ = json.NewDecoder(r.Body).Decode(&req)
		if req.Stream {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, stream.String())
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(full)
	})
	return mux
}

func body(size int, stream bool) string {
	pad := strings.Repeat("a", max(size-200, 0))
	return fmt.Sprintf(`{"model":"m","stream":%v,"messages":[{"role":"user","content":"%s"}]}`, stream, pad)
}

// call sends one request with the API key key and reads the whole answer.
func call(ctx context.Context, client *http.Client, url, key, payload string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", strings.NewReader(payload))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	return nil
}

func percentile(xs []time.Duration, p float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return float64(s[int(p*float64(len(s)-1))]) / 1e6
}

// Run measures; it needs nothing but loopback.
func Run(ctx context.Context, opt Options) (*Report, error) {
	up := httptest.NewServer(upstream(opt.StreamChunks))
	defer up.Close()
	// One session per concurrent caller, as harnesses are: each has its own key.
	store := &mem.Store{}
	for i := 0; i < max(opt.Concurrency, 1); i++ {
		store.AddSession(benchKey(i), benchKey(i))
	}
	px := httptest.NewServer(&proxy.Server{Dialects: proxy.Dialects{Chat: openai.Chat{}}, Engine: &vllm.Engine{BaseURL: up.URL, Model: "m"},
		Sessions: store, Recorder: discard{}, Gate: &proxy.Gate{}, Log: slog.New(slog.DiscardHandler)})
	defer px.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: opt.Concurrency + 8}}
	rep := &Report{Options: opt, Concurrent: opt.Concurrency}
	for _, stream := range []bool{false, true} {
		mode := "non-streaming"
		if stream {
			mode = "streaming"
		}
		payload := body(opt.RequestBytes, stream)
		var direct, proxied []time.Duration
		for i := 0; i < opt.Requests; i++ {
			// Alternate, so both see the same machine.
			for _, target := range []string{up.URL, px.URL} {
				t0 := time.Now()
				if err := call(ctx, client, target, benchKey(0), payload); err != nil {
					return nil, fmt.Errorf("%s to %s: %w", mode, target, err)
				}
				if target == up.URL {
					direct = append(direct, time.Since(t0))
				} else {
					proxied = append(proxied, time.Since(t0))
				}
			}
		}
		rep.Latencies = append(rep.Latencies, Latency{Mode: mode,
			DirectP50: percentile(direct, 0.5), DirectP99: percentile(direct, 0.99),
			ProxyP50: percentile(proxied, 0.5), ProxyP99: percentile(proxied, 0.99)})
		if opt.Progress != nil {
			fmt.Fprintf(opt.Progress, "%s: %d requests each way\n", mode, opt.Requests)
		}
	}
	payload := body(opt.RequestBytes, true)
	var wg sync.WaitGroup
	var done, failed atomic.Int64
	start := time.Now()
	// Each session starts requests until the phase's duration is over and finishes the
	// one it is in, so every request started is counted, on a loaded machine too, and the
	// rate is over the time they all took.
	for i := 0; i < opt.Concurrency; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil && time.Since(start) < opt.Duration {
				err := call(ctx, client, px.URL, benchKey(i), payload)
				if ctx.Err() != nil {
					return
				}
				if err != nil {
					failed.Add(1)
				}
				done.Add(1)
			}
		}()
	}
	wg.Wait()
	rep.Requests, rep.Errors = done.Load(), failed.Load()
	rep.PerSecond = float64(rep.Requests) / time.Since(start).Seconds()
	return rep, nil
}

func benchKey(i int) string { return fmt.Sprintf("bench-%d", i) }

// discard records nothing: the benchmark measures translation and forwarding.
type discard struct{}

func (discard) Record(context.Context, *trace.Call) error { return nil }

// Table renders the report.
func (r *Report) Table() string {
	var b strings.Builder
	fmt.Fprintf(&b, "requests of %d KiB, streamed answers of %d chunks\n\n", r.Options.RequestBytes/1024, r.Options.StreamChunks)
	b.WriteString("| mode | direct p50 ms | via proxy p50 ms | added p50 ms | direct p99 ms | via proxy p99 ms | added p99 ms |\n|---|---:|---:|---:|---:|---:|---:|\n")
	for _, l := range r.Latencies {
		fmt.Fprintf(&b, "| %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", l.Mode, l.DirectP50, l.ProxyP50, l.ProxyP50-l.DirectP50, l.DirectP99, l.ProxyP99, l.ProxyP99-l.DirectP99)
	}
	fmt.Fprintf(&b, "\n%d concurrent streaming sessions for %s: %d requests, %d errors, %.0f requests/s\n",
		r.Concurrent, r.Options.Duration, r.Requests, r.Errors, r.PerSecond)
	return b.String()
}
