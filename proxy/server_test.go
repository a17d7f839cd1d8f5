package proxy_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/internal/ssetest"
	"github.com/floe-rl/floe/proxy/openai"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/mem"
)

// fakeVLLM is an upstream speaking vLLM's wire format with a scripted answer: each
// element of pieces is one streamed chunk (text, token ids, logprobs).
type fakeVLLM struct {
	t        *testing.T
	prompt   []int32
	pieces   []fakePiece
	finish   string
	noIDs    bool          // omit token ids
	cutAfter int           // close the stream after this many chunks (0: never)
	delay    time.Duration // between chunks
	status   int           // answer with this error status and errBody instead
	errBody  string

	mu       sync.Mutex
	requests []map[string]any
	canceled chan struct{}
}

type fakePiece struct {
	content, reasoning string
	call               *proxy.ToolCallDelta
	ids                []int32
	logprobs           []float32
}

func (f *fakeVLLM) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"served-model","object":"model"}]}`)
	})
	mux.HandleFunc("POST /tokenize", func(w http.ResponseWriter, r *http.Request) {
		_, _ = fmt.Fprintf(w, `{"count": %d, "max_model_len": 4096, "tokens": []}`, len(f.prompt))
	})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		var req map[string]any
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			f.t.Errorf("upstream got a body that is not JSON: %v", err)
		}
		f.mu.Lock()
		f.requests = append(f.requests, req)
		f.mu.Unlock()
		if f.status != 0 {
			w.WriteHeader(f.status)
			_, _ = io.WriteString(w, f.errBody)
			return
		}
		if req["stream"] == true {
			f.stream(w, r)
			return
		}
		var ids []int32
		lps := []map[string]any{}
		var content, reasoning strings.Builder
		var calls []proxy.ChatToolCall
		for _, p := range f.pieces {
			ids = append(ids, p.ids...)
			for _, lp := range p.logprobs {
				lps = append(lps, map[string]any{"token": "x", "logprob": lp})
			}
			content.WriteString(p.content)
			reasoning.WriteString(p.reasoning)
			if p.call != nil {
				if p.call.ID != "" {
					calls = append(calls, proxy.ChatToolCall{ID: p.call.ID, Type: "function", Function: proxy.ChatFunctionCall{Name: p.call.Name}})
				}
				calls[len(calls)-1].Function.Arguments += p.call.Arguments
			}
		}
		choice := map[string]any{"index": 0, "finish_reason": f.finish, "logprobs": map[string]any{"content": lps},
			"message": map[string]any{"role": "assistant", "content": content.String(), "reasoning_content": reasoning.String(), "tool_calls": calls}}
		resp := map[string]any{"id": "chatcmpl-up", "choices": []any{choice}, "usage": map[string]int{"prompt_tokens": len(f.prompt), "completion_tokens": len(ids), "total_tokens": len(f.prompt) + len(ids)}}
		if !f.noIDs {
			choice["token_ids"] = ids
			resp["prompt_token_ids"] = f.prompt
		}
		_ = json.NewEncoder(w).Encode(resp)
	})
	return mux
}

func (f *fakeVLLM) stream(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	send := func(v any) {
		b, _ := json.Marshal(v)
		_, _ = fmt.Fprintf(w, "data: %s\n\n", b)
		fl.Flush()
	}
	first := map[string]any{"id": "chatcmpl-up", "choices": []any{map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}}}}
	if !f.noIDs {
		first["prompt_token_ids"] = f.prompt
	}
	send(first)
	total := 0
	for i, p := range f.pieces {
		if f.cutAfter > 0 && i == f.cutAfter {
			return // the upstream dies mid-stream
		}
		select {
		case <-r.Context().Done():
			if f.canceled != nil {
				close(f.canceled)
			}
			return
		case <-time.After(f.delay):
		}
		delta := map[string]any{}
		if p.content != "" {
			delta["content"] = p.content
		}
		if p.reasoning != "" {
			delta["reasoning_content"] = p.reasoning
		}
		if p.call != nil {
			fn := map[string]any{"arguments": p.call.Arguments}
			call := map[string]any{"index": p.call.Index, "function": fn}
			if p.call.ID != "" {
				call["id"], call["type"], fn["name"] = p.call.ID, "function", p.call.Name
			}
			delta["tool_calls"] = []any{call}
		}
		lps := []map[string]any{}
		for _, lp := range p.logprobs {
			lps = append(lps, map[string]any{"token": "x", "logprob": lp})
		}
		choice := map[string]any{"index": 0, "delta": delta, "logprobs": map[string]any{"content": lps}}
		if !f.noIDs {
			choice["token_ids"] = p.ids
		}
		total += len(p.ids)
		send(map[string]any{"id": "chatcmpl-up", "choices": []any{choice}})
	}
	send(map[string]any{"id": "chatcmpl-up", "choices": []any{map[string]any{"index": 0, "delta": map[string]any{}, "finish_reason": f.finish}}})
	send(map[string]any{"id": "chatcmpl-up", "choices": []any{}, "usage": map[string]int{"prompt_tokens": len(f.prompt), "completion_tokens": total, "total_tokens": len(f.prompt) + total}})
	_, _ = io.WriteString(w, "data: [DONE]\n\n")
	fl.Flush()
}

// answer is a scripted reply: reasoning, text and a tool call, with a token-id-only chunk
// (delta {}) as vLLM sends for <tool_call>.
func answer() []fakePiece {
	return []fakePiece{
		{reasoning: "think", ids: []int32{10, 11}, logprobs: []float32{-0.1, -0.2}},
		{content: "Hel", ids: []int32{12}, logprobs: []float32{-0.3}},
		{content: "lo", ids: []int32{13}, logprobs: []float32{-0.4}},
		{ids: []int32{14}, logprobs: []float32{-0.5}},
		{call: &proxy.ToolCallDelta{Index: 0, ID: "call_1", Name: "read_file"}, ids: []int32{15}, logprobs: []float32{-0.6}},
		{call: &proxy.ToolCallDelta{Index: 0, Arguments: `{"path":`}, ids: []int32{16}, logprobs: []float32{-0.7}},
		{call: &proxy.ToolCallDelta{Index: 0, Arguments: `"a.txt"}`}, ids: []int32{17, 18}, logprobs: []float32{-0.8, 0}},
	}
}

type fixture struct {
	up    *fakeVLLM
	store *mem.Store
	gate  *proxy.Gate
	srv   *proxy.Server
	url   string
}

func newFixture(t *testing.T, up *fakeVLLM) *fixture {
	t.Helper()
	upstream := httptest.NewServer(up.handler())
	t.Cleanup(upstream.Close)
	f := &fixture{up: up, store: &mem.Store{}, gate: &proxy.Gate{}}
	f.store.AddSession("key-1", "sess-1")
	f.srv = &proxy.Server{
		Dialects: proxy.Dialects{openai.Chat{}}, Engine: &vllm.Engine{BaseURL: upstream.URL},
		Sessions: f.store, Recorder: f.store, Gate: f.gate, Log: slog.New(slog.DiscardHandler),
	}
	ts := httptest.NewServer(f.srv)
	t.Cleanup(ts.Close)
	f.url = ts.URL
	return f
}

func (f *fixture) post(t *testing.T, path, key, body string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, f.url+path, strings.NewReader(body))
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

const chatBody = `{"model":"claude-like","messages":[{"role":"user","content":"hi"}]%s}`

func TestRecordsTheSameCallStreamingOrNot(t *testing.T) {
	up := &fakeVLLM{t: t, prompt: []int32{1, 2, 3}, pieces: answer(), finish: "tool_calls"}
	f := newFixture(t, up)

	resp := f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, ""))
	var got map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil || resp.StatusCode != 200 {
		t.Fatalf("status %d, %v", resp.StatusCode, err)
	}
	if got["model"] != "claude-like" {
		t.Errorf("answer names model %v, want the caller's", got["model"])
	}
	if sent := up.requests[0]; sent["model"] != "served-model" || sent["logprobs"] != true || sent["return_token_ids"] != true {
		t.Errorf("upstream request %v lacks the served model or the token flags", sent)
	}

	resp = f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, `,"stream":true,"stream_options":{"include_usage":true}`))
	events := ssetest.Data(t, resp.Body)
	if events[len(events)-1] != "[DONE]" {
		t.Fatalf("stream does not end with [DONE]: %v", events)
	}
	var text, args strings.Builder
	for _, e := range events[:len(events)-1] {
		var c struct {
			Choices []struct {
				Delta struct {
					Content   string `json:"content"`
					ToolCalls []struct {
						Function struct{ Arguments string } `json:"function"`
					} `json:"tool_calls"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(e), &c); err != nil {
			t.Fatal(err)
		}
		for _, ch := range c.Choices {
			text.WriteString(ch.Delta.Content)
			for _, tc := range ch.Delta.ToolCalls {
				args.WriteString(tc.Function.Arguments)
			}
		}
	}
	if text.String() != "Hello" || args.String() != `{"path":"a.txt"}` {
		t.Errorf("streamed text %q and arguments %q", text.String(), args.String())
	}

	calls := f.store.Calls("sess-1")
	if len(calls) != 2 {
		t.Fatalf("%d calls recorded, want 2", len(calls))
	}
	want := []int32{10, 11, 12, 13, 14, 15, 16, 17, 18}
	for i, c := range calls {
		if !c.Trainable || c.Index != i || c.API != "openai_chat" || fmt.Sprint(c.PromptIDs) != "[1 2 3]" || fmt.Sprint(c.ResponseIDs) != fmt.Sprint(want) {
			t.Errorf("call %d: %+v", i, c)
		}
	}
	a, b := calls[0], calls[1]
	if fmt.Sprint(a.Logprobs) != fmt.Sprint(b.Logprobs) || a.FinishReason != b.FinishReason {
		t.Errorf("streamed call differs: logprobs %v vs %v, finish %q vs %q", a.Logprobs, b.Logprobs, a.FinishReason, b.FinishReason)
	}
	var ma, mb proxy.ChatMessage
	_ = json.Unmarshal(a.Response, &ma)
	_ = json.Unmarshal(b.Response, &mb)
	if fmt.Sprint(ma) != fmt.Sprint(mb) {
		t.Errorf("recorded messages differ:\n%+v\n%+v", ma, mb)
	}
}

