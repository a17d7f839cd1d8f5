// Package fakevllm is a minimal stand-in for vLLM's chat completions, for tests of floe
// serve: token ids are the bytes of the messages, so the prompts of one conversation
// extend each other as real ones do, and the answer is "ok <number of messages>".
package fakevllm

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
)

// Options change how the fake answers, for tests of floe's deadlines and limits.
type Options struct {
	// Hold, when set, is called with each chat completion request after its body is read
	// and before it is answered: a test blocks in it to play a hung or slow inference
	// server (returning when r's context ends, which is floe giving up on the call), or
	// counts the calls in flight.
	Hold func(r *http.Request)
	// MidStream, when set, is called in a streamed answer once its first content chunk has
	// been flushed: a test blocks in it to stop the server while the caller's stream has
	// begun.
	MidStream func(r *http.Request)
	// Healthy, when set, is asked by GET /health: false answers 503. Unset: 200.
	Healthy func() bool
	// OnCall, when set, is told of each chat completion request as it arrives.
	OnCall func(r *http.Request)
	// Fail, when set, is asked after a chat completion request has been read (and counted):
	// a status of 400 or more answers it with that status and vLLM's error object (a
	// request that makes vLLM fail after prefill, an overloaded server's 429); Reset or
	// Hangup drops the connection with no answer; anything else answers as usual.
	Fail func(r *http.Request) int
}

// What Options.Fail returns to drop a call's connection after reading its request.
const (
	// Reset closes it with a TCP reset (connection reset by peer).
	Reset = -1
	// Hangup closes it cleanly: the caller reads EOF where the answer should be.
	Hangup = -2
)

// Handler serves GET /v1/models and non-streaming POST /v1/chat/completions with
// prompt_token_ids, token_ids and logprobs.
func Handler() http.Handler { return HandlerWith(Options{}) }

// HandlerWith is Handler with opts. It also serves GET /health and streamed answers
// ("stream": true: one chunk per byte of the answer, each with its token id and
// log-prob, then the usage and [DONE]).
func HandlerWith(opts Options) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"data":[{"id":"m"}]}`)
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		if opts.Healthy != nil && !opts.Healthy() {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Messages []struct {
				Content string `json:"content"`
			} `json:"messages"`
			Stream bool `json:"stream"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, `{"object":"error","message":"bad JSON"}`, http.StatusBadRequest)
			return
		}
		if opts.OnCall != nil {
			opts.OnCall(r)
		}
		if opts.Fail != nil {
			if code := opts.Fail(r); code >= 400 {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(code)
				_ = json.NewEncoder(w).Encode(map[string]any{"object": "error", "message": "failed as the test asked",
					"type": http.StatusText(code), "code": code})
				return
			} else if code == Reset || code == Hangup {
				drop(w, code == Reset)
				return
			}
		}
		if opts.Hold != nil {
			opts.Hold(r)
			if r.Context().Err() != nil {
				return // the caller gave up
			}
		}
		var prompt []int32
		for _, m := range req.Messages {
			for _, b := range []byte(m.Content) {
				prompt = append(prompt, int32(b))
			}
			prompt = append(prompt, 0)
		}
		answer := "ok " + fmt.Sprint(len(req.Messages))
		if req.Stream {
			stream(w, r, opts, prompt, answer)
			return
		}
		ids := []int32{}
		lps := []map[string]any{}
		for _, b := range []byte(answer) {
			ids = append(ids, int32(b))
			lps = append(lps, map[string]any{"logprob": -0.5})
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"id": "c", "prompt_token_ids": prompt,
			"choices": []any{map[string]any{"index": 0, "finish_reason": "stop", "token_ids": ids, "logprobs": map[string]any{"content": lps},
				"message": map[string]any{"role": "assistant", "content": answer}}}})
	})
	return mux
}

// drop closes the call's connection without an answer; with reset, by a TCP reset
// (SO_LINGER 0), as a server that crashes or aborts the request does.
func drop(w http.ResponseWriter, reset bool) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler) // closes the connection all the same
	}
	if tc, ok := conn.(*net.TCPConn); ok && reset {
		_ = tc.SetLinger(0)
	}
	_ = conn.Close()
}

