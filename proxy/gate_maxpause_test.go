package proxy_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/anthropic"
	"github.com/floe-rl/floe/proxy/openai"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace/mem"
)

// TestPauseOutlastingMaxPause: a pause the trainer never ends (it crashed between pause
// and resume) stops holding calls after -max-pause: the calls waiting at the gate and
// every new one are refused at once in their provider's overloaded shape (Anthropic
// 529, OpenAI 429) with Retry-After, so harnesses back off instead of hanging;
// OnPauseExpired is told once; a resume serves calls again.
func TestPauseOutlastingMaxPause(t *testing.T) {
	up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"}
	upstream := httptest.NewServer(up.handler())
	defer upstream.Close()
	expired := make(chan time.Duration, 4)
	gate := &proxy.Gate{MaxPause: 200 * time.Millisecond, OnPauseExpired: func(d time.Duration) { expired <- d }}
	store := &mem.Store{}
	store.AddSession("k", "s")
	srv := httptest.NewServer(&proxy.Server{Dialects: proxy.Dialects{openai.Chat{}, anthropic.Dialect{}},
		Engine: &vllm.Engine{BaseURL: upstream.URL, Model: "m"}, Sessions: store, Recorder: store, Gate: gate,
		Log: slog.New(slog.DiscardHandler)})
	defer srv.Close()
	call := func(path, body string) (int, string, string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err.Error(), ""
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), resp.Header.Get("Retry-After")
	}
	chat := fmt.Sprintf(chatBody, "")
	messages := `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`

	if _, err := gate.Pause(context.Background()); err != nil {
		t.Fatal(err)
	}
	waiting := make(chan int, 1)
	go func() { code, _, _ := call("/v1/chat/completions", chat); waiting <- code }()
	var lasted time.Duration
	select {
	case lasted = <-expired:
	case <-time.After(20 * time.Second): // a hang guard
		t.Fatal("OnPauseExpired was never called")
	}
	if lasted < gate.MaxPause {
		t.Errorf("the pause expired after %s, before -max-pause %s", lasted, gate.MaxPause)
	}
	select {
	case code := <-waiting:
		if code != 429 {
			t.Errorf("the call waiting at the gate: %d; want 429", code)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the call waiting at the gate still hangs after -max-pause")
	}
	if !gate.PauseExpired() {
		t.Error("PauseExpired is false after -max-pause")
	}
	for _, tc := range []struct {
		path, body string
		want       int
	}{
		{"/v1/chat/completions", chat, 429},
		{"/v1/messages", messages, 529},
	} {
		code, body, retry := call(tc.path, tc.body)
		if code != tc.want || retry == "" || !strings.Contains(body, "paused for a weight sync") {
			t.Errorf("%s after -max-pause: %d (Retry-After %q) %s; want %d with Retry-After", tc.path, code, retry, body, tc.want)
		}
	}
	if err := gate.Resume(1); err != nil {
		t.Fatal(err)
	}
	if gate.PauseExpired() {
		t.Error("PauseExpired is still true after a resume")
	}
	if code, body, _ := call("/v1/chat/completions", chat); code != 200 {
		t.Errorf("after the resume: %d %s; want 200", code, body)
	}
	if len(expired) != 0 {
		t.Errorf("OnPauseExpired called %d more times; want once", len(expired))
	}
}

// TestGateMaxPause: the gate on its own. Admit waits during a pause within MaxPause and
// fails with ErrPauseExpired after it; a new pause starts a new MaxPause; with no
// MaxPause a pause holds calls until its caller's context ends.
func TestGateMaxPause(t *testing.T) {
	tests := []struct {
		name     string
		maxPause time.Duration
		expires  bool
	}{
		{"bounded", 50 * time.Millisecond, true},
		{"unbounded", 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			expired := make(chan struct{}, 4)
			g := &proxy.Gate{MaxPause: tt.maxPause, OnPauseExpired: func(time.Duration) { expired <- struct{}{} }}
			for round := range 2 { // a second pause, after a resume, is bounded afresh
				if _, err := g.Pause(context.Background()); err != nil {
					t.Fatal(err)
				}
				wait := 100 * time.Millisecond // how long an unbounded pause is watched holding a call
				if tt.expires {
					wait = 20 * time.Second // a hang guard
				}
				ctx, cancel := context.WithTimeout(context.Background(), wait)
				_, _, _, err := g.Admit(ctx)
				cancel()
				switch {
				case tt.expires && !errors.Is(err, proxy.ErrPauseExpired):
					t.Fatalf("round %d: Admit: %v; want ErrPauseExpired", round, err)
				case !tt.expires && !errors.Is(err, context.DeadlineExceeded):
					t.Fatalf("round %d: Admit: %v; want it to wait until its context ended", round, err)
				}
				if err := g.Resume(int64(round + 1)); err != nil {
					t.Fatal(err)
				}
				if _, _, leave, err := g.Admit(context.Background()); err != nil {
					t.Fatalf("round %d: Admit after the resume: %v", round, err)
				} else {
					leave()
				}
			}
			want := 0
			if tt.expires {
				want = 2
			}
			if len(expired) != want {
				t.Errorf("OnPauseExpired called %d times; want %d", len(expired), want)
			}
		})
	}
}
