package capacity

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"

	"github.com/floe-rl/floe/internal/fakevllm"
)

// Upstream is floe's zero-latency fake vLLM (internal/fakevllm) with the streaming the
// capacity benchmark's agents use: token ids are the bytes of the messages, each followed
// by 0, so one session's prompts extend each other (the store keeps them by reference and
// the batcher merges them), and the answer is answer(len(messages), n): "ok <messages>"
// padded to n tokens, streamed one token per chunk as vLLM does. A non-streaming request
// is fakevllm's own.
func Upstream(answerTokens int) http.Handler {
	plain := fakevllm.Handler()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/v1/chat/completions" {
			plain.ServeHTTP(w, r)
			return
		}
		var req struct {
			Stream   bool `json:"stream"`
			Messages []struct {
				Content string `json:"content"`
			} `json:"messages"`
		}
		var body bytes.Buffer
		if _, err := body.ReadFrom(r.Body); err != nil {
			http.Error(w, `{"object":"error","message":"reading the body"}`, http.StatusBadRequest)
			return
		}
		if err := json.Unmarshal(body.Bytes(), &req); err != nil {
			http.Error(w, `{"object":"error","message":"bad JSON"}`, http.StatusBadRequest)
			return
		}
		if !req.Stream {
			r.Body = readCloser{bytes.NewReader(body.Bytes())}
			plain.ServeHTTP(w, r)
			return
		}
		n := 0
		for _, m := range req.Messages {
			n += len(m.Content) + 1
		}
		prompt := make([]int32, 0, n)
		for _, m := range req.Messages {
			for _, b := range []byte(m.Content) {
				prompt = append(prompt, int32(b))
			}
			prompt = append(prompt, 0)
		}
		w.Header().Set("Content-Type", "text/event-stream")
		streamAnswer(w, prompt, answer(len(req.Messages), answerTokens))
	})
}

// answer is what the fake answers a request of messages messages, tokens tokens long
// (byte tokens): the agents know it without parsing the stream, so their next turn's
// history holds exactly what was sampled.
func answer(messages, tokens int) string {
	a := []byte("ok " + strconv.Itoa(messages) + " ")
	for len(a) < tokens {
		a = append(a, 'a'+byte(len(a)%26))
	}
	return string(a[:max(tokens, 1)])
}

type readCloser struct{ *bytes.Reader }

func (readCloser) Close() error { return nil }

// streamAnswer writes vLLM's chat stream: the prompt ids in the first chunk, then one
// chunk per sampled token with its id and log-prob, the finish reason and [DONE].
func streamAnswer(w http.ResponseWriter, prompt []int32, text string) {
	var b bytes.Buffer
	head, _ := json.Marshal(map[string]any{"id": "c", "prompt_token_ids": prompt,
		"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}}}})
	fmt.Fprintf(&b, "data: %s\n\n", head)
	for i := 0; i < len(text); i++ {
		fmt.Fprintf(&b, `data: {"id":"c","choices":[{"index":0,"delta":{"content":%q},"token_ids":[%d],"logprobs":{"content":[{"token":%q,"logprob":-0.5}]}}]}`+"\n\n",
			text[i:i+1], text[i], text[i:i+1])
	}
	b.WriteString(`data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}` + "\n\n")
	b.WriteString("data: [DONE]\n\n")
	_, _ = w.Write(b.Bytes())
}
