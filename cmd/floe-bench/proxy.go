package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/floe-rl/floe/benchmarks/proxybench"
	"github.com/floe-rl/floe/internal/cli"
	"github.com/floe-rl/floe/trace"
)

const proxyUsage = `usage: floe-bench proxy [flags]

Measures the proxy's cost in every dialect (OpenAI chat and Responses, Anthropic
Messages, Gemini), at each request size, streaming and not: added latency (each request
sent straight to a zero-latency fake vLLM and through the proxy in front of it,
alternately, the proxy with Go's default GOMAXPROCS), concurrent streaming throughput
with the proxy on one core (GOMAXPROCS=1), and its CPU
time per request. With -litellm, LiteLLM's proxy is measured the same way beside it; with
-memory, the proxy's RSS under load, its stored calls unbounded and then bounded.

`

// runProxy is the proxy cost benchmark. The proxy runs as a child: this program again,
// serving when proxybench.ServeEnv is set.
func runProxy(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if served, err := proxybench.ServeFromEnv(ctx, stdout); served {
		return err
	}
	fs := cli.NewFlagSet("floe-bench proxy", proxyUsage, stderr)
	dialects := fs.String("dialects", "", "dialects to measure, comma-separated (openai_chat, openai_responses, anthropic, gemini); empty: all")
	sizes := fs.String("request-bytes", "65536,524288", "request body sizes, comma-separated")
	n := fs.Int("requests", 300, "sequential requests per dialect, size, mode and target")
	chunks := fs.Int("chunks", 64, "chunks in a streamed answer")
	conc := fs.Int("concurrency", 64, "concurrent streaming sessions")
	dur := fs.Duration("duration", 5*time.Second, "length of each throughput phase")
	litellm := fs.String("litellm", "", "LiteLLM's litellm command, to measure it beside floe (make bench-proxy-litellm)")
	llN := fs.Int("litellm-requests", 40, "sequential requests per mode and target for LiteLLM")
	mem := fs.Duration("memory", 0, "also measure the proxy's RSS under load for this long, before and after the retention limit")
	maxStored := fs.Int64("max-stored-bytes", trace.DefaultMaxStoredBytes, "the in-memory store's retention limit (floe proxy's default)")
	profile := fs.String("cpuprofile", "", "write the proxy's CPU profile of the throughput phases (on one core) to this file")
	latProcs := fs.Int("latency-procs", 0, "GOMAXPROCS of floe's proxy in the latency phase; 0: Go's default (every core), as floe proxy runs")
	before := fs.String("before", "", "a floe-bench binary built at an earlier commit: its proxy is measured in the same run beside this one's, sample for sample (-before-name names its rows)")
	beforeName := fs.String("before-name", "before", "the name of -before's rows (e.g. its commit)")
	out := fs.String("out", "", "also write the report (Markdown) to this file")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	var sz []int
	for _, s := range strings.Split(*sizes, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || v <= 0 {
			return fmt.Errorf("-request-bytes %q: want positive sizes", *sizes)
		}
		sz = append(sz, v)
	}
	var ds []proxybench.Dialect
	for _, d := range strings.Split(*dialects, ",") {
		if d = strings.TrimSpace(d); d == "" {
			continue
		}
		if !slices.Contains(proxybench.AllDialects, proxybench.Dialect(d)) {
			return fmt.Errorf("-dialects: unknown dialect %q", d)
		}
		ds = append(ds, proxybench.Dialect(d))
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("finding floe-bench to run the proxy: %w", err)
	}
	var beforeCmd []string
	if *before != "" {
		beforeCmd = []string{*before, "proxy"}
	}
	load, _ := os.ReadFile("/proc/loadavg")
	rep, err := proxybench.Run(ctx, proxybench.Options{Dialects: ds, Sizes: sz, Requests: *n, StreamChunks: *chunks,
		Concurrency: *conc, Duration: *dur, ProxyCommand: []string{exe, "proxy"}, BeforeCommand: beforeCmd, BeforeName: *beforeName,
		LiteLLM: *litellm, LiteLLMRequests: *llN, Memory: *mem, MaxStoredBytes: *maxStored, CPUProfile: *profile,
		LatencyProcs: *latProcs, Progress: stderr})
	if err != nil {
		return err
	}
	loadEnd, _ := os.ReadFile("/proc/loadavg")
	table := rep.Table()
	_, _ = fmt.Fprint(stdout, table) // the terminal's copy: a write error there must not fail the run
	if *out != "" {
		cmd := fmt.Sprintf("floe-bench proxy -request-bytes %s -requests %d -chunks %d -concurrency %d -duration %s -litellm-requests %d -memory %s -max-stored-bytes %d",
			*sizes, *n, *chunks, *conc, *dur, *llN, *mem, *maxStored)
		if *litellm != "" {
			cmd += " -litellm .venv-litellm/bin/litellm"
		}
		if *latProcs > 0 {
			cmd += fmt.Sprintf(" -latency-procs %d", *latProcs)
		}
		if *dialects != "" {
			cmd += " -dialects " + *dialects
		}
		title, how := "Proxy cost benchmark", "(`make bench-proxy`)"
		if *before != "" {
			cmd += fmt.Sprintf(" -before floe-bench-%s -before-name %s", *beforeName, *beforeName)
			title = "Proxy cost benchmark: " + *beforeName + " and this build side by side"
			how = fmt.Sprintf("(floe-bench-%s: `go build ./cmd/floe-bench` in a worktree at %s; load average at the end: %s)", *beforeName, *beforeName, loadAverage(loadEnd))
		}
		doc := fmt.Sprintf("# %s\n\nCommand: `%s` %s\n\nMachine: %s. floe's proxy runs as a child process: with %s for the latency phase, and with GOMAXPROCS=1 for the throughput phase and its CPU per request; the fake upstream and the clients run in the benchmark's process. "+
			"The proxy, the fake upstream and the clients share the machine's cores (load average (1, 5, 15 min) at the start: "+loadAverage(load)+"): compare rows of one run, and read ratios rather than absolute figures.\n\n"+
			"Each request goes straight to a zero-latency fake vLLM and through the proxy in front of it, alternately, in one run; \"added\" is the difference. "+
			"CPU per request is the proxy process's user+system time (/proc) over a throughput phase, divided by the requests it completed. "+
			"LiteLLM runs as its own proxy (`litellm --num_workers 1`, the fake upstream as its `hosted_vllm` provider, one Python process); where it cannot serve a dialect, the row says what it answered. "+
			"The profiles behind the optimisations: [PROFILE.md](PROFILE.md).\n\n%s",
			title, cmd, how, machine(), latencyProcs(*latProcs), table)
		if err := os.WriteFile(*out, []byte(doc), 0o644); err != nil {
			return fmt.Errorf("report: %w", err)
		}
	}
	return nil
}

// latencyProcs says how the latency phase ran the proxy.
func latencyProcs(n int) string {
	if n > 0 {
		return fmt.Sprintf("GOMAXPROCS=%d", n)
	}
	return "Go's default GOMAXPROCS (every core, as `floe proxy` runs)"
}
