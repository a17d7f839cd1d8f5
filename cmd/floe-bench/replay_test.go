package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
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

	// -tokenizer: the same rollouts tokenized by a model's tokenizer directory, here a
	// byte-level one without merges, so every byte is a token: more tokens than the
	// server's BPE gives, with the loss terms still equal in both dialects.
	tokDir := t.TempDir()
	writeByteTokenizer(t, tokDir)
	stdout.Reset()
	stderr.Reset()
	code = run(context.Background(), []string{"replay", "-rollouts", "../../benchmarks/replay/testdata/tiny_rollouts.jsonl",
		"-tokenizer", tokDir, "-dialects", "responses,chat", "-python", py, "-repeats", "1",
		"-max-model-len", "65536", "-out", out}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("-tokenizer: exit %d, stderr:\n%s", code, stderr.String())
	}
	var s replay.Summary
	if err := json.Unmarshal(bytes.TrimSpace(stdout.Bytes()), &s); err != nil {
		t.Fatalf("-tokenizer: summary %q: %v", stdout.String(), err)
	}
	if s.Calls != 12 || !s.LossTermsEqual || s.PerRequestTokens <= 2*perRequest[0] {
		t.Errorf("-tokenizer (bytes): %+v; want 12 calls, equal loss terms and more than twice the BPE's %d per_request tokens",
			s, perRequest[0])
	}
	if doc, err := os.ReadFile(filepath.Join(out, "REPORT.md")); err != nil || !strings.Contains(string(doc), "Tokenizer: "+tokDir+"/tokenizer.json") {
		t.Errorf("REPORT.md does not name the tokenizer directory (%v):\n%s", err, doc)
	}
}

// writeByteTokenizer writes a Hugging Face tokenizer.json into dir: byte-level BPE with no
// merges (GPT-2's byte-to-character map), none of the server's ChatML or markup tokens.
func writeByteTokenizer(t *testing.T, dir string) {
	t.Helper()
	vocab := map[string]int{}
	n := 0
	for b := range 256 {
		r := rune(b)
		if !(b >= '!' && b <= '~' || b >= 0xA1 && b <= 0xAC || b >= 0xAE && b <= 0xFF) {
			r = rune(256 + n) // GPT-2 moves the bytes that are not printable past 255
			n++
		}
		vocab[string(r)] = b
	}
	byteLevel := map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
	doc, err := json.Marshal(map[string]any{
		"version": "1.0", "added_tokens": []any{}, "normalizer": nil, "post_processor": nil,
		"pre_tokenizer": byteLevel, "decoder": byteLevel,
		"model": map[string]any{"type": "BPE", "vocab": vocab, "merges": []any{}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), doc, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestCheckTokenizerDir(t *testing.T) {
	root := t.TempDir()
	mk := func(name, tokenizerJSON string) string {
		d := filepath.Join(root, name)
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if tokenizerJSON != "" {
			if err := os.WriteFile(filepath.Join(d, "tokenizer.json"), []byte(tokenizerJSON), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		return d
	}
	good := mk("good", `{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}`)
	for _, tc := range []struct {
		name, dir, want string
	}{
		{"a tokenizer directory", good, ""},
		{"missing", filepath.Join(root, "absent"), "no such file"},
		{"a file", filepath.Join(good, "tokenizer.json"), "not a directory"},
		{"no tokenizer.json", mk("empty", ""), "want a Hugging Face tokenizer directory"},
		{"not JSON", mk("corrupt", "{not json"), "tokenizer.json: invalid character"},
		{"no model", mk("nomodel", `{"version": "1.0"}`), "has no tokenizer model"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := checkTokenizerDir(tc.dir)
			if tc.want == "" {
				if err != nil || got != tc.dir {
					t.Fatalf("checkTokenizerDir(%s) = %q, %v; want the directory, no error", tc.dir, got, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.dir) {
				t.Fatalf("checkTokenizerDir(%s) error %v; want one naming the directory with %q", tc.dir, err, tc.want)
			}
		})
	}
	// The command says so before it starts anything.
	var stderr bytes.Buffer
	if code := run(context.Background(), []string{"replay", "-rollouts", "x.jsonl", "-tokenizer", root}, io.Discard, &stderr); code == 0 ||
		!strings.Contains(stderr.String(), "-tokenizer: tokenizer directory "+root) {
		t.Errorf("floe-bench replay -tokenizer %s: exit %d, stderr %q; want a -tokenizer error", root, code, stderr.String())
	}
}
