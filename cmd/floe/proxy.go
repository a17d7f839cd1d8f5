package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/floe-rl/floe/internal/cli"
	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/sidecar"
	"github.com/floe-rl/floe/trace"
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
	fs.Int64Var(&cfg.MaxBodyBytes, "max-body-bytes", proxy.DefaultMaxBodyBytes, "largest request body accepted")
	fs.Int64Var(&cfg.Retention.MaxStoredBytes, "max-stored-bytes", trace.DefaultMaxStoredBytes, "bound on the recorded calls kept in memory: past it the oldest are dropped (counted at /metrics; -record keeps them all); 0 keeps every call")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	if cfg.Retention.MaxStoredBytes < 0 {
		return fmt.Errorf("-max-stored-bytes %d: want 0 (unbounded) or more", cfg.Retention.MaxStoredBytes)
	}
	keys := map[string]string{}
	for _, s := range sessions {
		k, v, ok := strings.Cut(s, "=")
		if !ok || k == "" || v == "" {
			return fmt.Errorf("-session %q: want KEY=SESSION", s)
		}
		keys[k] = v
	}
	if err := cfg.LoadTokens(os.Getenv); err != nil {
		return err
	}
	// floe proxy is floe serve with calls kept in memory and no Flight service: its Node
	// takes sessions and pauses, and forms no steps.
	opts := []sidecar.Option{sidecar.InMemory(keys), sidecar.WithoutFlight()}
	if *record != "" {
		opts = append(opts, sidecar.RecordFile(*record))
	}
	return sidecar.Serve(ctx, cfg, log, sidecar.AnnounceJSON(stdout), opts...)
}

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }
