package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/floe-rl/floe/internal/fakevllm"
)

// TestHostileHarnessCannotStallFloe runs the real floe serve in front of an inference
// server that hangs on the calls a hostile harness makes. The harness cannot take more
// than -max-inflight-per-session calls, so another session still gets a slot; past
// -max-inflight the next call is refused at once in its provider's shape; it cannot
// hold the trainer's weight sync past -drain-timeout (its calls are cut off and recorded
// untrainable), and a hung upstream ends in a 504 at -upstream-first-byte-timeout.
func TestHostileHarnessCannotStallFloe(t *testing.T) {
	release := make(chan struct{})
	var held atomic.Int64
	up := httptest.NewServer(fakevllm.HandlerWith(fakevllm.Options{Hold: func(r *http.Request) {
		held.Add(1)
		defer held.Add(-1)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}}))
	defer up.Close()
	defer close(release)
	f := startFloe(t, "-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0", "-upstream", up.URL,
		"-max-inflight", "3", "-max-inflight-per-session", "2", "-drain-timeout", "1s", "-upstream-first-byte-timeout", "3s")
	s := f.post(t, "/floe/v1/sessions", "", `{"task_id": "t"}`)
	other := f.post(t, "/floe/v1/sessions", "", `{"task_id": "t"}`)
	callAs := func(key, text string) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, f.proxy+"/v1/chat/completions",
			strings.NewReader(fmt.Sprintf(`{"model":"x","messages":[{"role":"user","content":%q}]}`, text)))
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	call := func(text string) (int, string) { return callAs(s["api_key"].(string), text) }
	waitHeld := func(n int64) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); held.Load() != n; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d calls held upstream, want %d", held.Load(), n)
			}
		}
	}

	// The hostile session's two calls hang upstream; its third is refused at once, and
	// the other session still gets the last slot; past that, -max-inflight refuses.
	var wg sync.WaitGroup
	codes := make([]int, 3)
	for i := range 2 {
		wg.Add(1)
		go func() { defer wg.Done(); codes[i], _ = call(fmt.Sprintf("hang %d", i)) }()
	}
	waitHeld(2)
	if code, body := call("one too many"); code != http.StatusTooManyRequests || !strings.Contains(body, "this API key already has") {
		t.Fatalf("a session's call past -max-inflight-per-session: %d %s; want 429", code, body)
	}
	wg.Add(1)
	go func() { defer wg.Done(); codes[2], _ = callAs(other["api_key"].(string), "the other session") }()
	waitHeld(3)
	if code, body := callAs(other["api_key"].(string), "one too many"); code != http.StatusTooManyRequests || !strings.Contains(body, "rate_limit_exceeded") {
		t.Fatalf("a call past -max-inflight: %d %s; want 429 rate_limit_exceeded", code, body)
	}

	// The trainer's pause returns once the drain timeout cuts the two calls off.
	paused := make(chan int, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, f.control+"/floe/v1/pause", strings.NewReader(`{}`))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			paused <- 0
			return
		}
		resp.Body.Close()
		paused <- resp.StatusCode
	}()
	select {
	case code := <-paused:
		if code != 200 {
			t.Fatalf("pause: %d", code)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the weight sync's pause is held by three hung calls past -drain-timeout 1s")
	}
	wg.Wait()
	for i, code := range codes {
		if code != http.StatusServiceUnavailable {
			t.Errorf("cut-off call %d answered %d, want 503", i, code)
		}
	}
	got := f.get(t, "/floe/v1/sessions/"+s["session_id"].(string))
	calls, _ := got["calls"].([]any)
	if len(calls) != 2 {
		t.Fatalf("session after the drain: %d calls recorded, want the 2 cut off", len(calls))
	}
	for _, c := range calls {
		c := c.(map[string]any)
		if c["trainable"] != false || !strings.Contains(fmt.Sprint(c["untrainable_reason"]), "weight sync") {
			t.Errorf("a cut-off call recorded as %v / %v, want untrainable, cut off by a weight sync", c["trainable"], c["untrainable_reason"])
		}
	}

	// After the resume, a call the upstream never answers ends at the first-byte deadline.
	f.post(t, "/floe/v1/resume", "", `{"policy_version": 1}`)
	if code, body := call("hang again"); code != http.StatusGatewayTimeout || !strings.Contains(body, "upstream-first-byte-timeout") {
		t.Fatalf("a call to a hung upstream: %d %s; want 504 naming -upstream-first-byte-timeout", code, body)
	}
}

