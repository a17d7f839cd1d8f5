package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/floe-rl/floe/batcher"
)

// Plot files WriteReport writes next to REPORT.md.
const (
	GPUPlotFile   = "gpu_utilization.png"
	StepsPlotFile = "step_seconds.png"
	RowsPlotFile  = "rows_per_step.png"
	ReportFile    = "REPORT.md"
)

// LoadRuns reads every <dir>/runs/*.json and returns the runs in report order
// (per_request, prefix_merging, tree).
func LoadRuns(dir string) ([]Run, error) {
	runsDir := filepath.Join(dir, "runs")
	entries, err := os.ReadDir(runsDir)
	if err != nil {
		return nil, fmt.Errorf("load runs: %w", err)
	}
	var runs []Run
	from := map[string]string{} // strategy → the file it came from, to name both on a duplicate
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		path := filepath.Join(runsDir, e.Name())
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("load runs: %w", err)
		}
		var r Run
		if err := json.Unmarshal(data, &r); err != nil {
			return nil, fmt.Errorf("load runs: %s: %w", path, err)
		}
		if _, err := batcher.ParseStrategy(r.Strategy); err != nil {
			return nil, fmt.Errorf("load runs: %s: %w", path, err)
		}
		if prev, ok := from[r.Strategy]; ok {
			return nil, fmt.Errorf("load runs: %s: a second %s run (the first is %s)", path, r.Strategy, prev)
		}
		from[r.Strategy] = path
		runs = append(runs, r)
	}
	if len(runs) == 0 {
		return nil, fmt.Errorf("load runs: no <strategy>.json in %s", runsDir)
	}
	sortRuns(runs)
	return runs, nil
}

func strategyRank(s string) int {
	return slices.Index(batcher.Strategies, batcher.Strategy(s))
}

func sortRuns(runs []Run) {
	slices.SortStableFunc(runs, func(a, b Run) int { return strategyRank(a.Strategy) - strategyRank(b.Strategy) })
}

// TrainingWindow is the span from the trainer's first step start to its last step end,
// in seconds since Started; ok is false without steps.
func (r Run) TrainingWindow() (start, end float64, ok bool) {
	if len(r.Steps) == 0 {
		return 0, 0, false
	}
	start, end = math.Inf(1), math.Inf(-1)
	for _, s := range r.Steps {
		start = min(start, s.TrainStart)
		end = max(end, s.TrainStart+s.StepSeconds)
	}
	return start, end, true
}

// Summary is one run reduced to the report's side-by-side row. A figure that cannot be
// computed (no steps, no GPU samples, no per_request run to compare with) is NaN.
type Summary struct {
	Strategy        string
	Steps           int
	Rows            int64   // Σ Rows
	AttnCost        float64 // Σ AttnCost
	MeanStepSeconds float64
	TrainSeconds    float64
	WaitShare       float64 // Σ WaitSeconds / Σ StepSeconds
	GPUBusy         float64 // mean utilization over the training window, 0..1
	Fill            float64 // rows-weighted mean
	Imbalance       float64 // worst step
	// Ratios against per_request: its value over this run's, so >1 means this run needed less.
	RowsRatio, AttnRatio, TrainRatio float64
}

// Summarize reduces each run to its Summary, in strategy order (per_request, prefix_merging,
// tree), ratios taken against the per_request run.
func Summarize(runs []Run) []Summary {
	runs = slices.Clone(runs)
	sortRuns(runs) // per_request first: the others are measured against it
	out := make([]Summary, len(runs))
	for i, r := range runs {
		out[i] = summarize(r)
	}
	base := -1
	for i, s := range out {
		if s.Strategy == string(batcher.PerRequest) {
			base = i
		}
	}
	for i := range out {
		out[i].RowsRatio, out[i].AttnRatio, out[i].TrainRatio = math.NaN(), math.NaN(), math.NaN()
		if base < 0 {
			continue
		}
		b := out[base]
		out[i].RowsRatio = ratio(float64(b.Rows), float64(out[i].Rows))
		out[i].AttnRatio = ratio(b.AttnCost, out[i].AttnCost)
		out[i].TrainRatio = ratio(b.TrainSeconds, out[i].TrainSeconds)
	}
	return out
}

