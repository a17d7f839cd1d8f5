package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sort"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/sidecar"
)

const serveUsage = `usage: floe serve [flags]

Runs floe beside a trainer: the proxy harnesses call (with the session and control API
under /floe/v1, Prometheus metrics at /metrics and /healthz), the durable trace store,
the step former, the Flight service and the GPU monitor. Prints {"proxy": url, "flight":
location} on stdout once serving; SIGTERM or SIGINT stops it.

Every flag can also be set in a YAML file given with -config, under the flag's name in
snake_case (token_budget: auto, groups_per_step: 4, open_sessions: true); flags given on
the command line win over the file, and an unknown key is an error.

`

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("floe serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, serveUsage)
		fs.PrintDefaults()
	}
	def := sidecar.DefaultConfig()
	cfg := def
	fs.StringVar(&cfg.ProxyAddr, "proxy-addr", def.ProxyAddr, "proxy and control API address; port 0 picks one")
	fs.StringVar(&cfg.FlightAddr, "flight-addr", def.FlightAddr, "Flight address; port 0 picks one; unix:/path for a Unix socket")
	fs.StringVar(&cfg.Upstream, "upstream", def.Upstream, "inference server base URL")
	fs.StringVar(&cfg.Engine, "engine", def.Engine, "inference engine: vllm or sglang")
	fs.StringVar(&cfg.Model, "model", "", "served model name sent upstream (default: the first the upstream lists)")
	fs.StringVar(&cfg.DataDir, "data-dir", def.DataDir, "where the durable trace store lives")
	strategy := fs.String("strategy", string(def.Batcher.Strategy), "per_request, prefix_merging or tree")
	adv := fs.String("advantage", string(def.Batcher.Advantage), "grpo, dr_grpo or rloo")
	fs.IntVar(&cfg.GroupSize, "group-size", def.GroupSize, "sessions that complete a group whose session did not give group_size")
	fs.IntVar(&cfg.MinGroupSize, "min-group-size", def.MinGroupSize, "a complete group with fewer usable sessions is dropped")
	fs.IntVar(&cfg.GroupsPerStep, "groups-per-step", def.GroupsPerStep, "complete groups per step")
	fs.IntVar(&cfg.StepsAhead, "steps-ahead", def.StepsAhead, "most uncommitted steps formed ahead of the trainer")
	fs.IntVar(&cfg.Batcher.DPSize, "dp-size", def.Batcher.DPSize, "data-parallel ranks")
	budget := fs.String("token-budget", strconv.Itoa(def.Batcher.TokenBudget),
		"rows per micro-batch, padding included; auto: sized to the trainer GPU's memory between -token-budget-min and -token-budget-max")
	fs.IntVar(&cfg.TokenBudgetMin, "token-budget-min", def.TokenBudgetMin, "with -token-budget auto: the smallest budget, and the first")
	fs.IntVar(&cfg.TokenBudgetMax, "token-budget-max", def.TokenBudgetMax, "with -token-budget auto: the largest budget")
	fs.Float64Var(&cfg.MemoryTarget, "memory-target", def.MemoryTarget,
		"with -token-budget auto: the fraction of device memory the predicted peak stays under")
	fs.Uint64Var(&cfg.GPUMemoryBytes, "gpu-memory", 0,
		"with -token-budget auto: the trainer device's memory in bytes, when floe cannot see the GPU through NVML (0: NVML's)")
	fs.IntVar(&cfg.Batcher.PadMultiple, "pad-multiple", def.Batcher.PadMultiple, "pad each micro-batch to a multiple of this many rows")
	fs.StringVar(&cfg.FlightToken, "flight-token", "", "require this bearer token on every Flight call")
	fs.BoolVar(&cfg.OpenSessions, "open-sessions", false, "let a call with an unknown key create its session")
	fs.BoolVar(&cfg.DropFailed, "drop-failed", false, "drop failed and timed-out sessions from their group (default: keep them, training none of their tokens)")
	fs.DurationVar(&cfg.GroupTimeout, "group-timeout", def.GroupTimeout,
		"end a group this long after its first session started: it closes, its running sessions finish as timeout with reward 0 (0: never; set it above your longest rollout)")
	fs.Int64Var(&cfg.MaxStaleness, "max-staleness", def.MaxStaleness,
		"train on a call only if its policy version lags the current one (the last resume) by at most this many versions; older calls are counted and kept as context (-1: no limit)")
	pyro := fs.String("pyroscope", "", "profile continuously to this Pyroscope server URL (default: $"+pyroscopeEnv+"; empty: off)")
	config := fs.String("config", "", "YAML file of settings, keyed by flag name in snake_case; flags win over it")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q (flags only; see floe serve -h)", fs.Args())
	}
	if *config != "" {
		if err := applyConfigFile(fs, *config); err != nil {
			return err
		}
	}
	var err error
	if cfg.Batcher.Strategy, err = batcher.ParseStrategy(*strategy); err != nil {
		return err
	}
	if cfg.Batcher.Advantage, err = batcher.ParseAdvantage(*adv); err != nil {
		return err
	}
	if *budget == "auto" {
		cfg.TokenBudgetAuto = true
	} else if cfg.Batcher.TokenBudget, err = strconv.Atoi(*budget); err != nil {
		return fmt.Errorf("-token-budget %q: a number of rows or auto", *budget)
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	if *pyro == "" {
		*pyro = os.Getenv(pyroscopeEnv)
	}
	stopProfiling, err := startProfiling(*pyro, log)
	if err != nil {
		return err
	}
	defer stopProfiling()
	return sidecar.Serve(ctx, cfg, log, sidecar.AnnounceJSON(stdout))
}

// applyConfigFile sets the flags of fs that the command line did not set from the YAML
// file at path: a top-level mapping of flag names in snake_case to scalar values.
func applyConfigFile(fs *flag.FlagSet, path string) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("-config: %w", err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		return fmt.Errorf("-config %s: %w", path, err)
	}
	if len(doc.Content) == 0 {
		return nil // an empty file
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return fmt.Errorf("-config %s:%d: want a mapping of settings (token_budget: auto, ...)", path, root.Line)
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	seen := map[string]bool{}
	for i := 0; i+1 < len(root.Content); i += 2 {
		k, v := root.Content[i], root.Content[i+1]
		name := strings.ReplaceAll(k.Value, "_", "-")
		f := fs.Lookup(name)
		if f == nil || name == "config" || strings.Contains(k.Value, "-") {
			return fmt.Errorf("-config %s:%d: unknown key %q (the keys are floe serve's flags in snake_case: %s)",
				path, k.Line, k.Value, strings.Join(configKeys(fs), ", "))
		}
		if seen[name] {
			return fmt.Errorf("-config %s:%d: key %q given twice", path, k.Line, k.Value)
		}
		seen[name] = true
		if v.Kind != yaml.ScalarNode {
			return fmt.Errorf("-config %s:%d: %s must be a single value", path, v.Line, k.Value)
		}
		if given[name] {
			continue // the command line wins
		}
		if err := fs.Set(name, v.Value); err != nil {
			return fmt.Errorf("-config %s:%d: %s: invalid value %q: %v", path, v.Line, k.Value, v.Value, err)
		}
	}
	return nil
}

func configKeys(fs *flag.FlagSet) []string {
	var keys []string
	fs.VisitAll(func(f *flag.Flag) {
		if f.Name != "config" {
			keys = append(keys, strings.ReplaceAll(f.Name, "-", "_"))
		}
	})
	sort.Strings(keys)
	return keys
}
