package proxy_test

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/internal/ssetest"
	"github.com/floe-rl/floe/proxy/providers"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/mem"
)

// The tests of this file put floe in front of an upstream that answers byte for byte as
// vLLM 0.32 does (issue 20, part 3): its chat answers (vllm/entrypoints/openai/
// chat_completion: JSONResponse of model_dump() for a plain answer, model_dump_json(
// exclude_unset=True) per stream chunk) and its refusals (serve/exception_handling:
// {"error": {message, type, param, code}}, the message str() of a VLLMValidationError,
// which appends "(parameter=…, value=…)").

// vllm032 is that upstream. Every /v1/chat/completions call gets answer (or stream, when
// it asks to stream), or status and errBody when status is set; /tokenize answers
// tokenizeCount, or 500 when tokenizeFails.
type vllm032 struct {
	answer, stream string
	status         int
	errBody        string
	tokenizeCount  int
	tokenizeFails  bool
	// turns, when set, answer the chat calls in order instead: (answer, stream) each.
	turns           [][2]string
	mu              sync.Mutex
	chatBodies      []map[string]any
	tokenizeBodies  []map[string]any
	tokenizeRawBody []string
}

func (u *vllm032) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	raw, _ := io.ReadAll(r.Body)
	var body map[string]any
	_ = json.Unmarshal(raw, &body)
	switch r.URL.Path {
	case "/v1/models":
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"smollm2","object":"model","created":1764662400,"owned_by":"vllm","root":"smollm2","parent":null,"max_model_len":4096,"permission":[]}]}`)
	case "/tokenize":
		u.mu.Lock()
		u.tokenizeBodies = append(u.tokenizeBodies, body)
		u.tokenizeRawBody = append(u.tokenizeRawBody, string(raw))
		u.mu.Unlock()
		if u.tokenizeFails {
			w.WriteHeader(http.StatusInternalServerError)
			_, _ = io.WriteString(w, `{"error":{"message":"tokenizer down","type":"InternalServerError","param":null,"code":500}}`)
			return
		}
		_, _ = fmt.Fprintf(w, `{"count":%d,"max_model_len":4096,"tokens":[1,2,3],"token_strs":null}`, u.tokenizeCount)
	case "/v1/chat/completions":
		u.mu.Lock()
		u.chatBodies = append(u.chatBodies, body)
		answer, stream := u.answer, u.stream
		if n := len(u.chatBodies); n <= len(u.turns) {
			answer, stream = u.turns[n-1][0], u.turns[n-1][1]
		}
		u.mu.Unlock()
		switch {
		case u.status != 0:
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(u.status)
			_, _ = io.WriteString(w, u.errBody)
		case body["stream"] == true:
			w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
			_, _ = io.WriteString(w, stream)
		default:
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, answer)
		}
	default:
		http.NotFound(w, r)
	}
}

// vllm032Fixture serves all four dialects in front of up, recording in memory.
func vllm032Fixture(t *testing.T, up *vllm032) (url string, store *mem.Store) {
	t.Helper()
	upstream := httptest.NewServer(up)
	t.Cleanup(upstream.Close)
	store = &mem.Store{}
	store.AddSession("key-1", "sess-1")
	srv := httptest.NewServer(&proxy.Server{Dialects: providers.Dialects(), Engine: vllm.New(upstream.URL, ""),
		Sessions: store, Recorder: store, Log: slog.New(slog.DiscardHandler)})
	t.Cleanup(srv.Close)
	return srv.URL, store
}

// dialectCall is one provider API's request, as its harness sends it; %s takes more
// top-level fields.
type dialectCall struct {
	name, path, body, streamPath string
	headers                      map[string]string
}

var vllm032Dialects = []dialectCall{
	{name: "chat", path: "/v1/chat/completions", body: `{"model":"m","messages":[{"role":"user","content":"hi"}]%s}`},
	{name: "responses", path: "/v1/responses", body: `{"model":"m","input":"hi"%s}`},
	{name: "anthropic", path: "/v1/messages", body: `{"model":"m","max_tokens":100,"messages":[{"role":"user","content":"hi"}]%s}`,
		headers: map[string]string{"anthropic-version": "2023-06-01", "x-api-key": "key-1"}},
	{name: "gemini", path: "/v1beta/models/m:generateContent", streamPath: "/v1beta/models/m:streamGenerateContent?alt=sse",
		body:    `{"contents":[{"role":"user","parts":[{"text":"hi"}]}],"generationConfig":{"thinkingConfig":{"includeThoughts":true}}%s}`,
		headers: map[string]string{"x-goog-api-key": "key-1"}},
}

// send posts dc's request with extra fields; stream asks for a streamed answer (Gemini
// by its path, the others by "stream": true).
func (dc dialectCall) send(t *testing.T, url, extra string, stream bool) (int, string) {
	t.Helper()
	path := dc.path
	if stream {
		if dc.streamPath != "" {
			path = dc.streamPath
		} else {
			extra += `,"stream":true`
		}
	}
	req, _ := http.NewRequest(http.MethodPost, url+path, strings.NewReader(fmt.Sprintf(dc.body, extra)))
	req.Header.Set("Authorization", "Bearer key-1")
	for k, v := range dc.headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// dig walks a decoded JSON value by object keys and array indexes; nil where the path
// does not exist.
func dig(v any, path ...any) any {
	for _, p := range path {
		switch k := p.(type) {
		case string:
			m, ok := v.(map[string]any)
			if !ok {
				return nil
			}
			v = m[k]
		case int:
			a, ok := v.([]any)
			if !ok || k >= len(a) {
				return nil
			}
			v = a[k]
		}
	}
	return v
}

func decodeJSON(t *testing.T, s string) any {
	t.Helper()
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatalf("not JSON: %v: %s", err, s)
	}
	return v
}

// vllm032Answer is a non-streamed vLLM 0.32 answer with message and finish reason.
func vllm032Answer(message, finish string) string {
	return `{"id":"chatcmpl-9f2","object":"chat.completion","created":1764662400,"model":"smollm2",` +
		`"choices":[{"index":0,"message":` + message + `,` +
		`"logprobs":{"content":[{"token":"token_id:504","logprob":-0.25,"bytes":[116,104],"top_logprobs":[]},{"token":"token_id:279","logprob":-1.5,"bytes":[101],"top_logprobs":[]}]},` +
		`"finish_reason":"` + finish + `","stop_reason":null,"token_ids":[504,279],"routed_experts":null}],` +
		`"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2,"prompt_tokens_details":null},` +
		`"prompt_logprobs":null,"prompt_token_ids":[1,2,3],"prompt_text":null,"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}`
}