func ratio(base, v float64) float64 {
	if v <= 0 || base <= 0 {
		return math.NaN()
	}
	return base / v
}

func summarize(r Run) Summary {
	s := Summary{Strategy: r.Strategy, Steps: len(r.Steps), TrainSeconds: r.TrainSeconds}
	var stepSec, waitSec, fillRows float64
	for _, st := range r.Steps {
		s.Rows += st.Rows
		s.AttnCost += st.AttnCost
		stepSec += st.StepSeconds
		waitSec += st.WaitSeconds
		fillRows += st.Fill * float64(st.Rows)
		s.Imbalance = max(s.Imbalance, st.Imbalance)
	}
	s.MeanStepSeconds, s.WaitShare, s.Fill = math.NaN(), math.NaN(), math.NaN()
	if len(r.Steps) > 0 {
		s.MeanStepSeconds = stepSec / float64(len(r.Steps))
	} else {
		s.Imbalance = math.NaN()
	}
	if stepSec > 0 {
		s.WaitShare = waitSec / stepSec
	}
	if s.Rows > 0 {
		s.Fill = fillRows / float64(s.Rows)
	}
	s.GPUBusy = gpuBusy(r)
	return s
}

// gpuBusy averages utilization over the training window only, so that the replay before
// the first step and the idle tail do not dilute what the trainer made of the device.
func gpuBusy(r Run) float64 {
	start, end, ok := r.TrainingWindow()
	if !ok {
		return math.NaN()
	}
	var sum float64
	var n int
	for _, g := range r.GPU {
		if g.T >= start && g.T <= end {
			sum += g.Utilization
			n++
		}
	}
	if n == 0 {
		return math.NaN()
	}
	return sum / float64(n)
}

// String is the one-line summary `floe-bench report` prints per strategy.
func (s Summary) String() string {
	return fmt.Sprintf("%s: %s rows (%s vs per_request), train %s s (%s), %s s/step, data wait %s, GPU busy %s",
		s.Strategy, compact(float64(s.Rows)), fmtRatio(s.RowsRatio), sig3(s.TrainSeconds), fmtRatio(s.TrainRatio),
		sig3(s.MeanStepSeconds), percent(s.WaitShare), percent(s.GPUBusy))
}

// WriteReport writes <dir>/REPORT.md and its plots for runs, which must hold at most one
// run per strategy.
func WriteReport(dir string, runs []Run) error {
	if len(runs) == 0 {
		return errors.New("write report: no runs")
	}
	runs = slices.Clone(runs)
	seen := map[string]bool{}
	for _, r := range runs {
		if _, err := batcher.ParseStrategy(r.Strategy); err != nil {
			return fmt.Errorf("write report: run %q: %w", r.Name, err)
		}
		if seen[r.Strategy] {
			return fmt.Errorf("write report: two %s runs", r.Strategy)
		}
		seen[r.Strategy] = true
	}
	sortRuns(runs)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("write report: %w", err)
	}

	hasGPU := slices.ContainsFunc(runs, func(r Run) bool { return len(r.GPU) > 0 })
	gpuPath := filepath.Join(dir, GPUPlotFile)
	if hasGPU {
		if err := writePlot(gpuPath, runs, gpuPlot); err != nil {
			return fmt.Errorf("write report: %w", err)
		}
	} else if err := os.Remove(gpuPath); err != nil && !errors.Is(err, fs.ErrNotExist) {
		// A plot left from an earlier GPU run in the same folder would contradict this report.
		return fmt.Errorf("write report: %w", err)
	}
	if err := writePlot(filepath.Join(dir, StepsPlotFile), runs, stepSecondsPlot); err != nil {
		return fmt.Errorf("write report: %w", err)
	}
	if err := writePlot(filepath.Join(dir, RowsPlotFile), runs, rowsPlot); err != nil {
		return fmt.Errorf("write report: %w", err)
	}

	doc := reportMarkdown(dir, runs, hasGPU)
	if err := os.WriteFile(filepath.Join(dir, ReportFile), []byte(doc), 0o644); err != nil {
		return fmt.Errorf("write report: %w", err)
	}
	return nil
}

