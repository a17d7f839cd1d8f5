package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/floe-rl/floe/benchmarks/e2e"
	"github.com/floe-rl/floe/benchmarks/replay"
	"github.com/floe-rl/floe/internal/cli"
	"github.com/floe-rl/floe/trace"
)

const replayUsage = `usage: floe-bench replay -rollouts FILE.jsonl[,FILE.jsonl...] [-tokenizer DIR] [flags]

Replays real agent rollouts (NeMo Gym's format: one trajectory per line as OpenAI Responses
output items, grouped by _ng_task_index, rewarded by reward) through floe's proxy against
the reference inference server in script mode, which answers each call with the recorded
output, tokenized by its BPE (or -tokenizer DIR's, a model's Hugging Face tokenizer
directory) and scored by its model; then forms one step of every
recorded group with each strategy at B = 16k, 64k, 128k and dp 1, 8 and 16, and reports rows,
passes, the cut floor, pack time and whether the Arrow micro-batches train exactly
per_request's loss terms. Prints one JSON summary line per file and harness prompt on
stdout; exits non-zero if any loss-term multiset differs. docs/benchmarks.md.

`

// benchReplay is floe-bench replay's configuration.
type benchReplay struct {
	files       []string
	harnesses   []string // none, auto, or a captured CLI
	dialects    []string
	out         string
	python      string
	tokenizer   string // a Hugging Face tokenizer directory, absolute; "" for the server's BPE
	maxModelLen int
	repeats     int
	keep        bool
	command     string
	stderr      io.Writer
}

func runReplay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := cli.NewFlagSet("floe-bench replay", replayUsage, stderr)
	b := benchReplay{stderr: stderr, command: "floe-bench replay " + strings.Join(args, " ")}
	files := fs.String("rollouts", "", "rollout files (JSONL), comma-separated")
	harness := fs.String("harness-prompt", "none",
		"prepend a real harness CLI's system prompt and tool schemas: none, "+strings.Join(replay.HarnessNames(), ", ")+
			", or auto (the file's own harness by its agent_ref, none if not captured); comma-separated to run each")
	dialects := fs.String("dialects", "responses", "the proxy dialects to drive, comma-separated: responses, chat; the first is measured, the others must record the same tokens")
	fs.StringVar(&b.out, "out", "", "write REPORT.md and summary.jsonl here")
	fs.StringVar(&b.python, "python", defaultPython(), "Python with floe_refserver installed")
	fs.StringVar(&b.tokenizer, "tokenizer", "", "a Hugging Face tokenizer directory (a model's folder with tokenizer.json) for the reference server to tokenize with (default: its own 4k BPE)")
	fs.IntVar(&b.maxModelLen, "max-model-len", 1<<20, "the reference server's context length")
	fs.IntVar(&b.repeats, "repeats", 3, "timed packings per setting; the fastest counts")
	fs.BoolVar(&b.keep, "keep", false, "keep the work folder (data dirs and logs)")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	b.files, b.harnesses, b.dialects = splitList(*files), splitList(*harness), splitList(*dialects)
	if len(b.files) == 0 {
		return errors.New("-rollouts: give at least one rollouts file")
	}
	for _, h := range b.harnesses {
		if h != "none" && h != "auto" {
			if _, err := replay.LoadHarness(h); err != nil {
				return fmt.Errorf("-harness-prompt: %w", err)
			}
		}
	}
	if b.tokenizer != "" {
		dir, err := checkTokenizerDir(b.tokenizer)
		if err != nil {
			return fmt.Errorf("-tokenizer: %w", err)
		}
		b.tokenizer = dir
	}
	if len(b.harnesses) == 0 {
		b.harnesses = []string{"none"}
	}
	for _, d := range b.dialects {
		if d != "responses" && d != "chat" {
			return fmt.Errorf("-dialects: unknown dialect %q (want responses or chat)", d)
		}
	}
	if len(b.dialects) == 0 {
		return errors.New("-dialects: give at least one")
	}
	return b.run(ctx, stdout)
}

