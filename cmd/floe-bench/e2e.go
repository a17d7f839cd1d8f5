package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/sourcegraph/conc/pool"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/benchmarks/e2e"
	"github.com/floe-rl/floe/gpu"
	"github.com/floe-rl/floe/internal/cli"
	"github.com/floe-rl/floe/internal/corpus"
	"github.com/floe-rl/floe/sidecar"
)

const e2eUsage = `usage: floe-bench e2e [flags]

Replays agent sessions (the synthetic corpus, or the sessions recorded in a floe data dir)
through floe's proxy against the reference inference server in script mode, so every
recorded token id and log-probability is the server's own; then, once per strategy, trains
on the recorded calls with a trainer on floe_bridge (examples/train_grpo.py) while floe
serves the steps, and records a timeline: floe's step formation, the trainer's step and
data-wait times from its reports, and NVML GPU utilization and memory at 10 Hz where a GPU
exists. Every strategy trains the same recorded calls. Writes <out>/runs/<strategy>.json
and <out>/REPORT.md with plots (floe-bench report).

`

// benchE2E is floe-bench e2e's configuration.
type benchE2E struct {
	name, out, work string
	corpus, dataDir string
	groups          int
	seed            int64
	strategies      []batcher.Strategy
	python, trainer string
	trainerArgs     []string
	device          string
	vocab           int
	// floe is the configuration every strategy's floe serve starts from: the flags set
	// its token budget, pad multiple and groups per step.
	floe            sidecar.Config
	maxModelLen     int
	concurrency     int
	runTimeout      time.Duration
	keep            bool
	command         string
	stderr          io.Writer
	calls, sessions int
}

func runE2E(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := cli.NewFlagSet("floe-bench e2e", e2eUsage, stderr)
	b := benchE2E{stderr: stderr, command: "floe-bench e2e " + strings.Join(args, " "), floe: sidecar.DefaultConfig()}
	// Sized for the tiny reference model on a CPU; one trainer process, so one rank.
	b.floe.Batcher.TokenBudget, b.floe.Batcher.PadMultiple, b.floe.GroupsPerStep = 4096, 64, 2
	fs.StringVar(&b.name, "name", "e2e-cpu", "benchmark name: the results folder under benchmarks/results")
	fs.StringVar(&b.out, "out", "", "results folder (default: benchmarks/results/<name>)")
	fs.StringVar(&b.corpus, "corpus", "small", "synthetic corpus to replay: small (tests), cpu (CPU runs), medium (GPU runs) or default")
	fs.StringVar(&b.dataDir, "from-data-dir", "", "replay the finished grouped sessions recorded in this floe data dir instead of the synthetic corpus")
	fs.IntVar(&b.groups, "groups", 8, "GRPO groups of the synthetic corpus (0: the corpus's own count)")
	fs.Int64Var(&b.seed, "seed", 1, "synthetic corpus seed")
	strategies := fs.String("strategies", "per_request,prefix_merging,tree", "strategies to run, comma-separated")
	fs.StringVar(&b.python, "python", defaultPython(), "Python with floe_bridge, floe_refserver and torch installed")
	fs.StringVar(&b.trainer, "trainer", "trainer-bridge/examples/train_grpo.py", "trainer script (floe_bridge's example trainer's flags)")
	trainerArgs := fs.String("trainer-args", "--preset refserver",
		"more trainer flags: --preset refserver trains the reference server's own model (rollout log-probs match at step 0); on a GPU e.g. --preset qwen2.5-0.5b --dtype bfloat16 --attn flex")
	fs.StringVar(&b.device, "device", "cpu", "the trainer's torch device: cpu or cuda")
	fs.IntVar(&b.vocab, "vocab", 8192, "trainer vocabulary (at least the reference tokenizer's; a --preset in -trainer-args may set it)")
	b.floe.Batcher.RegisterFlags(fs, batcher.FlagTokenBudget, batcher.FlagPadMultiple)
	b.floe.RegisterFlags(fs, "groups-per-step")
	fs.IntVar(&b.maxModelLen, "max-model-len", 8192, "the reference server's context length")
	fs.IntVar(&b.concurrency, "concurrency", 8, "sessions replayed at once")
	fs.DurationVar(&b.runTimeout, "run-timeout", 30*time.Minute, "longest a strategy's training may take")
	fs.BoolVar(&b.keep, "keep", false, "keep the work folder (data dirs and logs)")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	for _, s := range strings.Split(*strategies, ",") {
		st, err := batcher.ParseStrategy(strings.TrimSpace(s))
		if err != nil {
			return err
		}
		b.strategies = append(b.strategies, st)
	}
	b.trainerArgs = strings.Fields(*trainerArgs)
	if b.out == "" {
		b.out = filepath.Join("benchmarks", "results", b.name)
	}
	if b.floe.GroupsPerStep < 1 || b.concurrency < 1 {
		return errors.New("-groups-per-step and -concurrency must be at least 1")
	}
	if err := b.floe.Batcher.Validate(); err != nil {
		return err
	}
	if _, err := os.Stat(b.trainer); err != nil {
		return fmt.Errorf("-trainer: %w (run from the repository root)", err)
	}
	return b.run(ctx, stdout)
}

