package proxy_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/anthropic"
	"github.com/floe-rl/floe/proxy/gemini"
	"github.com/floe-rl/floe/proxy/openai"
	"github.com/floe-rl/floe/proxy/sglang"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/mem"
)

// hangingUpstream answers like vLLM up to a point, then says nothing until the proxy
// gives up on it (or the test ends): hangAt "headers" sends nothing at all, "body" sends
// the headers of a stream and nothing more, "chunk" one chunk with a token.
type hangingUpstream struct {
	hangAt    string
	cancelled chan struct{} // closed when the proxy drops the upstream request
	once      sync.Once
}

func (h *hangingUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/v1/models" {
		_, _ = io.WriteString(w, `{"data":[{"id":"m"}]}`)
		return
	}
	_, _ = io.Copy(io.Discard, r.Body)
	switch h.hangAt {
	case "body":
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
	case "chunk":
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"id":"x","prompt_token_ids":[1,2],"choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"token_ids":[7],"logprobs":{"content":[{"logprob":-0.5}]}}]}`+"\n\n")
		w.(http.Flusher).Flush()
	}
	<-r.Context().Done()
	h.once.Do(func() { close(h.cancelled) })
}

func newHanging(t *testing.T, hangAt string) (*hangingUpstream, string) {
	h := &hangingUpstream{hangAt: hangAt, cancelled: make(chan struct{})}
	up := httptest.NewServer(h)
	t.Cleanup(func() {
		up.CloseClientConnections()
		up.Close()
	})
	return h, up.URL
}

// limitsProxy serves the Chat API in front of upstream with lim and gate.
func limitsProxy(t *testing.T, upstream string, lim proxy.Limits, gate *proxy.Gate) (*mem.Store, string) {
	store := &mem.Store{}
	store.AddSession("k", "s")
	srv := httptest.NewServer(&proxy.Server{Dialects: proxy.Dialects{openai.Chat{}}, Engine: &vllm.Engine{BaseURL: upstream, Model: "m"},
		Sessions: store, Recorder: store, Gate: gate, Limits: lim, Log: slog.New(slog.DiscardHandler)})
	t.Cleanup(srv.Close)
	return store, srv.URL
}

func postChat(t *testing.T, url, extra string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, extra)))
	req.Header.Set("Authorization", "Bearer k")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// waitCalls waits (generously) until the store has n calls of session s.
func waitCalls(t *testing.T, store *mem.Store, n int) []trace.Call {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for len(store.Calls("s")) < n && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	calls := store.Calls("s")
	if len(calls) != n {
		t.Fatalf("recorded %d calls, want %d: %+v", len(calls), n, calls)
	}
	return calls
}

func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s did not happen", what)
	}
}

// TestUpstreamDeadlines: an upstream that hangs before its answer, before the first
// byte of a stream's body, or between chunks is given up on after the injected deadline:
// the upstream request is cancelled, the caller gets a 504 (or, once its stream has
// begun, an error event) naming the flag, and the call is recorded untrainable.
func TestUpstreamDeadlines(t *testing.T) {
	short := 100 * time.Millisecond
	for _, tt := range []struct {
		name, hangAt, extra string
		lim                 proxy.Limits
		wantStatus          int
		wantFlag            string
	}{
		{"first byte, not streamed", "headers", "", proxy.Limits{UpstreamFirstByte: short}, 504, "upstream-first-byte-timeout"},
		{"first byte, streamed", "headers", `,"stream":true`, proxy.Limits{UpstreamFirstByte: short}, 504, "upstream-first-byte-timeout"},
		{"first byte of a begun stream", "body", `,"stream":true`, proxy.Limits{UpstreamFirstByte: short}, 504, "upstream-first-byte-timeout"},
		{"idle between chunks", "chunk", `,"stream":true`, proxy.Limits{UpstreamIdle: short}, 200, "upstream-idle-timeout"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h, url := newHanging(t, tt.hangAt)
			store, px := limitsProxy(t, url, tt.lim, nil)
			status, body := postChat(t, px, tt.extra)
			if status != tt.wantStatus || !strings.Contains(body, tt.wantFlag) || !strings.Contains(body, `"timeout"`) {
				t.Errorf("status %d body %s; want %d and a timeout error naming -%s", status, body, tt.wantStatus, tt.wantFlag)
			}
			waitClosed(t, h.cancelled, "cancelling the upstream request")
			calls := waitCalls(t, store, 1)
			if c := calls[0]; c.Trainable || !strings.Contains(c.UntrainableReason, "upstream timeout") || !strings.Contains(c.UntrainableReason, tt.wantFlag) {
				t.Errorf("recorded trainable=%v reason %q; want untrainable for the timeout", c.Trainable, c.UntrainableReason)
			}
		})
	}
}

