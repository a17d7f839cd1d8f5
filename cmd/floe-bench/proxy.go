package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/floe-rl/floe/benchmarks/proxybench"
	"github.com/floe-rl/floe/internal/cli"
)

const proxyUsage = `usage: floe-bench proxy [flags]

Measures the proxy's added latency (each request sent straight to a zero-latency fake vLLM
and through the proxy in front of it, alternately) and its concurrent streaming
throughput, and prints the table.

`

// runProxy is the proxy overhead benchmark.
func runProxy(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := cli.NewFlagSet("floe-bench proxy", proxyUsage, stderr)
	size := fs.Int("request-bytes", 64<<10, "request body size")
	n := fs.Int("requests", 500, "sequential requests per mode and target")
	chunks := fs.Int("chunks", 64, "chunks in a streamed answer")
	conc := fs.Int("concurrency", 256, "concurrent streaming sessions")
	dur := fs.Duration("duration", 10*time.Second, "length of the concurrent phase")
	out := fs.String("out", "", "also write the report (Markdown) to this file")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	rep, err := proxybench.Run(ctx, proxybench.Options{RequestBytes: *size, Requests: *n, StreamChunks: *chunks,
		Concurrency: *conc, Duration: *dur, Progress: stderr})
	if err != nil {
		return err
	}
	table := rep.Table()
	fmt.Fprint(stdout, table)
	if *out != "" {
		cmd := fmt.Sprintf("floe-bench proxy -request-bytes %d -requests %d -chunks %d -concurrency %d -duration %s", *size, *n, *chunks, *conc, *dur)
		doc := fmt.Sprintf("# Proxy overhead benchmark\n\nCommand: `%s` (`make bench-proxy`)\n\nMachine: %s\n\nEach request goes straight to a zero-latency fake vLLM and through the proxy in front of it, alternately, in one run; \"added\" is the difference.\n\n%s",
			cmd, machine(), table)
		if err := os.WriteFile(*out, []byte(doc), 0o644); err != nil {
			return fmt.Errorf("report: %w", err)
		}
	}
	return nil
}