func reportMarkdown(dir string, runs []Run, hasGPU bool) string {
	sums := Summarize(runs)
	var b strings.Builder
	name := runs[0].Name
	if name == "" {
		name = filepath.Base(dir)
	}
	fmt.Fprintf(&b, "# End-to-end benchmark: %s\n\n", name)

	writeSetup(&b, runs)

	b.WriteString("## Strategies side by side\n\n")
	b.WriteString("| strategy | rows forwarded | attention cost Σ(depth+1) | trainer s/step | train s | data wait | GPU busy | fill | imbalance | rows vs per_request | attention vs per_request | train time vs per_request |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, s := range sums {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
			s.Strategy, compact(float64(s.Rows)), compact(s.AttnCost), sig3(s.MeanStepSeconds), sig3(s.TrainSeconds),
			percent(s.WaitShare), percent(s.GPUBusy), percent(s.Fill), fixed3(s.Imbalance),
			fmtRatio(s.RowsRatio), fmtRatio(s.AttnRatio), fmtRatio(s.TrainRatio))
	}
	b.WriteString("\nData wait is Σ wait / Σ step seconds; GPU busy is the mean NVML utilization between the trainer's first step start and its last step end; fill is rows-weighted; imbalance is the worst step's heaviest rank over the mean rank. A ratio is per_request's figure over the strategy's.\n\n")

	b.WriteString(polarLine(sums, hasGPU))
	b.WriteString("\n")
	b.WriteString(sameSamplesLine(runs))
	if !hasGPU {
		b.WriteString("No GPU: no run recorded GPU samples, so there is no GPU busy share and no utilization plot.\n\n")
	}
	if slices.ContainsFunc(runs, func(r Run) bool { return strings.EqualFold(strings.TrimSpace(r.Setup.Device), "cpu") }) {
		b.WriteString("This ran the trainer on a CPU: only the ratios between strategies count here; absolute times mean something only on a GPU.\n\n")
	}

	b.WriteString("## Plots\n\n")
	if hasGPU {
		fmt.Fprintf(&b, "![GPU utilization during training, per strategy](%s)\n\n", GPUPlotFile)
	}
	fmt.Fprintf(&b, "![Trainer seconds per step, per strategy](%s)\n\n", StepsPlotFile)
	fmt.Fprintf(&b, "![Rows forwarded per step, per strategy](%s)\n\n", RowsPlotFile)

	b.WriteString("## Steps\n")
	for _, r := range runs {
		fmt.Fprintf(&b, "\n### %s\n\n", r.Strategy)
		if len(r.Steps) == 0 {
			b.WriteString("No steps recorded.\n")
			continue
		}
		b.WriteString("| step | rows | loss rows | micro-batches | fill | imbalance | form s | step s | wait s | loss |\n")
		b.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, st := range r.Steps {
			fmt.Fprintf(&b, "| %d | %s | %s | %d | %s | %s | %s | %s | %s | %.6f |\n",
				st.Step, grouped(st.Rows), grouped(st.LossRows), st.MicroBatches, percent(st.Fill), fixed3(st.Imbalance),
				sig3(st.FormSeconds), sig3(st.StepSeconds), sig3(st.WaitSeconds), st.Loss)
		}
	}
	return b.String()
}

