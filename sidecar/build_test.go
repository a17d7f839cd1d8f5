package sidecar

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/internal/corpus"
	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace/bolt"
	"github.com/floe-rl/floe/trace/mem"
)

// freeAddr is a loopback address nobody listens on now: a listener a Floe builds there
// would take it.
func freeAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	testutil.Close(t, lis)
	return addr
}

// bound reports whether something listens on addr.
func bound(t *testing.T, addr string) bool {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return true
	}
	testutil.Close(t, lis)
	return false
}

// corpusSteps forms the small corpus's steps, two groups each, as floe corpus-serve does.
func corpusSteps(t *testing.T, cfg batcher.Config) []*batcher.Step {
	t.Helper()
	cc, err := corpus.Preset("small", 0)
	if err != nil {
		t.Fatal(err)
	}
	groups, err := corpus.Generate(cc, 1)
	if err != nil {
		t.Fatal(err)
	}
	var steps []*batcher.Step
	for i := 0; i < len(groups); i += 2 {
		st, err := batcher.FormStep(int64(len(steps)), groups[i:min(i+2, len(groups))], cfg)
		if err != nil {
			t.Fatal(err)
		}
		steps = append(steps, st)
	}
	return steps
}

// TestNewBuildsWhatItsOptionsSay: floe serve, floe proxy and floe corpus-serve are three
// option sets of New, and each builds its parts and no others: the bbolt file only for
// floe serve, a Flight listener for serve and corpus-serve only, the proxy and control
// listeners for serve and proxy only; each one runs and stops cleanly.
func TestNewBuildsWhatItsOptionsSay(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts func(t *testing.T, cfg Config) []Option
		// which listeners and which store the option set has
		proxy, control, flight, durable bool
		// check looks at the running Floe's own parts.
		check func(t *testing.T, f *Floe, cfg Config)
	}{
		{
			name: "serve", proxy: true, control: true, flight: true, durable: true,
			opts: func(*testing.T, Config) []Option { return nil },
			check: func(t *testing.T, f *Floe, cfg Config) {
				n := f.Node()
				if _, ok := n.store.(*bolt.Store); !ok || n.ready == nil || n.former == nil || n.archiver == nil || n.steps == nil {
					t.Errorf("floe serve's Node: store %T, ready %v, former %v, archiver %v, steps %v; want every part",
						n.store, n.ready != nil, n.former != nil, n.archiver != nil, n.steps != nil)
				}
				if m := scrape(t, f); !strings.Contains(m, "floe_steps_committed_total 0") || strings.Contains(m, "floe_proxy_stored_bytes") {
					t.Errorf("floe serve's /metrics: want the step metrics and no in-memory store's:\n%s", m)
				}
			},
		},
		{
			name: "proxy", proxy: true, control: true,
			opts: func(_ *testing.T, cfg Config) []Option {
				return []Option{InMemory(map[string]string{"k": "s"}), WithoutFlight(), RecordFile(recordPath(cfg))}
			},
			check: func(t *testing.T, f *Floe, cfg Config) {
				n := f.Node()
				if _, ok := n.store.(*mem.Store); !ok || n.ready != nil || n.former != nil || n.archiver != nil || n.steps != nil {
					t.Errorf("floe proxy's Node: store %T, ready %v, former %v, archiver %v, steps %v; want a memory store alone",
						n.store, n.ready != nil, n.former != nil, n.archiver != nil, n.steps != nil)
				}
				// The key given to InMemory is taken: the call reaches the upstream.
				req, _ := http.NewRequest(http.MethodPost, f.Addrs().Proxy+"/v1/chat/completions",
					strings.NewReader(`{"model":"x","messages":[{"role":"user","content":"hi"}]}`))
				req.Header.Set("Authorization", "Bearer k")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("a call with InMemory's key: %d %s", resp.StatusCode, body)
				}
				// RecordFile: the call is in the file once its answer has ended.
				if b, err := os.ReadFile(recordPath(cfg)); err != nil || strings.Count(string(b), "\n") != 1 {
					t.Errorf("the record file after one call: %q, %v; want one JSON line", b, err)
				}
				// One registry, client_golang's: the store's retention and the proxy's
				// counters, and none of the step former's.
				m := scrape(t, f)
				for _, want := range []string{"floe_proxy_stored_bytes ", "floe_proxy_dropped_calls_total 0", `floe_calls_recorded_total{api="openai_chat",trainable="true"} 1`, "floe_proxy_connections "} {
					if !strings.Contains(m, want) {
						t.Errorf("floe proxy's /metrics lacks %q:\n%s", want, m)
					}
				}
				if strings.Contains(m, "floe_steps_committed_total") || strings.Contains(m, "floe_token_budget_rows") {
					t.Errorf("floe proxy's /metrics shows step metrics, and it forms no steps:\n%s", m)
				}
			},
		},
		{
			name: "corpus-serve", flight: true,
			opts: func(t *testing.T, cfg Config) []Option { return []Option{FromSteps(corpusSteps(t, cfg.Batcher))} },
			check: func(t *testing.T, f *Floe, cfg Config) {
				n := f.Node()
				if n.store != nil || n.ready == nil || n.former != nil || n.archiver != nil {
					t.Errorf("floe corpus-serve's Node: store %T, ready %v, former %v, archiver %v; want a READY buffer alone",
						n.store, n.ready != nil, n.former != nil, n.archiver != nil)
				}
				// The corpus's first step is served, through the Node's Flight door.
				st, err := n.Flight().Next(context.Background())
				if err != nil || st.Number() != 0 {
					t.Fatalf("the first step served: %v, %v; want step 0", st, err)
				}
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t)
			cfg.ProxyAddr, cfg.ControlAddr, cfg.FlightAddr = freeAddr(t), freeAddr(t), freeAddr(t)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			f, err := New(ctx, cfg, quietLog(), tc.opts(t, cfg)...)
			if err != nil {
				t.Fatal(err)
			}
			a := f.Addrs()
			for _, l := range []struct {
				name, addr, announced string
				want                  bool
			}{
				{"proxy", cfg.ProxyAddr, a.Proxy, tc.proxy},
				{"control", cfg.ControlAddr, a.Control, tc.control},
				{"flight", cfg.FlightAddr, a.Flight, tc.flight},
			} {
				if got := bound(t, l.addr); got != l.want || (l.announced != "") != l.want {
					t.Errorf("%s listener: bound %v, announced %q; want %v", l.name, got, l.announced, l.want)
				}
			}
			_, err = os.Stat(filepath.Join(cfg.DataDir, bolt.FileName))
			if got := err == nil; got != tc.durable {
				t.Errorf("bbolt file in the data dir: %v (%v), want %v", got, err, tc.durable)
			}
			done := make(chan error, 1)
			go func() { done <- f.Run(ctx) }() // owned here: ends with cancel below
			tc.check(t, f, cfg)
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
			for _, addr := range []string{cfg.ProxyAddr, cfg.ControlAddr, cfg.FlightAddr} {
				if bound(t, addr) {
					t.Errorf("%s still bound once Run returned", addr)
				}
			}
		})
	}
}