// TestVLLM032NonStreamedReasoning: issue 20, 3.1. vLLM 0.32 names a plain answer's
// reasoning "reasoning"; floe read only "reasoning_content", so a harness got content ""
// on chat, [] on Anthropic, and output [] with status incomplete on Responses, and its
// next turn had no assistant turn. Each dialect now shows the reasoning as its
// provider's reasoning item, and the call records it.
func TestVLLM032NonStreamedReasoning(t *testing.T) {
	answers := []struct {
		name, message, finish string
		reasoning, text       string
	}{
		{"reasoning and text", `{"role":"assistant","content":"Hi.","refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":"The user greets."}`,
			"stop", "The user greets.", "Hi."},
		{"reasoning cut by max_tokens, content null", `{"role":"assistant","content":null,"refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":"Let me think"}`,
			"length", "Let me think", ""},
	}
	for _, a := range answers {
		for _, dc := range vllm032Dialects {
			t.Run(a.name+"/"+dc.name, func(t *testing.T) {
				url, store := vllm032Fixture(t, &vllm032{answer: vllm032Answer(a.message, a.finish)})
				status, body := dc.send(t, url, "", false)
				if status != 200 {
					t.Fatalf("status %d: %s", status, body)
				}
				v := decodeJSON(t, body)
				var reasoning, text any
				switch dc.name {
				case "chat":
					reasoning, text = dig(v, "choices", 0, "message", "reasoning_content"), dig(v, "choices", 0, "message", "content")
				case "responses":
					if dig(v, "output", 0, "type") != "reasoning" {
						t.Errorf("output[0] is not a reasoning item: %s", body)
					}
					reasoning = dig(v, "output", 0, "summary", 0, "text")
					text = dig(v, "output", 1, "content", 0, "text")
				case "anthropic":
					if dig(v, "content", 0, "type") != "thinking" {
						t.Errorf("content[0] is not a thinking block: %s", body)
					}
					reasoning, text = dig(v, "content", 0, "thinking"), dig(v, "content", 1, "text")
				case "gemini":
					if dig(v, "candidates", 0, "content", "parts", 0, "thought") != true {
						t.Errorf("parts[0] is not a thought: %s", body)
					}
					reasoning, text = dig(v, "candidates", 0, "content", "parts", 0, "text"), dig(v, "candidates", 0, "content", "parts", 1, "text")
				}
				if text == nil {
					text = ""
				}
				if reasoning != a.reasoning || text != a.text {
					t.Errorf("reasoning %v, text %v; want %q, %q in %s", reasoning, text, a.reasoning, a.text, body)
				}
				calls := store.Calls("sess-1")
				if len(calls) != 1 || !strings.Contains(string(calls[0].Response), `"reasoning_content":"`+a.reasoning+`"`) {
					t.Errorf("recorded %d calls; the answer recorded is %s", len(calls), calls[0].Response)
				}
			})
		}
	}
}

