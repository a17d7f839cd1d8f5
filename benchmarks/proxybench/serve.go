package proxybench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"
	"time"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/providers"
	"github.com/floe-rl/floe/sidecar"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/mem"
)

// ServeEnv names the environment variable that makes a program serve floe's proxy for
// the benchmark (ServeFromEnv) instead of doing what it usually does; its value is a
// ServeConfig in JSON.
const ServeEnv = "FLOE_PROXYBENCH_SERVE"

// ServeConfig is what the child proxy serves.
type ServeConfig struct {
	Upstream       string `json:"upstream"`
	Keys           int    `json:"keys"`             // sessions bench-0 … bench-(Keys-1)
	MaxStoredBytes int64  `json:"max_stored_bytes"` // the in-memory store's retention limit; 0: none
	CPUProfile     string `json:"cpu_profile"`      // when set, the proxy's CPU profile is written there at its end
}

// ServeFromEnv serves floe's proxy as floe proxy does (every dialect, the vLLM engine,
// calls recorded in memory under a retention limit, floe proxy's default limits, its
// connections bounded by the descriptor limit), in front of the configured
// upstream, when ServeEnv is set: it prints "serving URL" on stdout and serves until ctx
// ends. It reports whether it served (false: ServeEnv is not set).
func ServeFromEnv(ctx context.Context, stdout io.Writer) (bool, error) {
	raw := os.Getenv(ServeEnv)
	if raw == "" {
		return false, nil
	}
	var cfg ServeConfig
	if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
		return true, fmt.Errorf("$%s: %w", ServeEnv, err)
	}
	store := &mem.Store{Retention: trace.Retention{MaxStoredBytes: cfg.MaxStoredBytes}}
	for i := 0; i < max(cfg.Keys, 1); i++ {
		store.AddSession(benchKey(i), benchKey(i))
	}
	eng, err := providers.NewEngine("vllm", cfg.Upstream, "m")
	if err != nil {
		return true, err
	}
	log := slog.New(slog.DiscardHandler)
	def := sidecar.DefaultConfig()
	// The latency phase sends thousands of calls with one key, GiBs past a session's
	// -max-session-bytes: the quota is still counted and checked on every call, never met.
	def.ProxyLimits.MaxSessionBytes = 1 << 62
	srv := &proxy.Server{Dialects: providers.Dialects(), Engine: eng, Sessions: store, Recorder: store,
		Gate: &proxy.Gate{}, Log: log, Limits: def.ProxyLimits}
	if cfg.CPUProfile != "" {
		f, err := os.Create(cfg.CPUProfile)
		if err != nil {
			return true, fmt.Errorf("cpu profile: %w", err)
		}
		defer func() { _ = f.Close() }() // StopCPUProfile, deferred after it and so run before, has written the profile
		if err := pprof.StartCPUProfile(f); err != nil {
			return true, fmt.Errorf("cpu profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	// The parent stops it with an interrupt, so that the profile is written.
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return true, fmt.Errorf("proxy listen: %w", err)
	}
	// floe proxy's http.Server: its connections counted and capped (proxy.ConnLimiter).
	hs, conns := sidecar.ProxyHTTPServer(def, srv, log)
	// The parent learns the address from this line.
	if _, err := fmt.Fprintf(stdout, "serving http://%s\n", lis.Addr()); err != nil {
		_ = lis.Close() // the write error is the one to report
		return true, fmt.Errorf("announcing the address: %w", err)
	}
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(conns.Listener(lis)) }() // owned here: Shutdown below ends it
	select {
	case err := <-errc:
		return true, err
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = hs.Shutdown(sctx)
		if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
			return true, err
		}
		return true, nil
	}
}