// recordPath is where the proxy case's RecordFile writes: beside the data dir, which
// must stay empty.
func recordPath(cfg Config) string { return cfg.DataDir + ".calls.jsonl" }

// scrape reads the control listener's /metrics.
func scrape(t *testing.T, f *Floe) string {
	t.Helper()
	resp, err := http.Get(f.Addrs().Control + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %d %v", resp.StatusCode, err)
	}
	return string(b)
}

// TestNewRefusesOptionsThatContradict: an option set whose parts cannot work together is
// refused before anything is bound or opened.
func TestNewRefusesOptionsThatContradict(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []Option
		want string
	}{
		{"memory with Flight", []Option{InMemory(nil)}, "forms no steps"},
		{"memory and steps", []Option{InMemory(nil), WithoutFlight(), FromSteps(nil)}, "take no calls"},
		{"steps without Flight", []Option{FromSteps(nil), WithoutFlight()}, "no way out"},
		{"record file with bbolt", []Option{RecordFile("x.jsonl")}, "keeps every call"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t)
			_, err := New(context.Background(), cfg, quietLog(), tc.opts...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New: %v, want an error saying %q", err, tc.want)
			}
			if entries, _ := os.ReadDir(cfg.DataDir); len(entries) != 0 {
				t.Errorf("a refused New left %d files in the data dir", len(entries))
			}
		})
	}
}
