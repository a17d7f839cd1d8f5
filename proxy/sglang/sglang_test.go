package sglang

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/anthropic"
	"github.com/floe-rl/floe/proxy/internal/ssetest"
	"github.com/floe-rl/floe/proxy/internal/upstream"
	"github.com/floe-rl/floe/proxy/openai"
	"github.com/floe-rl/floe/trace/mem"
)

// fakeSGLang answers as SGLang's OpenAI-compatible server does, with the field names of
// its source (see the SGLang type's doc comment): per-choice prompt_token_ids under
// return_prompt_token_ids or return_token_ids, the generated ids under return_token_ids
// as idField (response_token_ids since sgl-project/sglang#35225, token_ids before it, none
// on servers older than #30917), meta_info with output_token_logprobs tuples under
// return_meta_info, and a refusal of every id flag on a streaming request.
type fakeSGLang struct {
	t       *testing.T
	prompt  []int32
	choices []fakeAnswer
	idField string // "response_token_ids", "token_ids" or "" (an older server)
	noMeta  bool   // a server without return_meta_info
	status  int    // answer /v1/chat/completions with this error status and errBody instead
	errBody string
	mutate  func(resp map[string]any) // edits the answer before it is sent

	mu       sync.Mutex
	requests []map[string]any // /v1/chat/completions bodies
	tokenize []map[string]any // /v1/tokenize bodies
}

// fakeAnswer is one choice as the engine generated it.
type fakeAnswer struct {
	reasoning, content string
	calls              []proxy.ChatToolCall
	ids                []int32
	logprobs           []float64
	finish             string
}

func defaultAnswer() fakeAnswer {
	return fakeAnswer{
		reasoning: "think", content: "Hello",
		calls:    []proxy.ChatToolCall{{ID: "call_0a1b", Type: "function", Function: proxy.ChatFunctionCall{Name: "read_file", Arguments: `{"path":"a.txt"}`}}},
		ids:      []int32{10, 11, 12, 13, 14, 15, 16, 17, 18},
		logprobs: []float64{-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7, -0.8, 0},
		finish:   "tool_calls",
	}
}

func newFakeSGLang(t *testing.T, idField string) *fakeSGLang {
	return &fakeSGLang{t: t, prompt: []int32{1, 2, 3}, choices: []fakeAnswer{defaultAnswer()}, idField: idField}
}

func (f *fakeSGLang) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"served-model","object":"model","created":1700000000,"owned_by":"sglang","root":"served-model","parent":null,"max_model_len":4096}]}`)
	})
	mux.HandleFunc("POST /v1/tokenize", func(w http.ResponseWriter, r *http.Request) {
		req := f.decode(r)
		f.mu.Lock()
		f.tokenize = append(f.tokenize, req)
		f.mu.Unlock()
		if (req["prompt"] == nil) == (req["messages"] == nil) {
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"error":{"message":"Exactly one of 'prompt' or 'messages' must be provided.","type":"BadRequestError","param":null,"code":400}}`)
			return
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"tokens": f.prompt, "count": len(f.prompt), "max_model_len": 4096})
	})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		req := f.decode(r)
		f.mu.Lock()
		f.requests = append(f.requests, req)
		f.mu.Unlock()
		if f.status != 0 {
			w.WriteHeader(f.status)
			_, _ = io.WriteString(w, f.errBody)
			return
		}
		if req["stream"] == true {
			for _, flag := range []string{"return_prompt_token_ids", "return_token_ids", "return_meta_info"} {
				if req[flag] == true {
					w.WriteHeader(http.StatusBadRequest)
					_, _ = fmt.Fprintf(w, `{"error":{"message":"%s is not supported with streaming. Please set stream=false when using %s=true.","type":"BadRequestError","param":null,"code":400}}`, flag, flag)
					return
				}
			}
		}
		_ = json.NewEncoder(w).Encode(f.answer(req))
	})
	return mux
}

func (f *fakeSGLang) decode(r *http.Request) map[string]any {
	var req map[string]any
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		f.t.Errorf("upstream got a body that is not JSON: %v", err)
	}
	return req
}

