package sidecar

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// recordsHandler is a slog.Handler that keeps every record and tells ch of each.
type recordsHandler struct {
	mu      *sync.Mutex
	records *[]slog.Record
	ch      chan slog.Record
}

func newRecords() recordsHandler {
	return recordsHandler{mu: &sync.Mutex{}, records: &[]slog.Record{}, ch: make(chan slog.Record, 1024)}
}

func (h recordsHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h recordsHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	*h.records = append(*h.records, r.Clone())
	h.mu.Unlock()
	select {
	case h.ch <- r.Clone():
	default:
	}
	return nil
}
func (h recordsHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h recordsHandler) WithGroup(string) slog.Handler      { return h }

func (h recordsHandler) all() []slog.Record {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]slog.Record(nil), *h.records...)
}

// serveLogged runs Serve in-process with its log captured until the test ends.
func serveLogged(t *testing.T, cfg Config) (Addrs, recordsHandler, func()) {
	t.Helper()
	h := newRecords()
	ctx, cancel := context.WithCancel(context.Background())
	addrs := make(chan Addrs, 1)
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, cfg, slog.New(h), func(a Addrs) { addrs <- a }) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Serve: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	select {
	case a := <-addrs:
		return a, h, stop
	case err := <-done:
		cancel()
		t.Fatalf("Serve: %v", err)
		return Addrs{}, h, stop
	}
}

// TestServeWarnsWithoutTokens: a control or Flight listener without its token is open to
// every local process (a sandbox sharing the host's network namespace too): floe serve
// logs a WARN for each, saying how to set the token, and none for a listener with one.
func TestServeWarnsWithoutTokens(t *testing.T) {
	tests := []struct {
		name                 string
		control, flight      string
		warnControl, warnFlt bool
	}{
		{"no tokens", "", "", true, true},
		{"control token only", "c-tok", "", false, true},
		{"both tokens", "c-tok", "f-tok", false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := testConfig(t)
			cfg.ControlToken, cfg.FlightToken = tt.control, tt.flight
			_, h, stop := serveLogged(t, cfg)
			stop() // every line of the start is logged before Serve returns
			var control, flight bool
			for _, r := range h.all() {
				if r.Level != slog.LevelWarn {
					continue
				}
				control = control || strings.Contains(r.Message, "-control-token-file FILE or $"+ControlTokenEnv)
				flight = flight || strings.Contains(r.Message, "-flight-token-file FILE or $"+FlightTokenEnv)
			}
			if control != tt.warnControl || flight != tt.warnFlt {
				t.Errorf("WARN naming how to set the control token: %v, the Flight token: %v; want %v, %v",
					control, flight, tt.warnControl, tt.warnFlt)
			}
		})
	}
}

// TestServeMaxPause: a pause the trainer never resumes is logged as an ERROR after
// -max-pause, the status says pause_expired, floe_pause_expired is 1, and a harness's
// call is refused at once with its provider's overloaded status (429 for OpenAI Chat)
// instead of hanging; a resume serves calls again.
func TestServeMaxPause(t *testing.T) {
	cfg := testConfig(t)
	cfg.MaxPause = 200 * time.Millisecond
	a, h, _ := serveLogged(t, cfg)
	r := &running{t: t, proxy: a.Proxy, control: a.Control}
	key := r.post("/floe/v1/sessions", "", `{"task_id":"t","group_id":"g","group_size":2}`, 200)["api_key"].(string)
	r.post("/floe/v1/pause", "", `{}`, 200)
	guard := time.After(20 * time.Second) // a hang guard
	for logged := false; !logged; {
		select {
		case rec := <-h.ch:
			logged = rec.Level == slog.LevelError && strings.Contains(rec.Message, "-max-pause")
		case <-guard:
			t.Fatal("no ERROR naming -max-pause was logged")
		}
	}
	resp, err := http.Get(a.Control + "/floe/v1/status")
	if err != nil {
		t.Fatal(err)
	}
	var st Status
	_ = json.NewDecoder(resp.Body).Decode(&st)
	resp.Body.Close()
	if !st.Paused || !st.PauseExpired {
		t.Errorf("status paused %v pause_expired %v; want both", st.Paused, st.PauseExpired)
	}
	if v := metric(r.metrics(), "floe_pause_expired"); v != 1 {
		t.Errorf("floe_pause_expired %v; want 1", v)
	}
	call := func() (int, string) {
		req, _ := http.NewRequest(http.MethodPost, a.Proxy+"/v1/chat/completions",
			strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set("Authorization", "Bearer "+key)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second) // a hang guard
		defer cancel()
		resp, err := http.DefaultClient.Do(req.WithContext(ctx))
		if err != nil {
			t.Fatalf("a call during the expired pause: %v", err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := call(); code != 429 {
		t.Errorf("a call after -max-pause: %d %s; want 429", code, body)
	}
	r.post("/floe/v1/resume", "", `{"policy_version": 1}`, 200)
	if code, body := call(); code != 200 {
		t.Errorf("a call after the resume: %d %s; want 200", code, body)
	}
	if v := metric(r.metrics(), "floe_pause_expired"); v != 0 {
		t.Errorf("floe_pause_expired %v after the resume; want 0", v)
	}
}

// TestServeMinFreeDisk: with the data dir's disk below -min-free-disk, floe serve
// refuses a call with its provider's overloaded status before any upstream call.
func TestServeMinFreeDisk(t *testing.T) {
	cfg := testConfig(t)
	cfg.ProxyLimits.MinFreeDisk = 1 << 62 // more than any disk has
	a, _, _ := serveLogged(t, cfg)
	r := &running{t: t, proxy: a.Proxy, control: a.Control}
	key := r.post("/floe/v1/sessions", "", `{"task_id":"t","group_id":"g","group_size":2}`, 200)["api_key"].(string)
	req, _ := http.NewRequest(http.MethodPost, a.Proxy+"/v1/messages",
		strings.NewReader(`{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("x-api-key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 529 || !strings.Contains(string(b), "short of disk space") || resp.Header.Get("Retry-After") == "" {
		t.Errorf("a call below -min-free-disk: %d %s; want 529 with Retry-After", resp.StatusCode, b)
	}
}

// TestProxyConnCap: the proxy's connection cap leaves floe's own descriptors and one
// upstream connection per call in flight (at most half of the rest).
func TestProxyConnCap(t *testing.T) {
	tests := []struct {
		nofile      uint64
		maxInflight int
		want        int
	}{
		{0, 1024, 0},                      // unknown: no cap
		{256, 1024, 64},                   // (256-128)/2
		{20000, 1024, 20000 - 128 - 1024}, // upstream room for every call in flight
		{1 << 20, 1024, 1<<20 - 128 - 1024},
		{100, 1024, 16},       // never below 16
		{^uint64(0), 1024, 0}, // RLIM_INFINITY: no cap (it wrapped negative, to 16)
	}
	for _, tt := range tests {
		if got := ProxyConnCap(tt.nofile, tt.maxInflight); got != tt.want {
			t.Errorf("ProxyConnCap(%d, %d) = %d; want %d", tt.nofile, tt.maxInflight, got, tt.want)
		}
	}
}
