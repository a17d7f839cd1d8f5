package proxy_test

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/openai"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace/mem"
)

// connLimitedProxy serves the Chat API behind a ConnLimiter.
func connLimitedProxy(t *testing.T, upstream string, cl *proxy.ConnLimiter) string {
	store := &mem.Store{}
	store.AddSession("k", "s")
	srv := httptest.NewUnstartedServer(&proxy.Server{Dialects: proxy.Dialects{openai.Chat{}},
		Engine: &vllm.Engine{BaseURL: upstream, Model: "m"}, Sessions: store, Recorder: store, Log: slog.New(slog.DiscardHandler)})
	srv.Listener = cl.Listener(srv.Listener)
	srv.Config.ConnContext, srv.Config.ConnState = cl.ConnContext, cl.ConnState
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL
}

// stranger opens a connection that announces a body to a path floe does not serve and
// sends one byte of it (the descriptor-exhaustion probe); closed when the test ends.
func stranger(t *testing.T, px string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(px, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() }) // a client's connection: its end is not the test
	_, _ = fmt.Fprintf(conn, "POST /nothing HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n{")
	return conn
}

// waitEOF waits until the server closes conn (a read ends), failing after a hang guard.
func waitEOF(t *testing.T, conn net.Conn, what string) {
	t.Helper()
	_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	_, err := io.Copy(io.Discard, conn)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("%s: the connection is still open", what)
	}
}

// TestConnLimiterEvictsStrangers: past the cap, a new connection closes the oldest
// stranger's, so a harness's call still gets in however many idle connections without a
// key are open; a connection serving a call with a live key is never the one closed.
func TestConnLimiterEvictsStrangers(t *testing.T) {
	release := make(chan struct{})
	held := make(chan struct{}, 1)
	var calls atomic.Int64
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if strings.HasSuffix(r.URL.Path, "/chat/completions") && calls.Add(1) == 1 { // only the first is held
			held <- struct{}{}
			<-release
		}
		_, _ = io.WriteString(w, `{"id":"c","prompt_token_ids":[1],"choices":[{"index":0,"finish_reason":"stop","token_ids":[2],"logprobs":{"content":[{"logprob":-0.5}]},"message":{"role":"assistant","content":"ok"}}]}`)
	}))
	defer upstream.Close()
	cl := &proxy.ConnLimiter{Max: 4}
	px := connLimitedProxy(t, upstream.URL, cl)

	// A call with a key takes one connection and is held upstream.
	first := make(chan int, 1)
	go func() { code, _ := postChat(t, px, ""); first <- code }()
	<-held
	var strangers []net.Conn
	for range 12 { // three times the cap
		strangers = append(strangers, stranger(t, px))
	}
	// The first strangers' connections were closed to make room for the later ones.
	waitEOF(t, strangers[0], "the oldest stranger")
	if status, body := postChat(t, px, ""); status != 200 {
		t.Errorf("a call while strangers fill the cap: %d %s; want 200", status, body)
	}
	close(release)
	if code := <-first; code != 200 {
		t.Errorf("the held call: %d; want 200 (a connection serving a call is never evicted)", code)
	}
	if open := cl.Open(); open > cl.Max {
		t.Errorf("%d connections open; want at most %d", open, cl.Max)
	}
	if cl.Evicted() == 0 {
		t.Error("no connection was evicted")
	}
}

// TestConnLimiterStrangerDeadline: a connection that has not shown a live key is closed
// Unauthenticated after its accept, whatever it sends; one whose call authenticated
// keeps its connection past it.
func TestConnLimiterStrangerDeadline(t *testing.T) {
	release := make(chan struct{})
	held := make(chan struct{}, 1)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if strings.HasSuffix(r.URL.Path, "/chat/completions") {
			held <- struct{}{}
			<-release
		}
		_, _ = io.WriteString(w, `{"id":"c","prompt_token_ids":[1],"choices":[{"index":0,"finish_reason":"stop","token_ids":[2],"logprobs":{"content":[{"logprob":-0.5}]},"message":{"role":"assistant","content":"ok"}}]}`)
	}))
	defer upstream.Close()
	const deadline = 200 * time.Millisecond
	px := connLimitedProxy(t, upstream.URL, &proxy.ConnLimiter{Unauthenticated: deadline})
	for _, tc := range []struct {
		name string
		send func(net.Conn)
	}{
		{"silent", func(net.Conn) {}},
		{"half a request line", func(c net.Conn) { _, _ = fmt.Fprint(c, "POST /v1/chat/comp") }},
		{"a body to an unknown path", func(c net.Conn) {
			_, _ = fmt.Fprint(c, "POST /nothing HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n{")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", strings.TrimPrefix(px, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = conn.Close() }() // a client's connection: its end is not the test
			started := time.Now()
			tc.send(conn)
			waitEOF(t, conn, "a stranger's connection")
			if took := time.Since(started); took < deadline/2 {
				t.Errorf("closed after %s, well before the deadline of %s", took, deadline)
			}
		})
	}
	t.Run("authenticated", func(t *testing.T) {
		conn, err := net.Dial("tcp", strings.TrimPrefix(px, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = conn.Close() }() // a client's connection: its end is not the test
		body := fmt.Sprintf(chatBody, "")
		_, _ = fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		<-held
		// A stranger that arrived later is closed at its deadline, which lies past this
		// connection's: this one, serving a call, is still open.
		waitEOF(t, stranger(t, px), "a stranger's connection")
		close(release)
		_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("the authenticated call's connection: %v; want its answer", err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("the authenticated call: %d; want 200", resp.StatusCode)
		}
	})
}