// TestTimeoutAndCapacityShapes: each dialect answers an upstream timeout as a 504 its
// SDKs read as a gateway timeout, and floe's concurrency cap as its provider's own
// overloaded error.
func TestTimeoutAndCapacityShapes(t *testing.T) {
	timeout := proxy.TimeoutError("sent nothing more", time.Minute, "upstream-idle-timeout")
	capacity := &proxy.Error{Kind: proxy.ErrCapacity, Message: "floe is busy"}
	for _, tt := range []struct {
		name   string
		d      proxy.Dialect
		err    *proxy.Error
		status int
		want   string
	}{
		{"anthropic timeout", anthropic.Dialect{}, timeout, 504, `"type":"timeout_error"`},
		{"anthropic capacity", anthropic.Dialect{}, capacity, 529, `"type":"overloaded_error"`},
		{"chat timeout", openai.Chat{}, timeout, 504, `"code":"timeout"`},
		{"chat capacity", openai.Chat{}, capacity, 429, `"code":"rate_limit_exceeded"`},
		{"responses timeout", openai.Responses{}, timeout, 504, `"code":"timeout"`},
		{"responses capacity", openai.Responses{}, capacity, 429, `"code":"rate_limit_exceeded"`},
		{"gemini timeout", gemini.Dialect{}, timeout, 504, `"status":"DEADLINE_EXCEEDED"`},
		{"gemini capacity", gemini.Dialect{}, capacity, 429, `"status":"RESOURCE_EXHAUSTED"`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			tt.d.WriteError(rec, tt.err)
			if rec.Code != tt.status || !strings.Contains(rec.Body.String(), tt.want) {
				t.Errorf("%d %s; want %d with %s", rec.Code, rec.Body, tt.status, tt.want)
			}
		})
	}
}