func TestBadInputAndFaults(t *testing.T) {
	tests := []struct {
		name   string
		up     func() *fakeVLLM
		path   string
		key    string
		body   string
		status int
		want   string
	}{
		{"malformed JSON", func() *fakeVLLM { return &fakeVLLM{} }, "/v1/chat/completions", "key-1", `{"model":`, 400, "request body: malformed JSON"},
		{"missing messages", func() *fakeVLLM { return &fakeVLLM{} }, "/v1/chat/completions", "key-1", `{"model":"m"}`, 400, "messages"},
		{"unknown path", func() *fakeVLLM { return &fakeVLLM{} }, "/v2/frobnicate", "key-1", `{}`, 404, "floe serves no POST /v2/frobnicate"},
		{"missing key", func() *fakeVLLM { return &fakeVLLM{} }, "/v1/chat/completions", "", fmt.Sprintf(chatBody, ""), 401, "unknown API key"},
		{"unknown key", func() *fakeVLLM { return &fakeVLLM{} }, "/v1/chat/completions", "nope", fmt.Sprintf(chatBody, ""), 401, "unknown API key"},
		{"context length", func() *fakeVLLM {
			return &fakeVLLM{status: 400, errBody: `{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4900 in the messages, 100 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","code":400}`}
		},
			"/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, ""), 400, "maximum context length is 4096 tokens. However, your messages resulted in 4900 tokens"},
		{"upstream 500", func() *fakeVLLM { return &fakeVLLM{status: 500, errBody: "boom"} }, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, ""), 502, "inference server error 500"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up := tt.up()
			up.t = t
			f := newFixture(t, up)
			resp := f.post(t, tt.path, tt.key, tt.body)
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tt.status || !strings.Contains(string(b), tt.want) || !strings.Contains(string(b), `"error"`) {
				t.Fatalf("status %d body %s; want %d mentioning %q", resp.StatusCode, b, tt.status, tt.want)
			}
		})
	}
}

