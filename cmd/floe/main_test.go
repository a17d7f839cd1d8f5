package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestBenchPrintsTableAndWritesReports(t *testing.T) {
	dir := t.TempDir()
	report, stats := filepath.Join(dir, "REPORT.md"), filepath.Join(dir, "STATS.md")
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"bench", "-groups", "2", "-repeats", "1", "-out", report, "-corpus-stats", stats}, &stdout, &stderr)
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
	if !strings.Contains(string(doc), stdout.String()) || !strings.Contains(string(doc), "floe bench -seed 1 -groups 2") {
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
		{nil, 2, "usage: floe"},
		{[]string{"frobnicate"}, 2, `unknown command "frobnicate"`},
		{[]string{"bench", "-advantage", "ppo"}, 1, `unknown advantage "ppo"`},
		{[]string{"bench", "-token-budget", "1000"}, 1, "multiple of the pad multiple"},
		{[]string{"serve", "-engine", "tgi", "-data-dir", t.TempDir()}, 1, `unknown inference engine "tgi"`},
		{[]string{"proxy", "-engine", "tgi"}, 1, `unknown inference engine "tgi"`},
		{[]string{"serve", "-group-timeout", "-1s", "-data-dir", t.TempDir()}, 1, "group timeout -1s must not be negative"},
		{[]string{"bench", "e2e", "-strategies", "tree,bfs"}, 1, `bfs`},
		{[]string{"bench", "e2e", "-corpus", "huge", "-trainer", "main.go"}, 1, `-corpus "huge": small, cpu, medium or default`},
		{[]string{"bench", "report"}, 1, "-dir"},
	}
	for _, tt := range tests {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), tt.args, &stdout, &stderr); code != tt.code || !strings.Contains(stderr.String(), tt.want) {
			t.Errorf("floe %v: exit %d, stderr %q; want exit %d mentioning %q", tt.args, code, stderr.String(), tt.code, tt.want)
		}
	}
	var stdout bytes.Buffer
	if code := run(context.Background(), []string{"version"}, &stdout, &stdout); code != 0 || !strings.HasPrefix(stdout.String(), "floe ") {
		t.Errorf("floe version: exit %d, %q", code, stdout.String())
	}
}

func TestCorpusServeFailsBeforeAnnouncingAnUnpackableCorpus(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"corpus-serve", "-token-budget", "512", "-pad-multiple", "16", "-flight-addr", "127.0.0.1:0"}, &stdout, &stderr)
	if code != 1 || stdout.Len() != 0 || !strings.Contains(stderr.String(), "longer than the token budget of 512 rows") {
		t.Fatalf("exit %d, stdout %q, stderr %q; want exit 1, nothing announced, the batcher's error", code, stdout.String(), stderr.String())
	}
}