// vLLM 0.32's refusals of a request over the model's length.
const (
	// vllm/renderers/params.py, TokenizeParams._token_len_check: vLLM stops tokenizing
	// one token past the limit, hence "at least".
	vllm032PromptTooLong = `{"error":{"message":"This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=4097)","type":"BadRequestError","param":"input_tokens","code":400}}`
	// _text_len_check: too many characters to be worth tokenizing.
	vllm032PromptChars = `{"error":{"message":"This model's maximum context length is 4096 tokens. However, your prompt contains 90000 characters (more than 65536 characters, which is the upper bound for 4096 input tokens). Please reduce the length of the input prompt. (parameter=input_text, value=90000)","type":"BadRequestError","param":"input_text","code":400}}`
	// TokenizeParams.__post_init__: max_tokens alone over the length, before tokenizing.
	vllm032BudgetTooLarge = `{"error":{"message":"max_completion_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output tokens. (parameter=max_completion_tokens, value=5000)","type":"BadRequestError","param":"max_completion_tokens","code":400}}`
)

// TestVLLM032ContextLengthErrors: issue 20, 3.3. vLLM 0.32's context-length refusals
// reach each harness in its provider's own words, with the numbers Claude Code and
// Codex act on: Anthropic's "prompt is too long: N tokens > M maximum" (compact) or
// "input length and `max_tokens` exceed context limit" (lower max_tokens), OpenAI's
// context_length_exceeded, Gemini's INVALID_ARGUMENT. Where vLLM gave no exact prompt
// length, floe counts it with /tokenize; when that fails, the lower bound vLLM gave
// stands. Streamed or not, nothing is recorded.
func TestVLLM032ContextLengthErrors(t *testing.T) {
	prompt := map[string]string{
		"chat":      "This model's maximum context length is 4096 tokens. However, your messages resulted in 5230 tokens. Please reduce the length of the messages.",
		"responses": "Your input exceeds the context window of this model. Please adjust your input and try again. Your input is 5230 tokens; the context window is 4096 tokens.",
		"anthropic": "prompt is too long: 5230 tokens > 4096 maximum",
		"gemini":    "The input token count (5230) exceeds the maximum number of tokens allowed (4096).",
	}
	cases := []struct {
		name          string
		errBody       string
		tokenizeFails bool
		want          map[string]string // dialect → message
	}{
		{"prompt over the limit (at least 4097)", vllm032PromptTooLong, false, prompt},
		{"prompt over the limit by its characters", vllm032PromptChars, false, prompt},
		{"prompt over the limit, /tokenize down: vLLM's lower bound", vllm032PromptTooLong, true, map[string]string{
			"chat":      "This model's maximum context length is 4096 tokens. However, your messages resulted in 4097 tokens. Please reduce the length of the messages.",
			"responses": "Your input exceeds the context window of this model. Please adjust your input and try again. Your input is 4097 tokens; the context window is 4096 tokens.",
			"anthropic": "prompt is too long: 4097 tokens > 4096 maximum",
			"gemini":    "The input token count (4097) exceeds the maximum number of tokens allowed (4096).",
		}},
		{"max_tokens over the model's length", vllm032BudgetTooLarge, false, map[string]string{
			"chat":      "This model's maximum context length is 4096 tokens. However, you requested 5230 tokens (230 in the messages, 5000 in the completion). Please reduce the length of the messages or completion.",
			"responses": "Your input (230 tokens) and max_output_tokens (5000) exceed the context window of this model (4096 tokens). Please lower max_output_tokens and try again.",
			"anthropic": "input length and `max_tokens` exceed context limit: 230 + 5000 > 4096, decrease input length or `max_tokens` and try again",
			"gemini":    "Unable to submit request because it has a maxOutputTokens value of 5000 but the supported range is from 1 (inclusive) to 4097 (exclusive). Update the value and try again.",
		}},
	}
	for _, tc := range cases {
		for _, dc := range vllm032Dialects {
			for _, stream := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/%s/stream=%v", tc.name, dc.name, stream), func(t *testing.T) {
					count := 5230
					if tc.errBody == vllm032BudgetTooLarge {
						count = 230
					}
					up := &vllm032{status: http.StatusBadRequest, errBody: tc.errBody, tokenizeCount: count, tokenizeFails: tc.tokenizeFails}
					url, store := vllm032Fixture(t, up)
					status, body := dc.send(t, url, "", stream)
					v := decodeJSON(t, body)
					var msg, kind any
					switch dc.name {
					case "chat", "responses":
						msg, kind = dig(v, "error", "message"), dig(v, "error", "code")
						if kind != "context_length_exceeded" || dig(v, "error", "type") != "invalid_request_error" {
							t.Errorf("error type %v code %v, want invalid_request_error context_length_exceeded: %s", dig(v, "error", "type"), kind, body)
						}
					case "anthropic":
						msg, kind = dig(v, "error", "message"), dig(v, "error", "type")
						if kind != "invalid_request_error" || dig(v, "type") != "error" {
							t.Errorf("error type %v, want invalid_request_error: %s", kind, body)
						}
					case "gemini":
						msg, kind = dig(v, "error", "message"), dig(v, "error", "status")
						if kind != "INVALID_ARGUMENT" || dig(v, "error", "code") != 400.0 {
							t.Errorf("error status %v, want 400 INVALID_ARGUMENT: %s", kind, body)
						}
					}
					if status != http.StatusBadRequest || msg != tc.want[dc.name] {
						t.Errorf("status %d, message\n %v\nwant 400,\n %s", status, msg, tc.want[dc.name])
					}
					// The count is of the conversation the chat call sent.
					if len(up.tokenizeBodies) != 1 || fmt.Sprint(dig(up.tokenizeBodies[0], "messages")) != fmt.Sprint(dig(up.chatBodies[0], "messages")) {
						t.Errorf("/tokenize asked %d times (%v) for chat messages %v", len(up.tokenizeBodies), up.tokenizeBodies, dig(up.chatBodies[0], "messages"))
					}
					if n := len(store.Calls("sess-1")); n != 0 {
						t.Errorf("%d calls recorded for a refused request", n)
					}
				})
			}
		}
	}
}