// sameSamplesLine checks what makes the comparison fair: every strategy trained the same
// loss tokens per step as per_request, and (the trainer reporting its loss) reached the
// same loss; it states the largest loss difference seen, or what differed.
func sameSamplesLine(runs []Run) string {
	var base *Run
	for i := range runs {
		if runs[i].Strategy == "per_request" {
			base = &runs[i]
		}
	}
	if base == nil {
		return ""
	}
	worst, compared := 0.0, 0
	for _, r := range runs {
		if r.Strategy == base.Strategy {
			continue
		}
		if len(r.Steps) != len(base.Steps) {
			return fmt.Sprintf("**%s trained %d steps, per_request %d: the runs did not train the same samples.**\n\n", r.Strategy, len(r.Steps), len(base.Steps))
		}
		for i, st := range r.Steps {
			if st.LossRows != base.Steps[i].LossRows {
				return fmt.Sprintf("**Step %d: %s trained %d loss tokens, per_request %d: the runs did not train the same samples.**\n\n",
					st.Step, r.Strategy, st.LossRows, base.Steps[i].LossRows)
			}
			worst = max(worst, math.Abs(st.Loss-base.Steps[i].Loss))
			compared++
		}
	}
	if compared == 0 {
		return ""
	}
	return fmt.Sprintf("Same samples: every strategy trained per_request's loss tokens in every step, and its per-step loss differs from per_request's by at most %.2g.\n\n", worst)
}

// writeSetup states what ran. Fields the runs agree on are given once; others per strategy,
// and a differing corpus, seed or model gets a warning since it voids the comparison.
func writeSetup(b *strings.Builder, runs []Run) {
	b.WriteString("## How this was run\n\n")
	var differ []string
	for _, f := range []struct {
		name string
		get  func(Setup) string
	}{
		{"corpus", func(s Setup) string { return s.Corpus }},
		{"seed", func(s Setup) string { return strconv.FormatInt(s.Seed, 10) }},
		{"model", func(s Setup) string { return s.Model }},
	} {
		if _, same := agreed(runs, f.get); !same {
			differ = append(differ, f.name)
		}
	}
	if len(differ) > 0 {
		fmt.Fprintf(b, "> **WARNING: the runs differ in %s. They did not train on the same thing, so the comparison below is not like for like.**\n\n",
			strings.Join(differ, ", "))
	}
	fmt.Fprintf(b, "Started %s.\n\n", runs[0].Started.UTC().Format("2006-01-02 15:04 MST"))
	line := func(label string, get func(Setup) string) {
		fmt.Fprintf(b, "- %s: %s\n", label, describe(runs, get))
	}
	line("Machine", func(s Setup) string { return s.Machine })
	line("Device", func(s Setup) string { return s.Device })
	line("Model", func(s Setup) string { return s.Model })
	line("Corpus", func(s Setup) string { return s.Corpus })
	line("Seed", func(s Setup) string { return strconv.FormatInt(s.Seed, 10) })
	line("Token budget", func(s Setup) string { return grouped(int64(s.TokenBudget)) + " rows per micro-batch" })
	line("Data-parallel size", func(s Setup) string { return strconv.Itoa(s.DPSize) })
	line("Replayed", func(s Setup) string {
		return fmt.Sprintf("%s calls in %s sessions", grouped(int64(s.Calls)), grouped(int64(s.Sessions)))
	})
	if cmd, same := agreed(runs, func(s Setup) string { return s.Command }); same {
		fmt.Fprintf(b, "\nCommand:\n\n```sh\n%s\n```\n\n", cmd)
		return
	}
	b.WriteString("\nCommands:\n")
	for _, r := range runs {
		fmt.Fprintf(b, "\n%s:\n\n```sh\n%s\n```\n", r.Strategy, r.Setup.Command)
	}
	b.WriteString("\n")
}

func agreed(runs []Run, get func(Setup) string) (string, bool) {
	v := get(runs[0].Setup)
	for _, r := range runs[1:] {
		if get(r.Setup) != v {
			return "", false
		}
	}
	return v, true
}

