package main

import (
	"bytes"
	"context"
	"encoding/json"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/floe-rl/floe/benchmarks/e2e"
)

func TestReportWritesReportAndSummaries(t *testing.T) {
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "runs"), 0o755); err != nil {
		t.Fatal(err)
	}
	setup := e2e.Setup{Machine: "test", Device: "cpu", Model: "tiny", Corpus: "synthetic", Seed: 3,
		Command: "floe-bench e2e -out " + dir, Calls: 10, Sessions: 2, TokenBudget: 4096, DPSize: 1}
	for i, r := range []struct {
		strategy string
		rows     int64
		train    float64
	}{{"per_request", 8000, 20}, {"prefix_merging", 2000, 8}, {"tree", 1000, 4}} {
		run := e2e.Run{Name: "e2e-cmd", Strategy: r.strategy, TrainSeconds: r.train, Setup: setup,
			Steps: []e2e.Step{{Step: 1, Rows: r.rows, AttnCost: float64(r.rows), Fill: 0.5, Imbalance: 1,
				TrainStart: 1, StepSeconds: r.train, WaitSeconds: float64(i)}}}
		data, err := json.Marshal(run)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "runs", r.strategy+".json"), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	var stdout, stderr bytes.Buffer
	if err := runReport(context.Background(), []string{"-dir", dir}, &stdout, &stderr); err != nil {
		t.Fatalf("runReport: %v\nstderr: %s", err, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	report := filepath.Join(dir, "REPORT.md")
	if len(lines) != 4 || lines[0] != report {
		t.Fatalf("stdout: want the report path then one line per strategy, got:\n%s", stdout.String())
	}
	for i, want := range []string{
		"per_request: 8k rows (1.00x vs per_request), train 20.0 s (1.00x)",
		"prefix_merging: 2k rows (4.00x vs per_request), train 8.00 s (2.50x)",
		"tree: 1k rows (8.00x vs per_request), train 4.00 s (5.00x)",
	} {
		if !strings.HasPrefix(lines[i+1], want) {
			t.Errorf("summary line %d = %q, want it to start with %q", i+1, lines[i+1], want)
		}
	}
	doc, err := os.ReadFile(report)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(doc), "# End-to-end benchmark: e2e-cmd") || !strings.Contains(string(doc), "floe-bench e2e -out "+dir) {
		t.Errorf("REPORT.md lacks the name or the command:\n%s", doc)
	}
	for _, name := range []string{"step_seconds.png", "rows_per_step.png"} {
		f, err := os.Open(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		_, err = png.Decode(f)
		_ = f.Close() // read only
		if err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "gpu_utilization.png")); !os.IsNotExist(err) {
		t.Errorf("gpu_utilization.png without GPU samples (stat: %v)", err)
	}
}

func TestReportErrors(t *testing.T) {
	empty := t.TempDir()
	for _, tt := range []struct {
		args []string
		want string
	}{
		{nil, "-dir is required"},
		{[]string{"-dir", empty}, "load runs"},
		{[]string{"-dir", empty, "extra"}, "unexpected arguments"},
		{[]string{"-nope"}, "flag provided but not defined"},
	} {
		var stdout, stderr bytes.Buffer
		err := runReport(context.Background(), tt.args, &stdout, &stderr)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("runReport(%q) = %v, want an error mentioning %q", tt.args, err, tt.want)
		}
	}
}
