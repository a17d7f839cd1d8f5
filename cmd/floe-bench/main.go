// Command floe-bench runs floe's benchmarks and writes their reports: packing on the
// synthetic corpus, the proxy's overhead, and the end-to-end utilization benchmark with
// its plots. It is a binary of its own so that the product, floe, links none of it (the
// plotting libraries, the subprocess orchestration). See benchmarks/ and docs/bench-e2e.md.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/floe-rl/floe/internal/cli"
)

const usage = `usage: floe-bench [command] [flags]

commands:
  (none)    reconstruct, pack and encode a synthetic agent-trace corpus with every
            strategy and print the comparison table (floe-bench -h: its flags)
  e2e       replay agent sessions through floe against the reference inference server
            and train on them once per strategy, recording a GPU/trainer timeline
  report    write REPORT.md and plots from the runs floe-bench e2e recorded
  proxy     measure the proxy's added latency and concurrent throughput against a
            zero-latency fake inference server
  capacity  drive one floe serve with R concurrent streaming agent sessions and T
            trainer-rank processes on loopback: calls recorded/s, added latency,
            memory per session, Flight GB/s, step-forming cost (make bench-capacity)
  replay    replay real agent rollouts (NeMo Gym JSONL) through floe's proxy and
            measure every strategy on what it recorded: rows, passes, cut floor,
            pack time, loss-term equality (make bench-replay)
  trl       floe's half of the comparison with TRL's tree packing: write a corpus's
            calls for benchmarks/trl_bench.py and pack them with floe (make bench-trl)
  version   print the version

Run 'floe-bench <command> -h' for a command's flags.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cmd := ""
	if len(args) > 0 {
		cmd = args[0]
	}
	var err error
	switch cmd {
	case "e2e":
		err = runE2E(ctx, args[1:], stdout, stderr)
	case "report":
		err = runReport(ctx, args[1:], stdout, stderr)
	case "proxy":
		err = runProxy(ctx, args[1:], stdout, stderr)
	case "capacity":
		err = runCapacity(ctx, args[1:], stdout, stderr)
	case "capacity-rank": // a trainer rank the capacity benchmark starts
		err = runCapacityRank(ctx, args[1:], stdout, stderr)
	case "trl":
		err = runTRL(ctx, args[1:], stdout, stderr)
	case "replay":
		err = runReplay(ctx, args[1:], stdout, stderr)
	case "version", "--version":
		_, _ = fmt.Fprintln(stdout, "floe-bench", cli.Version()) // nowhere left to report a failed write to the terminal
	case "help":
		_, _ = fmt.Fprint(stdout, usage) // nowhere left to report a failed write to the terminal
	default:
		// No command, or flags only: the packing benchmark (what floe bench was).
		if cmd != "" && cmd[0] != '-' {
			_, _ = fmt.Fprintf(stderr, "floe-bench: unknown command %q\n\n%s", cmd, usage) // nowhere left to report a failed write to the terminal
			return 2
		}
		err = runPack(ctx, args, stdout, stderr)
	}
	if err != nil {
		_, _ = fmt.Fprintln(stderr, "floe-bench:", err) // nowhere left to report a failed write to the terminal
		return 1
	}
	return 0
}
