package vllm

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
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
			fmt.Fprintf(w, `data: {"id":"c","prompt_token_ids":[1,2],"choices":[{"index":0,"delta":{"content":%q},"token_ids":[%d],"logprobs":{"content":[{"logprob":-0.5}]}}]}`+"\n\n", s, 10+i)
			w.(http.Flusher).Flush()
		}
		fmt.Fprint(w, `data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`+"\n\ndata: [DONE]\n\n")
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
