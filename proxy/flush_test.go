package proxy_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/providers"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace/mem"
)

// sendCounter stands where the proxy's handler meets the caller's connection: it passes
// every write and flush on, and notes each send, the bytes written since the previous
// flush, which that flush hands to the connection (and those left at the end, which
// net/http sends as the handler returns).
type sendCounter struct {
	http.ResponseWriter
	mu      sync.Mutex
	pending bytes.Buffer
	sends   []string
	sent    chan struct{} // a send happened (capacity 1: a wake-up, not a count)
}

func newSendCounter() *sendCounter { return &sendCounter{sent: make(chan struct{}, 1)} }

func (c *sendCounter) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.pending.Write(p)
	c.mu.Unlock()
	return c.ResponseWriter.Write(p)
}

func (c *sendCounter) Flush() {
	c.ResponseWriter.(http.Flusher).Flush()
	c.send()
}

func (c *sendCounter) send() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pending.Len() == 0 {
		return
	}
	c.sends = append(c.sends, c.pending.String())
	c.pending.Reset()
	select {
	case c.sent <- struct{}{}:
	default:
	}
}

func (c *sendCounter) Unwrap() http.ResponseWriter { return c.ResponseWriter }

func (c *sendCounter) all() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.sends)
}

// waitSent waits until a send holds s; false if none did within a bound far beyond any
// relay's (the relay then held s back, waiting for more from the upstream).
func (c *sendCounter) waitSent(s string) bool {
	deadline := time.After(10 * time.Second)
	for {
		for _, b := range c.all() {
			if strings.Contains(b, s) {
				return true
			}
		}
		select {
		case <-c.sent:
		case <-deadline:
			return false
		}
	}
}

// token is the text of the i-th streamed chunk: no JSON escaping, found in any dialect's
// event for it.
func token(i int) string { return fmt.Sprintf("tok%02d;", i) }