// answer builds a ChatCompletionResponse as serving_chat.py's _build_chat_response does.
func (f *fakeSGLang) answer(req map[string]any) map[string]any {
	var choices []any
	completion := 0
	for i, a := range f.choices {
		lps := []any{}
		var tuples []any
		for j, lp := range a.logprobs {
			lps = append(lps, map[string]any{"token": "t", "bytes": []int{116}, "logprob": lp, "top_logprobs": []any{}})
			if j < len(a.ids) {
				tuples = append(tuples, []any{lp, a.ids[j], "t"})
			}
		}
		var calls []any
		for k, c := range a.calls {
			calls = append(calls, map[string]any{"id": c.ID, "index": k, "type": "function",
				"function": map[string]any{"name": c.Function.Name, "arguments": c.Function.Arguments}})
		}
		var reasoning any
		if a.reasoning != "" {
			reasoning = a.reasoning
		}
		choice := map[string]any{"index": i, "logprobs": map[string]any{"content": lps}, "finish_reason": a.finish, "matched_stop": nil,
			"message": map[string]any{"role": "assistant", "content": a.content, "reasoning_content": reasoning, "tool_calls": calls}}
		if req["return_prompt_token_ids"] == true || req["return_token_ids"] == true {
			choice["prompt_token_ids"] = f.prompt
		}
		if req["return_token_ids"] == true && f.idField != "" {
			choice[f.idField] = a.ids
		}
		if req["return_meta_info"] == true && !f.noMeta {
			// The engine's finish reason, before the tool-call parser turns stop into tool_calls.
			finish := a.finish
			if finish == "tool_calls" {
				finish = "stop"
			}
			choice["meta_info"] = map[string]any{"id": "5bb3c1f2a7d44e0c", "finish_reason": map[string]any{"type": finish, "matched": 151645},
				"prompt_tokens": len(f.prompt), "completion_tokens": len(a.ids), "cached_tokens": 0,
				"output_token_logprobs": tuples, "e2e_latency": 0.01, "weight_version": "default"}
		}
		choices = append(choices, choice)
		completion += len(a.ids)
	}
	resp := map[string]any{"id": "5bb3c1f2a7d44e0c", "object": "chat.completion", "created": 1700000000, "model": req["model"],
		"choices": choices, "metadata": map[string]any{"weight_version": "default"},
		"usage": map[string]any{"prompt_tokens": len(f.prompt), "total_tokens": len(f.prompt) + completion, "completion_tokens": completion,
			"prompt_tokens_details": nil, "reasoning_tokens": 0}}
	if f.mutate != nil {
		f.mutate(resp)
	}
	return resp
}

// choiceOf returns choice i of an answer being mutated.
func choiceOf(resp map[string]any, i int) map[string]any {
	return resp["choices"].([]any)[i].(map[string]any)
}

type fixture struct {
	up    *fakeSGLang
	store *mem.Store
	srv   *proxy.Server
	url   string
}

func newSGLFixture(t *testing.T, up *fakeSGLang) *fixture {
	t.Helper()
	upstream := httptest.NewServer(up.handler())
	t.Cleanup(upstream.Close)
	f := &fixture{up: up, store: &mem.Store{}}
	f.store.AddSession("key-1", "sess-1")
	f.srv = &proxy.Server{
		Dialects: proxy.Dialects{openai.Chat{}, anthropic.Dialect{}}, Engine: &Engine{BaseURL: upstream.URL},
		Sessions: f.store, Recorder: f.store, Log: slog.New(slog.DiscardHandler),
	}
	ts := httptest.NewServer(f.srv)
	t.Cleanup(ts.Close)
	f.url = ts.URL
	return f
}