func TestBodyOverTheLimit(t *testing.T) {
	f := newFixture(t, &fakeVLLM{t: t})
	f.srv.MaxBodyBytes = 1024
	resp := f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, `,"pad":"`+strings.Repeat("x", 2000)+`"`))
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 413 || !strings.Contains(string(b), "larger than the limit of 1024 bytes") {
		t.Fatalf("status %d body %s", resp.StatusCode, b)
	}
}

func TestUpstreamRefusingConnections(t *testing.T) {
	lis, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := lis.Addr().String()
	_ = lis.Close() // nothing listens there now
	store := &mem.Store{}
	store.AddSession("k", "s")
	srv := httptest.NewServer(&proxy.Server{Dialects: proxy.Dialects{openai.Chat{}}, Engine: &vllm.Engine{BaseURL: "http://" + addr, Model: "m"},
		Sessions: store, Recorder: store, Log: slog.New(slog.DiscardHandler)})
	defer srv.Close()
	for _, extra := range []string{"", `,"stream":true`} {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, extra)))
		req.Header.Set("Authorization", "Bearer k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 502 || !strings.Contains(string(b), "unreachable") {
			t.Errorf("stream=%q: status %d body %s", extra, resp.StatusCode, b)
		}
	}
}

func TestUpstreamClosingMidStream(t *testing.T) {
	up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop", cutAfter: 3}
	f := newFixture(t, up)
	resp := f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, `,"stream":true`))
	events := ssetest.Data(t, resp.Body)
	if last := events[len(events)-2]; !strings.Contains(last, `"error"`) || !strings.Contains(last, "closed the stream before [DONE]") {
		t.Fatalf("last events %v: want an error event", events[len(events)-2:])
	}
	calls := f.store.Calls("sess-1")
	if len(calls) != 1 || calls[0].Trainable || !strings.Contains(calls[0].UntrainableReason, "stream broke") {
		t.Fatalf("recorded %+v; want one untrainable call saying the stream broke", calls)
	}
}