// vllm032StopStream is a stream that ended on the stop string "e": the text stops before
// it, the finishing chunk carries the token that held it and stop_reason "e".
const vllm032StopStream = `data: {"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1764662400,"model":"smollm2","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[1,2,3]}

data: {"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1764662400,"model":"smollm2","choices":[{"index":0,"delta":{"content":"th"},"logprobs":{"content":[{"token":"token_id:504","logprob":-0.25,"bytes":[116,104],"top_logprobs":[]}]},"finish_reason":null,"token_ids":[504]}]}

data: {"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1764662400,"model":"smollm2","choices":[{"index":0,"delta":{"content":""},"logprobs":{"content":[{"token":"token_id:279","logprob":-1.5,"bytes":[101],"top_logprobs":[]}]},"finish_reason":"stop","stop_reason":"e","token_ids":[279]}]}

data: {"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1764662400,"model":"smollm2","choices":[],"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2}}

data: [DONE]

`

// vllm032StopAnswer is the same answer, not streamed.
func vllm032StopAnswer(stopReason string) string {
	return strings.Replace(vllm032Answer(`{"role":"assistant","content":"th","refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":null}`, "stop"),
		`"stop_reason":null`, `"stop_reason":`+stopReason, 1)
}

// TestVLLM032AnthropicStopSequence: issue 20, 3.4. An answer that one of the request's
// stop_sequences ended (vLLM: finish_reason "stop", stop_reason "e") is answered as
// Anthropic's API does: stop_reason "stop_sequence", stop_sequence "e", streamed (in
// message_delta) and not. Any other stop (a stop token id, the end of sequence) stays
// end_turn with a null stop_sequence.
func TestVLLM032AnthropicStopSequence(t *testing.T) {
	anthropic := vllm032Dialects[2]
	cases := []struct {
		name, stopReason string
		wantReason       string
		wantSequence     any
	}{
		{"a stop string", `"e"`, "stop_sequence", "e"},
		{"a stop token id", `128001`, "end_turn", nil},
		{"the end of sequence", `null`, "end_turn", nil},
	}
	for _, tc := range cases {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/stream=%v", tc.name, stream), func(t *testing.T) {
				up := &vllm032{answer: vllm032StopAnswer(tc.stopReason), stream: strings.Replace(vllm032StopStream, `"stop_reason":"e"`, `"stop_reason":`+tc.stopReason, 1)}
				url, _ := vllm032Fixture(t, up)
				status, body := anthropic.send(t, url, `,"stop_sequences":["e","\n\nHuman:"]`, stream)
				if status != 200 {
					t.Fatalf("status %d: %s", status, body)
				}
				var reason, sequence any
				if stream {
					for _, ev := range ssetest.Events(t, body) {
						if ev.Name == "message_delta" {
							reason, sequence = dig(ev.Data, "delta", "stop_reason"), dig(ev.Data, "delta", "stop_sequence")
						}
					}
				} else {
					v := decodeJSON(t, body)
					reason, sequence = dig(v, "stop_reason"), dig(v, "stop_sequence")
					if dig(v, "content", 0, "text") != "th" {
						t.Errorf("text %v, want th", dig(v, "content", 0, "text"))
					}
				}
				if reason != tc.wantReason || sequence != tc.wantSequence {
					t.Errorf("stop_reason %v stop_sequence %v, want %v %v: %s", reason, sequence, tc.wantReason, tc.wantSequence, body)
				}
				if got := up.chatBodies[0]["stop"]; fmt.Sprint(got) != fmt.Sprint([]any{"e", "\n\nHuman:"}) {
					t.Errorf("upstream stop %v", got)
				}
			})
		}
	}
}