// TestClientThatStopsReadingIsDropped: a harness that opens a stream and never reads it
// is dropped after the client idle limit; the upstream request is cancelled, the call
// recorded as aborted, and the gate is left with nothing in flight.
func TestClientThatStopsReadingIsDropped(t *testing.T) {
	cancelled := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"id":"x","prompt_token_ids":[1],"choices":[]}`+"\n\n")
		chunk := `data: {"id":"x","choices":[{"index":0,"delta":{"content":"` + strings.Repeat("y", 32<<10) + `"},"token_ids":[7],"logprobs":{"content":[{"logprob":-0.5}]}}]}` + "\n\n"
		for {
			if _, err := io.WriteString(w, chunk); err != nil {
				break
			}
			w.(http.Flusher).Flush()
			if r.Context().Err() != nil {
				break
			}
		}
		close(cancelled)
	}))
	defer up.Close()
	gate := &proxy.Gate{}
	store, px := limitsProxy(t, up.URL, proxy.Limits{ClientIdle: 200 * time.Millisecond}, gate)

	conn, err := net.Dial("tcp", strings.TrimPrefix(px, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }() // a client's connection: its end is not the test
	body := fmt.Sprintf(chatBody, `,"stream":true`)
	_, _ = fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	// ... and never read.
	waitClosed(t, cancelled, "cancelling the upstream request")
	calls := waitCalls(t, store, 1)
	if c := calls[0]; c.Trainable || !strings.Contains(c.UntrainableReason, "aborted") || !strings.Contains(c.UntrainableReason, "client-idle-timeout") {
		t.Errorf("recorded trainable=%v reason %q; want aborted by the client idle limit", c.Trainable, c.UntrainableReason)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, _, n := gate.State(); n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the dropped call is still in flight")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestPauseDrainsStuckCalls: a pause waits for a call stuck upstream at most the drain
// timeout, then cuts it off: the pause returns, the upstream request is cancelled, the
// caller (still there) gets an overloaded error to retry, and the call is recorded
// untrainable. Calls admitted after the resume run normally.
func TestPauseDrainsStuckCalls(t *testing.T) {
	for _, tt := range []struct{ name, hangAt, extra string }{
		{"not streamed", "headers", ""},
		{"streamed, before any chunk", "body", `,"stream":true`},
		{"streamed, mid-answer", "chunk", `,"stream":true`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h, url := newHanging(t, tt.hangAt)
			gate := &proxy.Gate{DrainTimeout: 100 * time.Millisecond}
			store, px := limitsProxy(t, url, proxy.Limits{}, gate)
			type answer struct {
				status int
				body   string
			}
			done := make(chan answer, 1)
			go func() {
				status, body := postChat(t, px, tt.extra)
				done <- answer{status, body}
			}()
			deadline := time.Now().Add(10 * time.Second)
			for _, _, n := gate.State(); n == 0; _, _, n = gate.State() {
				if time.Now().After(deadline) {
					t.Fatal("the call never got in flight")
				}
				time.Sleep(5 * time.Millisecond)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if _, err := gate.Pause(ctx); err != nil {
				t.Fatalf("pause: %v; want it to cut the stuck call off", err)
			}
			if gate.Drained() != 1 {
				t.Errorf("drained %d calls, want 1", gate.Drained())
			}
			waitClosed(t, h.cancelled, "cancelling the upstream request")
			a := <-done
			if !strings.Contains(a.body, "weight sync") || !strings.Contains(a.body, "overloaded") {
				t.Errorf("the caller got %d %s; want an overloaded error saying a weight sync cut it off", a.status, a.body)
			}
			calls := waitCalls(t, store, 1)
			if c := calls[0]; c.Trainable || !strings.Contains(c.UntrainableReason, "weight sync") {
				t.Errorf("recorded trainable=%v reason %q; want untrainable, cut off by the weight sync", c.Trainable, c.UntrainableReason)
			}
			if err := gate.Resume(1); err != nil {
				t.Fatal(err)
			}
			if _, _, n := gate.State(); n != 0 {
				t.Errorf("%d calls in flight after the drain", n)
			}
		})
	}
}

// TestGateDrainTimeout: a call that never leaves holds a pause for the drain timeout
// only; its late leave changes nothing; a negative timeout waits for ever (until ctx).
func TestGateDrainTimeout(t *testing.T) {
	g := &proxy.Gate{DrainTimeout: 50 * time.Millisecond}
	ctx, _, leave, err := g.Admit(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.Pause(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !errorsIsDrained(ctx) {
		t.Errorf("the straggler's context: %v, cause %v; want cancelled with ErrDrained", ctx.Err(), context.Cause(ctx))
	}
	leave()
	if _, _, n := g.State(); n != 0 || g.Drained() != 1 {
		t.Errorf("in flight %d, drained %d; want 0 and 1", n, g.Drained())
	}
	_ = g.Resume(0)
	forever := &proxy.Gate{DrainTimeout: -1}
	_, _, leave2, _ := forever.Admit(context.Background())
	defer leave2()
	pctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := forever.Pause(pctx); err == nil {
		t.Error("a pause with no drain timeout returned while a call was in flight")
	}
}

func errorsIsDrained(ctx context.Context) bool {
	return ctx.Err() != nil && errors.Is(context.Cause(ctx), proxy.ErrDrained)
}

// TestMaxInflight: with -max-inflight N, N calls in flight and one more: the one more
// gets its provider's overloaded error at once, with Retry-After, and the proxy serves
// again once a slot frees.
func TestMaxInflight(t *testing.T) {
	const n = 3
	release := make(chan struct{})
	var arrived sync.WaitGroup
	arrived.Add(n)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case <-release:
		default:
			arrived.Done()
			<-release
		}
		_, _ = io.WriteString(w, `{"id":"c","prompt_token_ids":[1],"choices":[{"index":0,"finish_reason":"stop","token_ids":[2],"logprobs":{"content":[{"logprob":-0.5}]},"message":{"role":"assistant","content":"ok"}}]}`)
	}))
	defer upstream.Close()
	store, px := limitsProxy(t, upstream.URL, proxy.Limits{MaxInflight: n}, nil)
	codes := make(chan int, n)
	for i := 0; i < n; i++ {
		go func() {
			status, _ := postChat(t, px, "")
			codes <- status
		}()
	}
	arrived.Wait()
	req, _ := http.NewRequest(http.MethodPost, px+"/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, "")))
	req.Header.Set("Authorization", "Bearer k")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 429 || !strings.Contains(string(b), "rate_limit_exceeded") || resp.Header.Get("Retry-After") == "" {
		t.Errorf("call %d: %d %s (Retry-After %q); want 429 rate_limit_exceeded with Retry-After", n+1, resp.StatusCode, b, resp.Header.Get("Retry-After"))
	}
	close(release)
	for i := 0; i < n; i++ {
		if c := <-codes; c != 200 {
			t.Errorf("a call within the cap: status %d", c)
		}
	}
	if status, body := postChat(t, px, ""); status != 200 {
		t.Errorf("after the cap freed: %d %s", status, body)
	}
	if got := len(store.Calls("s")); got != n+1 {
		t.Errorf("recorded %d calls, want %d (the refused one is not recorded)", got, n+1)
	}
}

// TestStoredRequestIsBoundedAndValidUTF8: a 30 MiB field floe does not know is not
// stored; the record says what was dropped; invalid UTF-8 is stored as U+FFFD; every
// stored document is valid JSON and UTF-8.
func TestStoredRequestIsBoundedAndValidUTF8(t *testing.T) {
	f := newFixture(t, &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"})
	for _, tt := range []struct {
		name, extra string
		check       func(t *testing.T, req map[string]any)
	}{
		{"30 MiB unknown field", `,"junk":"` + strings.Repeat("j", 30<<20) + `"`, func(t *testing.T, req map[string]any) {
			mark, _ := req["floe_truncated"].(map[string]any)
			if mark == nil || !strings.Contains(fmt.Sprint(mark["dropped"]), "junk") || req["junk"] != nil {
				t.Errorf("floe_truncated %v; want junk dropped and named", mark)
			}
			if req["messages"] == nil || req["model"] != "claude-like" {
				t.Errorf("the request's small fields are gone: %v", req)
			}
		}},
		{"invalid UTF-8", ``, func(t *testing.T, req map[string]any) {
			msgs, _ := req["messages"].([]any)
			if len(msgs) == 0 || !strings.Contains(fmt.Sprint(msgs[0]), "\uFFFD") {
				t.Errorf("messages %v; want the invalid bytes as U+FFFD", msgs)
			}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			body := fmt.Sprintf(chatBody, tt.extra)
			if tt.extra == "" {
				body = strings.Replace(body, `"hi"`, "\"h\xff\xfei\"", 1)
			}
			before := len(f.store.Calls("sess-1"))
			resp := f.post(t, "/v1/chat/completions", "key-1", body)
			if b, _ := io.ReadAll(resp.Body); resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, b)
			}
			calls := f.store.Calls("sess-1")
			if len(calls) != before+1 {
				t.Fatalf("recorded %d calls", len(calls)-before)
			}
			c := calls[len(calls)-1]
			if len(c.Request) > 1<<20+4<<10 {
				t.Errorf("stored request is %d bytes; want at most about 1 MiB", len(c.Request))
			}
			for name, doc := range map[string][]byte{"request": c.Request, "upstream_request": c.UpstreamRequest, "response": c.Response} {
				if !utf8.Valid(doc) || !json.Valid(doc) {
					t.Errorf("%s is not valid UTF-8 JSON", name)
				}
			}
			var req map[string]any
			if err := json.Unmarshal(c.Request, &req); err != nil {
				t.Fatal(err)
			}
			tt.check(t, req)
		})
	}
}

// flakyRecorder fails while fail is set, with an error naming a session and a path.
type flakyRecorder struct {
	mu    sync.Mutex
	fail  bool
	store *mem.Store
}

func (r *flakyRecorder) Record(ctx context.Context, c *trace.Call) error {
	r.mu.Lock()
	fail := r.fail
	r.mu.Unlock()
	if fail {
		return fmt.Errorf("writing /var/lib/floe/%s.db: %w", c.SessionID, errNoSpace)
	}
	return r.store.Record(ctx, c)
}

var errNoSpace = fmt.Errorf("no space left on device")

// TestHealthzWhileTheStoreCannotWrite: /healthz answers 503 with the reason (naming no
// session or path) after the store refused a write, and ok again once a write succeeds;
// a Health check saying no also makes it 503.
func TestHealthzWhileTheStoreCannotWrite(t *testing.T) {
	f := newFixture(t, &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"})
	rec := &flakyRecorder{fail: true, store: f.store}
	f.srv.Recorder = rec
	health := func() (int, string) {
		resp, err := http.Get(f.url + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := health(); code != 200 {
		t.Fatalf("healthz before any write: %d %s", code, body)
	}
	f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, ""))
	code, body := health()
	if code != 503 || !strings.Contains(body, "store cannot write") || strings.Contains(body, "sess-1") || strings.Contains(body, "/var/lib") {
		t.Errorf("healthz after a failed write: %d %q; want 503 with the reason, naming no session or path", code, body)
	}
	rec.mu.Lock()
	rec.fail = false
	rec.mu.Unlock()
	f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, ""))
	if code, body := health(); code != 200 {
		t.Errorf("healthz after a write succeeded: %d %s", code, body)
	}
}

func TestHealthCheck(t *testing.T) {
	srv := httptest.NewServer(&proxy.Server{Health: func() error { return fmt.Errorf("the disk is full") }})
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 503 || !strings.Contains(string(b), "the disk is full") {
		t.Errorf("%d %s", resp.StatusCode, b)
	}
}

// TestKeepAliveOutlivesTheClientIdleLimit: the write deadline of one answer does not
// outlive it (net/http clears it after each request): the connection's next request,
// sent after longer than the limit, is answered, by the proxy or by a handler beside it
// on the same listener (the control API's, in floe proxy).
func TestKeepAliveOutlivesTheClientIdleLimit(t *testing.T) {
	up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"}
	upstream := httptest.NewServer(up.handler())
	defer upstream.Close()
	store := &mem.Store{}
	store.AddSession("k", "s")
	proxySrv := &proxy.Server{Dialects: proxy.Dialects{openai.Chat{}}, Engine: &vllm.Engine{BaseURL: upstream.URL, Model: "m"},
		Sessions: store, Recorder: store, Limits: proxy.Limits{ClientIdle: 50 * time.Millisecond}, Log: slog.New(slog.DiscardHandler)}
	mux := http.NewServeMux()
	mux.Handle("/", proxySrv)
	mux.HandleFunc("/other", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"data":[{"id":"Hel"}]}`)
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	px := srv.URL
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
	defer client.CloseIdleConnections()
	var conns sync.Map
	for i, extra := range []string{`,"stream":true`, "other", "", "other", `,"stream":true`} {
		trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) { conns.Store(info.Conn.LocalAddr().String(), true) }}
		path := "/v1/chat/completions"
		if extra == "other" {
			path, extra = "/other", ""
		}
		req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), http.MethodPost,
			px+path, strings.NewReader(fmt.Sprintf(chatBody, extra)))
		req.Header.Set("Authorization", "Bearer k")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(b), "Hel") {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
		time.Sleep(150 * time.Millisecond) // three times the limit
	}
	n := 0
	conns.Range(func(any, any) bool { n++; return true })
	if n != 1 {
		t.Errorf("the requests used %d connections; want one kept alive", n)
	}
	if calls := store.Calls("s"); len(calls) != 3 || !calls[2].Trainable {
		t.Errorf("recorded %d calls; want 3, trainable", len(calls))
	}
}