// checkTokenizerDir returns dir made absolute (the server runs elsewhere) when it holds a
// tokenizer.json the reference server can load: a JSON object with a tokenizer model.
// The server itself loads it; this says what is wrong before anything starts.
func checkTokenizerDir(dir string) (string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	if fi, err := os.Stat(abs); err != nil {
		return "", fmt.Errorf("tokenizer directory %s: %w", dir, err)
	} else if !fi.IsDir() {
		return "", fmt.Errorf("tokenizer directory %s: not a directory", dir)
	}
	raw, err := os.ReadFile(filepath.Join(abs, "tokenizer.json"))
	if err != nil {
		return "", fmt.Errorf("tokenizer directory %s: want a Hugging Face tokenizer directory (a model's, with tokenizer.json): %w", dir, err)
	}
	var tok struct {
		Model map[string]json.RawMessage `json:"model"`
	}
	if err := json.Unmarshal(raw, &tok); err != nil {
		return "", fmt.Errorf("tokenizer directory %s: tokenizer.json: %w", dir, err)
	}
	if len(tok.Model) == 0 {
		return "", fmt.Errorf("tokenizer directory %s: tokenizer.json has no tokenizer model", dir)
	}
	return abs, nil
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func (b *benchReplay) progress(format string, a ...any) {
	_, _ = fmt.Fprintf(b.stderr, format+"\n", a...) // progress lines: a closed stderr must not stop a run
}

func (b *benchReplay) run(ctx context.Context, stdout io.Writer) error {
	work, err := os.MkdirTemp("", "floe-bench-replay-")
	if err != nil {
		return err
	}
	if b.keep {
		b.progress("work folder (kept): %s", work)
	} else {
		defer func() { _ = os.RemoveAll(work) }() // a temporary directory: best effort
	}
	procs := benchProcs{work: work, python: b.python, tokenizer: b.tokenizer, progress: b.progress}
	ref, err := procs.startRefServer(ctx, b.maxModelLen)
	if err != nil {
		return err
	}
	defer ref.stop()
	var results []replay.Result
	for fi, file := range b.files {
		for _, h := range b.harnesses {
			res, ok, err := b.replayFile(ctx, procs, ref, file, h, filepath.Join(work, fmt.Sprintf("f%d-%s", fi, h)))
			if err != nil {
				return fmt.Errorf("%s (harness prompt %s): %w", file, h, err)
			}
			if !ok {
				continue
			}
			_, _ = fmt.Fprintln(stdout, res.Summary().JSON()) // the terminal's copy: a write error there must not fail the run
			results = append(results, res)
		}
	}
	if b.out != "" {
		if err := b.write(results); err != nil {
			return err
		}
	}
	for _, r := range results {
		if !r.M.LossTermsEqual() {
			return fmt.Errorf("%s (harness prompt %s): a strategy's loss terms differ from per_request's (see the report)", r.File, r.Harness)
		}
	}
	return nil
}

// replayFile replays one file under one harness-prompt variant in every dialect and
// measures the first dialect's recording; ok is false for "auto" on a file whose harness
// was not captured.
func (b *benchReplay) replayFile(ctx context.Context, procs benchProcs, ref *refServer, file, harness, dir string) (replay.Result, bool, error) {
	f, err := os.Open(file)
	if err != nil {
		return replay.Result{}, false, err
	}
	defer func() { _ = f.Close() }() // read only: a Close error loses nothing
	var agent string
	if harness == "auto" {
		// The agent is on every line; read it from the rollouts themselves.
		ro, err := replay.Read(f, replay.Options{})
		if err != nil {
			return replay.Result{}, false, err
		}
		agent = ro.Agent
		if harness = replay.HarnessFor(agent); harness == "" {
			b.progress("%s: no captured harness for agent %q: -harness-prompt auto skips it", file, agent)
			return replay.Result{}, false, nil
		}
		if _, err := f.Seek(0, io.SeekStart); err != nil {
			return replay.Result{}, false, err
		}
	}
	// Room for any recorded answer, within the server's context.
	opt := replay.Options{MaxTokens: min(1<<16, b.maxModelLen/4)}
	label := "none"
	if harness != "none" {
		h, err := replay.LoadHarness(harness)
		if err != nil {
			return replay.Result{}, false, err
		}
		opt.Harness, label = h, fmt.Sprintf("%s %s", h.CLI, h.Version)
	}
	ro, err := replay.Read(f, opt)
	if err != nil {
		return replay.Result{}, false, err
	}
	b.progress("%s: %d rollouts, %d calls, %d groups; harness prompt %s", filepath.Base(file), len(ro.Sessions), ro.Calls, ro.Groups, label)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return replay.Result{}, false, err
	}
	res := replay.Result{File: file, Agent: ro.Agent, Harness: label, Dialects: b.dialects}
	var base []trace.Group
	for i, d := range b.dialects {
		data := filepath.Join(dir, d)
		// One session at a time, untagged: the server takes the scripted outputs in order,
		// and no tag perturbs the prompts the sessions share.
		drv := &e2e.Driver{Model: "floe-ref", Concurrency: 1, Dialect: d}
		if err := procs.record(ctx, ref, ro.Sessions, data, filepath.Base(file)+" "+d, drv); err != nil {
			return res, false, fmt.Errorf("replay (%s): %w", d, err)
		}
		groups, err := replay.LoadGroups(data)
		if err != nil {
			return res, false, err
		}
		if i == 0 {
			base = groups
			continue
		}
		if err := replay.SameRecording(base, groups); err != nil {
			return res, false, fmt.Errorf("the %s and %s dialects recorded different tokens: %w", b.dialects[0], d, err)
		}
	}
	m, err := replay.Measure(ctx, base, replay.DefaultSettings, b.repeats)
	if err != nil {
		return res, false, err
	}
	res.M = m
	return res, true, nil
}

