package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sort"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/floe-rl/floe/internal/cli"
	"github.com/floe-rl/floe/sidecar"
)

const serveUsage = `usage: floe serve [flags]

Runs floe beside a trainer: the proxy harnesses call (-proxy-addr: the provider APIs
and /healthz only), the session and control API (-control-addr: /floe/v1 and Prometheus
metrics at /metrics), the durable trace store, the step former, the Flight service and
the GPU monitor. Prints {"proxy": url, "control": url, "flight": location} on stdout
once serving; SIGTERM or SIGINT stops it.

Tokens: -control-token-file and -flight-token-file, or $FLOE_CONTROL_TOKEN and
$FLOE_FLIGHT_TOKEN. The control and Flight listeners may be bound beyond loopback only
with their token (docs/security.md).

Every flag can also be set in a YAML file given with -config, under the flag's name in
snake_case (token_budget: auto, groups_per_step: 4, max_abs_reward: 100); flags given on
the command line win over the file, and an unknown key is an error.

`

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := cli.NewFlagSet("floe serve", serveUsage, stderr)
	cfg := sidecar.DefaultConfig()
	cfg.RegisterFlags(fs)
	pyro := fs.String("pyroscope", "", "profile continuously to this Pyroscope server URL (default: $"+pyroscopeEnv+"; empty: off)")
	config := fs.String("config", "", "YAML file of settings, keyed by flag name in snake_case; flags win over it")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	warnTokenOnCommandLine(fs, log)
	if *config != "" {
		if err := applyConfigFile(fs, *config); err != nil {
			return err
		}
	}
	if err := cfg.LoadTokens(os.Getenv); err != nil {
		return err
	}
	if *pyro == "" {
		*pyro = os.Getenv(pyroscopeEnv)
	}
	stopProfiling, err := startProfiling(*pyro, log)
	if err != nil {
		return err
	}
	defer stopProfiling()
	log.Info("floe starting", "version", cli.Version(), "pid", os.Getpid())
	// A signal (SIGINT, SIGTERM) ends ctx: say so when it happens, since the drain that
	// follows can take up to the HTTP servers' shutdown grace.
	drainLogged := make(chan struct{})
	stopDrainLine := context.AfterFunc(ctx, func() {
		log.Info("floe stopping: no new calls; draining calls in flight, then closing the store", "cause", context.Cause(ctx))
		close(drainLogged)
	})
	err = sidecar.Serve(ctx, cfg, log, sidecar.AnnounceJSON(stdout))
	if !stopDrainLine() {
		<-drainLogged // the stopping line runs on its own goroutine: let it come first
	}
	if err != nil {
		log.Error("floe stopped on an error", "err", err)
		return err
	}
	log.Info("floe stopped")
	return nil
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

// warnTokenOnCommandLine logs a warning when -flight-token was given on the command line:
// every user of the host can read a process's command line.
func warnTokenOnCommandLine(fs *flag.FlagSet, log *slog.Logger) {
	fs.Visit(func(f *flag.Flag) {
		if f.Name == "flight-token" {
			log.Warn("-flight-token on the command line can be read by every user of this host (ps, /proc/PID/cmdline); use -flight-token-file or $" +
				sidecar.FlightTokenEnv + " instead")
		}
	})
}