func describe(runs []Run, get func(Setup) string) string {
	if v, same := agreed(runs, get); same {
		return orUnknown(v)
	}
	parts := make([]string, len(runs))
	for i, r := range runs {
		parts[i] = r.Strategy + ": " + orUnknown(get(r.Setup))
	}
	return "differs: " + strings.Join(parts, "; ")
}

func orUnknown(s string) string {
	if strings.TrimSpace(s) == "" {
		return "(not recorded)"
	}
	return s
}

// polarLine sets this run next to NVIDIA Polar's published figures without claiming
// either reproduces the other: the setups differ.
func polarLine(sums []Summary, hasGPU bool) string {
	get := func(strategy string) (Summary, bool) {
		i := slices.IndexFunc(sums, func(s Summary) bool { return s.Strategy == strategy })
		if i < 0 {
			return Summary{}, false
		}
		return sums[i], true
	}
	trainRatio := func(strategy string) string {
		if s, ok := get(strategy); ok {
			return fmtRatio(s.TrainRatio)
		}
		return "n/a (not run)"
	}
	busy := func(strategy string) string {
		if s, ok := get(strategy); ok {
			return percent(s.GPUBusy)
		}
		return "n/a (not run)"
	}
	var b strings.Builder
	b.WriteString("NVIDIA Polar reports 5.39x less training time from prefix merging and GPU utilization going from 20.4% to 87.7%. ")
	fmt.Fprintf(&b, "This run: training time per_request / prefix_merging %s, per_request / tree %s; ",
		trainRatio(string(batcher.PrefixMerging)), trainRatio(string(batcher.Tree)))
	if hasGPU {
		fmt.Fprintf(&b, "GPU busy per_request %s, prefix_merging %s, tree %s.\n",
			busy(string(batcher.PerRequest)), busy(string(batcher.PrefixMerging)), busy(string(batcher.Tree)))
	} else {
		b.WriteString("GPU busy n/a (no GPU).\n")
	}
	return b.String()
}

// roundSig rounds x to n significant digits.
func roundSig(x float64, n int) float64 {
	if x == 0 || math.IsNaN(x) || math.IsInf(x, 0) {
		return x
	}
	p := math.Pow(10, float64(n-1)-math.Floor(math.Log10(math.Abs(x))))
	return math.Round(x*p) / p
}

// sig3 writes x with 3 significant digits, keeping every integer digit (1234 → 1230).
func sig3(x float64) string {
	if math.IsNaN(x) {
		return "n/a"
	}
	r := roundSig(x, 3)
	if r == 0 {
		return "0"
	}
	decimals := max(0, 2-int(math.Floor(math.Log10(math.Abs(r)))))
	return strconv.FormatFloat(r, 'f', decimals, 64)
}

// compact writes x with 3 significant digits and a k/M/G/T suffix, as the packing report does.
func compact(x float64) string {
	if math.IsNaN(x) {
		return "n/a"
	}
	r := roundSig(x, 3)
	suffixes := []string{"", "k", "M", "G", "T"}
	i := 0
	for i < len(suffixes)-1 && math.Abs(r) >= 1000 {
		r /= 1000
		i++
	}
	s := sig3(r)
	if strings.Contains(s, ".") {
		s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	}
	return s + suffixes[i]
}

// grouped writes n with thousands separators.
func grouped(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	if neg {
		b.WriteByte('-')
	}
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}

func percent(x float64) string {
	if math.IsNaN(x) {
		return "n/a"
	}
	return fmt.Sprintf("%.1f%%", 100*x)
}

func fmtRatio(x float64) string {
	if math.IsNaN(x) {
		return "n/a"
	}
	return fmt.Sprintf("%.2fx", x)
}

func fixed3(x float64) string {
	if math.IsNaN(x) {
		return "n/a"
	}
	return fmt.Sprintf("%.3f", x)
}
