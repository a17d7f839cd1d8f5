package vllm

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/floe-rl/floe/proxy"
)

type collect struct{ text strings.Builder }

func (c *collect) Delta(d proxy.Delta) error { c.text.WriteString(d.Content); return nil }
func (c *collect) Flush()                    {}

// streamingVLLM answers every streamed chat call with two chunks and [DONE], chunked as
// vLLM's server sends it; hold, when set, keeps the body open after [DONE] until closed.
func streamingVLLM(t *testing.T, hold chan struct{}) (url string, conns *atomic.Int64) {
	conns = &atomic.Int64{}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i, s := range []string{"a", "b"} {
			_, _ = fmt.Fprintf(w, `data: {"id":"c","prompt_token_ids":[1,2],"choices":[{"index":0,"delta":{"content":%q},"token_ids":[%d],"logprobs":{"content":[{"logprob":-0.5}]}}]}`+"\n\n", s, 10+i)
			w.(http.Flusher).Flush()
		}
		_, _ = fmt.Fprint(w, `data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`+"\n\ndata: [DONE]\n\n")
		w.(http.Flusher).Flush()
		if hold != nil {
			select {
			case <-hold:
			case <-r.Context().Done():
			}
		}
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL, conns
}

// TestStreamedCallsReuseTheUpstreamConnection: the engine reads a stream to its end
// after [DONE], so the next call goes over the same connection instead of a new one.
func TestStreamedCallsReuseTheUpstreamConnection(t *testing.T) {
	url, conns := streamingVLLM(t, nil)
	e := &Engine{BaseURL: url, Model: "m", Client: &http.Client{Transport: &http.Transport{}}}
	for i := 0; i < 5; i++ {
		sink := &collect{}
		res, err := e.Stream(context.Background(), &proxy.ChatRequest{Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}}}, sink)
		if err != nil {
			t.Fatal(err)
		}
		if sink.text.String() != "ab" || res.Response.Choices[0].FinishReason != "stop" {
			t.Fatalf("call %d: streamed %q, finish %q", i, sink.text.String(), res.Response.Choices[0].FinishReason)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("5 streamed calls opened %d connections upstream, want 1", n)
	}
}

// TestAStreamHeldOpenAfterDONEStillEnds: a server that keeps the body open after [DONE]
// does not hold the call: the engine stops waiting for the body's end and answers.
func TestAStreamHeldOpenAfterDONEStillEnds(t *testing.T) {
	hold := make(chan struct{})
	defer close(hold)
	url, _ := streamingVLLM(t, hold)
	e := &Engine{BaseURL: url, Model: "m", Client: &http.Client{Transport: &http.Transport{}}}
	sink := &collect{}
	res, err := e.Stream(context.Background(), &proxy.ChatRequest{Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}}}, sink)
	if err != nil {
		t.Fatal(err)
	}
	if sink.text.String() != "ab" || len(res.Choices) != 1 || len(res.Choices[0].ResponseIDs) != 2 {
		t.Errorf("streamed %q, token data %+v", sink.text.String(), res.Choices)
	}
}

// vLLM 0.32's non-streamed answer, as its api_router writes it (JSONResponse of
// ChatCompletionResponse.model_dump(): every field, null when unset; tool_calls dropped
// when empty) with the message and the choice's finish_reason and stop_reason spliced in.
func vllm032Answer(message, finish, stopReason string) string {
	return `{"id":"chatcmpl-9f2","object":"chat.completion","created":1764662400,"model":"smollm2",` +
		`"choices":[{"index":0,"message":` + message + `,` +
		`"logprobs":{"content":[{"token":"token_id:504","logprob":-0.25,"bytes":[116,104],"top_logprobs":[]},{"token":"token_id:279","logprob":-1.5,"bytes":[101],"top_logprobs":[]}]},` +
		`"finish_reason":"` + finish + `","stop_reason":` + stopReason + `,"token_ids":[504,279],"routed_experts":null}],` +
		`"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2,"prompt_tokens_details":null},` +
		`"prompt_logprobs":null,"prompt_token_ids":[1,2,3],"prompt_text":null,"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}`
}

// vllm032Stream is the same answer streamed: chunks as model_dump_json(exclude_unset=True)
// writes them, the finishing one with finish_reason and stop_reason.
func vllm032Stream(reasoning, content, finish, stopReason string) string {
	chunk := func(choice string) string {
		return `data: {"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1764662400,"model":"smollm2","choices":[` + choice + `]}` + "\n\n"
	}
	return `data: {"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1764662400,"model":"smollm2","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[1,2,3]}` + "\n\n" +
		chunk(`{"index":0,"delta":{"reasoning":`+reasoning+`},"logprobs":{"content":[{"token":"token_id:504","logprob":-0.25,"bytes":[116,104],"top_logprobs":[]}]},"finish_reason":null,"token_ids":[504]}`) +
		chunk(`{"index":0,"delta":{"content":`+content+`},"logprobs":{"content":[{"token":"token_id:279","logprob":-1.5,"bytes":[101],"top_logprobs":[]}]},"finish_reason":"`+finish+`","stop_reason":`+stopReason+`,"token_ids":[279]}`) +
		`data: {"id":"chatcmpl-9f2","object":"chat.completion.chunk","created":1764662400,"model":"smollm2","choices":[],"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2}}` + "\n\n" +
		"data: [DONE]\n\n"
}

