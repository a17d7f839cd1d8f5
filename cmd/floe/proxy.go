package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/providers"
	"github.com/floe-rl/floe/sidecar"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/mem"
)

// runProxy serves the proxy alone, recording calls in memory and appending each, as one
// JSON line, to a file: for harness and SDK tests, and for trying floe's translation
// against an inference server without the training side.
func runProxy(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("floe proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: floe proxy [flags]\n\nServes the provider APIs (Anthropic, OpenAI Chat and Responses, Gemini) in front of an\ninference server and records every call, with the session and control API under /floe/v1\n(docs/control.md). Prints {\"proxy\": address} on stdout once serving.\n\n")
		fs.PrintDefaults()
	}
	addr := fs.String("proxy-addr", "127.0.0.1:8700", "listen address; port 0 picks one")
	upstream := fs.String("upstream", "http://127.0.0.1:8000", "inference server base URL")
	engine := fs.String("engine", "vllm", "inference engine: vllm or sglang")
	model := fs.String("model", "", "served model name sent upstream (default: the first the upstream lists)")
	open := fs.Bool("open-sessions", false, "let a call with an unknown key create its session")
	record := fs.String("record", "", "append every recorded call to this file as a JSON line (fsynced before the answer ends)")
	var sessions multiFlag
	fs.Var(&sessions, "session", "KEY=SESSION: accept API key KEY for SESSION (repeatable)")
	maxBody := fs.Int64("max-body-bytes", proxy.DefaultMaxBodyBytes, "largest request body accepted")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	eng, err := providers.NewEngine(*engine, *upstream, *model)
	if err != nil {
		return fmt.Errorf("-engine: %w", err)
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	store := &mem.Store{}
	for _, s := range sessions {
		k, v, ok := strings.Cut(s, "=")
		if !ok || k == "" || v == "" {
			return fmt.Errorf("-session %q: want KEY=SESSION", s)
		}
		store.AddSession(k, v)
	}
	var rec trace.CallRecorder = store
	if *record != "" {
		f, err := os.OpenFile(*record, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			return fmt.Errorf("record file: %w", err)
		}
		defer f.Close()
		rec = &fileRecorder{next: store, f: f}
	}
	gate := &proxy.Gate{}
	srv := &proxy.Server{
		Dialects: providers.Dialects(), Engine: eng,
		Sessions: store, Recorder: rec, Gate: gate, OpenSessions: *open, MaxBodyBytes: *maxBody, Log: log,
	}
	lis, err := net.Listen("tcp", *addr)
	if err != nil {
		return fmt.Errorf("proxy listen: %w", err)
	}
	control := &sidecar.ControlAPI{Store: store, Gate: gate, BaseURL: "http://" + lis.Addr().String()}
	hello, _ := json.Marshal(map[string]string{"proxy": "http://" + lis.Addr().String()})
	fmt.Fprintln(stdout, string(hello))
	log.Info("proxy serving", "addr", lis.Addr().String(), "upstream", *upstream)
	hs := &http.Server{Handler: control.Handler(srv), ReadHeaderTimeout: 30 * time.Second}
	return sidecar.ServeHTTP(ctx, hs, lis)
}

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

// fileRecorder records into next, then appends the call to f and syncs it, so a call is
// on disk before its answer ends.
type fileRecorder struct {
	next trace.CallRecorder
	mu   sync.Mutex
	f    *os.File
}

func (r *fileRecorder) Record(ctx context.Context, c *trace.Call) error {
	if err := r.next.Record(ctx, c); err != nil {
		return err
	}
	b, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("encoding call: %w", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, err := r.f.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("writing call: %w", err)
	}
	return r.f.Sync()
}
