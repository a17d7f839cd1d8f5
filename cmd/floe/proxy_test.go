package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"
)

// TestProxyMaxStoredBytesDropsOldestCalls: floe proxy keeps the recorded calls in memory
// under -max-stored-bytes, the oldest dropped first and counted at /metrics, while the
// session's call indexes go on.
func TestProxyMaxStoredBytesDropsOldestCalls(t *testing.T) {
	up := fakeEngine()
	defer up.Close()
	for _, tc := range []struct {
		name        string
		limit       string
		wantIndexes []any // the calls the session keeps
		wantDropped string
	}{
		// Any call is larger than one byte: only the newest is kept.
		{name: "tiny limit", limit: "1", wantIndexes: []any{2.0}, wantDropped: "floe_proxy_dropped_calls_total 2\n"},
		{name: "unbounded", limit: "0", wantIndexes: []any{0.0, 1.0, 2.0}, wantDropped: "floe_proxy_dropped_calls_total 0\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startFloeProxy(t, "-proxy-addr", "127.0.0.1:0", "-control-addr", "127.0.0.1:0", "-upstream", up.URL,
				"-session", "k=s", "-max-stored-bytes", tc.limit)
			for i := 0; i < 3; i++ {
				req, _ := http.NewRequest(http.MethodPost, p.proxy+"/v1/chat/completions", strings.NewReader(`{"model":"x","messages":[{"role":"user","content":"hi"}]}`))
				req.Header.Set("Authorization", "Bearer k")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					t.Fatalf("call %d: %d", i, resp.StatusCode)
				}
			}
			get := func(path string) []byte {
				resp, err := http.Get(p.control + path)
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				if resp.StatusCode != 200 {
					t.Fatalf("GET %s: %d %s", path, resp.StatusCode, b)
				}
				return b
			}
			var s struct{ Calls []map[string]any }
			if err := json.Unmarshal(get("/floe/v1/sessions/s"), &s); err != nil {
				t.Fatal(err)
			}
			var indexes []any
			for _, c := range s.Calls {
				indexes = append(indexes, c["index"])
			}
			if got, want := indexes, tc.wantIndexes; !reflect.DeepEqual(got, want) {
				t.Errorf("session keeps calls %v, want %v", got, want)
			}
			if m := string(get("/metrics")); !strings.Contains(m, tc.wantDropped) {
				t.Errorf("metrics lack %q:\n%s", tc.wantDropped, m)
			}
		})
	}
}

// TestProxyWarnsWithoutControlToken: floe proxy, like floe serve, logs a WARN saying how
// to set the control token when its control listener has none (any local process, a
// sandbox sharing the host's network namespace too, could finish its sessions), and none
// when it has one.
func TestProxyWarnsWithoutControlToken(t *testing.T) {
	up := fakeEngine()
	defer up.Close()
	for _, tc := range []struct {
		name, token string
		warn        bool
	}{{"no token", "", true}, {"token", "c-tok", false}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("FLOE_CONTROL_TOKEN", tc.token)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			outR, outW := io.Pipe()
			var stderr bytes.Buffer // read once runProxy has returned
			done := make(chan error, 1)
			go func() { // owned here: ends once ctx is cancelled below
				done <- runProxy(ctx, []string{"-proxy-addr", "127.0.0.1:0", "-control-addr", "127.0.0.1:0", "-upstream", up.URL}, outW, &stderr)
				_ = outW.Close() // ends the reader's wait; runProxy's error is the result
			}()
			if _, err := bufio.NewReader(outR).ReadString('\n'); err != nil {
				t.Fatalf("floe proxy announced nothing: %v", err)
			}
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				t.Fatalf("floe proxy: %v\n%s", err, stderr.String())
			}
			warned := false
			for _, line := range strings.Split(stderr.String(), "\n") {
				warned = warned || (strings.Contains(line, "level=WARN") && strings.Contains(line, "-control-token-file FILE or $FLOE_CONTROL_TOKEN"))
			}
			if warned != tc.warn {
				t.Errorf("WARN naming how to set the control token: %v, want %v\n%s", warned, tc.warn, stderr.String())
			}
		})
	}
}
