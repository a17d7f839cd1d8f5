package upstream

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/floe-rl/floe/proxy"
)

// TestConnectTimeout: a connection not made within the call's connect timeout ends the
// call with a 504 timeout naming the flag (a nanosecond: no dial finishes in time).
func TestConnectTimeout(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	defer srv.Close()
	c := &http.Client{Transport: Client.Transport.(*http.Transport).Clone()}
	ctx := proxy.WithUpstreamTimeouts(context.Background(), proxy.UpstreamTimeouts{Connect: time.Nanosecond})
	_, err := PostJSON(ctx, c, srv.URL, "/v1/chat/completions", []byte(`{}`), MapError)
	var e *proxy.Error
	if !errors.As(err, &e) || e.Kind != proxy.ErrTimeout || e.Status != 504 || !strings.Contains(e.Message, "upstream-connect-timeout") {
		t.Fatalf("err %v; want a 504 timeout naming -upstream-connect-timeout", err)
	}
	// The request never reached the server: a replica pool fails over at once.
	var un *proxy.UnreachableError
	if !errors.As(err, &un) {
		t.Errorf("err %T is not a proxy.UnreachableError", err)
	}
}

// TestSessionHeaderAndUnreachable: a call names its session in the header its context
// asks for (and in none when it asks for none); a server that refuses the connection
// gives a proxy.UnreachableError whose message names it without its credentials.
func TestSessionHeaderAndUnreachable(t *testing.T) {
	got := make(chan http.Header, 4)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Clone()
		_, _ = w.Write([]byte(`{"data":[{"id":"m"}]}`))
	}))
	defer srv.Close()
	for _, tc := range []struct{ header, want string }{{"X-Session-ID", "sess-1"}, {"X-SMG-Routing-Key", "sess-1"}, {"", ""}} {
		ctx := proxy.WithSession(context.Background(), "sess-1", tc.header)
		resp, err := PostJSON(ctx, Client, srv.URL, "/v1/chat/completions", []byte(`{}`), MapError)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		h := <-got
		if tc.header != "" && h.Get(tc.header) != tc.want {
			t.Errorf("header %s = %q, want %q", tc.header, h.Get(tc.header), tc.want)
		}
		if tc.header == "" && (h.Get("X-Session-ID") != "" || h.Get("Authorization") != "") {
			t.Errorf("with no session header the call carries %v", h)
		}
		if _, err := ListModels(ctx, Client, srv.URL, MapError); err != nil {
			t.Fatal(err)
		}
		if h := <-got; tc.header != "" && h.Get(tc.header) != tc.want {
			t.Errorf("models: header %s = %q, want %q", tc.header, h.Get(tc.header), tc.want)
		}
	}

	dead := httptest.NewServer(http.NotFoundHandler())
	addr := dead.Listener.Addr().String()
	dead.Close()
	for _, call := range []func() error{
		func() error {
			_, err := PostJSON(context.Background(), Client, "http://user:secret@"+addr, "/v1/chat/completions", []byte(`{}`), MapError)
			return err
		},
		func() error {
			_, err := ListModels(context.Background(), Client, "http://user:secret@"+addr, MapError)
			return err
		},
	} {
		err := call()
		var un *proxy.UnreachableError
		if !errors.As(err, &un) || un.Err.Status != http.StatusBadGateway || strings.Contains(err.Error(), "secret") ||
			!strings.Contains(err.Error(), "http://"+addr+" is unreachable") {
			t.Errorf("a refused connection: %T %v; want a 502 UnreachableError naming http://%s without its password", err, err, addr)
		}
	}
}

// TestEncodeRequestSplicesLargeStrings: a request whose messages carry large strings
// (with characters JSON escapes, and invalid UTF-8) encodes to the same JSON value as the
// plain encoder gives, in a body allocated at its final size.
func TestEncodeRequestSplicesLargeStrings(t *testing.T) {
	big := func(c string) string { return strings.Repeat(c, spliceMin/len(c)+7) }
	special := big("a\"b\\c\nd\re\tf<g>h&i\u2028j\u2029k\x01é😀") + "\xff\xfe"
	r := &proxy.ChatRequest{Model: "m", Messages: []proxy.ChatMessage{
		{Role: "system", Content: "small"},
		{Role: "user", Content: special},
		{Role: "user", Content: []proxy.ChatPart{{Type: "text", Text: big("t")}, {Type: "image_url", ImageURL: &proxy.ChatImageURL{URL: "data:image/png;base64," + big("Q")}}}},
		{Role: "assistant", Content: "", ReasoningContent: big("r"), ToolCalls: []proxy.ChatToolCall{{ID: "c1", Type: "function", Function: proxy.ChatFunctionCall{Name: "f", Arguments: big(`{"x":1}`)}}}},
		{Role: "user", Content: "floe-splice-" + nonce + "-0"}, // even a caller who knew the nonce only confuses its own text
	}}
	enc := func(r *proxy.ChatRequest) ([]byte, error) { return Marshal(r) }
	got, err := EncodeRequest(r, enc)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != cap(got) {
		t.Errorf("body of %d bytes in a buffer of %d: not sized once", len(got), cap(got))
	}
	want, _ := enc(r)
	var g, w any
	if err := json.Unmarshal(got, &g); err != nil {
		t.Fatalf("spliced body is not JSON: %v", err)
	}
	_ = json.Unmarshal(want, &w)
	if !reflect.DeepEqual(g, w) {
		t.Error("spliced body differs from the encoder's")
	}
	if !bytes.Equal(got, want) {
		t.Error("spliced body is not byte for byte the encoder's")
	}
	if r.Messages[1].Content != special {
		t.Error("EncodeRequest changed the caller's request")
	}
}