// get reads a control API resource as JSON.
func (p *floeProc) get(t *testing.T, path string) map[string]any {
	t.Helper()
	resp, err := http.Get(p.control + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	return out
}

// TestHostileHarnessTrickledBody runs the real floe serve binary with one slot for model
// calls (-max-inflight 1) and plays a harness that trickles its body a byte at a time, well
// within -client-idle-timeout. While the body arrives the call holds no slot: another
// session's call is answered meanwhile (on 9eafcf5 the trickle held the only slot, and it
// got 429), and the harness's own next call is refused, since a session has
// -max-inflight-per-session places to read bodies in. However steadily it trickles, the
// body is cut off at -client-body-timeout (408 naming the flag), and nothing of it
// reaches upstream.
func TestHostileHarnessTrickledBody(t *testing.T) {
	up, upstreamCalls := countingEngine()
	defer up.Close()
	f := startFloe(t, "-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0", "-upstream", up.URL,
		"-max-inflight", "1", "-max-inflight-per-session", "1", "-client-idle-timeout", "3s", "-client-body-timeout", "4s")
	hostile := f.post(t, "/floe/v1/sessions", "", `{"task_id": "t"}`)["api_key"].(string)
	other := f.post(t, "/floe/v1/sessions", "", `{"task_id": "t"}`)["api_key"].(string)

	conn, err := net.Dial("tcp", strings.TrimPrefix(f.proxy, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }() // a stalled client's connection: its end is not the test
	// A hang guard only: the answer is due at -client-body-timeout.
	_ = conn.SetReadDeadline(time.Now().Add(60 * time.Second))
	_, _ = fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: floe\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"+
		"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n", hostile, 1<<20)
	// floe asks for the body (100 Continue) when it starts reading it: the call is
	// authenticated and admitted to read.
	br := bufio.NewReader(conn)
	if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "HTTP/1.1 100") {
		t.Fatalf("floe did not ask for the body: %q %v\n%s", line, err, f.logs)
	}
	if line, err := br.ReadString('\n'); err != nil || line != "\r\n" {
		t.Fatalf("after 100 Continue: %q %v", line, err)
	}
	stop := make(chan struct{})
	trickled := make(chan struct{})
	go func() { // owned here: ends when stop closes, or at the connection's end
		defer close(trickled)
		if _, err := io.WriteString(conn, `{"model":"x","messages":[{"role":"user","content":"`); err != nil {
			return
		}
		tick := time.NewTicker(200 * time.Millisecond) // a byte every 0.2 s: never silent for -client-idle-timeout
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				if _, err := io.WriteString(conn, "x"); err != nil {
					return
				}
			}
		}
	}()
	defer func() { close(stop); <-trickled }()

	// While the body trickles, another session's call takes the only slot.
	if code, _, answer := harnessCall(t, f.proxy, chatPath, other, strings.NewReader(chatBody(""))); code != 200 {
		t.Errorf("another session's call while a body trickles: %d %s; want 200 (a body being read holds no slot)", code, answer)
	}
	// The harness's own second call finds its session's one reading place taken.
	if code, _, answer := harnessCall(t, f.proxy, chatPath, hostile, strings.NewReader(chatBody(""))); code != http.StatusTooManyRequests {
		t.Errorf("the trickling session's second call: %d %s; want 429", code, answer)
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("no answer to the trickled body: %v\n%s", err, f.logs)
	}
	answer, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(answer), "-client-body-timeout") {
		t.Errorf("the trickled body: %d %s; want 408 naming -client-body-timeout", resp.StatusCode, answer)
	}
	if n := upstreamCalls.Load(); n != 1 {
		t.Errorf("%d calls reached upstream; want 1, the other session's", n)
	}
}