func TestClientDisconnectCancelsUpstreamAndRecordsAbort(t *testing.T) {
	up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop", delay: 50 * time.Millisecond, canceled: make(chan struct{})}
	f := newFixture(t, up)
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, f.url+"/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, `,"stream":true`)))
	req.Header.Set("Authorization", "Bearer key-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	for i := 0; i < 3; i++ { // read a few events, then hang up
		if _, err := br.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	resp.Body.Close()
	select {
	case <-up.canceled:
	case <-time.After(5 * time.Second):
		t.Fatal("the upstream request was not cancelled")
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(f.store.Calls("sess-1")) == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	calls := f.store.Calls("sess-1")
	if len(calls) != 1 || calls[0].Trainable || !strings.Contains(calls[0].UntrainableReason, "aborted") {
		t.Fatalf("recorded %+v; want one aborted call", calls)
	}
	// The proxy keeps serving.
	if resp := f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, "")); resp.StatusCode != 200 {
		t.Fatalf("after the disconnect: status %d", resp.StatusCode)
	}
}

func TestUpstreamOmittingTokenIDs(t *testing.T) {
	up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop", noIDs: true}
	f := newFixture(t, up)
	for _, extra := range []string{"", `,"stream":true`} {
		resp := f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, extra))
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 || !bytes.Contains(b, []byte("Hel")) {
			t.Fatalf("the harness must still get its answer: %d %s", resp.StatusCode, b)
		}
	}
	for _, c := range f.store.Calls("sess-1") {
		if c.Trainable || !strings.Contains(c.UntrainableReason, "prompt_token_ids") {
			t.Errorf("call %d recorded as %v %q", c.Index, c.Trainable, c.UntrainableReason)
		}
	}
}

func TestPauseHoldsCallsAndResumeStampsTheNewVersion(t *testing.T) {
	up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"}
	f := newFixture(t, up)
	if _, err := f.gate.Pause(context.Background()); err != nil {
		t.Fatal(err)
	}
	done := make(chan int, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, f.url+"/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, "")))
		req.Header.Set("Authorization", "Bearer key-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			done <- -1
			return
		}
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	select {
	case code := <-done:
		t.Fatalf("a call went through while paused (status %d)", code)
	case <-time.After(200 * time.Millisecond):
	}
	if err := f.gate.Resume(7); err != nil {
		t.Fatal(err)
	}
	if code := <-done; code != 200 {
		t.Fatalf("status %d after resume", code)
	}
	if c := f.store.Calls("sess-1"); len(c) != 1 || c[0].PolicyVersion != 7 {
		t.Fatalf("recorded %+v, want policy version 7", c)
	}
}

func TestOpenSessions(t *testing.T) {
	f := newFixture(t, &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"})
	f.srv.OpenSessions = true
	resp := f.post(t, "/v1/chat/completions", "fresh-key", fmt.Sprintf(chatBody, ""))
	if resp.StatusCode != 200 || len(f.store.Calls("fresh-key")) != 1 {
		t.Fatalf("open sessions: status %d, calls %v", resp.StatusCode, f.store.Calls("fresh-key"))
	}

}

func TestCountTokensAndModels(t *testing.T) {
	f := newFixture(t, &fakeVLLM{t: t, prompt: []int32{1, 2, 3, 4}})
	req, _ := http.NewRequest(http.MethodGet, f.url+"/v1/models", nil)
	req.Header.Set("Authorization", "Bearer key-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `"id":"served-model"`) {
		t.Errorf("models: %s", b)
	}
	n, err := f.srv.Engine.CountTokens(context.Background(), &proxy.ChatRequest{Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}}})
	if err != nil || n != 4 {
		t.Errorf("CountTokens = %d, %v", n, err)
	}
}

