package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/internal/cli"
	"github.com/floe-rl/floe/internal/corpus"
	"github.com/floe-rl/floe/sidecar"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/jsonl"
)

const corpusServeUsage = `usage: floe corpus-serve [flags]

Forms steps from the synthetic agent-trace corpus and serves them over Arrow Flight
(docs/flight.md). Prints {"flight": location, "steps": n} on stdout once serving.

`

// runCorpusServe forms steps from the synthetic corpus and serves them over Flight: the
// trainer side of floe without harnesses or an inference server, for developing a trainer
// against floe, for the bridge's tests and for benchmarks.
func runCorpusServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := cli.NewFlagSet("floe corpus-serve", corpusServeUsage, stderr)
	// The Flight, step and batcher settings are floe serve's, under its names; the corpus
	// is a few groups, so two make a step.
	cfg := sidecar.DefaultConfig()
	cfg.GroupsPerStep = 2
	cfg.RegisterFlags(fs, append(append([]string{}, sidecar.FlightFlags...), sidecar.StepFlags...)...)
	cfg.Batcher.RegisterFlags(fs) // -token-budget is a number here: no GPU to size it to
	kind := fs.String("corpus", "small", "corpus size: small (tests), cpu, medium, default (benchmark) or longtool (long tool outputs)")
	groups := fs.Int("groups", 0, "GRPO groups (0: the corpus's own count)")
	seed := fs.Int64("seed", 1, "corpus seed")
	fold := fs.Int("fold-vocab", 0, "map every token id to id % N, for tiny test models (0: off)")
	dump := fs.String("dump-groups", "", "write the corpus as JSON to this file (for equivalence tests)")
	calls := fs.String("calls", "", "serve these recorded calls (JSON lines, as floe proxy -record writes them) instead of the synthetic corpus: one group holding every session, in order of appearance")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	ccfg, err := corpus.Preset(*kind, *groups)
	if err != nil {
		return err
	}
	if err := cfg.Batcher.Validate(); err != nil {
		return err
	}
	if cfg.GroupsPerStep < 1 || *fold < 0 {
		return fmt.Errorf("groups-per-step must be at least 1 and fold-vocab not negative")
	}
	var data []trace.Group
	if *calls != "" {
		data, err = jsonl.ReadGroups(*calls)
	} else {
		data, err = corpus.Generate(ccfg, *seed)
	}
	if err != nil {
		return fmt.Errorf("corpus: %w", err)
	}
	if *fold > 0 {
		foldVocab(data, int32(*fold))
	}
	if *dump != "" {
		if err := dumpGroups(*dump, data, cfg.Batcher.Advantage); err != nil {
			return err
		}
	}
	// Form every step before announcing the server, so that a corpus the budget cannot
	// hold fails here with the batcher's error rather than as a missing step later.
	var steps []*batcher.Step
	for i := 0; i < len(data); i += cfg.GroupsPerStep {
		st, err := batcher.FormStep(int64(len(steps)), data[i:min(i+cfg.GroupsPerStep, len(data))], cfg.Batcher)
		if err != nil {
			return err
		}
		steps = append(steps, st)
	}

	log := slog.New(slog.NewTextHandler(stderr, nil))
	warnTokenOnCommandLine(fs, log)
	if err := cfg.LoadTokens(os.Getenv); err != nil {
		return err
	}
	announce := func(a sidecar.Addrs) {
		hello, _ := json.Marshal(map[string]any{"flight": a.Flight, "steps": len(steps)})
		_, _ = fmt.Fprintln(stdout, string(hello)) // a launcher gone from the pipe ends floe by SIGPIPE (os/signal)
	}
	// floe corpus-serve is floe serve with the corpus's steps for its upstream: no proxy,
	// control API or store.
	return sidecar.Serve(ctx, cfg, log, announce, sidecar.FromSteps(steps))
}

func foldVocab(groups []trace.Group, n int32) {
	for gi := range groups {
		for si := range groups[gi].Sessions {
			for ci := range groups[gi].Sessions[si].Calls {
				c := &groups[gi].Sessions[si].Calls[ci]
				for i := range c.PromptIDs {
					c.PromptIDs[i] %= n
				}
				for i := range c.ResponseIDs {
					c.ResponseIDs[i] %= n
				}
			}
		}
	}
}

// dumpGroups writes the corpus, calls in the recorded-call wire format (docs/trace.md),
// with each session's advantage as the batcher computes it: the reference the bridge's
// tests check floe's steps against.
func dumpGroups(path string, groups []trace.Group, kind batcher.Advantage) error {
	type sessionJSON struct {
		trace.Session
		Advantage float32 `json:"advantage"`
	}
	type groupJSON struct {
		ID       string        `json:"id"`
		TaskID   string        `json:"task_id"`
		Sessions []sessionJSON `json:"sessions"`
	}
	out := make([]groupJSON, 0, len(groups))
	for _, g := range groups {
		advs, err := batcher.SessionAdvantages(kind, g.Sessions)
		if err != nil {
			return fmt.Errorf("dump groups: %w", err)
		}
		gj := groupJSON{ID: g.ID, TaskID: g.TaskID}
		for i, s := range g.Sessions {
			if s.Calls == nil {
				s.Calls = []trace.Call{}
			}
			gj.Sessions = append(gj.Sessions, sessionJSON{Session: s, Advantage: float32(advs[i])})
		}
		out = append(out, gj)
	}
	b, err := json.Marshal(out)
	if err != nil {
		return fmt.Errorf("dump groups: %w", err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return fmt.Errorf("dump groups: %w", err)
	}
	return nil
}
