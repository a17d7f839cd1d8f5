package e2e

import (
	"encoding/json"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const testCommand = "floe-bench e2e -out benchmarks/results/e2e-test -seed 7 -token-budget 65536"

// testRuns builds three runs whose totals and ratios are easy to check by hand:
// rows 153,600 / 38,400 / 15,360 (4.00x, 10.00x), attention cost rows×100 / ×30 / ×20
// (13.33x, 50.00x), train seconds 30 / 12 / 5.566 (2.50x, 5.39x).
func testRuns(withGPU bool) []Run {
	setup := Setup{
		Machine: "Test CPU, 16 cores", Device: "cpu", Model: "tiny-llama 1M", Corpus: "synthetic, 2 groups",
		Seed: 7, Command: testCommand, Calls: 1234, Sessions: 16, TokenBudget: 65536, DPSize: 2,
	}
	if withGPU {
		setup.Device, setup.Machine = "cuda", "Test CPU, 16 cores, NVIDIA H200"
	}
	steps := func(rows [3]int64, attnPerRow, start, stepSec float64) []Step {
		fills := [3]float64{0.9, 0.95, 1}
		imb := [3]float64{1.01, 1.05, 1.02}
		out := make([]Step, 3)
		for i := range out {
			out[i] = Step{
				Step: int64(i + 1), FormedAt: start - 1, FormSeconds: 0.0123,
				Rows: rows[i], PaddedRows: rows[i], LossRows: rows[i] / 4, AttnCost: float64(rows[i]) * attnPerRow,
				MicroBatches: i + 1, Fill: fills[i], Imbalance: imb[i],
				TrainStart: start + float64(i)*stepSec, StepSeconds: stepSec, WaitSeconds: stepSec / 10,
			}
		}
		return out
	}
	started := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	runs := []Run{
		{Name: "e2e-test", Strategy: "per_request", Started: started, WallSeconds: 45, TrainSeconds: 30, Setup: setup,
			Steps: steps([3]int64{40960, 51200, 61440}, 100, 10, 10)},
		{Name: "e2e-test", Strategy: "prefix_merging", Started: started, WallSeconds: 25, TrainSeconds: 12, Setup: setup,
			Steps: steps([3]int64{10240, 12800, 15360}, 30, 10, 4)},
		{Name: "e2e-test", Strategy: "tree", Started: started, WallSeconds: 20, TrainSeconds: 5.566, Setup: setup,
			Steps: steps([3]int64{4096, 5120, 6144}, 20, 10, 2)},
	}
	if withGPU {
		// Samples outside the training window ([10, 40] and [10, 22]) must not count.
		runs[0].GPU = []GPUSample{{T: 5, Utilization: 0}, {T: 15, Utilization: 0.2}, {T: 25, Utilization: 0.3}, {T: 35, Utilization: 0.1}, {T: 45, Utilization: 1}}
		runs[1].GPU = []GPUSample{{T: 12, Utilization: 0.8}, {T: 16, Utilization: 0.9}, {T: 20, Utilization: 1}, {T: 30, Utilization: 0}}
		// tree has no samples: a partial GPU set must show n/a for it, not 0%.
	}
	return runs
}

// writeRuns stores runs as <dir>/runs/<file>.json; names default to the strategy.
func writeRuns(t *testing.T, dir string, runs []Run, names ...string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Join(dir, "runs"), 0o755); err != nil {
		t.Fatal(err)
	}
	for i, r := range runs {
		name := r.Strategy
		if i < len(names) {
			name = names[i]
		}
		data, err := json.MarshalIndent(r, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "runs", name+".json"), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func loadAndReport(t *testing.T, dir string) string {
	t.Helper()
	runs, err := LoadRuns(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := WriteReport(dir, runs); err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(dir, ReportFile))
	if err != nil {
		t.Fatal(err)
	}
	return string(doc)
}

func wantContains(t *testing.T, doc string, wants ...string) {
	t.Helper()
	for _, w := range wants {
		if !strings.Contains(doc, w) {
			t.Errorf("REPORT.md lacks %q", w)
		}
	}
	if t.Failed() {
		t.Logf("REPORT.md:\n%s", doc)
	}
}

func checkPNG(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }() // read only
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	want := [2]int{int(PlotWidth.Dots(PlotDPI) + 0.5), int(PlotHeight.Dots(PlotDPI) + 0.5)}
	if got := [2]int{img.Bounds().Dx(), img.Bounds().Dy()}; got != want || want != [2]int{1200, 600} {
		t.Errorf("%s: %dx%d px, want %dx%d (1200x600)", path, got[0], got[1], want[0], want[1])
	}
}

func TestReportWithGPU(t *testing.T) {
	dir := t.TempDir()
	writeRuns(t, dir, testRuns(true))
	doc := loadAndReport(t, dir)
	wantContains(t, doc,
		"# End-to-end benchmark: e2e-test",
		"- Machine: Test CPU, 16 cores, NVIDIA H200", "- Device: cuda", "- Model: tiny-llama 1M",
		"- Corpus: synthetic, 2 groups", "- Seed: 7", "- Token budget: 65,536 rows per micro-batch",
		"- Data-parallel size: 2", "- Replayed: 1,234 calls in 16 sessions",
		"```sh\n"+testCommand+"\n```",
		// rows, attention, s/step, train s, wait, GPU busy (window only), rows-weighted fill, worst imbalance, ratios
		"| per_request | 154k | 15.4M | 10.0 | 30.0 | 10.0% | 20.0% | 95.7% | 1.050 | 1.00x | 1.00x | 1.00x |",
		"| prefix_merging | 38.4k | 1.15M | 4.00 | 12.0 | 10.0% | 90.0% | 95.7% | 1.050 | 4.00x | 13.33x | 2.50x |",
		"| tree | 15.4k | 307k | 2.00 | 5.57 | 10.0% | n/a | 95.7% | 1.050 | 10.00x | 50.00x | 5.39x |",
		"NVIDIA Polar reports 5.39x less training time from prefix merging and GPU utilization going from 20.4% to 87.7%.",
		"This run: training time per_request / prefix_merging 2.50x, per_request / tree 5.39x; GPU busy per_request 20.0%, prefix_merging 90.0%, tree n/a.",
		"![GPU utilization during training, per strategy](gpu_utilization.png)",
		"![Trainer seconds per step, per strategy](step_seconds.png)",
		"![Rows forwarded per step, per strategy](rows_per_step.png)",
		"### per_request", "### prefix_merging", "### tree",
		"| 1 | 40,960 | 10,240 | 1 | 90.0% | 1.010 | 0.0123 | 10.0 | 1.00 |",
		"| 3 | 6,144 | 1,536 | 3 | 100.0% | 1.020 | 0.0123 | 2.00 | 0.200 |",
	)
	for _, bad := range []string{"WARNING", "No GPU", "on a CPU"} {
		if strings.Contains(doc, bad) {
			t.Errorf("REPORT.md of an agreeing GPU run says %q", bad)
		}
	}
	for _, f := range []string{GPUPlotFile, StepsPlotFile, RowsPlotFile} {
		checkPNG(t, filepath.Join(dir, f))
	}
}

func TestReportWithoutGPU(t *testing.T) {
	dir := t.TempDir()
	// A utilization plot from an earlier GPU run in the same folder must not survive.
	if err := os.WriteFile(filepath.Join(dir, GPUPlotFile), []byte("stale"), 0o644); err != nil {
		t.Fatal(err)
	}
	writeRuns(t, dir, testRuns(false))
	doc := loadAndReport(t, dir)
	wantContains(t, doc,
		"- Device: cpu",
		"| tree | 15.4k | 307k | 2.00 | 5.57 | 10.0% | n/a | 95.7% | 1.050 | 10.00x | 50.00x | 5.39x |",
		"GPU busy n/a (no GPU).",
		"No GPU: no run recorded GPU samples",
		"only the ratios between strategies count here; absolute times mean something only on a GPU",
	)
	if strings.Contains(doc, GPUPlotFile) {
		t.Errorf("REPORT.md without GPU samples embeds %s", GPUPlotFile)
	}
	if _, err := os.Stat(filepath.Join(dir, GPUPlotFile)); !os.IsNotExist(err) {
		t.Errorf("%s exists without GPU samples (stat: %v)", GPUPlotFile, err)
	}
	for _, f := range []string{StepsPlotFile, RowsPlotFile} {
		checkPNG(t, filepath.Join(dir, f))
	}
}

func TestReportOrdersRunsByStrategyNotFileName(t *testing.T) {
	dir := t.TempDir()
	runs := testRuns(false)
	writeRuns(t, dir, []Run{runs[2], runs[1], runs[0]}, "a", "b", "c")
	got, err := LoadRuns(dir)
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	for _, r := range got {
		order = append(order, r.Strategy)
	}
	if strings.Join(order, ",") != "per_request,prefix_merging,tree" {
		t.Errorf("order %v, want per_request, prefix_merging, tree", order)
	}
}

func TestReportWarnsWhenRunsDisagree(t *testing.T) {
	dir := t.TempDir()
	runs := testRuns(false)
	runs[2].Setup.Seed = 8
	runs[2].Setup.Corpus = "synthetic, 4 groups"
	runs[2].Setup.Command = testCommand + " -strategy tree"
	writeRuns(t, dir, runs)
	doc := loadAndReport(t, dir)
	wantContains(t, doc,
		"**WARNING: the runs differ in corpus, seed.",
		"- Seed: differs: per_request: 7; prefix_merging: 7; tree: 8",
		"tree:\n\n```sh\n"+testCommand+" -strategy tree\n```",
	)
}

func TestReportLoadRunsErrorsNameTheFile(t *testing.T) {
	t.Run("bad JSON", func(t *testing.T) {
		dir := t.TempDir()
		writeRuns(t, dir, testRuns(false)[:1])
		bad := filepath.Join(dir, "runs", "tree.json")
		if err := os.WriteFile(bad, []byte(`{"strategy": "tree", "steps": [`), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadRuns(dir); err == nil || !strings.Contains(err.Error(), bad) {
			t.Errorf("LoadRuns = %v, want an error naming %s", err, bad)
		}
	})
	t.Run("unknown strategy", func(t *testing.T) {
		dir := t.TempDir()
		runs := testRuns(false)
		runs[1].Strategy = "ppo"
		writeRuns(t, dir, runs, "per_request", "ppo")
		bad := filepath.Join(dir, "runs", "ppo.json")
		if _, err := LoadRuns(dir); err == nil || !strings.Contains(err.Error(), bad) || !strings.Contains(err.Error(), `unknown strategy "ppo"`) {
			t.Errorf("LoadRuns = %v, want an unknown-strategy error naming %s", err, bad)
		}
	})
	t.Run("duplicate strategy", func(t *testing.T) {
		dir := t.TempDir()
		runs := testRuns(false)
		writeRuns(t, dir, []Run{runs[2], runs[2]}, "tree", "tree-again")
		if _, err := LoadRuns(dir); err == nil || !strings.Contains(err.Error(), "a second tree run") {
			t.Errorf("LoadRuns = %v, want a duplicate error", err)
		}
	})
	t.Run("no runs", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.MkdirAll(filepath.Join(dir, "runs"), 0o755); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadRuns(dir); err == nil || !strings.Contains(err.Error(), "no <strategy>.json") {
			t.Errorf("LoadRuns = %v, want a no-runs error", err)
		}
		if _, err := LoadRuns(filepath.Join(dir, "missing")); err == nil {
			t.Error("LoadRuns of a missing folder succeeded")
		}
	})
}

func TestReportWithoutPerRequestOrSteps(t *testing.T) {
	dir := t.TempDir()
	runs := testRuns(false)[1:]
	runs[1].Steps = nil
	if err := WriteReport(dir, runs); err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(dir, ReportFile))
	if err != nil {
		t.Fatal(err)
	}
	wantContains(t, string(doc),
		"| tree | 0 | 0 | n/a | 5.57 | n/a | n/a | n/a | n/a | n/a | n/a | n/a |",
		"No steps recorded.",
	)
	for _, f := range []string{StepsPlotFile, RowsPlotFile} {
		checkPNG(t, filepath.Join(dir, f))
	}
	if err := WriteReport(dir, nil); err == nil {
		t.Error("WriteReport without runs succeeded")
	}
}

func TestReportNumberFormats(t *testing.T) {
	for _, tt := range []struct {
		got, want string
	}{
		{compact(153600), "154k"}, {compact(999.6), "1k"}, {compact(1234567), "1.23M"}, {compact(2.36e12), "2.36T"},
		{compact(512), "512"}, {compact(0), "0"}, {compact(math.NaN()), "n/a"},
		{sig3(1234), "1230"}, {sig3(12.345), "12.3"}, {sig3(0.0012345), "0.00123"}, {sig3(5.566), "5.57"}, {sig3(0), "0"},
		{grouped(1234567), "1,234,567"}, {grouped(-1234), "-1,234"}, {grouped(999), "999"},
		{fmtRatio(30 / 5.566), "5.39x"}, {percent(0.877), "87.7%"},
	} {
		if tt.got != tt.want {
			t.Errorf("got %q, want %q", tt.got, tt.want)
		}
	}
}
