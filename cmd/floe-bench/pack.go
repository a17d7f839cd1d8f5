package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/benchmarks/packbench"
	"github.com/floe-rl/floe/internal/cli"
	"github.com/floe-rl/floe/internal/corpus"
)

const packUsage = usage + `
The packing benchmark's flags (floe-bench [flags]):

`

// runPack is the packing benchmark: every strategy reconstructs, packs and encodes one
// synthetic corpus; the table compares rows, fill, balance and throughput on one core.
func runPack(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := cli.NewFlagSet("floe-bench", packUsage, stderr)
	cfg := batcher.DefaultConfig()
	cfg.DPSize = 8 // a node's worth of ranks, where balancing shows
	seed := fs.Int64("seed", 1, "corpus seed")
	groups := fs.Int("groups", corpus.Default().Groups, "GRPO groups in the corpus")
	perStep := fs.Int("groups-per-step", 0, "groups per step (0: the whole corpus is one step)")
	cfg.RegisterFlags(fs, batcher.FlagTokenBudget, batcher.FlagPadMultiple, batcher.FlagDPSize, batcher.FlagAdvantage)
	repeats := fs.Int("repeats", 3, "timed passes per strategy; the fastest counts")
	statsOut := fs.String("corpus-stats", "", "also write the corpus statistics (Markdown) to this file")
	out := fs.String("out", "", "also write the report (Markdown) to this file")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	ccfg := corpus.Default()
	ccfg.Groups = *groups

	_, _ = fmt.Fprintf(stderr, "generating corpus: %d groups of %d sessions, seed %d\n", ccfg.Groups, ccfg.GroupSize, *seed) // progress lines: a closed stderr must not stop a run
	start := time.Now()
	data, cstats, err := corpus.GenerateWithStats(ccfg, *seed)
	if err != nil {
		return fmt.Errorf("corpus: %w", err)
	}
	_, _ = fmt.Fprintf(stderr, "corpus ready in %.1fs\n", time.Since(start).Seconds()) // progress lines: a closed stderr must not stop a run
	if *statsOut != "" {
		if err := os.WriteFile(*statsOut, []byte(cstats.Markdown()), 0o644); err != nil {
			return fmt.Errorf("corpus stats: %w", err)
		}
	}
	rep, err := packbench.Run(ctx, data, packbench.Options{Batcher: cfg, GroupsPerStep: *perStep, Repeats: *repeats, Progress: stderr})
	if err != nil {
		return err
	}
	table := rep.Table()
	_, _ = fmt.Fprint(stdout, table) // the terminal's copy: a write error there must not fail the run
	if *out != "" {
		cmd := fmt.Sprintf("floe-bench -seed %d -groups %d -groups-per-step %d -token-budget %d -pad-multiple %d -dp-size %d -advantage %s -repeats %d",
			*seed, *groups, *perStep, cfg.TokenBudget, cfg.PadMultiple, cfg.DPSize, cfg.Advantage, *repeats)
		doc := fmt.Sprintf("# Reconstruction and packing benchmark\n\nCommand: `%s` (`make bench-report`)\n\nMachine: %s\n\n%s\n## Corpus\n\n%s",
			cmd, machine(), table, cstats.Markdown())
		if err := os.WriteFile(*out, []byte(doc), 0o644); err != nil {
			return fmt.Errorf("report: %w", err)
		}
	}
	return nil
}

// machine describes where the benchmark ran, for the report.
func machine() string {
	return fmt.Sprintf("%s, %d logical CPUs (throughput measured on one: GOMAXPROCS=1), %s %s/%s",
		cpuModel(), runtime.NumCPU(), runtime.Version(), runtime.GOOS, runtime.GOARCH)
}

// cpuModel is the CPU's model name from /proc/cpuinfo, or "unknown CPU".
func cpuModel() string {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return "unknown CPU"
	}
	defer func() { _ = f.Close() }() // read only: a Close error loses nothing
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown CPU"
}
