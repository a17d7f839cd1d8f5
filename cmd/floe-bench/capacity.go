package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/floe-rl/floe/benchmarks/capacity"
	"github.com/floe-rl/floe/internal/cli"
)

const capacityUsage = `usage: floe-bench capacity [flags]

Measures how far one floe serve goes: for each R in -sessions and T in -ranks it starts
floe serve (the real binary, a child process, default store) against a zero-latency fake
vLLM in this process, runs R concurrent streaming agent sessions (multi-turn, growing
history, groups finished with rewards) through it for -load, while T trainer-rank
processes (floe-bench capacity-rank) fetch their micro-batches of every step over Flight
and commit it. It reports durable calls recorded per second, the latency floe adds (the
open sessions then send each call straight to the fake and through floe, paced), floe's memory per open
session, Flight GB/s to T ranks, what the data dir keeps (the bbolt file, bounded since
floe archives each committed step to Parquet, and the archive's bytes per call), and,
in-process, the cost of forming a step against its size. A point fails unless, after its
drain, every committed step's calls are in the archive and none in the store. Writes
REPORT.md, results.json and PNG plots into -out.

`

// runCapacity is the capacity benchmark (make bench-capacity).
func runCapacity(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := cli.NewFlagSet("floe-bench capacity", capacityUsage, stderr)
	sessions := fs.String("sessions", "64,256,1024,4096", "R: concurrent agent sessions, comma-separated")
	ranks := fs.String("ranks", "1,8,64", "T: trainer-rank processes (floe's -dp-size), comma-separated")
	groupSize := fs.Int("group-size", 8, "sessions per GRPO group")
	turns := fs.Int("turns", 8, "calls per session")
	systemBytes := fs.Int("system-bytes", 4096, "system prompt bytes (one token per byte), shared by every session")
	taskBytes := fs.Int("task-bytes", 512, "task bytes, shared by a group")
	toolBytes := fs.Int("tool-bytes", 1024, "bytes of each tool result")
	answerTokens := fs.Int("answer-tokens", 64, "tokens the fake samples per call, streamed one a chunk")
	groupsPerStep := fs.Int("groups-per-step", 8, "floe serve's -groups-per-step")
	budget := fs.Int("token-budget", 0, "floe serve's -token-budget (0: the longest call rounded up, at least 16384)")
	loadFor := fs.Duration("load", 5*time.Second, "length of each point's saturating load through floe")
	minCalls := fs.Float64("min-calls-per-session", 2, "the load goes on past -load until the agents made this many calls per session on average (so that sessions have a history at large R)...")
	loadMax := fs.Duration("load-max", 30*time.Second, "... but no longer than this")
	probeFor := fs.Duration("probe", 3*time.Second, "length of each point's latency probe (each call straight to the fake, then through floe)")
	probeLoad := fs.Float64("probe-load", 0.5, "the probe's rate through floe, as a fraction of the rate the point's load sustained")
	drainFor := fs.Duration("drain", 20*time.Second, "most time each point's sessions and steps get to drain")
	formGroups := fs.String("form-groups", "1,2,4,8,16,32", "step sizes (groups) the in-process forming cost is measured at; empty: none")
	formDP := fs.Int("form-dp", 8, "ranks the in-process steps are balanced over")
	seed := fs.Uint64("seed", 1, "seed of the agents' texts")
	floeBin := fs.String("floe", "", "floe binary (default: go build ./cmd/floe into the work dir)")
	work := fs.String("work", "", "work dir for data dirs and floe's logs (default: a temporary one, removed)")
	out := fs.String("out", "benchmarks/results/capacity", "where REPORT.md, results.json and the plots go (empty: print only)")
	reportOnly := fs.Bool("report-only", false, "measure nothing: rewrite REPORT.md and the plots in -out from its results.json")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	if *reportOnly {
		raw, err := os.ReadFile(filepath.Join(*out, "results.json"))
		if err != nil {
			return err
		}
		var rep capacity.Report
		if err := json.Unmarshal(raw, &rep); err != nil {
			return fmt.Errorf("%s: %w", filepath.Join(*out, "results.json"), err)
		}
		if err := rep.WritePlots(*out); err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(*out, "REPORT.md"), []byte(rep.Markdown()), 0o644)
	}
	rs, err := intList(*sessions)
	if err != nil {
		return fmt.Errorf("-sessions: %w", err)
	}
	ts, err := intList(*ranks)
	if err != nil {
		return fmt.Errorf("-ranks: %w", err)
	}
	fg, err := intList(*formGroups)
	if err != nil {
		return fmt.Errorf("-form-groups: %w", err)
	}
	if *work == "" {
		dir, err := os.MkdirTemp("", "floe-capacity-")
		if err != nil {
			return err
		}
		defer func() { _ = os.RemoveAll(dir) }() // a temporary directory: best effort
		*work = dir
	}
	if *floeBin == "" {
		*floeBin = filepath.Join(*work, "floe")
		_, _ = fmt.Fprintln(stderr, "building floe:", *floeBin) // progress lines: a closed stderr must not stop a run
		build := exec.CommandContext(ctx, "go", "build", "-o", *floeBin, "./cmd/floe")
		build.Stdout, build.Stderr = stderr, stderr
		if err := build.Run(); err != nil {
			return fmt.Errorf("go build ./cmd/floe (run from the repository root, or give -floe): %w", err)
		}
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	opt := capacity.Options{
		Sessions: rs, Ranks: ts,
		Workload: capacity.Workload{GroupSize: *groupSize, Turns: *turns, SystemBytes: *systemBytes, TaskBytes: *taskBytes,
			ToolBytes: *toolBytes, AnswerTokens: *answerTokens},
		GroupsPerStep: *groupsPerStep, TokenBudget: *budget, LoadFor: *loadFor, MinCallsPerSession: *minCalls, LoadMax: *loadMax, ProbeFor: *probeFor, ProbeLoad: *probeLoad, DrainFor: *drainFor,
		Seed: *seed, Work: *work, FormGroups: fg, FormDPSize: *formDP, Progress: stderr,
		Floe: func(args []string) *exec.Cmd {
			cmd := exec.CommandContext(ctx, *floeBin, append([]string{"serve"}, args...)...)
			// Without tokens floe serves loopback only, which is what this measures.
			cmd.Env = withoutFloeTokens(os.Environ())
			return cmd
		},
		Rank: func(loc string, r int) *exec.Cmd {
			cmd := exec.CommandContext(ctx, self, "capacity-rank", "-flight", loc, "-rank", strconv.Itoa(r))
			cmd.Stderr = stderr
			return cmd
		},
	}
	load, _ := os.ReadFile("/proc/loadavg")
	rep, err := capacity.Run(ctx, opt)
	if err != nil {
		return err
	}
	rep.Command = "floe-bench capacity " + strings.Join(flagArgs(fs), " ")
	rep.Machine = fmt.Sprintf("%s, %d logical CPUs, %s %s/%s; load average (1, 5, 15 min) at the start: %s",
		cpuModel(), runtime.NumCPU(), runtime.Version(), runtime.GOOS, runtime.GOARCH, loadAverage(load))
	// The terminal's copy: a write error there must not fail the run.
	_, _ = fmt.Fprint(stdout, rep.Table())
	_, _ = fmt.Fprintf(stdout, "\nmarginal memory per open session: %.1f KiB\n\n%s", rep.MarginalBytesPerSession()/1024, rep.FormTable())
	_, _ = fmt.Fprintf(stdout, "\nwall time: %.0f s\n", rep.WallSeconds)
	if *out == "" {
		return nil
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}
	raw, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(*out, "results.json"), append(raw, '\n'), 0o644); err != nil {
		return err
	}
	if err := rep.WritePlots(*out); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(*out, "REPORT.md"), []byte(rep.Markdown()), 0o644)
}

