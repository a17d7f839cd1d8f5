package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/sourcegraph/conc/pool"

	"github.com/floe-rl/floe/internal/cli"
	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/providers"
	"github.com/floe-rl/floe/sidecar"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/jsonl"
	"github.com/floe-rl/floe/trace/mem"
)

const proxyUsage = `usage: floe proxy [flags]

Serves the provider APIs (Anthropic, OpenAI Chat and Responses, Gemini) in front of an
inference server and records every call (-proxy-addr), with the session and control API
under /floe/v1 on its own listener (-control-addr, docs/control.md). Prints {"proxy":
url, "control": url} on stdout once serving. Nothing here trains: -open-sessions lets a
call with an unknown key open a session for recording.

`

// runProxy serves the proxy alone, recording calls in memory and appending each, as one
// JSON line, to a file: for harness and SDK tests, and for trying floe's translation
// against an inference server without the training side.
func runProxy(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := cli.NewFlagSet("floe proxy", proxyUsage, stderr)
	cfg := sidecar.DefaultConfig()
	cfg.RegisterFlags(fs, sidecar.ProxyFlags...)
	record := fs.String("record", "", "append every recorded call to this file as a JSON line (fsynced before the answer ends)")
	var sessions multiFlag
	fs.Var(&sessions, "session", "KEY=SESSION: accept API key KEY for SESSION (repeatable)")
	maxBody := fs.Int64("max-body-bytes", proxy.DefaultMaxBodyBytes, "largest request body accepted")
	maxStored := fs.Int64("max-stored-bytes", DefaultMaxStoredBytes, "bound on the recorded calls kept in memory: past it the oldest are dropped (counted at /metrics; -record keeps them all); 0 keeps every call")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	if *maxStored < 0 {
		return fmt.Errorf("-max-stored-bytes %d: want 0 (unbounded) or more", *maxStored)
	}
	eng, err := sidecar.NewUpstream(cfg, log, nil)
	if err != nil {
		return err
	}
	if err := sidecar.CheckServedModel(ctx, cfg, http.DefaultClient, log); err != nil {
		return err
	}
	store := &mem.Store{Retention: trace.Retention{MaxStoredBytes: *maxStored}}
	for _, s := range sessions {
		k, v, ok := strings.Cut(s, "=")
		if !ok || k == "" || v == "" {
			return fmt.Errorf("-session %q: want KEY=SESSION", s)
		}
		store.AddSession(k, v)
	}
	var rec trace.CallRecorder = store
	if *record != "" {
		file, err := jsonl.NewRecorder(*record)
		if err != nil {
			return fmt.Errorf("record file: %w", err)
		}
		defer func() { _ = file.Close() }() // each Record fsynced its line: a Close error loses nothing
		rec = teeRecorder{store, file}
	}
	gate := &proxy.Gate{DrainTimeout: cfg.DrainTimeout, MaxPause: cfg.MaxPause, OnPauseExpired: sidecar.PauseExpired(log)}
	srv := &proxy.Server{
		Dialects: providers.Dialects(), Engine: eng,
		Sessions: store, Recorder: rec, Gate: gate, OpenSessions: cfg.OpenSessions, MaxBodyBytes: *maxBody, Log: log,
		Limits: cfg.ProxyLimits, Sampling: cfg.Sampling, TrainTruncated: cfg.TrainTruncated, SessionHeader: cfg.UpstreamSessionHeader,
	}
	if err := cfg.LoadTokens(os.Getenv); err != nil {
		return err
	}
	if err := sidecar.CheckLoopback("-control-addr", cfg.ControlAddr, cfg.ControlToken, "-control-token-file or $"+sidecar.ControlTokenEnv); err != nil {
		return err
	}
	lis, err := net.Listen("tcp", cfg.ProxyAddr)
	if err != nil {
		return fmt.Errorf("proxy listen: %w", err)
	}
	cl, err := net.Listen("tcp", cfg.ControlAddr)
	if err != nil {
		_ = lis.Close() // the error above is the one to report
		return fmt.Errorf("control listen: %w", err)
	}
	// floe proxy's Node takes sessions and pauses; it forms no steps.
	node, err := sidecar.NewNode(sidecar.NodeConfig{Log: log, Gate: gate, Store: store})
	if err != nil {
		// The error above is the one to report.
		_ = lis.Close()
		_ = cl.Close()
		return err
	}
	control := &sidecar.ControlAPI{Node: node, BaseURL: "http://" + lis.Addr().String(), Token: cfg.ControlToken,
		Metrics: proxyMetrics(store)}
	hello, _ := json.Marshal(map[string]string{"proxy": "http://" + lis.Addr().String(), "control": "http://" + cl.Addr().String()})
	_, _ = fmt.Fprintln(stdout, string(hello)) // a launcher gone from the pipe ends floe by SIGPIPE (os/signal)
	log.Info("proxy serving", "addr", lis.Addr().String(), "control", cl.Addr().String(), "control_token", cfg.ControlToken != "",
		"upstreams", eng.Status())
	// As floe serve does: without a token the control API is open to every local process.
	sidecar.WarnOpenControl(cfg, log)
	hs, conns := sidecar.ProxyHTTPServer(cfg, srv, log) // connections bounded by the descriptor limit
	cs := &http.Server{Handler: control.Handler(), ReadHeaderTimeout: 30 * time.Second}
	p := pool.New().WithContext(ctx).WithCancelOnError()
	p.Go(eng.Run) // the replicas' health checks
	p.Go(func(ctx context.Context) error { return sidecar.ServeHTTP(ctx, hs, conns.Listener(lis)) })
	p.Go(func(ctx context.Context) error { return sidecar.ServeHTTP(ctx, cs, cl) })
	return p.Wait()
}

// DefaultMaxStoredBytes bounds floe proxy's calls kept in memory (256 MiB): under load
// with long agent histories it otherwise grew by gigabytes a minute.
const DefaultMaxStoredBytes = 256 << 20

// proxyMetrics is floe proxy's /metrics: the in-memory store's retention, through
// client_golang like floe serve's metrics (read from the store at each scrape, so
// nothing is counted twice).
func proxyMetrics(store *mem.Store) http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "floe_proxy_stored_bytes",
			Help: "Bytes of the recorded calls kept in memory (counted under -max-stored-bytes)."},
			func() float64 { stored, _ := store.Retained(); return float64(stored) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "floe_proxy_dropped_calls_total",
			Help: "Recorded calls dropped from memory by -max-stored-bytes."},
			func() float64 { _, dropped := store.Retained(); return float64(dropped.Calls) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "floe_proxy_dropped_bytes_total",
			Help: "Bytes of the recorded calls dropped from memory by -max-stored-bytes."},
			func() float64 { _, dropped := store.Retained(); return float64(dropped.Bytes) }),
	)
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
}

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

// teeRecorder records a call in memory (which knows the sessions, and refuses a call
// of an unknown or finished one) and then in the recorded-calls file, durably, before the
// answer ends. On a fresh file both give a call the same index; after a restart on an
// existing file the file's indexes go on while memory, which knows no session from
// before, starts anew.
type teeRecorder struct {
	mem  trace.CallRecorder
	file *jsonl.Recorder
}

func (t teeRecorder) Record(ctx context.Context, c *trace.Call) error {
	if err := t.mem.Record(ctx, c); err != nil {
		return err
	}
	return t.file.Record(ctx, c)
}