// chunkUpstream streams n chunks of vLLM's shape, one token each: all in one write
// (together), or each in a write of its own sent only once the caller was sent the
// previous token, so that a relay holding a token back until more arrives never gets
// more (spaced).
func chunkUpstream(t *testing.T, n int, spaced bool, caller *sendCounter) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		var out bytes.Buffer
		event := func(v any) {
			b, _ := json.Marshal(v)
			fmt.Fprintf(&out, "data: %s\n\n", b)
		}
		send := func() {
			_, _ = w.Write(out.Bytes())
			w.(http.Flusher).Flush()
			out.Reset()
		}
		event(map[string]any{"id": "up", "prompt_token_ids": []int32{1, 2, 3},
			"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}}}})
		for i := 0; i < n; i++ {
			event(map[string]any{"id": "up", "choices": []any{map[string]any{"index": 0,
				"delta": map[string]any{"content": token(i)}, "token_ids": []int32{int32(100 + i)},
				"logprobs": map[string]any{"content": []any{map[string]any{"token": "x", "logprob": -0.5}}}}}})
			if spaced {
				send()
				if !caller.waitSent(token(i)) {
					t.Errorf("the caller was not sent %q before the upstream's next chunk: the relay held it back", token(i))
				}
			}
		}
		event(map[string]any{"id": "up", "choices": []any{map[string]any{"index": 0, "delta": map[string]any{}, "finish_reason": "stop"}}})
		event(map[string]any{"id": "up", "choices": []any{}, "usage": map[string]int{"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}})
		out.WriteString("data: [DONE]\n\n")
		send()
	})
}

// streamRequests are a streamed call of each dialect.
var streamRequests = []struct{ dialect, path, body string }{
	{"OpenAI chat", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`},
	{"OpenAI Responses", "/v1/responses", `{"model":"m","input":"hi","stream":true}`},
	{"Anthropic Messages", "/v1/messages", `{"model":"m","max_tokens":64,"messages":[{"role":"user","content":"hi"}],"stream":true}`},
	{"Gemini", "/v1beta/models/m:streamGenerateContent?alt=sse", `{"contents":[{"role":"user","parts":[{"text":"hi"}]}]}`},
}

// TestStreamedChunksLeaveTogetherOrEachAtOnce: in every dialect, chunks that reach the proxy
// together reach the caller in one send, and chunks that reach it apart each reach the
// caller in a send of its own before the next one comes (no token waits for the next);
// the call recorded is the same either way.
func TestStreamedChunksLeaveTogetherOrEachAtOnce(t *testing.T) {
	const n = 8
	for _, rq := range streamRequests {
		recorded := map[bool]string{}
		for _, spaced := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/spaced=%v", rq.dialect, spaced), func(t *testing.T) {
				caller := newSendCounter()
				up := httptest.NewServer(chunkUpstream(t, n, spaced, caller))
				defer up.Close()
				store := &mem.Store{}
				store.AddSession("key-1", "sess-1")
				srv := &proxy.Server{Dialects: providers.Dialects(), Engine: &vllm.Engine{BaseURL: up.URL, Model: "m"},
					Sessions: store, Recorder: store, Log: slog.New(slog.DiscardHandler)}
				px := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					caller.ResponseWriter = w
					srv.ServeHTTP(caller, r)
					caller.send()
				}))
				defer px.Close()

				req, _ := http.NewRequest(http.MethodPost, px.URL+rq.path, strings.NewReader(rq.body))
				req.Header.Set("Authorization", "Bearer key-1")
				req.Header.Set("anthropic-version", "2023-06-01")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				body, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil || resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d, %v: %s", resp.StatusCode, err, body)
				}

				sends := caller.all()
				if got := strings.Join(sends, ""); got != string(body) {
					t.Fatalf("the sends are not the body the caller read:\n%q\n%q", got, body)
				}
				var withTokens []int // tokens per send that has any
				at := 0
				for _, s := range sends {
					k := 0
					for at < n && strings.Contains(s, token(at)) {
						k, at = k+1, at+1
					}
					if k > 0 {
						withTokens = append(withTokens, k)
					}
				}
				if at != n {
					t.Fatalf("the caller got %d of %d tokens in order, in sends %q", at, n, sends)
				}
				want := []int{n} // all in one send
				if spaced {
					want = slices.Repeat([]int{1}, n) // one send each
				}
				if !slices.Equal(withTokens, want) {
					t.Errorf("tokens per send %v, want %v (sends %q)", withTokens, want, sends)
				}
				// The stream's end (finish reason, usage) leaves after the call is recorded,
				// in one more send.
				if len(sends) != len(want)+1 {
					t.Errorf("%d sends, want %d: %q", len(sends), len(want)+1, sends)
				}

				calls := store.Calls("sess-1")
				if len(calls) != 1 {
					t.Fatalf("%d calls recorded, want 1", len(calls))
				}
				c := calls[0]
				if !c.Trainable || len(c.ResponseIDs) != n || c.ResponseIDs[n-1] != 100+n-1 || len(c.Logprobs) != n {
					t.Errorf("recorded call: trainable %v (%s), ids %v, %d logprobs", c.Trainable, c.UntrainableReason, c.ResponseIDs, len(c.Logprobs))
				}
				recorded[spaced] = fmt.Sprintf("%s %s %v %v %v", c.Response, c.FinishReason, c.PromptIDs, c.ResponseIDs, c.Logprobs)
			})
		}
		if recorded[false] != recorded[true] {
			t.Errorf("%s: the call recorded from chunks together\n%s\ndiffers from chunks apart\n%s", rq.dialect, recorded[false], recorded[true])
		}
	}
}

// TestAnswersDeclareTheirLength: a non-streamed answer carries its Content-Length, so that
// it leaves with its headers in one write, without chunked framing and the write of the
// last chunk after it; this one is over the 2 KiB net/http measures by itself.
func TestAnswersDeclareTheirLength(t *testing.T) {
	text := strings.Repeat("0123456789abcdef", 512) // 8 KiB
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		_ = json.NewEncoder(w).Encode(map[string]any{"id": "up", "prompt_token_ids": []int32{1, 2, 3},
			"choices": []any{map[string]any{"index": 0, "finish_reason": "stop", "token_ids": []int32{7},
				"logprobs": map[string]any{"content": []any{map[string]any{"token": "x", "logprob": -0.5}}},
				"message":  map[string]any{"role": "assistant", "content": text}}},
			"usage": map[string]int{"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
	}))
	defer up.Close()
	store := &mem.Store{}
	store.AddSession("key-1", "sess-1")
	px := httptest.NewServer(&proxy.Server{Dialects: providers.Dialects(), Engine: &vllm.Engine{BaseURL: up.URL, Model: "m"},
		Sessions: store, Recorder: store, Log: slog.New(slog.DiscardHandler)})
	defer px.Close()
	for _, rq := range streamRequests {
		t.Run(rq.dialect, func(t *testing.T) {
			path := strings.Replace(rq.path, ":streamGenerateContent?alt=sse", ":generateContent", 1)
			req, _ := http.NewRequest(http.MethodPost, px.URL+path, strings.NewReader(strings.Replace(rq.body, `,"stream":true`, "", 1)))
			req.Header.Set("Authorization", "Bearer key-1")
			req.Header.Set("anthropic-version", "2023-06-01")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d, %v: %s", resp.StatusCode, err, body)
			}
			if !strings.Contains(string(body), text) {
				t.Fatalf("the answer lacks the upstream's text: %.200s", body)
			}
			if resp.ContentLength != int64(len(body)) || len(resp.TransferEncoding) != 0 {
				t.Errorf("Content-Length %d, transfer encoding %v, for a body of %d bytes", resp.ContentLength, resp.TransferEncoding, len(body))
			}
		})
	}
}