// TestVLLM032CountTokensRendersReasoning: issue 20, 3.5. vLLM 0.32's /tokenize renders an
// assistant's reasoning only from "reasoning" (renderers/chat_utils.py), while
// /v1/chat/completions renames "reasoning_content" to it first, so Anthropic's
// count_tokens and Gemini's countTokens undercounted every history with thinking (328
// against 338 tokens). The count request now carries what the chat call of the same
// request renders: each assistant's reasoning as "reasoning", the same tools and the same
// chat_template_kwargs (enable_thinking).
func TestVLLM032CountTokensRendersReasoning(t *testing.T) {
	cases := []struct {
		name, generatePath, countPath, body string
		headers                             map[string]string
		reasoning                           string
	}{
		{"anthropic count_tokens", "/v1/messages", "/v1/messages/count_tokens",
			`{"model":"m","max_tokens":100,"thinking":{"type":"enabled","budget_tokens":1024},
			"tools":[{"name":"read_file","input_schema":{"type":"object"}}],
			"messages":[{"role":"user","content":"hi"},
			{"role":"assistant","content":[{"type":"thinking","thinking":"The user greets.","signature":"sig"},{"type":"text","text":"Hi."}]},
			{"role":"user","content":"again"}]}`,
			map[string]string{"anthropic-version": "2023-06-01", "x-api-key": "key-1"}, "The user greets."},
		{"gemini countTokens", "/v1beta/models/m:generateContent", "/v1beta/models/m:countTokens",
			`{"contents":[{"role":"user","parts":[{"text":"hi"}]},
			{"role":"model","parts":[{"text":"The user greets.","thought":true},{"text":"Hi."}]},
			{"role":"user","parts":[{"text":"again"}]}],
			"generationConfig":{"thinkingConfig":{"thinkingBudget":0}}}`,
			map[string]string{"x-goog-api-key": "key-1"}, "The user greets."},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			up := &vllm032{answer: vllm032Answer(`{"role":"assistant","content":"Hi.","reasoning":null}`, "stop"), tokenizeCount: 338}
			url, _ := vllm032Fixture(t, up)
			for _, path := range []string{tc.generatePath, tc.countPath} {
				req, _ := http.NewRequest(http.MethodPost, url+path, strings.NewReader(tc.body))
				for k, v := range tc.headers {
					req.Header.Set(k, v)
				}
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					t.Fatalf("%s: status %d: %s", path, resp.StatusCode, b)
				}
				if path == tc.countPath && !strings.Contains(string(b), "338") {
					t.Errorf("count answer %s, want 338", b)
				}
			}
			if len(up.chatBodies) != 1 || len(up.tokenizeBodies) != 1 {
				t.Fatalf("%d chat calls, %d tokenize calls", len(up.chatBodies), len(up.tokenizeBodies))
			}
			chat, count := up.chatBodies[0], up.tokenizeBodies[0]
			// What vLLM renders of each: the renderer reads "reasoning" only; the chat
			// call first renames reasoning_content to it
			// (ChatCompletionRequest._normalize_messages_before), /tokenize does not.
			rendered := func(body map[string]any, renames bool) []any {
				msgs, _ := body["messages"].([]any)
				out := make([]any, len(msgs))
				for i, m := range msgs {
					mm := map[string]any{}
					for k, v := range m.(map[string]any) {
						mm[k] = v
					}
					if r, ok := mm["reasoning_content"]; ok {
						delete(mm, "reasoning_content")
						if renames && mm["reasoning"] == nil {
							mm["reasoning"] = r
						}
					}
					out[i] = mm
				}
				return out
			}
			if got, want := fmt.Sprint(rendered(count, false)), fmt.Sprint(rendered(chat, true)); got != want {
				t.Errorf("/tokenize renders\n %s\nthe chat call renders\n %s", got, want)
			}
			if got := dig(count, "messages", 1, "reasoning"); got != tc.reasoning {
				t.Errorf(`/tokenize's assistant message has "reasoning" %v, want %q: vLLM renders no other name`, got, tc.reasoning)
			}
			for _, k := range []string{"tools", "chat_template_kwargs"} {
				if fmt.Sprint(count[k]) != fmt.Sprint(chat[k]) {
					t.Errorf("%s: /tokenize got %v, the chat call %v", k, count[k], chat[k])
				}
			}
			if count["add_generation_prompt"] != true {
				t.Errorf("add_generation_prompt %v", count["add_generation_prompt"])
			}
		})
	}
}