// TestVLLM032Answers: issue 20, 3.1 and 3.4. vLLM 0.32 names a non-streamed answer's
// reasoning "reasoning" (the stream's delta too), and says in stop_reason which stop
// string ended it (a number for a stop token id, null for the end of sequence). The
// engine reads the reasoning under either name, streamed or not, and carries a stop
// string into the choice only when it is one of the request's stop sequences. The token
// data is vLLM's, whole: a stop string truncates the text, never the ids.
func TestVLLM032Answers(t *testing.T) {
	cases := []struct {
		name                      string
		message                   string // non-streamed message
		streamReasoning           string // streamed JSON values
		streamContent             string
		finish, stopReason        string
		stop                      []string
		wantReasoning, wantText   string
		wantFinish, wantStopMatch string
	}{
		{name: "reasoning and text, end of sequence",
			message:         `{"role":"assistant","content":"Hi.","refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":"The user greets."}`,
			streamReasoning: `"The user greets."`, streamContent: `"Hi."`,
			finish: "stop", stopReason: "null",
			wantReasoning: "The user greets.", wantText: "Hi.", wantFinish: "stop"},
		{name: "reasoning only, cut by max_tokens (content null)",
			message:         `{"role":"assistant","content":null,"refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":"Let me think"}`,
			streamReasoning: `"Let me think"`, streamContent: `""`,
			finish: "length", stopReason: "null",
			wantReasoning: "Let me think", wantText: "", wantFinish: "length"},
		{name: "older vLLM's reasoning_content",
			message:         `{"role":"assistant","content":"Hi.","reasoning_content":"The user greets.","tool_calls":[]}`,
			streamReasoning: `"The user greets."`, streamContent: `"Hi."`,
			finish: "stop", stopReason: "null",
			wantReasoning: "The user greets.", wantText: "Hi.", wantFinish: "stop"},
		{name: "a stop string of the request",
			message:         `{"role":"assistant","content":"th","refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":null}`,
			streamReasoning: `""`, streamContent: `"th"`,
			finish: "stop", stopReason: `"e"`, stop: []string{"END", "e"},
			wantText: "th", wantFinish: "stop", wantStopMatch: "e"},
		{name: "a stop token id is no stop string",
			message:         `{"role":"assistant","content":"the","refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":null}`,
			streamReasoning: `""`, streamContent: `"the"`,
			finish: "stop", stopReason: "151645", stop: []string{"e"},
			wantText: "the", wantFinish: "stop"},
		{name: "a string the request did not ask to stop at",
			message:         `{"role":"assistant","content":"th","refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":null}`,
			streamReasoning: `""`, streamContent: `"th"`,
			finish: "stop", stopReason: `"e"`, stop: []string{"x"},
			wantText: "th", wantFinish: "stop"},
	}
	for _, tc := range cases {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/stream=%v", tc.name, stream), func(t *testing.T) {
				srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if stream {
						w.Header().Set("Content-Type", "text/event-stream")
						_, _ = io.WriteString(w, vllm032Stream(tc.streamReasoning, tc.streamContent, tc.finish, tc.stopReason))
						return
					}
					w.Header().Set("Content-Type", "application/json")
					_, _ = io.WriteString(w, vllm032Answer(tc.message, tc.finish, tc.stopReason))
				}))
				defer srv.Close()
				e := &Engine{BaseURL: srv.URL, Model: "smollm2"}
				req := &proxy.ChatRequest{Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}}, Stop: tc.stop}
				var res *proxy.Result
				var err error
				if stream {
					res, err = e.Stream(context.Background(), req, &collect{})
				} else {
					res, err = e.Complete(context.Background(), req)
				}
				if err != nil {
					t.Fatal(err)
				}
				c := res.Response.Choices[0]
				if c.Message.ReasoningContent != tc.wantReasoning || c.Message.Content != tc.wantText {
					t.Errorf("reasoning %q text %q, want %q %q", c.Message.ReasoningContent, c.Message.Content, tc.wantReasoning, tc.wantText)
				}
				if c.FinishReason != tc.wantFinish || c.StopSequence != tc.wantStopMatch {
					t.Errorf("finish %q stop sequence %q, want %q %q", c.FinishReason, c.StopSequence, tc.wantFinish, tc.wantStopMatch)
				}
				td := res.Choices[0]
				if td.Problem != "" || !slices.Equal(td.ResponseIDs, []int32{504, 279}) || !slices.Equal(td.Logprobs, []float32{-0.25, -1.5}) ||
					!slices.Equal(res.PromptIDs, []int32{1, 2, 3}) {
					t.Errorf("token data %+v prompt %v; want vLLM's ids [504 279], log-probs [-0.25 -1.5], prompt [1 2 3]", td, res.PromptIDs)
				}
			})
		}
	}
}
