package fakevllm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestHoldPlaysAHungServer: a Hold that waits for the request's end keeps the call
// unanswered until the client gives up; without Hold the fake answers.
func TestHoldPlaysAHungServer(t *testing.T) {
	held := make(chan struct{}, 1)
	srv := httptest.NewServer(HandlerWith(Options{Hold: func(r *http.Request) {
		held <- struct{}{}
		<-r.Context().Done()
	}}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/chat/completions",
		strings.NewReader(`{"messages":[{"role":"user","content":"hi"}]}`))
	if _, err := http.DefaultClient.Do(req); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err %v; want the client's deadline", err)
	}
	<-held

	plain := httptest.NewServer(Handler())
	defer plain.Close()
	resp, err := http.Post(plain.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("%v %v", resp, err)
	}
	resp.Body.Close()
}

// TestServerStopsRestartsAndCounts: a stopped Server refuses connections; restarted, it
// answers on the same URL; it counts each session's calls by SessionHeader, answers a
// streamed call as SSE ending in [DONE], and /health follows SetHealthy.
func TestServerStopsRestartsAndCounts(t *testing.T) {
	s, err := Start(Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	// A fresh connection per call: a stopped server's connections are closed, so a kept
	// one would fail with EOF rather than be refused.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	call := func(stream bool) (string, error) {
		req, _ := http.NewRequest(http.MethodPost, s.URL+"/v1/chat/completions",
			strings.NewReader(`{"stream":`+map[bool]string{true: "true", false: "false"}[stream]+`,"messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set(SessionHeader, "sess-1")
		resp, err := client.Do(req)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	}
	health := func() int {
		resp, err := client.Get(s.URL + "/health")
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if body, err := call(false); err != nil || !strings.Contains(body, `"ok 1"`) {
		t.Fatalf("plain call: %q %v", body, err)
	}
	if body, err := call(true); err != nil || !strings.HasSuffix(body, "data: [DONE]\n\n") || !strings.Contains(body, `"token_ids":[111]`) {
		t.Fatalf("streamed call: %q %v", body, err)
	}
	if h := health(); h != 200 {
		t.Errorf("/health %d", h)
	}
	s.SetHealthy(false)
	if h := health(); h != 503 {
		t.Errorf("/health after SetHealthy(false): %d", h)
	}
	s.Stop()
	if _, err := call(false); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("a call to a stopped server: %v, want connection refused", err)
	}
	if err := s.Restart(); err != nil {
		t.Fatal(err)
	}
	if _, err := call(false); err != nil {
		t.Fatalf("a call after the restart: %v", err)
	}
	if got := s.Calls(); got["sess-1"] != 3 || len(got) != 1 {
		t.Errorf("calls %v, want sess-1: 3", got)
	}
}

// TestFailAnswersOrDrops: Fail answers a read request with the status it returns (in
// vLLM's error object), drops its connection with a reset or a hang-up, or lets it be
// answered; the call is counted either way.
func TestFailAnswersOrDrops(t *testing.T) {
	tests := []struct {
		fail    int
		status  int
		errWant string // what the client's error says, when the connection is dropped
	}{
		{0, 200, ""},
		{500, 500, ""},
		{429, 429, ""},
		{Reset, 0, "connection reset by peer"},
		{Hangup, 0, "EOF"},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.fail), func(t *testing.T) {
			s, err := Start(Options{Fail: func(*http.Request) int { return tt.fail }})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			req, _ := http.NewRequest(http.MethodPost, s.URL+"/v1/chat/completions", strings.NewReader(`{"messages":[{"role":"user","content":"hi"}]}`))
			req.Header.Set(SessionHeader, "s")
			resp, err := http.DefaultClient.Do(req)
			if tt.errWant != "" {
				if err == nil || !strings.Contains(err.Error(), tt.errWant) {
					t.Fatalf("err %v, want one saying %q", err, tt.errWant)
				}
			} else {
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != tt.status || tt.status != 200 && !strings.Contains(string(body), `"object":"error"`) {
					t.Fatalf("%d %s, want %d", resp.StatusCode, body, tt.status)
				}
			}
			if n := s.Calls()["s"]; n != 1 {
				t.Errorf("%d calls counted, want 1", n)
			}
		})
	}
}
