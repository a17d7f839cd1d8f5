// Command floe is the training-side data path for RL of coding agents. See README.md.
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

const usage = `usage: floe <command> [flags]

commands:
  serve     run floe beside a trainer: proxy, durable trace store, step former and
            Flight service
  corpus-serve
            form steps from the synthetic corpus and serve them over Arrow Flight, for
            developing and testing a trainer against floe
  proxy     serve the provider APIs in front of an inference server and record every
            call (the proxy alone, without the training side)
  export    write the calls held in a data dir's store to Parquet (docs/archive.md)
  version   print the version

Run 'floe <command> -h' for a command's flags. The benchmarks are a binary of their own:
floe-bench (go run ./cmd/floe-bench -h).
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		_, _ = fmt.Fprint(stderr, usage) // nowhere left to report a failed write to the terminal
		return 2
	}
	var err error
	switch args[0] {
	case "serve":
		err = runServe(ctx, args[1:], stdout, stderr)
	case "corpus-serve":
		err = runCorpusServe(ctx, args[1:], stdout, stderr)
	case "proxy":
		err = runProxy(ctx, args[1:], stdout, stderr)
	case "export":
		err = runExport(ctx, args[1:], stdout, stderr)
	case "version", "--version":
		_, _ = fmt.Fprintln(stdout, "floe", cli.Version()) // nowhere left to report a failed write to the terminal
	case "help", "-h", "--help":
		_, _ = fmt.Fprint(stdout, usage) // nowhere left to report a failed write to the terminal
	default:
		_, _ = fmt.Fprintf(stderr, "floe: unknown command %q\n\n%s", args[0], usage) // nowhere left to report a failed write to the terminal
		return 2
	}
	if err != nil {
		_, _ = fmt.Fprintln(stderr, "floe:", err) // nowhere left to report a failed write to the terminal
		return 1
	}
	return 0
}
