package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strconv"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/sidecar"
)

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("floe serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: floe serve [flags]\n\nRuns floe beside a trainer: the proxy harnesses call (with the session and control API\nunder /floe/v1), the durable trace store, the step former and the Flight service.\nPrints {\"proxy\": url, \"flight\": location} on stdout once serving; SIGTERM stops it.\n\n")
		fs.PrintDefaults()
	}
	def := sidecar.DefaultConfig()
	cfg := def
	fs.StringVar(&cfg.ProxyAddr, "proxy-addr", def.ProxyAddr, "proxy and control API address; port 0 picks one")
	fs.StringVar(&cfg.FlightAddr, "flight-addr", def.FlightAddr, "Flight address; port 0 picks one; unix:/path for a Unix socket")
	fs.StringVar(&cfg.Upstream, "upstream", def.Upstream, "inference server base URL")
	engine := fs.String("engine", "vllm", "inference engine: vllm")
	fs.StringVar(&cfg.Model, "model", "", "served model name sent upstream (default: the first the upstream lists)")
	fs.StringVar(&cfg.DataDir, "data-dir", def.DataDir, "where the durable trace store lives")
	strategy := fs.String("strategy", string(def.Batcher.Strategy), "per_request, prefix_merging or tree")
	adv := fs.String("advantage", string(def.Batcher.Advantage), "grpo, dr_grpo or rloo")
	fs.IntVar(&cfg.GroupSize, "group-size", def.GroupSize, "sessions that complete a group whose session did not give group_size")
	fs.IntVar(&cfg.MinGroupSize, "min-group-size", def.MinGroupSize, "a complete group with fewer usable sessions is dropped")
	fs.IntVar(&cfg.GroupsPerStep, "groups-per-step", def.GroupsPerStep, "complete groups per step")
	fs.IntVar(&cfg.StepsAhead, "steps-ahead", def.StepsAhead, "most uncommitted steps formed ahead of the trainer")
	fs.IntVar(&cfg.Batcher.DPSize, "dp-size", def.Batcher.DPSize, "data-parallel ranks")
	budget := fs.String("token-budget", strconv.Itoa(def.Batcher.TokenBudget), "rows per micro-batch, padding included (auto: not yet)")
	fs.IntVar(&cfg.Batcher.PadMultiple, "pad-multiple", def.Batcher.PadMultiple, "pad each micro-batch to a multiple of this many rows")
	fs.StringVar(&cfg.FlightToken, "flight-token", "", "require this bearer token on every Flight call")
	fs.BoolVar(&cfg.OpenSessions, "open-sessions", false, "let a call with an unknown key create its session")
	fs.BoolVar(&cfg.DropFailed, "drop-failed", false, "drop failed and timed-out sessions from their group (default: keep them, training none of their tokens)")
	config := fs.String("config", "", "configuration file (not supported yet)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if *config != "" {
		return fmt.Errorf("-config is not supported yet: give the settings as flags")
	}
	if *engine != "vllm" {
		return fmt.Errorf("engine %q is not supported yet (vllm is)", *engine)
	}
	var err error
	if cfg.Batcher.Strategy, err = batcher.ParseStrategy(*strategy); err != nil {
		return err
	}
	if cfg.Batcher.Advantage, err = batcher.ParseAdvantage(*adv); err != nil {
		return err
	}
	if cfg.Batcher.TokenBudget, err = strconv.Atoi(*budget); err != nil {
		return fmt.Errorf("-token-budget %q: a number of rows (auto is not supported yet)", *budget)
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	return sidecar.Serve(ctx, cfg, log, sidecar.AnnounceJSON(stdout))
}
