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
	"github.com/floe-rl/floe/proxy/openai"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/mem"
)

// TestKeysThatNeverReachUpstream: a session id (in any credential header, or in
// x-floe-session), a sibling's id, and the key of a finished or timed-out session are all
// refused with the provider's 401 authentication error before any upstream call, and the
// answer names no session.
func TestKeysThatNeverReachUpstream(t *testing.T) {
	var upstreamCalls atomic.Int64
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		upstreamCalls.Add(1)
		http.Error(w, "upstream must not be called", http.StatusTeapot)
	}))
	defer upstream.Close()
	store := &mem.Store{}
	for _, s := range []struct{ id, key string }{{"sess-a", "sk-a"}, {"sess-b", "sk-b"}, {"sess-done", "sk-done"}, {"sess-late", "sk-late"}} {
		if err := store.CreateSession(trace.Session{ID: s.id, TaskID: "t", GroupID: "g"}, s.key, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := store.FinishSession("sess-done", 1, trace.StatusCompleted); err != nil {
		t.Fatal(err)
	}
	if err := store.FinishSession("sess-late", 0, trace.StatusTimeout); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(&proxy.Server{
		Dialects: proxy.Dialects{openai.Chat{}, anthropic.Dialect{}},
		Engine:   &vllm.Engine{BaseURL: upstream.URL, Model: "m"},
		Sessions: store, Recorder: store, Log: slog.New(slog.DiscardHandler),
	})
	defer srv.Close()
	chat := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	msgs := `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`
	for _, tc := range []struct {
		name, path, body string
		header           [2]string
		wantType         string
	}{
		{"session id as bearer", "/v1/chat/completions", chat, [2]string{"Authorization", "Bearer sess-a"}, "authentication_error"},
		{"sibling's id as x-api-key", "/v1/messages", msgs, [2]string{"x-api-key", "sess-b"}, "authentication_error"},
		{"session id in x-floe-session", "/v1/chat/completions", chat, [2]string{"x-floe-session", "sess-a"}, "authentication_error"},
		{"finished session's key", "/v1/chat/completions", chat, [2]string{"Authorization", "Bearer sk-done"}, "authentication_error"},
		{"finished session's key, streaming", "/v1/chat/completions", strings.Replace(chat, `{"model"`, `{"stream":true,"model"`, 1), [2]string{"Authorization", "Bearer sk-done"}, "authentication_error"},
		{"timed-out session's key", "/v1/messages", msgs, [2]string{"x-api-key", "sk-late"}, "authentication_error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(http.MethodPost, srv.URL+tc.path, strings.NewReader(tc.body))
			req.Header.Set(tc.header[0], tc.header[1])
			req.Header.Set("anthropic-version", "2023-06-01")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(string(b), tc.wantType) {
				t.Errorf("status %d body %s; want 401 %s", resp.StatusCode, b, tc.wantType)
			}
			if strings.Contains(string(b), "sess-") {
				t.Errorf("the answer names a session: %s", b)
			}
		})
	}
	if n := upstreamCalls.Load(); n != 0 {
		t.Errorf("%d calls reached upstream", n)
	}
	if calls := store.Calls("sess-a"); len(calls) != 0 {
		t.Errorf("calls were recorded into sess-a with its id: %+v", calls)
	}
}