func (f *fixture) post(t *testing.T, path, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, f.url+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer key-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

const (
	chatBody = `{"model":"claude-like","messages":[{"role":"user","content":"hi"}]%s}`
	anthBody = `{"model":"claude-like","max_tokens":%d,"messages":[{"role":"user","content":"hi"}]%s}`
)

// chatEvents summarizes a Chat Completions stream: each chunk's delta and finish reason,
// a usage chunk as its usage, and [DONE].
func chatEvents(t *testing.T, body string) []string {
	t.Helper()
	var out []string
	for _, data := range ssetest.Data(t, strings.NewReader(body)) {
		if data == "[DONE]" {
			out = append(out, data)
			continue
		}
		var c struct {
			Object  string `json:"object"`
			Model   string `json:"model"`
			Choices []struct {
				Delta        map[string]any `json:"delta"`
				FinishReason *string        `json:"finish_reason"`
			} `json:"choices"`
			Usage *proxy.Usage `json:"usage"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("chunk %s: %v", data, err)
		}
		if c.Object != "chat.completion.chunk" || c.Model != "claude-like" {
			t.Errorf("chunk %s: want a chat.completion.chunk naming the caller's model", data)
		}
		for _, ch := range c.Choices {
			d, _ := json.Marshal(ch.Delta)
			s := string(d)
			if ch.FinishReason != nil {
				s += " finish=" + *ch.FinishReason
			}
			out = append(out, s)
		}
		if c.Usage != nil {
			u, _ := json.Marshal(c.Usage)
			out = append(out, "usage="+string(u))
		}
	}
	return out
}

func anthEvents(t *testing.T, body string) []string {
	t.Helper()
	var out []string
	for _, ev := range ssetest.Events(t, body) {
		s := ssetest.Summary(ev)
		if ev.Name == "message_delta" {
			d, _ := json.Marshal(ev.Data["delta"])
			u, _ := json.Marshal(ev.Data["usage"])
			s += " " + string(d) + " " + string(u)
		}
		out = append(out, s)
	}
	return out
}

// TestSGLangStreamingCallerIsServedFromOneNonStreamingCall: whichever fields the server
// carries its ids in, a streaming caller gets its dialect's whole SSE sequence from one
// non-streaming upstream call, and the call is recorded exactly as a non-streaming one.
func TestSGLangStreamingCallerIsServedFromOneNonStreamingCall(t *testing.T) {
	dialects := []struct {
		name, path, body, stream string
		events                   func(*testing.T, string) []string
		want                     []string
	}{
		{"openai chat", "/v1/chat/completions", fmt.Sprintf(chatBody, ""),
			fmt.Sprintf(chatBody, `,"stream":true,"stream_options":{"include_usage":true}`), chatEvents, []string{
				`{"content":"","role":"assistant"}`,
				`{"reasoning_content":"think"}`,
				`{"content":"Hello"}`,
				`{"tool_calls":[{"function":{"arguments":"{\"path\":\"a.txt\"}","name":"read_file"},"id":"call_0a1b","index":0,"type":"function"}]}`,
				`{} finish=tool_calls`,
				`usage={"prompt_tokens":3,"completion_tokens":9,"total_tokens":12}`,
				`[DONE]`,
			}},
		{"anthropic", "/v1/messages", fmt.Sprintf(anthBody, 100, ""), fmt.Sprintf(anthBody, 100, `,"stream":true`), anthEvents, []string{
			"message_start", "ping",
			"content_block_start 0 thinking", "content_block_delta 0 thinking_delta", "content_block_delta 0 signature_delta", "content_block_stop 0",
			"content_block_start 1 text", "content_block_delta 1 text_delta", "content_block_stop 1",
			"content_block_start 2 tool_use", "content_block_delta 2 input_json_delta", "content_block_stop 2",
			`message_delta {"stop_reason":"tool_use","stop_sequence":null} {"input_tokens":3,"output_tokens":9}`,
			"message_stop",
		}},
	}
	servers := []struct{ name, idField string }{
		{"response_token_ids (sglang#35225)", "response_token_ids"},
		{"token_ids (sglang#30917)", "token_ids"},
		{"meta_info only (older)", ""},
	}
	for _, srv := range servers {
		for _, d := range dialects {
			t.Run(srv.name+"/"+d.name, func(t *testing.T) {
				up := newFakeSGLang(t, srv.idField)
				f := newSGLFixture(t, up)

				status, body := f.post(t, d.path, d.body)
				if status != 200 || !strings.Contains(body, "Hello") || !strings.Contains(body, `"claude-like"`) {
					t.Fatalf("non-streaming answer %d %s", status, body)
				}
				status, body = f.post(t, d.path, d.stream)
				if status != 200 {
					t.Fatalf("streaming answer %d %s", status, body)
				}
				if got := d.events(t, body); !reflect.DeepEqual(got, d.want) {
					t.Errorf("stream events\n got: %q\nwant: %q", got, d.want)
				}

				if len(up.requests) != 2 {
					t.Fatalf("%d upstream calls, want 2", len(up.requests))
				}
				for i, sent := range up.requests {
					if sent["stream"] == true || sent["model"] != "served-model" || sent["logprobs"] != true || sent["return_prompt_token_ids"] != true ||
						sent["return_token_ids"] != true || sent["return_meta_info"] != true {
						t.Errorf("upstream request %d %v: want non-streaming, the served model and the token flags", i, sent)
					}
				}
				if !reflect.DeepEqual(up.requests[0], up.requests[1]) {
					t.Errorf("the streaming caller's upstream request differs:\n%v\n%v", up.requests[0], up.requests[1])
				}

				calls := f.store.Calls("sess-1")
				if len(calls) != 2 {
					t.Fatalf("%d calls recorded, want 2", len(calls))
				}
				a, b := calls[0], calls[1]
				if !a.Trainable || fmt.Sprint(a.PromptIDs) != "[1 2 3]" || fmt.Sprint(a.ResponseIDs) != "[10 11 12 13 14 15 16 17 18]" ||
					fmt.Sprint(a.Logprobs) != "[-0.1 -0.2 -0.3 -0.4 -0.5 -0.6 -0.7 -0.8 0]" || a.FinishReason != "tool_calls" {
					t.Errorf("non-streaming call recorded as %+v", a)
				}
				b.Index, b.Started, b.Finished, b.UpstreamLatency, b.Request = a.Index, a.Started, a.Finished, a.UpstreamLatency, a.Request
				if !reflect.DeepEqual(a, b) {
					t.Errorf("the streamed call is recorded differently:\n%+v\n%+v", a, b)
				}
				var msg proxy.ChatMessage
				if err := json.Unmarshal(a.Response, &msg); err != nil || msg.ReasoningContent != "think" || msg.Content != "Hello" ||
					len(msg.ToolCalls) != 1 || msg.ToolCalls[0].Function.Arguments != `{"path":"a.txt"}` {
					t.Errorf("recorded message %s (%v)", a.Response, err)
				}
			})
		}
	}
}

func TestSGLangSiblingChoices(t *testing.T) {
	second := fakeAnswer{content: "Hi there", ids: []int32{20, 21, 22}, logprobs: []float64{-1, -2, -3}, finish: "stop"}
	tests := []struct {
		name    string
		mutate  func(map[string]any)
		problem [2]string // the untrainable reason of each choice, "" for trainable
	}{
		{"both trainable", nil, [2]string{"", ""}},
		{"a sibling with another prompt", func(r map[string]any) { choiceOf(r, 1)["prompt_token_ids"] = []int32{1, 2, 4} },
			[2]string{"", "prompt_token_ids of choice 1 differ from choice 0's"}},
		{"a sibling without ids", func(r map[string]any) {
			delete(choiceOf(r, 1), "response_token_ids")
			delete(choiceOf(r, 1), "meta_info")
		}, [2]string{"", "no token ids for the response"}},
	}
	for _, tt := range tests {
		for _, extra := range []string{`,"n":2`, `,"n":2,"stream":true`} {
			t.Run(tt.name+extra, func(t *testing.T) {
				up := newFakeSGLang(t, "response_token_ids")
				up.choices = append(up.choices, second)
				up.mutate = tt.mutate
				f := newSGLFixture(t, up)
				status, body := f.post(t, "/v1/chat/completions", fmt.Sprintf(chatBody, extra))
				if status != 200 || !strings.Contains(body, "Hello") {
					t.Fatalf("answer %d %s", status, body)
				}
				if up.requests[0]["n"] != float64(2) {
					t.Errorf("upstream asked for n=%v", up.requests[0]["n"])
				}
				calls := f.store.Calls("sess-1")
				if len(calls) != 2 {
					t.Fatalf("%d calls recorded, want 2 siblings", len(calls))
				}
				wantIDs := []string{"[10 11 12 13 14 15 16 17 18]", "[20 21 22]"}
				for i, c := range calls {
					if c.Index != 0 || c.Choice != i || fmt.Sprint(c.PromptIDs) != "[1 2 3]" {
						t.Errorf("choice %d recorded as index %d choice %d prompt %v: want siblings of one prompt", i, c.Index, c.Choice, c.PromptIDs)
					}
					if tt.problem[i] == "" {
						if !c.Trainable || fmt.Sprint(c.ResponseIDs) != wantIDs[i] {
							t.Errorf("choice %d: trainable %v (%s), ids %v", i, c.Trainable, c.UntrainableReason, c.ResponseIDs)
						}
					} else if c.Trainable || !strings.Contains(c.UntrainableReason, tt.problem[i]) {
						t.Errorf("choice %d: trainable %v, reason %q; want untrainable: %q", i, c.Trainable, c.UntrainableReason, tt.problem[i])
					}
				}
			})
		}
	}
}

func TestSGLangInconsistentTokenDataIsUntrainable(t *testing.T) {
	tests := []struct {
		name    string
		setup   func(*fakeSGLang)
		mutate  func(map[string]any)
		problem string
	}{
		{"no prompt ids", nil, func(r map[string]any) { delete(choiceOf(r, 0), "prompt_token_ids") }, "no prompt_token_ids"},
		{"no response ids anywhere", func(f *fakeSGLang) { f.idField, f.noMeta = "", true }, nil, "no token ids for the response"},
		{"no logprobs", nil, func(r map[string]any) { choiceOf(r, 0)["logprobs"] = nil }, "no logprobs"},
		{"fewer logprobs than ids", nil, func(r map[string]any) {
			lp := choiceOf(r, 0)["logprobs"].(map[string]any)
			lp["content"] = lp["content"].([]any)[:8]
		}, "8 logprobs for 9 response token ids"},
		{"a null logprob", nil, func(r map[string]any) {
			choiceOf(r, 0)["logprobs"].(map[string]any)["content"].([]any)[2].(map[string]any)["logprob"] = nil
		}, "logprob of response token 2 is null"},
		{"ids disagreeing with meta_info", nil, func(r map[string]any) {
			choiceOf(r, 0)["response_token_ids"] = []int32{10, 11, 12, 13, 14, 15, 16, 17, 99}
		}, "response_token_ids (9 ids) disagree with meta_info.output_token_logprobs"},
		{"an aborted generation", func(f *fakeSGLang) { f.choices[0].finish = "abort" }, nil, "aborted the generation"},
		{"a positive logprob", func(f *fakeSGLang) { f.choices[0].logprobs[3] = 0.5 }, nil, "logprob"},
	}
	for _, tt := range tests {
		for _, extra := range []string{"", `,"stream":true`} {
			t.Run(tt.name+extra, func(t *testing.T) {
				up := newFakeSGLang(t, "response_token_ids")
				if tt.setup != nil {
					tt.setup(up)
				}
				up.mutate = tt.mutate
				f := newSGLFixture(t, up)
				status, body := f.post(t, "/v1/chat/completions", fmt.Sprintf(chatBody, extra))
				if status != 200 || !strings.Contains(body, "Hello") || !strings.Contains(body, "read_file") {
					t.Fatalf("the harness must still get its answer: %d %s", status, body)
				}
				calls := f.store.Calls("sess-1")
				if len(calls) != 1 || calls[0].Trainable || !strings.Contains(calls[0].UntrainableReason, tt.problem) {
					t.Fatalf("recorded %+v; want one untrainable call saying %q", calls, tt.problem)
				}
			})
		}
	}
}

// TestSGLangContextLengthErrors: SGLang's two overflow wordings, in its older flat error
// object and its newer OpenAI envelope, reach each dialect as a vLLM overflow would.
func TestSGLangContextLengthErrors(t *testing.T) {
	inputTooLong := `{"object":"error","message":"The input (5000 tokens) is longer than the model's context length (4096 tokens).","type":"BadRequestError","param":null,"code":400}`
	requested := `{"error":{"message":"Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of 5000 tokens: 1000 tokens from the input messages and 4000 tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.","type":"BadRequestError","param":null,"code":400}}`
	tests := []struct {
		name, errBody, vllmMessage string
		prompt, max                int
		path, body, want           string
	}{
		{"input too long, chat", inputTooLong,
			"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens in the messages, Please reduce the length of the messages.",
			5000, 4096, "/v1/chat/completions", chatBody,
			"This model's maximum context length is 4096 tokens. However, your messages resulted in 5000 tokens."},
		{"input too long, anthropic", inputTooLong, "", 5000, 4096, "/v1/messages", fmt.Sprintf(anthBody, 100, "%s"),
			"prompt is too long: 5000 tokens \u003e 4096 maximum"},
		{"prompt and completion too long, chat", requested,
			"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (1000 in the messages, 4000 in the completion). Please reduce the length of the messages or completion.",
			1000, 4096, "/v1/chat/completions", chatBody,
			"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (1000 in the messages, 4000 in the completion). Please reduce the length of the messages or completion."},
		{"prompt and completion too long, anthropic", requested, "", 1000, 4096, "/v1/messages", fmt.Sprintf(anthBody, 4000, "%s"),
			"input length and `max_tokens` exceed context limit: 1000 + 4000 \u003e 4096"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := mapError(http.StatusBadRequest, []byte(tt.errBody))
			if got.Kind != proxy.ErrContextLength || got.Status != http.StatusBadRequest || got.PromptTokens != tt.prompt || got.MaxTokens != tt.max {
				t.Errorf("mapError = %+v; want a 400 context-length error of %d prompt tokens, limit %d", got, tt.prompt, tt.max)
			}
			if tt.vllmMessage != "" {
				vllm := upstream.MapError(http.StatusBadRequest, fmt.Appendf(nil, `{"object":"error","message":%q,"type":"BadRequestError","code":400}`, tt.vllmMessage))
				if !reflect.DeepEqual(got, vllm) {
					t.Errorf("mapped differently from vLLM's overflow:\n sglang %+v\n   vllm %+v", got, vllm)
				}
			}
			for _, extra := range []string{"", `,"stream":true`} {
				up := newFakeSGLang(t, "response_token_ids")
				up.status, up.errBody = http.StatusBadRequest, tt.errBody
				f := newSGLFixture(t, up)
				status, body := f.post(t, tt.path, fmt.Sprintf(tt.body, extra))
				var shaped struct {
					Error struct {
						Message string `json:"message"`
						Type    string `json:"type"`
					} `json:"error"`
				}
				if err := json.Unmarshal([]byte(body), &shaped); err != nil || status != 400 || !strings.Contains(shaped.Error.Message, tt.want) ||
					shaped.Error.Type != "invalid_request_error" {
					t.Errorf("stream=%q: status %d body %s; want 400 invalid_request_error saying %q", extra, status, body, tt.want)
				}
				if n := len(f.store.Calls("sess-1")); n != 0 {
					t.Errorf("stream=%q: %d calls recorded for a refused request", extra, n)
				}
			}
		})
	}
}

func TestSGLangOtherUpstreamErrors(t *testing.T) {
	tests := []struct {
		name, body string
		status     int
		want       string
		wantStatus int
	}{
		{"server error", `{"error":{"message":"Internal server error: boom","type":"InternalServerError","param":null,"code":500}}`, 500, "inference server error 500: Internal server error: boom", 502},
		{"busy", `{"object":"error","message":"queue full","type":"ServiceUnavailable","param":null,"code":503}`, 503, "inference server busy: queue full", 503},
		{"validation", `{"detail":[{"type":"missing","loc":["body","messages"],"msg":"Field required"}]}`, 422, "inference server rejected the request", 400},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up := newFakeSGLang(t, "response_token_ids")
			up.status, up.errBody = tt.status, tt.body
			f := newSGLFixture(t, up)
			for _, extra := range []string{"", `,"stream":true`} {
				status, body := f.post(t, "/v1/chat/completions", fmt.Sprintf(chatBody, extra))
				if status != tt.wantStatus || !strings.Contains(body, tt.want) {
					t.Errorf("stream=%q: status %d body %s; want %d mentioning %q", extra, status, body, tt.wantStatus, tt.want)
				}
			}
		})
	}
}

func TestSGLangUpstreamRefusingConnections(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	_ = lis.Close() // nothing listens there now
	engine := &Engine{BaseURL: "http://" + addr}
	store := &mem.Store{}
	store.AddSession("k", "s")
	srv := httptest.NewServer(&proxy.Server{Dialects: proxy.Dialects{openai.Chat{}, anthropic.Dialect{}}, Engine: engine,
		Sessions: store, Recorder: store, Log: slog.New(slog.DiscardHandler)})
	defer srv.Close()
	tests := []struct{ path, body, want string }{
		{"/v1/chat/completions", fmt.Sprintf(chatBody, ""), `"type":"server_error"`},
		{"/v1/chat/completions", fmt.Sprintf(chatBody, `,"stream":true`), `"type":"server_error"`},
		{"/v1/messages", fmt.Sprintf(anthBody, 100, `,"stream":true`), `"type":"api_error"`},
	}
	for _, tt := range tests {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+tt.path, strings.NewReader(tt.body))
		req.Header.Set("Authorization", "Bearer k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 502 || !strings.Contains(string(b), "unreachable") || !strings.Contains(string(b), tt.want) {
			t.Errorf("%s %s: status %d body %s; want a provider-shaped 502", tt.path, tt.body, resp.StatusCode, b)
		}
	}
	ctx := context.Background()
	_, errModels := engine.Models(ctx)
	_, errCount := (&Engine{BaseURL: "http://" + addr, Model: "m"}).CountTokens(ctx, &proxy.ChatRequest{Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}}})
	for name, err := range map[string]error{"Models": errModels, "CountTokens": errCount} {
		var e *proxy.Error
		if !errors.As(err, &e) || e.Kind != proxy.ErrUpstreamUnavailable || e.Status != http.StatusBadGateway {
			t.Errorf("%s: %v; want a 502 upstream_unavailable", name, err)
		}
	}
	if n := len(store.Calls("s")); n != 0 {
		t.Errorf("%d calls recorded without an upstream answer", n)
	}
}

func TestSGLangCountTokensAndModels(t *testing.T) {
	up := newFakeSGLang(t, "response_token_ids")
	up.prompt = []int32{1, 2, 3, 4, 5}
	f := newSGLFixture(t, up)

	status, body := f.post(t, "/v1/messages/count_tokens",
		`{"model":"claude-like","messages":[{"role":"user","content":"hi"}],"tools":[{"name":"read_file","input_schema":{"type":"object"}}]}`)
	if status != 200 || !strings.Contains(body, `"input_tokens":5`) {
		t.Fatalf("count_tokens: %d %s", status, body)
	}
	sent := up.tokenize[0]
	if sent["model"] != "served-model" || sent["messages"] == nil || sent["prompt"] != nil || sent["tools"] == nil {
		t.Errorf("tokenize request %v: want the served model, the messages and the tools", sent)
	}

	n, err := f.srv.Engine.CountTokens(context.Background(), &proxy.ChatRequest{Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
		ChatTemplateKwargs: map[string]any{"enable_thinking": false}})
	if err != nil || n != 5 {
		t.Errorf("CountTokens = %d, %v", n, err)
	}
	if kw, _ := up.tokenize[1]["chat_template_kwargs"].(map[string]any); kw["enable_thinking"] != false {
		t.Errorf("tokenize request %v lacks the chat template kwargs", up.tokenize[1])
	}

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
}

// failingSink is a caller that has gone away.
type failingSink struct{ deltas int }

func (s *failingSink) Delta(proxy.Delta) error { s.deltas++; return errors.New("broken pipe") }
func (s *failingSink) Flush()                  {}

func TestSGLangStreamToAGoneCallerReturnsTheAnswer(t *testing.T) {
	up := newFakeSGLang(t, "response_token_ids")
	upstream := httptest.NewServer(up.handler())
	defer upstream.Close()
	sink := &failingSink{}
	res, err := (&Engine{BaseURL: upstream.URL}).Stream(context.Background(), &proxy.ChatRequest{Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}}}, sink)
	if !errors.Is(err, proxy.ErrCallerGone) || res == nil || len(res.Choices) != 1 || res.Choices[0].Problem != "" || sink.deltas != 1 {
		t.Fatalf("Stream = %+v, %v after %d deltas; want the whole answer and proxy.ErrCallerGone after the first delta", res, err, sink.deltas)
	}
}

func TestAnswerDeltas(t *testing.T) {
	msg := proxy.ChatMessage{Role: "assistant", Content: "Reading both.", ReasoningContent: "Need both.", ToolCalls: []proxy.ChatToolCall{
		{ID: "a", Type: "function", Function: proxy.ChatFunctionCall{Name: "Read", Arguments: `{"p":1}`}},
		{ID: "b", Type: "function", Function: proxy.ChatFunctionCall{Name: "Grep", Arguments: `{}`}},
	}}
	want := []proxy.Delta{{Reasoning: "Need both."}, {Content: "Reading both."},
		{ToolCalls: []proxy.ToolCallDelta{{Index: 0, ID: "a", Name: "Read", Arguments: `{"p":1}`}}},
		{ToolCalls: []proxy.ToolCallDelta{{Index: 1, ID: "b", Name: "Grep", Arguments: `{}`}}}}
	if got := answerDeltas(msg); !reflect.DeepEqual(got, want) {
		t.Errorf("answerDeltas\n got %+v\nwant %+v", got, want)
	}
	if got := answerDeltas(proxy.ChatMessage{Role: "assistant", Content: ""}); len(got) != 0 {
		t.Errorf("an empty answer gave deltas %+v", got)
	}
}
