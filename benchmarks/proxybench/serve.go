package proxybench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"

	"github.com/floe-rl/floe/sidecar"
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
	keys := map[string]string{}
	for i := 0; i < max(cfg.Keys, 1); i++ {
		keys[benchKey(i)] = benchKey(i)
	}
	// floe proxy's configuration: its default limits, its upstream pool, its metrics.
	fc := sidecar.DefaultConfig()
	fc.Upstream, fc.Model, fc.Retention.MaxStoredBytes = cfg.Upstream, "m", cfg.MaxStoredBytes
	fc.ProxyAddr, fc.ControlAddr = "127.0.0.1:0", "127.0.0.1:0"
	// The latency phase sends thousands of calls with one key, GiBs past a session's
	// -max-session-bytes: the quota is still counted and checked on every call, never met.
	fc.ProxyLimits.MaxSessionBytes = 1 << 62
	if cfg.CPUProfile != "" {
		f, err := os.Create(cfg.CPUProfile)
		if err != nil {
			return true, fmt.Errorf("cpu profile: %w", err)
		}
		defer func() { _ = f.Close() }() // StopCPUProfile, deferred after, has written the profile by then
		if err := pprof.StartCPUProfile(f); err != nil {
			return true, fmt.Errorf("cpu profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	// The parent stops it with an interrupt, so that the profile is written.
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	// floe proxy as its command builds it: calls kept in memory, no Flight service.
	f, err := sidecar.New(ctx, fc, slog.New(slog.DiscardHandler), sidecar.InMemory(keys), sidecar.WithoutFlight())
	if err != nil {
		return true, err
	}
	if _, err := fmt.Fprintf(stdout, "serving %s\n", f.Addrs().Proxy); err != nil {
		f.Close()
		return true, fmt.Errorf("announcing the address: %w", err)
	}
	return true, f.Run(ctx)
}
