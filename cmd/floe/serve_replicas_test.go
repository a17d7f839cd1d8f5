package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/floe-rl/floe/internal/fakevllm"
)

// TestServeFailsOverBetweenReplicas runs the real floe serve in front of two fake vLLMs
// (-upstream a,b) and kills one mid-run: every session's calls stick to one replica; once
// one is killed, the calls of its sessions are answered by the other with no error to the
// harness; the status and /metrics show it down; restarted, it passes a health check and
// its sessions come back. A harness naming another session in the header floe sends
// upstream does not move its calls: floe sends its own session's id.
func TestServeFailsOverBetweenReplicas(t *testing.T) {
	a, err := fakevllm.Start(fakevllm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := fakevllm.Start(fakevllm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	f := startFloe(t, "-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0",
		"-upstream", a.URL+","+b.URL, "-upstream-health-interval", "100ms", "-group-size", "64")
	type session struct{ id, key string }
	var sessions []session
	for range 12 {
		s := f.post(t, "/floe/v1/sessions", "", `{"task_id": "t", "group_id": "g"}`)
		sessions = append(sessions, session{s["session_id"].(string), s["api_key"].(string)})
	}
	call := func(s session, header string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, f.proxy+"/v1/chat/completions",
			strings.NewReader(`{"model":"x","messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set("Authorization", "Bearer "+s.key)
		if header != "" {
			req.Header.Set(fakevllm.SessionHeader, header)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	on := func() map[string]string {
		t.Helper()
		out := map[string]string{}
		for _, r := range []*fakevllm.Server{a, b} {
			for id := range r.Calls() {
				if prev, ok := out[id]; ok && prev != r.URL {
					t.Fatalf("session %s called both %s and %s", id, prev, r.URL)
				}
				out[id] = r.URL
			}
		}
		return out
	}
	for _, s := range sessions {
		for range 2 {
			if code, body := call(s, ""); code != 200 {
				t.Fatalf("session %s: %d %s", s.id, code, body)
			}
		}
	}
	first := on()
	if len(first) != len(sessions) {
		t.Fatalf("%d sessions seen upstream, want %d: %v", len(first), len(sessions), first)
	}
	onA := 0
	for _, u := range first {
		if u == a.URL {
			onA++
		}
	}
	if onA == 0 || onA == len(sessions) {
		t.Fatalf("%d of %d sessions on %s: the sessions are not spread", onA, len(sessions), a.URL)
	}

	// The hostile harness names another session upstream: floe sends its own.
	victim, other := sessions[0], sessions[1]
	for _, s := range sessions[1:] {
		if first[s.id] != first[victim.id] {
			other = s
			break
		}
	}
	if code, _ := call(victim, other.id); code != 200 {
		t.Fatal("a call with a forged session header failed")
	}
	if on()[victim.id] != first[victim.id] {
		t.Fatal("a forged session header moved the call")
	}

	// Kill the replica of the first session: every session's call still succeeds.
	dead := a
	if first[victim.id] == b.URL {
		dead = b
	}
	dead.Stop()
	before := dead.Calls()
	for _, s := range sessions {
		if code, body := call(s, ""); code != 200 || !strings.Contains(body, "ok 1") {
			t.Fatalf("session %s (was on %s) after the kill: %d %s", s.id, first[s.id], code, body)
		}
	}
	for id, n := range dead.Calls() {
		if n != before[id] {
			t.Fatalf("the killed replica answered session %s", id)
		}
	}
	waitStatus := func(healthy bool) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			st := f.get(t, "/floe/v1/status")
			ups, _ := st["upstreams"].([]any)
			for _, u := range ups {
				if u := u.(map[string]any); u["url"] == dead.URL && u["healthy"] == healthy {
					return
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("status upstreams %v: want %s healthy=%t", ups, dead.URL, healthy)
			}
		}
	}
	waitStatus(false)
	metrics := f.metricsText(t)
	for _, want := range []string{
		fmt.Sprintf(`floe_replica_healthy{upstream=%q} 0`, dead.URL),
		fmt.Sprintf(`floe_replica_healthy{upstream=%q} 1`, liveOf(a, b, dead)),
		fmt.Sprintf(`floe_replica_failovers_total{upstream=%q}`, dead.URL),
		fmt.Sprintf(`floe_replica_calls_total{upstream=%q}`, dead.URL),
		fmt.Sprintf(`floe_replica_latency_seconds_count{upstream=%q}`, liveOf(a, b, dead)),
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}

	// Restarted, the replica passes a check and its sessions come back.
	if err := dead.Restart(); err != nil {
		t.Fatal(err)
	}
	waitStatus(true)
	before = dead.Calls()
	for _, s := range sessions {
		if code, body := call(s, ""); code != 200 {
			t.Fatalf("session %s after the restart: %d %s", s.id, code, body)
		}
		if first[s.id] == dead.URL && dead.Calls()[s.id] != before[s.id]+1 {
			t.Errorf("session %s did not come back to %s", s.id, dead.URL)
		}
	}
}

// liveOf is the URL of the replica of a and b that is not dead.
func liveOf(a, b, dead *fakevllm.Server) string {
	if dead == a {
		return b.URL
	}
	return a.URL
}

// metricsText reads the control listener's /metrics.
func (p *floeProc) metricsText(t *testing.T) string {
	t.Helper()
	resp, err := http.Get(p.control + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// TestProxyFailsOverBetweenReplicas: floe proxy takes several replicas by repeating
// -upstream; with one of them dead from the start, every session's calls are answered.
func TestProxyFailsOverBetweenReplicas(t *testing.T) {
	live, err := fakevllm.Start(fakevllm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()
	dead, err := fakevllm.Start(fakevllm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	dead.Stop()
	p := startFloeProxy(t, "-proxy-addr", "127.0.0.1:0", "-control-addr", "127.0.0.1:0", "-open-sessions",
		"-upstream", dead.URL, "-upstream", live.URL)
	for i := range 8 {
		req, _ := http.NewRequest(http.MethodPost, p.proxy+"/v1/chat/completions",
			strings.NewReader(`{"model":"x","messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set("Authorization", fmt.Sprintf("Bearer key-%d", i))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("call %d with a dead replica: %d %s\n%s", i, resp.StatusCode, body, p.logs.String())
		}
	}
	if n := len(live.Calls()); n != 8 {
		t.Errorf("the live replica saw %d sessions, want all 8", n)
	}
}

// TestBadUpstreamIsRefused: floe serve and floe proxy refuse an -upstream that is not a
// list of http(s) base URLs, naming the flag. (The flag package repeats the value as
// given on the command line; floe's own part of the message masks its password.)
func TestBadUpstreamIsRefused(t *testing.T) {
	for _, tc := range []struct{ cmd, value, want string }{
		{"serve", "127.0.0.1:8000", "-upstream"},
		{"proxy", "http://a:1,,http://b:1", "an empty URL"},
		{"serve", "http://a:1,http://a:1/", "-upstream http://a:1 is given twice"},
		{"proxy", "ftp://u:secret@h:1", "-upstream ftp://u:xxxxx@h:1: want an http:// or https:// base URL"},
	} {
		var stdout, stderr bytes.Buffer
		args := []string{tc.cmd, "-upstream", tc.value}
		if tc.cmd == "serve" {
			args = append(args, "-data-dir", t.TempDir())
		}
		code := run(context.Background(), args, &stdout, &stderr)
		if code == 0 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("floe %s -upstream %q: exit %d, %s; want a refusal mentioning %q", tc.cmd, tc.value, code, stderr.String(), tc.want)
		}
	}
}
