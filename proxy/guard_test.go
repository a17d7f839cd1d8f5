package proxy_test

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/anthropic"
	"github.com/floe-rl/floe/proxy/gemini"
	"github.com/floe-rl/floe/proxy/openai"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace/mem"
)

// TestRequestGuard: every dialect's request is checked after it is normalized, before
// anything goes upstream: n past -max-n, sampling values that are not finite or out of
// range, image URLs the inference server would fetch (request forgery from its host),
// and chat_template_kwargs keys not allowed are refused with a 400 naming the field, and
// nothing reaches upstream; data: URLs, allowed hosts and allowed keys pass.
func TestRequestGuard(t *testing.T) {
	up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"}
	var reached atomic.Int64
	h := up.handler()
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/chat/completions") {
			reached.Add(1)
		}
		h.ServeHTTP(w, r)
	}))
	defer upstream.Close()
	store := &mem.Store{}
	store.AddSession("k", "s")
	srv := httptest.NewServer(&proxy.Server{
		Dialects: proxy.Dialects{openai.Chat{}, openai.Responses{}, anthropic.Dialect{}, gemini.Dialect{}},
		Engine:   &vllm.Engine{BaseURL: upstream.URL, Model: "m"}, Sessions: store, Recorder: store,
		Limits: proxy.Limits{MaxN: 4, MediaHosts: []string{"images.internal", "cdn.internal:8443"}}, Log: slog.New(slog.DiscardHandler)})
	defer srv.Close()

	const png = "data:image/png;base64,iVBORw0KGgo="
	chat := func(extra string) string {
		return `{"model":"m","messages":[{"role":"user","content":"hi"}]` + extra + `}`
	}
	chatImage := func(url string) string {
		return `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"` + url + `"}}]}]}`
	}
	tests := []struct {
		name, path, body string
		want             int
		field            string // named in the 400
	}{
		{"n within -max-n", "/v1/chat/completions", chat(`,"n":1`), 200, ""},
		{"n past -max-n", "/v1/chat/completions", chat(`,"n":1000`), 400, "n: 1000 is more than floe's maximum of 4"},
		{"n zero", "/v1/chat/completions", chat(`,"n":0`), 400, "n: 0 must be at least 1"},
		{"gemini candidateCount", "/v1beta/models/m:generateContent",
			`{"contents":[{"role":"user","parts":[{"text":"hi"}]}],"generationConfig":{"candidateCount":1000}}`, 400, "generationConfig.candidateCount: 1000"},
		{"temperature 1e308", "/v1/chat/completions", chat(`,"temperature":1e308`), 400, "temperature: 1e+308 is out of range"},
		{"temperature negative", "/v1/messages", `{"model":"m","max_tokens":8,"temperature":-1,"messages":[{"role":"user","content":"hi"}]}`, 400, "temperature: -1 is out of range"},
		{"top_p zero", "/v1/chat/completions", chat(`,"top_p":0`), 400, "top_p: 0 is out of range"},
		{"top_p above 1", "/v1/responses", `{"model":"m","input":"hi","top_p":1.5}`, 400, "top_p: 1.5 is out of range"},
		{"gemini topP", "/v1beta/models/m:generateContent",
			`{"contents":[{"role":"user","parts":[{"text":"hi"}]}],"generationConfig":{"topP":7}}`, 400, "generationConfig.topP: 7"},
		{"sampling in range", "/v1/chat/completions", chat(`,"temperature":0.7,"top_p":0.95`), 200, ""},
		{"data: image", "/v1/chat/completions", chatImage(png), 200, ""},
		{"metadata service image", "/v1/chat/completions", chatImage("http://169.254.169.254/latest/meta-data/"), 400, "image_url (message 0, part 1): floe forwards images only as data: URLs"},
		{"loopback image", "/v1/chat/completions", chatImage("http://127.0.0.1:8701/floe/v1/pause"), 400, "host 127.0.0.1 is not in -media-hosts"},
		{"allowed host", "/v1/chat/completions", chatImage("https://images.internal/cat.png"), 200, ""},
		{"allowed host:port", "/v1/chat/completions", chatImage("https://cdn.internal:8443/cat.png"), 200, ""},
		{"allowed host, other port", "/v1/chat/completions", chatImage("https://cdn.internal:9000/cat.png"), 400, "host cdn.internal is not in -media-hosts"},
		{"file: image", "/v1/chat/completions", chatImage("file:///etc/passwd"), 400, "no http or https URL"},
		{"anthropic url image", "/v1/messages",
			`{"model":"m","max_tokens":8,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"http://169.254.169.254/"}}]}]}`, 400, "image.source.url"},
		{"gemini fileData", "/v1beta/models/m:generateContent",
			`{"contents":[{"role":"user","parts":[{"fileData":{"mimeType":"image/png","fileUri":"http://10.0.0.1/x.png"}}]}]}`, 400, "fileData.fileUri"},
		{"responses input_image", "/v1/responses",
			`{"model":"m","input":[{"role":"user","content":[{"type":"input_image","image_url":"http://127.0.0.1/x.png"}]}]}`, 400, "input_image.image_url"},
		{"chat_template", "/v1/chat/completions", chat(`,"chat_template_kwargs":{"chat_template":"{{ 'pwned' }}"}`), 400, "chat_template_kwargs.chat_template: floe does not forward this key"},
		{"unknown kwarg", "/v1/chat/completions", chat(`,"chat_template_kwargs":{"enable_thinking":true,"tools_in_system":1}`), 400, "chat_template_kwargs.tools_in_system"},
		{"enable_thinking", "/v1/chat/completions", chat(`,"chat_template_kwargs":{"enable_thinking":false}`), 200, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := reached.Load()
			req, _ := http.NewRequest(http.MethodPost, srv.URL+tt.path, strings.NewReader(tt.body))
			req.Header.Set("Authorization", "Bearer k")
			req.Header.Set("x-goog-api-key", "k")
			req.Header.Set("anthropic-version", "2023-06-01")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tt.want || !strings.Contains(string(b), tt.field) {
				t.Fatalf("%d %s; want %d naming %q", resp.StatusCode, b, tt.want, tt.field)
			}
			if n := reached.Load() - before; tt.want != 200 && n != 0 {
				t.Errorf("a refused call reached upstream %d times", n)
			}
		})
	}
}