// TestMapErrorContextLength: issue 20, 3.3. Every vLLM wording of a request over the
// model's length, from the exact bodies each version answers, becomes ErrContextLength
// with the numbers it gives; PromptTokensUnknown says when they are not the prompt's
// exact length, so the engine counts it.
func TestMapErrorContextLength(t *testing.T) {
	cases := []struct {
		name                string
		body                string
		prompt, max, budget int
		unknown             bool
	}{
		{"0.32, prompt over the limit", `{"error":{"message":"This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=4097)","type":"BadRequestError","param":"input_tokens","code":400}}`,
			4097, 4096, 0, true},
		{"0.32, prompt over the limit, counted whole", `{"error":{"message":"This model's maximum context length is 4096 tokens. However, your prompt contains 5000 input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=5000)","type":"BadRequestError","param":"input_tokens","code":400}}`,
			5000, 4096, 0, false},
		{"0.32, prompt over the limit by its characters", `{"error":{"message":"This model's maximum context length is 4096 tokens. However, your prompt contains 90000 characters (more than 65536 characters, which is the upper bound for 4096 input tokens). Please reduce the length of the input prompt. (parameter=input_text, value=90000)","type":"BadRequestError","param":"input_text","code":400}}`,
			4097, 4096, 0, true},
		{"0.32, max_completion_tokens over the length", `{"error":{"message":"max_completion_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output tokens. (parameter=max_completion_tokens, value=5000)","type":"BadRequestError","param":"max_completion_tokens","code":400}}`,
			0, 4096, 5000, true},
		{"0.32, max_tokens over the length", `{"error":{"message":"max_tokens=8192 cannot be greater than max_model_len=4096. Please request fewer output tokens. (parameter=max_tokens, value=8192)","type":"BadRequestError","param":"max_tokens","code":400}}`,
			0, 4096, 8192, true},
		{"0.32, input length after truncation", `{"error":{"message":"Input length (5000) exceeds model's maximum context length (4096).","type":"BadRequestError","param":null,"code":400}}`,
			5000, 4096, 0, false},
		{"0.10, budget", `{"object":"error","message":"'max_tokens' or 'max_completion_tokens' is too large: 32000. This model's maximum context length is 32768 tokens and your request has 17177 input tokens (32000 > 32768 - 17177).","type":"BadRequestError","param":null,"code":400}`,
			17177, 32768, 32000, false},
		{"0.10, prompt", `{"object":"error","message":"This model's maximum context length is 32768 tokens. However, your request has 40000 input tokens. Please reduce the length of the input messages.","type":"BadRequestError","param":null,"code":400}`,
			40000, 32768, 0, false},
		{"before 0.10", `{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}`,
			4000, 4096, 1000, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := MapError(http.StatusBadRequest, []byte(tc.body))
			if e.Kind != proxy.ErrContextLength || e.Status != http.StatusBadRequest || e.PromptTokens != tc.prompt || e.MaxTokens != tc.max || e.CompletionTokens != tc.budget {
				t.Errorf("MapError = %+v; want a 400 context-length error, prompt %d, max %d, budget %d", e, tc.prompt, tc.max, tc.budget)
			}
			if got := PromptTokensUnknown(e); got != tc.unknown {
				t.Errorf("PromptTokensUnknown = %v, want %v", got, tc.unknown)
			}
		})
	}
	other := MapError(http.StatusBadRequest, []byte(`{"error":{"message":"top_k must be 0 (disable), or at least 1, got -2.","type":"BadRequestError","param":"top_k","code":400}}`))
	if other.Kind != proxy.ErrInvalidRequest || PromptTokensUnknown(other) {
		t.Errorf("another 400: %+v", other)
	}
}