// TestTricklingBodyIsDropped: a harness that sends part of its body and stops gets a 408
// after the client idle limit, and the -max-inflight slot it held is free again.
func TestTricklingBodyIsDropped(t *testing.T) {
	up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"}
	upstream := httptest.NewServer(up.handler())
	defer upstream.Close()
	_, px := limitsProxy(t, upstream.URL, proxy.Limits{ClientIdle: 100 * time.Millisecond, MaxInflight: 1}, nil)
	conn, err := net.Dial("tcp", strings.TrimPrefix(px, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }() // a client's connection: its end is not the test
	_, _ = fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":")
	// net/http drops a connection whose body read failed, so the 408 floe answers may
	// not arrive; the connection must end either way, and soon.
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	var ne net.Error
	switch {
	case errors.As(err, &ne) && ne.Timeout():
		t.Fatal("the connection of a trickled body is still open")
	case err == nil:
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 408 || !strings.Contains(string(b), "client-idle-timeout") {
			t.Errorf("%d %s; want 408 naming -client-idle-timeout", resp.StatusCode, b)
		}
	}
	if status, body := postChat(t, px, ""); status != 200 {
		t.Errorf("the next call: %d %s; want the slot free", status, body)
	}
}

// TestSGLangFirstByteDeadline: SGLang's answer comes whole (floe never streams from it),
// so -upstream-first-byte-timeout bounds its whole generation, streaming caller or not.
func TestSGLangFirstByteDeadline(t *testing.T) {
	for _, extra := range []string{"", `,"stream":true`} {
		h, url := newHanging(t, "headers")
		store := &mem.Store{}
		store.AddSession("k", "s")
		srv := httptest.NewServer(&proxy.Server{Dialects: proxy.Dialects{openai.Chat{}}, Engine: sglang.New(url, "m"),
			Sessions: store, Recorder: store, Limits: proxy.Limits{UpstreamFirstByte: 100 * time.Millisecond}, Log: slog.New(slog.DiscardHandler)})
		status, body := postChat(t, srv.URL, extra)
		if status != 504 || !strings.Contains(body, "upstream-first-byte-timeout") {
			t.Errorf("stream=%v: %d %s; want a 504 naming -upstream-first-byte-timeout", extra != "", status, body)
		}
		waitClosed(t, h.cancelled, "cancelling the upstream request")
		if c := waitCalls(t, store, 1)[0]; c.Trainable || !strings.Contains(c.UntrainableReason, "upstream timeout") {
			t.Errorf("recorded trainable=%v reason %q", c.Trainable, c.UntrainableReason)
		}
		srv.Close()
	}
}