// stream answers as vLLM streams with return_token_ids: the prompt ids in the first
// chunk, one chunk per sampled token.
func stream(w http.ResponseWriter, r *http.Request, opts Options, prompt []int32, answer string) {
	w.Header().Set("Content-Type", "text/event-stream")
	flusher, _ := w.(http.Flusher)
	send := func(v any) {
		b, _ := json.Marshal(v)
		_, _ = fmt.Fprintf(w, "data: %s\n\n", b)
		if flusher != nil {
			flusher.Flush()
		}
	}
	send(map[string]any{"id": "c", "prompt_token_ids": prompt,
		"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}}}})
	for i, b := range []byte(answer) {
		send(map[string]any{"id": "c", "choices": []any{map[string]any{"index": 0, "delta": map[string]any{"content": string(b)},
			"token_ids": []int32{int32(b)}, "logprobs": map[string]any{"content": []any{map[string]any{"logprob": -0.5}}}}}})
		if i == 0 && opts.MidStream != nil {
			opts.MidStream(r)
			if r.Context().Err() != nil {
				return
			}
		}
	}
	send(map[string]any{"id": "c", "choices": []any{map[string]any{"index": 0, "delta": map[string]any{}, "finish_reason": "stop"}}})
	send(map[string]any{"id": "c", "choices": []any{}, "usage": map[string]any{"prompt_tokens": len(prompt), "completion_tokens": len(answer), "total_tokens": len(prompt) + len(answer)}})
	_, _ = io.WriteString(w, "data: [DONE]\n\n")
}

// SessionHeader is the header Server counts calls by: floe's default
// -upstream-session-header.
const SessionHeader = "X-Session-ID"

// Server is a fake vLLM on a loopback port that a test can stop, which then refuses
// connections as a dead replica's does, and start again on the same port, as a
// restarted replica. It counts the chat calls of each session (by SessionHeader).
type Server struct {
	// URL is the base URL, the same across restarts.
	URL string

	opts    Options
	addr    string
	healthy atomic.Bool
	mu      sync.Mutex
	srv     *http.Server
	done    chan struct{}
	calls   map[string]int
}

// Start serves a fake vLLM with opts (its Healthy and OnCall are the Server's own).
func Start(opts Options) (*Server, error) {
	s := &Server{opts: opts, calls: map[string]int{}}
	s.healthy.Store(true)
	user := opts.OnCall
	s.opts.OnCall = func(r *http.Request) {
		s.mu.Lock()
		s.calls[r.Header.Get(SessionHeader)]++
		s.mu.Unlock()
		if user != nil {
			user(r)
		}
	}
	s.opts.Healthy = s.healthy.Load
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("fake vLLM listen: %w", err)
	}
	s.addr = lis.Addr().String()
	s.URL = "http://" + s.addr
	s.serve(lis)
	return s, nil
}

func (s *Server) serve(lis net.Listener) {
	srv := &http.Server{Handler: HandlerWith(s.opts)}
	done := make(chan struct{})
	s.srv, s.done = srv, done
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
}

// Stop closes the listener and every connection: calls in flight break, new ones are
// refused.
func (s *Server) Stop() {
	s.mu.Lock()
	srv, done := s.srv, s.done
	s.srv = nil
	s.mu.Unlock()
	if srv == nil {
		return
	}
	_ = srv.Close()
	<-done
}

// Restart serves again on the same port.
func (s *Server) Restart() error {
	s.Stop()
	lis, err := net.Listen("tcp", s.addr)
	if err != nil {
		return fmt.Errorf("fake vLLM listen again on %s: %w", s.addr, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.serve(lis)
	return nil
}

// SetHealthy makes GET /health answer 200 (true) or 503.
func (s *Server) SetHealthy(ok bool) { s.healthy.Store(ok) }

// Calls returns the chat calls received for each session, by its SessionHeader.
func (s *Server) Calls() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int, len(s.calls))
	for k, v := range s.calls {
		out[k] = v
	}
	return out
}

// Close stops the server for good.
func (s *Server) Close() { s.Stop() }
