package proxy_test

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/floe-rl/floe/proxy"
)

// startTrickle opens a connection to the proxy and sends a chat call's headers with key
// and the first bytes of a 1000-byte body; with every > 0 it goes on sending one byte
// each interval until stop is closed or the connection fails. The connection is closed
// when the test ends.
func startTrickle(t *testing.T, px, key string, every time.Duration, stop <-chan struct{}) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(px, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() }) // a client's connection: its end is not the test
	_, _ = fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":", key)
	if every > 0 {
		done := make(chan struct{})
		t.Cleanup(func() { <-done }) // the caller closes stop before the test ends
		// Owned by the test: it ends at stop or when the connection fails.
		go func() {
			defer close(done)
			tick := time.NewTicker(every)
			defer tick.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tick.C:
					if _, err := conn.Write([]byte(" ")); err != nil {
						return
					}
				}
			}
		}()
	}
	return conn
}

// TestTrickledBodyHoldsNoSlot: a call whose body is still arriving holds no -max-inflight
// slot (the body is read before the slot is taken), so one harness trickling its bodies
// cannot refuse another session's call; once its body is in, the call is served.
func TestTrickledBodyHoldsNoSlot(t *testing.T) {
	up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"}
	upstream := httptest.NewServer(up.handler())
	defer upstream.Close()
	for _, tc := range []struct {
		name   string
		sender string
	}{
		{"another session", "k2"},
		{"the trickler's own session", "k"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// a proxy of its own: the other case's trickle, stopped, may still hold its
			// session's reading place for a moment
			store, px := limitsProxy(t, upstream.URL, proxy.Limits{ClientIdle: time.Minute, MaxInflight: 1, MaxInflightPerSession: 1}, nil)
			store.AddSession("k2", "s2")
			stop := make(chan struct{})
			defer close(stop)
			startTrickle(t, px, "k", 5*time.Millisecond, stop)
			// The trickler's headers are in once its session's reading place is taken; a
			// second trickle of the same key shows it (refused: one reading at a time
			// here), without any sleep.
			waitRefused(t, px, "k")
			// A probe of waitRefused admitted before the trickle's headers can still hold
			// the one slot for a moment after its answer reached the client: another
			// session's call refused for capacity is tried again while the trickle goes on.
			// A trickle that held the slot would keep refusing it until the hang guard.
			deadline := time.Now().Add(10 * time.Second)
			var resp *http.Response
			var b []byte
			for {
				req, _ := http.NewRequest(http.MethodPost, px+"/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, "")))
				req.Header.Set("Authorization", "Bearer "+tc.sender)
				var err error
				if resp, err = http.DefaultClient.Do(req); err != nil {
					t.Fatal(err)
				}
				b, _ = io.ReadAll(resp.Body)
				_ = resp.Body.Close() // read whole
				if tc.sender != "k2" || resp.StatusCode != 429 || !strings.Contains(string(b), "concurrent calls") || time.Now().After(deadline) {
					break
				}
			}
			switch {
			case tc.sender == "k2" && resp.StatusCode != 200:
				t.Errorf("another session's call while a body trickles: %d %s; want 200 (the trickle holds no slot)", resp.StatusCode, b)
			case tc.sender == "k" && resp.StatusCode != 429:
				t.Errorf("the trickler's own second call: %d %s; want 429 (its session is reading its maximum of bodies)", resp.StatusCode, b)
			}
		})
	}
}

// waitRefused waits until a call with key is refused for its session's cap: the
// session's earlier call has been admitted to read its body.
func waitRefused(t *testing.T, px, key string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second) // a hang guard, not a measure
	for {
		req, _ := http.NewRequest(http.MethodPost, px+"/v1/chat/completions", strings.NewReader(fmt.Sprintf(chatBody, "")))
		req.Header.Set("Authorization", "Bearer "+key)
		req.ContentLength = -1 // not sent before the answer: a refused call reads none
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 429 {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the trickling call was never admitted (last: %v)", err)
		}
	}
}

// TestBodyTotalDeadline: a body that keeps trickling (never silent for -client-idle-timeout)
// is dropped once -client-body-timeout has passed since its headers, with a 408 naming
// the flag (or, as net/http often does, by closing the connection).
func TestBodyTotalDeadline(t *testing.T) {
	up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"}
	upstream := httptest.NewServer(up.handler())
	defer upstream.Close()
	const total = 300 * time.Millisecond
	_, px := limitsProxy(t, upstream.URL, proxy.Limits{ClientIdle: time.Minute, BodyTimeout: total}, nil)
	stop := make(chan struct{})
	defer close(stop)
	started := time.Now()
	conn := startTrickle(t, px, "k", 10*time.Millisecond, stop)
	_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second)) // a hang guard
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	held := time.Since(started)
	var ne net.Error
	switch {
	case errors.As(err, &ne) && ne.Timeout():
		t.Fatal("a body trickled steadily is still being read")
	case err == nil:
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 408 || !strings.Contains(string(b), "client-body-timeout") {
			t.Errorf("%d %s; want 408 naming -client-body-timeout", resp.StatusCode, b)
		}
	}
	if held < total {
		t.Errorf("the body was dropped after %s, before its deadline of %s", held, total)
	}
	t.Logf("a body trickled at 1 byte / 10ms was dropped after %s (-client-body-timeout %s)", held.Round(time.Millisecond), total)
}
