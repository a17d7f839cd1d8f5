package proxybench

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/providers"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/mem"
)

// cannedUpstream answers the vLLM engine's calls in-process with the fake upstream's
// answer (recorded once), without a network in between: what the benchmark below
// measures is the proxy's own work (reading, translating, encoding, relaying, recording).
type cannedUpstream struct {
	answer      []byte
	contentType string
}

func newCannedUpstream(stream bool) cannedUpstream {
	rec := httptest.NewRecorder()
	body := `{"stream":false}`
	if stream {
		body = `{"stream":true}`
	}
	upstream(64).ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body)))
	return cannedUpstream{answer: rec.Body.Bytes(), contentType: rec.Header().Get("Content-Type")}
}

func (c cannedUpstream) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Body != nil {
		_, _ = io.Copy(io.Discard, r.Body)
		_ = r.Body.Close()
	}
	return &http.Response{StatusCode: http.StatusOK, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{"Content-Type": {c.contentType}}, Body: io.NopCloser(bytes.NewReader(c.answer)),
		ContentLength: int64(len(c.answer)), Request: r}, nil
}

// discardWriter is a caller that reads every answer at once.
type discardWriter struct {
	h      http.Header
	status int
	n      int
}

func (w *discardWriter) Header() http.Header         { return w.h }
func (w *discardWriter) WriteHeader(code int)        { w.status = code }
func (w *discardWriter) Write(p []byte) (int, error) { w.n += len(p); return len(p), nil }
func (w *discardWriter) Flush()                      {}

// BenchmarkServe is one call through proxy.Server, in each dialect, size and mode, with
// floe proxy's engine (vLLM) and in-memory store: CPU time and bytes allocated per call.
// The upstream answers in-process (its share is the same for every dialect and small:
// the answer is canned).
func BenchmarkServe(b *testing.B) {
	for _, d := range AllDialects {
		for _, size := range []int{64 << 10, 512 << 10} {
			for _, stream := range []bool{false, true} {
				mode := "full"
				if stream {
					mode = "stream"
				}
				b.Run(fmt.Sprintf("%s/%dKiB/%s", d, size>>10, mode), func(b *testing.B) {
					store := &mem.Store{Retention: trace.Retention{MaxStoredBytes: 64 << 20}}
					store.AddSession(benchKey(0), benchKey(0))
					eng := vllm.New("http://upstream", "m")
					eng.Client = &http.Client{Transport: newCannedUpstream(stream)}
					srv := &proxy.Server{Dialects: providers.Dialects(), Engine: eng, Sessions: store, Recorder: store,
						Gate: &proxy.Gate{}, Log: slog.New(slog.DiscardHandler)}
					body := Body(d, size, stream)
					path := d.path(stream)
					b.SetBytes(int64(len(body)))
					b.ReportAllocs()
					cpu0 := processCPU()
					for b.Loop() {
						r := httptest.NewRequest(http.MethodPost, path, io.NopCloser(bytes.NewReader(body)))
						r.ContentLength = int64(len(body))
						r.Header.Set("Authorization", "Bearer "+benchKey(0))
						r.Header.Set("x-api-key", benchKey(0))
						r.Header.Set("x-goog-api-key", benchKey(0))
						r.Header.Set("anthropic-version", "2023-06-01")
						w := &discardWriter{h: http.Header{}}
						srv.ServeHTTP(w, r)
						if (w.status != 0 && w.status != http.StatusOK) || w.n == 0 {
							b.Fatalf("status %d, %d bytes", w.status, w.n)
						}
					}
					b.ReportMetric(float64(processCPU()-cpu0)/float64(b.N), "cpu-ns/op")
				})
			}
		}
	}
}