// write puts REPORT.md and summary.jsonl in the -out folder.
func (b *benchReplay) write(results []replay.Result) error {
	if err := os.MkdirAll(b.out, 0o755); err != nil {
		return err
	}
	var lines strings.Builder
	for _, r := range results {
		lines.WriteString(r.Summary().JSON() + "\n")
	}
	if err := os.WriteFile(filepath.Join(b.out, "summary.jsonl"), []byte(lines.String()), 0o644); err != nil {
		return err
	}
	tokenizer := "the reference server's own byte-level BPE (4k tokens)"
	if b.tokenizer != "" {
		tokenizer = fmt.Sprintf("%s/tokenizer.json (-tokenizer; the ChatML and markup tokens it lacks appended after its vocabulary)", b.tokenizer)
	}
	doc := fmt.Sprintf("# Real agent rollouts through floe: rows per strategy\n\nCommand: `%s` (`make bench-replay`)\n\nMachine: %s\n\nTokenizer: %s\n\n",
		b.command, fmt.Sprintf("%s, %d logical CPUs, %s %s/%s", cpuModel(), runtime.NumCPU(), runtime.Version(), runtime.GOOS, runtime.GOARCH), tokenizer) +
		replayMethod + replay.Markdown(results)
	path := filepath.Join(b.out, "REPORT.md")
	if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
		return err
	}
	b.progress("wrote %s", path)
	return nil
}

// replayMethod says in the report what was measured, and how.
const replayMethod = "Each line of a rollouts file is one trajectory as OpenAI Responses output items\n" +
	"(NeMo Gym's format). Every model call is rebuilt from it: the request is everything\n" +
	"before a run of model outputs (messages, function calls and outputs, reasoning), the\n" +
	"answer is that run. Each call went through `floe serve`'s proxy (in-process) to the\n" +
	"reference inference server in script mode, which answered with the recorded output as\n" +
	"vLLM would: token ids from its tokenizer (above) and log-probs from its seeded model, scored\n" +
	"by teacher forcing. Sessions were replayed one at a time; the rollouts of one\n" +
	"`_ng_task_index` are one GRPO group, rewarded by `reward`. Tool-call arguments are\n" +
	"scripted in Python's json.dumps spacing, as the chat template writes them back into the\n" +
	"history, and `<think>` text the model wrote inline is its reasoning. Without a harness\n" +
	"prompt the requests offer each called function by name only (the files hold no tool\n" +
	"schemas); with one, every call carries the system messages and tool schemas the real\n" +
	"CLI sent in its first request (captured from `make test-harness`,\n" +
	"benchmarks/replay/testdata/harness), the task in place of the test's question.\n" +
	"\n" +
	"All of a file's groups form one step, per strategy and setting, with floe's defaults\n" +
	"otherwise (pad multiple 128, pass cost 1024, grpo advantages). Rows are what the trainer\n" +
	"forwards, padding included; passes are micro-batches per rank; the cut floor is the\n" +
	"fewest rows any cut of the trees to B can forward; pack time is `batcher.Pack` (cut,\n" +
	"pack, balance), the fastest of the repeats, on a shared machine. \"Loss terms =\n" +
	"per_request\" decodes every Arrow micro-batch, builds each loss row's context from its\n" +
	"pred_idx chain (hashed, 128 bits) and compares the multiset of (context, token, log-prob,\n" +
	"advantage, temperature) with the one the recorded calls define: the run fails if any\n" +
	"differs.\n" +
	"\n"
