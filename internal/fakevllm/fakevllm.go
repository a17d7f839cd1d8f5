// Package fakevllm is a minimal stand-in for vLLM's chat completions, for tests of floe
// serve: token ids are the bytes of the messages, so the prompts of one conversation
// extend each other as real ones do, and the answer is "ok <number of messages>".
package fakevllm

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
)

// Options change how the fake answers, for tests of floe's deadlines and limits.
type Options struct {
	// Hold, when set, is called with each chat completion request after its body is read
	// and before it is answered: a test blocks in it to play a hung or slow inference
	// server (returning when r's context ends, which is floe giving up on the call), or
	// counts the calls in flight.
	Hold func(r *http.Request)
}

// Handler serves GET /v1/models and non-streaming POST /v1/chat/completions with
// prompt_token_ids, token_ids and logprobs.
func Handler() http.Handler { return HandlerWith(Options{}) }

// HandlerWith is Handler with opts.
func HandlerWith(opts Options) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"data":[{"id":"m"}]}`)
	})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Messages []struct {
				Content string `json:"content"`
			} `json:"messages"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, `{"object":"error","message":"bad JSON"}`, http.StatusBadRequest)
			return
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