// TestVLLM032StopStringDrift: issue 20, 3.6. A stop string truncates the text but not the
// ids: vLLM ends on the token that holds the stop string ("ere", id 279, for stop "e")
// and returns it with its log-prob, while the text stops before it ("th"). The harness
// echoes "th", and the next prompt re-tokenizes that, without 279: the history drifts
// from what was sampled. floe records both calls exactly as vLLM gave them (the first
// with 279 and its log-prob, the next with vLLM's own prompt ids), both trainable, and
// the batcher trains 279 in the context it was sampled in: under tree the next prompt
// branches off after 504, as any drift does. Streamed and not.
func TestVLLM032StopStringDrift(t *testing.T) {
	turn2IDs := func(s string) string {
		s = strings.Replace(s, `"prompt_token_ids":[1,2,3]`, `"prompt_token_ids":[1,2,3,504,8,9,10]`, 1)
		s = strings.Replace(s, `"token_ids":[504,279]`, `"token_ids":[11,12]`, 1)
		s = strings.Replace(s, `"token_ids":[504]`, `"token_ids":[11]`, 1)
		s = strings.Replace(s, `"token_ids":[279]`, `"token_ids":[12]`, 1)
		return strings.Replace(s, `"stop_reason":"e"`, `"stop_reason":null`, 1)
	}
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			up := &vllm032{turns: [][2]string{
				{vllm032StopAnswer(`"e"`), vllm032StopStream},
				{turn2IDs(vllm032StopAnswer("null")), turn2IDs(vllm032StopStream)},
			}}
			url, store := vllm032Fixture(t, up)
			chat := vllm032Dialects[0]
			if status, body := chat.send(t, url, `,"stop":["e"]`, stream); status != 200 || !strings.Contains(body, `"th"`) {
				t.Fatalf("turn 1: status %d: %s", status, body)
			}
			// The harness's next turn holds the text it saw.
			chat.body = `{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"th"},{"role":"user","content":"again"}]%s}`
			if status, body := chat.send(t, url, `,"stop":["e"]`, stream); status != 200 {
				t.Fatalf("turn 2: status %d: %s", status, body)
			}
			if got := dig(up.chatBodies[1], "messages", 1, "content"); got != "th" {
				t.Errorf("turn 2 sent the assistant turn as %v", got)
			}
			calls := store.Calls("sess-1")
			if len(calls) != 2 {
				t.Fatalf("%d calls recorded", len(calls))
			}
			want := []struct{ prompt, response []int32 }{{[]int32{1, 2, 3}, []int32{504, 279}}, {[]int32{1, 2, 3, 504, 8, 9, 10}, []int32{11, 12}}}
			for i, c := range calls {
				if !c.Trainable || fmt.Sprint(c.PromptIDs) != fmt.Sprint(want[i].prompt) || fmt.Sprint(c.ResponseIDs) != fmt.Sprint(want[i].response) ||
					fmt.Sprint(c.Logprobs) != "[-0.25 -1.5]" || c.FinishReason != "stop" {
					t.Errorf("call %d: trainable %v (%s) prompt %v response %v log-probs %v finish %q; want vLLM's %v %v [-0.25 -1.5] stop",
						i, c.Trainable, c.UntrainableReason, c.PromptIDs, c.ResponseIDs, c.Logprobs, c.FinishReason, want[i].prompt, want[i].response)
				}
			}
			if !strings.Contains(string(calls[0].Response), `"content":"th"`) {
				t.Errorf("call 0 recorded the answer %s, want the text the harness saw", calls[0].Response)
			}
			// Every sampled token is a loss row once (2 + 2), 279 included; tree forwards the
			// shared [1 2 3 504] once and branches: 4 + 1 + 5 rows, per_request 5 + 9.
			groups := []trace.Group{{ID: "g", TaskID: "t", Sessions: []trace.Session{{ID: "sess-1", Calls: calls, Reward: 1}}}}
			for strategy, rows := range map[batcher.Strategy]int64{batcher.Tree: 10, batcher.PerRequest: 14} {
				cfg := batcher.DefaultConfig()
				cfg.Strategy, cfg.TokenBudget, cfg.PadMultiple = strategy, 64, 8
				st, err := batcher.FormStep(0, groups, cfg)
				if err != nil {
					t.Fatalf("%s: %v", strategy, err)
				}
				if st.Stats.Rows != rows || st.Stats.LossRows != 4 {
					t.Errorf("%s: %d rows, %d loss rows; want %d, 4", strategy, st.Stats.Rows, st.Stats.LossRows, rows)
				}
			}
		})
	}
}