var _ = trace.Call{}

// TestUpstreamDyingBeforeTheFirstDelta: nothing may be flushed before the first delta,
// or the caller would get a 200 followed by an error body instead of a proper error.
func TestUpstreamDyingBeforeTheFirstDelta(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"id":"x","prompt_token_ids":[1],"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`+"\n\n")
		w.(http.Flusher).Flush()
		time.Sleep(20 * time.Millisecond) // the proxy has read the first chunk and is idle
	}))
	defer up.Close()
	store := &mem.Store{}
	store.AddSession("k", "s")
	srv := httptest.NewServer(&proxy.Server{Dialects: proxy.Dialects{openai.Chat{}}, Engine: &vllm.Engine{BaseURL: up.URL, Model: "m"},
		Sessions: store, Recorder: store, Log: slog.New(slog.DiscardHandler)})
	defer srv.Close()
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, `,"stream":true`)))
	req.Header.Set("Authorization", "Bearer k")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 502 || !strings.Contains(string(b), "closed the stream before [DONE]") {
		t.Fatalf("status %d body %s; want a 502 error body", resp.StatusCode, b)
	}
}

// failingRecorder refuses every call, with an error naming the session and a file path.
type failingRecorder struct{}

func (failingRecorder) Record(_ context.Context, c *trace.Call) error {
	return fmt.Errorf("writing /var/lib/floe/%s.db: disk full", c.SessionID)
}

// TestInternalErrorsNameNoSessionOrPath: a failure of floe's own (here the store) reaches
// the harness as a 500 that names neither the session nor a file path, streamed or not.
func TestInternalErrorsNameNoSessionOrPath(t *testing.T) {
	f := newFixture(t, &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"})
	f.srv.Recorder = failingRecorder{}
	for _, extra := range []string{"", `,"stream":true`} {
		resp := f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, extra))
		b, _ := io.ReadAll(resp.Body)
		if !strings.Contains(string(b), "floe") || strings.Contains(string(b), "sess-1") || strings.Contains(string(b), "/var/lib") {
			t.Errorf("stream=%v: status %d body %s; want an error naming no session or path", extra != "", resp.StatusCode, b)
		}
	}
}

// finishedRecorder plays a session that finished (its group timed out) while its call was
// in flight.
type finishedRecorder struct{}

func (finishedRecorder) Record(context.Context, *trace.Call) error {
	return fmt.Errorf("record: %w: %q", trace.ErrSessionFinished, "sess-1")
}

// TestSessionFinishedMidCall: a call whose session finished while it was in flight is
// answered as an authentication error (401, or an error event in a begun stream), never
// a 5xx that SDKs retry, and the answer names no session.
func TestSessionFinishedMidCall(t *testing.T) {
	f := newFixture(t, &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"})
	f.srv.Recorder = finishedRecorder{}
	resp := f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, ""))
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(string(b), "has finished") || strings.Contains(string(b), "sess-1") {
		t.Errorf("non-streaming: status %d body %s; want 401 naming no session", resp.StatusCode, b)
	}
	resp = f.post(t, "/v1/chat/completions", "key-1", fmt.Sprintf(chatBody, `,"stream":true`))
	b, _ = io.ReadAll(resp.Body)
	if !strings.Contains(string(b), "has finished") || strings.Contains(string(b), "sess-1") || strings.Contains(string(b), "internal") {
		t.Errorf("streaming: body %s; want an authentication error event naming no session", b)
	}
}
