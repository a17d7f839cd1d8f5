package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/floe-rl/floe/internal/fakevllm"
)

// TestHostileHarness runs the real floe serve binary, with control and Flight tokens from
// the environment, and plays a hostile harness: the policy under training, which runs
// arbitrary code and holds the proxy's address and its session's api_key (and, worse,
// has learned a sibling's session id). Every attack on rewards, sessions, steps, the gate
// or another session's data is refused, nothing of it reaches upstream or the store, and
// the step the trainer then reads holds only the runner's rewards (docs/security.md).
func TestHostileHarness(t *testing.T) {
	var upstreamCalls atomic.Int64
	fake := fakevllm.Handler()
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/chat/completions") {
			upstreamCalls.Add(1)
		}
		fake.ServeHTTP(w, r)
	}))
	defer up.Close()
	const controlToken, flightToken = "ctl-9d2f", "flt-41ac"
	f := startFloeEnv(t, []string{"FLOE_CONTROL_TOKEN=" + controlToken, "FLOE_FLIGHT_TOKEN=" + flightToken},
		"-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0", "-upstream", up.URL,
		"-group-size", "2", "-min-group-size", "2", "-groups-per-step", "1", "-token-budget", "4096", "-pad-multiple", "16",
		"-max-abs-reward", "10")

	// do sends one HTTP request and returns the status and body.
	do := func(method, url, auth, body string, header ...string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, url, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if auth != "" {
			req.Header.Set("Authorization", "Bearer "+auth)
		}
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	// The runner (trusted, with the control token) creates a group of two sessions.
	type session struct{ id, key string }
	var sess []session
	for range 2 {
		code, body := do("POST", f.control+"/floe/v1/sessions", controlToken, `{"task_id": "t", "group_id": "g", "group_size": 2}`)
		if code != 200 {
			t.Fatalf("the runner's create: %d %s", code, body)
		}
		var s map[string]any
		_ = json.Unmarshal([]byte(body), &s)
		urls := s["base_urls"].(map[string]any)
		if urls["anthropic"] != f.proxy || strings.Contains(body, f.control) {
			t.Fatalf("base_urls %v: want the proxy's address, never the control's", urls)
		}
		sess = append(sess, session{s["session_id"].(string), s["api_key"].(string)})
	}
	me, sibling := sess[0], sess[1]
	chat := `{"model":"x","messages":[{"role":"user","content":"hi"}]}`
	if code, body := do("POST", f.proxy+"/v1/chat/completions", me.key, chat); code != 200 {
		t.Fatalf("a call with the session's own key: %d %s", code, body)
	}
	if code, body := do("POST", f.proxy+"/v1/chat/completions", sibling.key, chat); code != 200 {
		t.Fatalf("the sibling's call: %d %s", code, body)
	}
	callsBefore := upstreamCalls.Load()

	// noIDs checks that an answer to the harness names no session (beyond echoing what
	// the request itself sent).
	noIDs := func(name, body string, sent ...string) {
		t.Helper()
		for _, s := range sess {
			if strings.Contains(body, s.id) && !strings.Contains(strings.Join(sent, " "), s.id) {
				t.Errorf("%s: the answer names session %s: %s", name, s.id, body)
			}
		}
	}

	t.Run("control API from the proxy address", func(t *testing.T) {
		for _, a := range []struct{ method, path, body string }{
			{"POST", "/floe/v1/sessions", `{"task_id": "t", "group_id": "mine", "group_size": 2}`},
			{"POST", "/floe/v1/sessions/" + me.id + "/finish", `{"reward": 10, "status": "completed"}`},
			{"POST", "/floe/v1/sessions/" + sibling.id + "/finish", `{"reward": -10, "status": "completed"}`},
			{"POST", "/floe/v1/pause", `{}`},
			{"POST", "/floe/v1/resume", `{"policy_version": 9223372036854775807}`},
			{"GET", "/floe/v1/status", ""},
			{"GET", "/floe/v1/sessions/" + sibling.id, ""},
			{"GET", "/metrics", ""},
		} {
			for _, auth := range []string{"", me.key, controlToken} { // even a leaked control token does not help here
				code, body := do(a.method, f.proxy+a.path, auth, a.body)
				if code != http.StatusNotFound {
					t.Errorf("%s %s on the proxy with %q: %d %s, want 404", a.method, a.path, auth, code, body)
				}
				noIDs(a.path, body, a.path)
			}
		}
	})

	t.Run("control address without the token", func(t *testing.T) {
		for _, a := range []struct{ method, path, body string }{
			{"POST", "/floe/v1/sessions", `{"task_id": "t", "group_id": "mine", "group_size": 2}`},
			{"POST", "/floe/v1/sessions/" + me.id + "/finish", `{"reward": 10, "status": "completed"}`},
			{"POST", "/floe/v1/pause", `{}`},
			{"POST", "/floe/v1/resume", `{"policy_version": 9223372036854775807}`},
			{"GET", "/floe/v1/sessions/" + sibling.id, ""},
			{"GET", "/metrics", ""},
		} {
			for _, auth := range []string{"", me.key, me.id} {
				if code, body := do(a.method, f.control+a.path, auth, a.body); code != http.StatusUnauthorized {
					t.Errorf("%s %s on the control address with %q: %d %s, want 401", a.method, a.path, auth, code, body)
				}
			}
		}
	})

	t.Run("Flight without the token", func(t *testing.T) {
		c, err := flight.NewClientWithMiddleware(strings.TrimPrefix(f.flightLoc, "grpc+tcp://"), nil, nil,
			grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = c.Close() }() // a gRPC client: nothing of the test's in it
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, a := range []struct{ typ, body string }{
			{"commit", `{"step": 0}`}, {"pause", `{}`}, {"resume", `{"policy_version": 9223372036854775807}`},
			{"report", `{"step": 0, "rank": 0, "peak_memory_bytes": 1, "step_seconds": 1, "wait_seconds": 0}`}, {"status", `{}`},
		} {
			s, err := c.DoAction(ctx, &flight.Action{Type: a.typ, Body: []byte(a.body)})
			if err == nil {
				_, err = s.Recv()
			}
			if status.Code(err) != codes.Unauthenticated {
				t.Errorf("DoAction %s without the token: %v, want UNAUTHENTICATED", a.typ, err)
			}
		}
		for _, ticket := range []string{`{"step": 0, "rank": 0}`, `{"step": 0, "kind": "samples"}`} {
			s, err := c.DoGet(ctx, &flight.Ticket{Ticket: []byte(ticket)})
			if err == nil {
				_, err = s.Recv()
			}
			if status.Code(err) != codes.Unauthenticated {
				t.Errorf("DoGet %s without the token: %v, want UNAUTHENTICATED", ticket, err)
			}
		}
		if _, err := c.GetFlightInfo(ctx, &flight.FlightDescriptor{Type: flight.DescriptorPATH, Path: []string{"next"}}); status.Code(err) != codes.Unauthenticated {
			t.Errorf("GetFlightInfo without the token: %v, want UNAUTHENTICATED", err)
		}
	})

	t.Run("session ids are no keys", func(t *testing.T) {
		msgs := `{"model":"x","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`
		for _, a := range []struct {
			name, path, body string
			header           []string
		}{
			{"own id as bearer", "/v1/chat/completions", chat, []string{"Authorization", "Bearer " + me.id}},
			{"sibling's id as bearer", "/v1/chat/completions", chat, []string{"Authorization", "Bearer " + sibling.id}},
			{"sibling's id as x-api-key", "/v1/messages", msgs, []string{"x-api-key", sibling.id, "anthropic-version", "2023-06-01"}},
			{"sibling's id as x-goog-api-key", "/v1beta/models/x:generateContent", `{"contents":[{"role":"user","parts":[{"text":"hi"}]}]}`, []string{"x-goog-api-key", sibling.id}},
			{"sibling's id in x-floe-session", "/v1/chat/completions", chat, []string{"x-floe-session", sibling.id}},
			{"sibling's id in x-floe-session beside the own key", "/v1/chat/completions", chat, []string{"x-floe-session", sibling.id, "Authorization", "Bearer " + me.key}},
		} {
			code, body := do("POST", f.proxy+a.path, "", a.body, a.header...)
			want := http.StatusUnauthorized
			if a.name == "sibling's id in x-floe-session beside the own key" {
				want = http.StatusOK // the call is the caller's own, recorded in its own session
			}
			if code != want {
				t.Errorf("%s: %d %s, want %d", a.name, code, body, want)
			}
			noIDs(a.name, body)
		}
	})

	t.Run("forged rewards at the control address", func(t *testing.T) {
		// Even the runner (with the token) cannot finish with a reward that is not finite
		// or beyond -max-abs-reward: 400 naming reward, and the session stays running.
		for _, r := range []string{"1e39", "-1e308", "11", "NaN", "Infinity", "1e400"} {
			code, body := do("POST", f.control+"/floe/v1/sessions/"+me.id+"/finish", controlToken, `{"reward": `+r+`, "status": "completed"}`)
			if code != http.StatusBadRequest || !strings.Contains(body, "reward") {
				t.Errorf("reward %s: %d %s, want 400 naming reward", r, code, body)
			}
		}
	})

	t.Run("conflicting group size", func(t *testing.T) {
		code, body := do("POST", f.control+"/floe/v1/sessions", controlToken, `{"task_id": "t", "group_id": "g", "group_size": 1000}`)
		if code != http.StatusConflict {
			t.Errorf("a third session asking group g for size 1000: %d %s, want 409", code, body)
		}
	})

	// The runner finishes both sessions with their true rewards.
	for i, s := range sess {
		if code, body := do("POST", f.control+"/floe/v1/sessions/"+s.id+"/finish", controlToken, fmt.Sprintf(`{"reward": %d, "status": "completed"}`, i)); code != 200 {
			t.Fatalf("the runner's finish: %d %s", code, body)
		}
	}
	callsBefore = upstreamCalls.Load() - callsBefore // the one allowed own-key call above
	if callsBefore != 1 {
		t.Errorf("%d calls reached upstream during the attacks, want 1 (the caller's own, with its own key)", callsBefore)
	}

	t.Run("finished keys never reach upstream", func(t *testing.T) {
		before := upstreamCalls.Load()
		for _, body := range []string{chat, strings.Replace(chat, `{"model"`, `{"stream":true,"model"`, 1)} {
			code, answer := do("POST", f.proxy+"/v1/chat/completions", me.key, body)
			if code != http.StatusUnauthorized || !strings.Contains(answer, "authentication_error") {
				t.Errorf("a finished session's key: %d %s, want 401 authentication_error", code, answer)
			}
			noIDs("finished key", answer)
		}
		if n := upstreamCalls.Load() - before; n != 0 {
			t.Errorf("%d calls of a finished session reached upstream", n)
		}
	})

	// The gate, the sessions and the step are the runner's and trainer's alone.
	code, body := do("GET", f.control+"/floe/v1/status", controlToken, "")
	var st map[string]any
	_ = json.Unmarshal([]byte(body), &st)
	if code != 200 || st["paused"] != false || st["policy_version"] != 0.0 || st["sessions"] != 2.0 {
		t.Errorf("status after the attacks: %d %s; want not paused, policy version 0, the runner's 2 sessions", code, body)
	}
	for i, s := range sess {
		_, body := do("GET", f.control+"/floe/v1/sessions/"+s.id, controlToken, "")
		var got map[string]any
		_ = json.Unmarshal([]byte(body), &got)
		wantCalls := 1
		if i == 0 {
			wantCalls = 2 // its own call beside the x-floe-session header
		}
		if got["reward"] != float64(i) || got["status"] != "completed" || len(got["calls"].([]any)) != wantCalls {
			t.Errorf("session %d after the attacks: reward %v status %v %d calls; want reward %d, completed, %d calls",
				i, got["reward"], got["status"], len(got["calls"].([]any)), i, wantCalls)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		recs, err := f.step(t, 0) // the trainer, with the Flight token
		if err == nil && len(recs) > 0 {
			for _, r := range recs {
				r.Release()
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("step 0 not READY: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := f.commit(t, 0); err != nil {
		t.Fatalf("the trainer's commit with the token: %v", err)
	}
}

// TestServeRefusesOpenListenersWithoutTokens: floe refuses to start with the control or
// Flight listener beyond loopback and no token, naming the flag; with the token it
// starts. -flight-token on the command line is logged as readable by other users.
func TestServeRefusesOpenListenersWithoutTokens(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-control-addr", "0.0.0.0:0"}, "-control-addr"},
		{[]string{"-flight-addr", "0.0.0.0:0"}, "-flight-addr"},
		{[]string{"-control-addr", ":0"}, "-control-addr"},
	} {
		var stdout, stderr bytes.Buffer
		args := append([]string{"serve", "-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0", "-control-addr", "127.0.0.1:0",
			"-flight-addr", "127.0.0.1:0"}, tc.args...)
		t.Setenv("FLOE_CONTROL_TOKEN", "")
		t.Setenv("FLOE_FLIGHT_TOKEN", "")
		code := run(context.Background(), args, &stdout, &stderr)
		if code == 0 || stdout.Len() != 0 || !strings.Contains(stderr.String(), tc.want) || !strings.Contains(stderr.String(), "token") {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want a refusal naming %s and the token", tc.args, code, stdout.String(), stderr.String(), tc.want)
		}
	}
	// With tokens (from files, as a deployment keeps them) it serves beyond loopback.
	dir := t.TempDir()
	ctl, flt := filepath.Join(dir, "control.token"), filepath.Join(dir, "flight.token")
	if err := os.WriteFile(ctl, []byte("c\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(flt, []byte("f\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	up := fakeEngine()
	defer up.Close()
	f := startFloeEnv(t, []string{"FLOE_FLIGHT_TOKEN=f"}, "-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0",
		"-control-addr", "0.0.0.0:0", "-flight-addr", "0.0.0.0:0", "-control-token-file", ctl, "-flight-token-file", flt, "-upstream", up.URL)
	if err := f.commit(t, 0); status.Code(err) == codes.Unauthenticated {
		t.Errorf("the Flight token from -flight-token-file was not taken: %v", err)
	}
	// -flight-token on the command line is logged as readable by every user.
	var stdout, stderr bytes.Buffer
	run(context.Background(), []string{"serve", "-data-dir", t.TempDir(), "-flight-token", "x", "-flight-token-file", filepath.Join(dir, "missing")}, &stdout, &stderr)
	if !strings.Contains(stderr.String(), "can be read by every user") {
		t.Errorf("no warning for -flight-token on the command line: %s", stderr.String())
	}
}

// TestProxyCommandSplitsListeners: floe proxy, too, serves the provider APIs on
// -proxy-addr and the control API on -control-addr only, and announces both.
func TestProxyCommandSplitsListeners(t *testing.T) {
	up := fakeEngine()
	defer up.Close()
	p := startFloeProxy(t, "-proxy-addr", "127.0.0.1:0", "-control-addr", "127.0.0.1:0", "-upstream", up.URL)
	post := func(url, key, body string) (int, map[string]any) {
		req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var m map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&m)
		return resp.StatusCode, m
	}
	if code, _ := post(p.proxy+"/floe/v1/sessions", "", `{"task_id": "t"}`); code != http.StatusNotFound {
		t.Errorf("POST /floe/v1/sessions on the proxy: %d, want 404", code)
	}
	code, s := post(p.control+"/floe/v1/sessions", "", `{"task_id": "t"}`)
	if code != 200 {
		t.Fatalf("POST /floe/v1/sessions on the control address: %d %v", code, s)
	}
	if code, _ := post(p.control+"/v1/chat/completions", s["api_key"].(string), `{"model":"x","messages":[{"role":"user","content":"hi"}]}`); code != http.StatusNotFound {
		t.Errorf("a model call on the control address: %d, want 404", code)
	}
	if code, m := post(p.proxy+"/v1/chat/completions", s["api_key"].(string), `{"model":"x","messages":[{"role":"user","content":"hi"}]}`); code != 200 {
		t.Errorf("a model call on the proxy: %d %v", code, m)
	}
}
