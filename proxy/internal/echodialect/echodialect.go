// Package echodialect is a fifth dialect for tests: the smallest provider API that shows
// what adding one takes (docs/proxy.md, "Adding a dialect"): this package, and one line
// that puts it in the server's proxy.Dialects. It serves POST …/echo with a body
// {"model", "prompt"}, takes its key from X-Echo-Key and answers errors as
// {"echo_error": {"kind", "message"}}.
package echodialect

import (
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/floe-rl/floe/proxy"
)

// Dialect is the echo API.
type Dialect struct{}

var _ proxy.Dialect = Dialect{}

func (Dialect) Name() string { return "echo" }

func (Dialect) Routes() []proxy.Route {
	return []proxy.Route{{Suffix: "/echo", Op: proxy.OpGenerate}}
}

func (Dialect) Claims(r *http.Request, _ map[string]json.RawMessage) proxy.Claim {
	if r.Header.Get("X-Echo-Key") != "" {
		return proxy.ClaimByHeader
	}
	return proxy.ClaimNone
}

func (Dialect) Key(r *http.Request) string { return r.Header.Get("X-Echo-Key") }

func (Dialect) Client() proxy.Client { return proxy.Client{Name: "echo", Path: "/echo-api"} }

func (Dialect) Decode(_ *http.Request, body []byte) (*proxy.Request, error) {
	var in struct {
		Model  string `json:"model"`
		Prompt string `json:"prompt"`
	}
	if err := json.Unmarshal(body, &in); err != nil || in.Model == "" {
		return nil, proxy.InvalidRequest("body must be {\"model\", \"prompt\"}")
	}
	return &proxy.Request{Model: in.Model, Chat: proxy.ChatRequest{Model: in.Model,
		Messages: []proxy.ChatMessage{{Role: "user", Content: in.Prompt}}}}, nil
}

func (Dialect) WriteResponse(w http.ResponseWriter, _ *proxy.Request, res *proxy.Response) error {
	text := ""
	if len(res.Choices) > 0 {
		text = proxy.ContentText(res.Choices[0].Message.Content)
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(map[string]string{"echo": text})
}

func (Dialect) NewStream(w http.ResponseWriter, _ *proxy.Request) proxy.Stream { return stream{w} }

func (Dialect) WriteError(w http.ResponseWriter, err *proxy.Error) {
	status := err.Status
	if status == 0 {
		status = http.StatusTooManyRequests
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"echo_error": map[string]string{"kind": string(err.Kind), "message": err.Message}})
}

func (Dialect) WriteModels(w http.ResponseWriter, models []string) {
	_ = json.NewEncoder(w).Encode(models)
}

// stream writes each delta's text as a line.
type stream struct{ w http.ResponseWriter }

func (s stream) Delta(d proxy.Delta) error {
	_, err := fmt.Fprintln(s.w, d.Content)
	return err
}
func (s stream) End(proxy.Finish, proxy.Usage) error { return nil }
func (s stream) Fail(err *proxy.Error) error {
	_, werr := fmt.Fprintln(s.w, "error:", err.Message)
	return werr
}
