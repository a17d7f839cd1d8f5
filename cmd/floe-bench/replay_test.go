package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/floe-rl/floe/benchmarks/replay"
)

// TestReplayTinyRollouts runs floe-bench replay end to end on the tiny rollouts file in
// benchmarks/replay/testdata: through floe's proxy in both dialects against the reference
// server, without and with Pi's captured context. Every strategy must train per_request's
// loss terms in every setting (the command's own hard check), and the tree must forward
// no more rows than prefix merging, which forwards no more than per_request. It needs the
// reference server's venv (make venv); `make test-replay` requires it, plain go test
// skips without it.
func TestReplayTinyRollouts(t *testing.T) {
	py, err := filepath.Abs(filepath.Join("..", "..", ".venv", "bin", "python"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(py); err != nil {
		if os.Getenv("FLOE_REPLAY_REQUIRE") != "" {
			t.Fatalf("FLOE_REPLAY_REQUIRE is set and the venv is missing: %v", err)
		}
		t.Skip("needs the reference server's venv: make venv (make test-replay requires it)")
	}
	out := t.TempDir()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"replay", "-rollouts", "../../benchmarks/replay/testdata/tiny_rollouts.jsonl",
		"-harness-prompt", "none,pi", "-dialects", "responses,chat", "-python", py, "-repeats", "1",
		"-max-model-len", "65536", "-out", out}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d, stderr:\n%s", code, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("%d summary lines, want 2 (none, pi):\n%s", len(lines), stdout.String())
	}
	var perRequest [2]int64
	for i, l := range lines {
		var s replay.Summary
		if err := json.Unmarshal([]byte(l), &s); err != nil {
			t.Fatalf("summary line %q: %v", l, err)
		}
		if s.File != "tiny_rollouts.jsonl" || s.Calls != 12 || s.Sessions != 4 || s.Groups != 2 || !s.LossTermsEqual {
			t.Errorf("summary %+v", s)
		}
		pr, pm, tr := s.Rows["per_request"], s.Rows["prefix_merging"], s.Rows["tree"]
		if !(0 < tr && tr <= pm && pm <= pr) || s.PerRequestTokens <= 0 {
			t.Errorf("%s: rows tree %d, prefix_merging %d, per_request %d: want tree <= prefix_merging <= per_request", s.Harness, tr, pm, pr)
		}
		perRequest[i] = s.PerRequestTokens
	}
	if !strings.HasPrefix(strings.SplitN(lines[1], `"harness_prompt":"`, 2)[1], "pi ") || perRequest[1] <= perRequest[0] {
		t.Errorf("Pi's context adds no tokens: %d without, %d with", perRequest[0], perRequest[1])
	}
	doc, err := os.ReadFile(filepath.Join(out, "REPORT.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Command: `floe-bench replay -rollouts", "| tiny_rollouts.jsonl | none | 12 | 4 | 2 |",
		"responses and chat dialect (both recorded the same token ids", "| 16k | 8 | tree |"} {
		if !strings.Contains(string(doc), want) {
			t.Errorf("REPORT.md lacks %q:\n%s", want, doc)
		}
	}
	if strings.Contains(string(doc), "**NO**") {
		t.Errorf("REPORT.md reports unequal loss terms:\n%s", doc)
	}
}
