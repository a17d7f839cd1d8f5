package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestPackPrintsTableAndWritesReports(t *testing.T) {
	dir := t.TempDir()
	report, stats := filepath.Join(dir, "REPORT.md"), filepath.Join(dir, "STATS.md")
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"-groups", "2", "-repeats", "1", "-out", report, "-corpus-stats", stats}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d, stderr:\n%s", code, stderr.String())
	}
	for _, s := range []string{"per_request", "prefix_merging", "tree"} {
		if !strings.Contains(stdout.String(), "| "+s+" |") {
			t.Errorf("table lacks %s:\n%s", s, stdout.String())
		}
	}
	if !strings.Contains(stderr.String(), "generating corpus: 2 groups") {
		t.Errorf("no progress on stderr: %q", stderr.String())
	}
	doc, err := os.ReadFile(report)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(doc), stdout.String()) ||
		!strings.Contains(string(doc), "floe-bench -seed 1 -groups 2 -groups-per-step 0 -token-budget 65536 -pad-multiple 128 -dp-size 8 -advantage grpo -repeats 1") {
		t.Errorf("report does not hold the printed table and the command:\n%s", doc)
	}
	if st, err := os.ReadFile(stats); err != nil || !strings.Contains(string(st), "sessions") {
		t.Errorf("corpus stats: %v\n%s", err, st)
	}
}

func TestUsageErrors(t *testing.T) {
	tests := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"frobnicate"}, 2, `unknown command "frobnicate"`},
		{[]string{"-advantage", "ppo"}, 1, `unknown advantage "ppo"`},
		{[]string{"-token-budget", "1000"}, 1, "multiple of the pad multiple"},
		{[]string{"-groups", "2", "extra"}, 1, `unexpected arguments ["extra"]`},
		{[]string{"e2e", "-strategies", "tree,bfs"}, 1, `bfs`},
		{[]string{"e2e", "-corpus", "huge", "-trainer", "main.go"}, 1, `-corpus: unknown corpus "huge" (want small, cpu, medium, default or longtool)`},
		{[]string{"e2e", "-token-budget", "1000"}, 1, "multiple of the pad multiple"},
		{[]string{"e2e", "-groups-per-step", "0"}, 1, "-groups-per-step and -concurrency must be at least 1"},
		{[]string{"e2e", "-strategy", "tree"}, 1, "flag provided but not defined: -strategy"},
		{[]string{"report"}, 1, "-dir"},
		{[]string{"proxy", "-requests", "many"}, 1, `invalid value "many" for flag -requests`},
		{[]string{"replay"}, 1, "-rollouts: give at least one rollouts file"},
		{[]string{"replay", "-rollouts", "x.jsonl", "-harness-prompt", "codex"}, 1, `no captured harness "codex" (have claude-code, pi)`},
		{[]string{"replay", "-rollouts", "x.jsonl", "-dialects", "gemini"}, 1, `unknown dialect "gemini"`},
	}
	for _, tt := range tests {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), tt.args, &stdout, &stderr); code != tt.code || !strings.Contains(stderr.String(), tt.want) {
			t.Errorf("floe-bench %v: exit %d, stderr %q; want exit %d mentioning %q", tt.args, code, stderr.String(), tt.code, tt.want)
		}
	}
	var stdout bytes.Buffer
	if code := run(context.Background(), []string{"version"}, &stdout, &stdout); code != 0 || !strings.HasPrefix(stdout.String(), "floe-bench ") {
		t.Errorf("floe-bench version: exit %d, %q", code, stdout.String())
	}
}

// TestHelpDocumentsEveryCommand: floe-bench -h names its commands above the packing
// benchmark's flags, and each command's -h exits 0 with its own flags.
func TestHelpDocumentsEveryCommand(t *testing.T) {
	tests := []struct {
		args []string
		want []string
	}{
		{[]string{"-h"}, []string{"e2e", "report", "proxy", "-token-budget", "-pad-multiple", "-dp-size", "-advantage", "-repeats"}},
		{[]string{"e2e", "-h"}, []string{"usage: floe-bench e2e", "-token-budget", "-pad-multiple", "-groups-per-step", "-strategies", "-trainer-args"}},
		{[]string{"report", "-h"}, []string{"usage: floe-bench report", "-dir"}},
		{[]string{"proxy", "-h"}, []string{"usage: floe-bench proxy", "-concurrency", "-request-bytes"}},
		{[]string{"replay", "-h"}, []string{"usage: floe-bench replay", "-rollouts", "-harness-prompt", "-dialects", "-out"}},
	}
	for _, tt := range tests {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), tt.args, &stdout, &stderr); code != 0 {
			t.Errorf("floe-bench %v: exit %d, stderr %q", tt.args, code, stderr.String())
		}
		for _, w := range tt.want {
			if !strings.Contains(stderr.String(), w) {
				t.Errorf("floe-bench %v: help lacks %q:\n%s", tt.args, w, stderr.String())
			}
		}
	}
}