// defaultPython is the repository's venv (make test builds it), else python3.
func defaultPython() string {
	if _, err := os.Stat(".venv/bin/python"); err == nil {
		return ".venv/bin/python"
	}
	return "python3"
}

func (b *benchE2E) progress(format string, a ...any) {
	_, _ = fmt.Fprintf(b.stderr, format+"\n", a...) // progress lines: a closed stderr must not stop a run
}

func (b *benchE2E) run(ctx context.Context, stdout io.Writer) error {
	sessions, corpusDesc, err := b.sessionsToReplay()
	if err != nil {
		return err
	}
	b.sessions = len(sessions)
	for _, s := range sessions {
		b.calls += len(s.Calls)
	}
	work, err := os.MkdirTemp("", "floe-bench-e2e-")
	if err != nil {
		return err
	}
	b.work = work
	if b.keep {
		b.progress("work folder (kept): %s", work)
	} else {
		defer func() { _ = os.RemoveAll(work) }() // a temporary directory: best effort
	}
	b.progress("replaying %d sessions, %d calls (%s) through floe against the reference server", b.sessions, b.calls, corpusDesc)
	recorded := filepath.Join(work, "recorded")
	if err := b.replay(ctx, sessions, recorded); err != nil {
		return fmt.Errorf("replay: %w", err)
	}
	mon := gpu.NewMonitor(b.lib(), gpu.MonitorConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	mctx, stopMon := context.WithCancel(ctx)
	monDone := make(chan struct{})
	go func() { defer close(monDone); _ = mon.Run(mctx) }() // ends with mctx
	defer func() { stopMon(); <-monDone }()
	setup := e2e.Setup{Machine: e2eMachine(mon), Device: b.device, Model: b.modelDesc(), Corpus: corpusDesc, Seed: b.seed,
		Command: b.command, Calls: b.calls, Sessions: b.sessions, TokenBudget: b.floe.Batcher.TokenBudget, DPSize: b.floe.Batcher.DPSize}
	// The folder holds this run's strategies only: a run left from an earlier invocation
	// would mix into floe-bench report's comparison.
	runsDir := filepath.Join(b.out, "runs")
	if err := os.MkdirAll(runsDir, 0o755); err != nil {
		return err
	}
	old, _ := filepath.Glob(filepath.Join(runsDir, "*.json"))
	for _, p := range old {
		if err := os.Remove(p); err != nil {
			return err
		}
	}
	var runs []e2e.Run
	for _, st := range b.strategies {
		run, err := b.train(ctx, st, recorded, mon, setup)
		if err != nil {
			return fmt.Errorf("%s: %w", st, err)
		}
		raw, _ := json.MarshalIndent(run, "", " ")
		path := filepath.Join(runsDir, string(st)+".json")
		if err := os.WriteFile(path, append(raw, '\n'), 0o644); err != nil {
			return err
		}
		runs = append(runs, run)
	}
	if err := e2e.WriteReport(b.out, runs); err != nil {
		return err
	}
	_, _ = fmt.Fprintln(stdout, filepath.Join(b.out, e2e.ReportFile)) // the terminal's copy: a write error there must not fail the run
	for _, s := range e2e.Summarize(runs) {
		_, _ = fmt.Fprintln(stdout, s.String()) // the terminal's copy: a write error there must not fail the run
	}
	return nil
}

func (b *benchE2E) lib() gpu.Lib { return gpu.SystemNVML() }

func (b *benchE2E) modelDesc() string {
	args := strings.Join(b.trainerArgs, " ")
	return fmt.Sprintf("Qwen2 built from a config, random init (%s %s)", filepath.Base(b.trainer), args)
}

// sessionsToReplay reads the recorded sessions or generates the synthetic corpus.
func (b *benchE2E) sessionsToReplay() ([]e2e.Session, string, error) {
	if b.dataDir != "" {
		ss, err := e2e.FromStore(b.dataDir)
		return ss, "sessions recorded in " + b.dataDir, err
	}
	cfg, err := corpus.Preset(b.corpus, b.groups)
	if err != nil {
		return nil, "", fmt.Errorf("-corpus: %w", err)
	}
	// Broken upstream token data is the proxy's concern, not this benchmark's: every
	// replayed call has its response.
	cfg.UntrainableProb = 0
	groups, err := corpus.Generate(cfg, b.seed)
	if err != nil {
		return nil, "", err
	}
	ss, err := e2e.FromCorpus(groups)
	return ss, fmt.Sprintf("synthetic corpus %q, %d groups x %d sessions", b.corpus, cfg.Groups, cfg.GroupSize), err
}

// replay starts the reference server and a floe that records without forming steps,
// and replays the sessions through it into dataDir.
func (b *benchE2E) replay(ctx context.Context, sessions []e2e.Session, dataDir string) error {
	p := b.procs()
	ref, err := p.startRefServer(ctx, b.maxModelLen)
	if err != nil {
		return err
	}
	defer ref.stop()
	return p.record(ctx, ref, sessions, dataDir, "replay", &e2e.Driver{Model: "floe-ref", Concurrency: b.concurrency})
}

func (b *benchE2E) procs() benchProcs {
	return benchProcs{work: b.work, python: b.python, progress: b.progress}
}

// train runs one strategy: a floe on a copy of the recorded data dir, the trainer for
// every formable step, the timeline recorded.
func (b *benchE2E) train(ctx context.Context, st batcher.Strategy, recorded string, mon *gpu.Monitor, setup e2e.Setup) (e2e.Run, error) {
	dir := filepath.Join(b.work, string(st))
	if err := copyDir(recorded, dir); err != nil {
		return e2e.Run{}, err
	}
	cfg := b.floe
	cfg.DataDir, cfg.ProxyAddr, cfg.ControlAddr, cfg.FlightAddr = dir, "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.Upstream = "http://127.0.0.1:1" // no call is made: the groups are recorded
	cfg.Batcher.Strategy, cfg.MinGroupSize = st, 1
	forms, err := sidecar.PlanDataDir(cfg) // the steps floe will form, as its planner decides them
	if err != nil {
		return e2e.Run{}, err
	}
	steps := len(forms)
	if steps == 0 {
		return e2e.Run{}, fmt.Errorf("the replay recorded too few trainable groups for one step of %d groups", cfg.GroupsPerStep)
	}
	rec := e2e.NewRecorder(time.Now(), mon)
	cfg.GPU, cfg.Observer = b.lib(), rec
	ctx, cancel := context.WithTimeout(ctx, b.runTimeout)
	defer cancel()
	f, err := b.procs().startFloe(ctx, cfg, string(st))
	if err != nil {
		return e2e.Run{}, err
	}
	defer f.stop()

	// The trainer's run ends the GPU sampling and the watch on floe; floe stopping first
	// ends the run.
	p := pool.New().WithContext(ctx).WithCancelOnError()
	tctx, trained := context.WithCancel(ctx)
	p.Go(func(context.Context) error { return rec.SampleGPU(tctx, time.Second) })
	p.Go(func(context.Context) error {
		select {
		case <-f.done:
			return fmt.Errorf("floe stopped during training: %v (log: %s)", f.err, f.log)
		case <-tctx.Done():
			return nil
		}
	})
	p.Go(func(ctx context.Context) error {
		defer trained()
		return b.runTrainer(ctx, st, f.addrs.Flight, steps)
	})
	if err := p.Wait(); err != nil {
		return e2e.Run{}, err
	}
	run := rec.Run(b.name, string(st), setup)
	if len(run.Steps) != steps {
		return run, fmt.Errorf("the trainer reported on %d steps, floe could form %d", len(run.Steps), steps)
	}
	return run, nil
}

// runTrainer runs the trainer for steps and shows its step lines.
func (b *benchE2E) runTrainer(ctx context.Context, st batcher.Strategy, location string, steps int) error {
	args := append([]string{b.trainer, "--location", location, "--steps", strconv.Itoa(steps),
		"--vocab", strconv.Itoa(b.vocab), "--device", b.device, "--timeout", "600"}, b.trainerArgs...)
	logf, err := os.Create(filepath.Join(b.work, string(st)+"-trainer.log"))
	if err != nil {
		return err
	}
	defer func() { _ = logf.Close() }() // the log only: losing its tail on Close must not hide the result
	cmd := exec.CommandContext(ctx, b.python, args...)
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	cmd.Stderr = logf
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting the trainer: %w", err)
	}
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		_, _ = fmt.Fprintln(logf, sc.Text()) // the log only; the loop must keep draining the pipe
		if strings.HasPrefix(sc.Text(), "step ") {
			b.progress("%s: %s (of %d)", st, sc.Text(), steps)
		}
	}
	_, _ = io.Copy(logf, out) // whatever the scanner could not take, so the trainer never blocks on its pipe
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("trainer: %w (log: %s)", err, logf.Name())
	}
	return nil
}

// copyDir copies the files of a data dir (not recursive: floe's data dir is flat).
func copyDir(src, dst string) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		raw, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dst, e.Name()), raw, 0o600); err != nil {
			return err
		}
	}
	return nil
}

// e2eMachine describes this machine and its GPUs for the report.
func e2eMachine(mon *gpu.Monitor) string {
	out := fmt.Sprintf("%s, %d cores", cpuModel(), runtime.NumCPU())
	for _, d := range mon.Devices() {
		out += fmt.Sprintf("; GPU %d: %s, %.0f GiB", d.Index, d.Name, float64(d.MemoryTotal)/(1<<30))
	}
	return out
}