// runCapacityRank is one trainer rank of the capacity benchmark (not in the usage: the
// benchmark starts it).
func runCapacityRank(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := cli.NewFlagSet("floe-bench capacity-rank", "usage: floe-bench capacity-rank -flight LOCATION -rank R\n\n", stderr)
	loc := fs.String("flight", "", "floe's Flight location (grpc+tcp://host:port)")
	rank := fs.Int("rank", 0, "this rank")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	return capacity.RunRank(ctx, *loc, *rank, os.Stdin, stdout)
}

func intList(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%q is not a positive number", f)
		}
		out = append(out, n)
	}
	return out, nil
}

// flagArgs is every flag with its value, defaults included, so the command line in the
// report reruns the same sweep (-work and -floe are left out: they are this machine's).
func flagArgs(fs *flag.FlagSet) []string {
	var out []string
	fs.VisitAll(func(f *flag.Flag) {
		if f.Name == "work" || f.Name == "floe" || f.Name == "report-only" {
			return
		}
		out = append(out, "-"+f.Name+"="+f.Value.String())
	})
	return out
}

func withoutFloeTokens(env []string) []string {
	var out []string
	for _, e := range env {
		if !strings.HasPrefix(e, "FLOE_") {
			out = append(out, e)
		}
	}
	return out
}

// loadAverage is /proc/loadavg's three averages ("1.72, 2.65, 3.61"), read before a
// benchmark so its report says how busy the machine was; "unknown" off Linux.
func loadAverage(procLoadavg []byte) string {
	f := strings.Fields(string(procLoadavg))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], ", ")
}
