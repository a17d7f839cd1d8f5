package fakevllm

import (
	"context"
	"errors"
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