// TestNoSlotForAStrangerOrOneGreedySession: a caller without a live key is refused before
// any of its body is read, so one that sends headers and then trickles nothing holds no
// slot; and one session with MaxInflightPerSession calls in flight cannot take the last
// slots from another session.
func TestNoSlotForAStrangerOrOneGreedySession(t *testing.T) {
	release := make(chan struct{})
	held := make(chan struct{}, 8)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if !strings.Contains(r.URL.Path, "models") {
			held <- struct{}{}
			<-release
		}
		_, _ = io.WriteString(w, `{"id":"c","prompt_token_ids":[1],"choices":[{"index":0,"finish_reason":"stop","token_ids":[2],"logprobs":{"content":[{"logprob":-0.5}]},"message":{"role":"assistant","content":"ok"}}]}`)
	}))
	defer upstream.Close()
	defer close(release)
	store, px := limitsProxy(t, upstream.URL, proxy.Limits{MaxInflight: 3, MaxInflightPerSession: 2}, nil)
	store.AddSession("k2", "s2")

	// A stranger announces a body and never sends it: answered 401 at once.
	conn, err := net.Dial("tcp", strings.TrimPrefix(px, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }() // a client's connection: its end is not the test
	_, _ = fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nobody\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	status, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil || !strings.Contains(status, " 401 ") {
		t.Fatalf("a stranger trickling its body: %q %v; want 401 before the body", status, err)
	}

	call := func(key string) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, px+"/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, "")))
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	codes := make(chan int, 3)
	for range 2 {
		go func() { c, _ := call("k"); codes <- c }()
	}
	<-held
	<-held
	if code, body := call("k"); code != 429 || !strings.Contains(body, "this API key already has") {
		t.Fatalf("a session's third call: %d %s; want 429 naming the per-session cap", code, body)
	}
	// The other session still gets the last slot.
	go func() { c, _ := call("k2"); codes <- c }()
	select {
	case <-held:
	case <-time.After(10 * time.Second):
		t.Fatal("session s2's call did not reach upstream while s held its per-session maximum")
	}
}
