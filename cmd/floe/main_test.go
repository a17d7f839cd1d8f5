package main

import (
	"bytes"
	"context"
	"os/exec"
	"strings"
	"testing"
)

func TestUsageErrors(t *testing.T) {
	tests := []struct {
		args []string
		code int
		want string
	}{
		{nil, 2, "usage: floe"},
		{[]string{"frobnicate"}, 2, `unknown command "frobnicate"`},
		{[]string{"bench"}, 2, `unknown command "bench"`}, // floe-bench's now
		{[]string{"bench-proxy"}, 2, `unknown command "bench-proxy"`},
		{[]string{"corpus-serve", "-advantage", "ppo"}, 1, `unknown advantage "ppo"`},
		{[]string{"corpus-serve", "-strategy", "bfs"}, 1, `invalid value "bfs" for flag -strategy: unknown strategy "bfs"`},
		{[]string{"corpus-serve", "-token-budget", "1000"}, 1, "multiple of the pad multiple"},
		{[]string{"corpus-serve", "-token-budget", "auto"}, 1, `invalid value "auto" for flag -token-budget`},
		{[]string{"corpus-serve", "extra"}, 1, `unexpected arguments ["extra"]`},
		{[]string{"serve", "-token-budget", "lots", "-data-dir", t.TempDir()}, 1, "-token-budget: a number of rows or auto"},
		{[]string{"serve", "-data-dir", t.TempDir(), "extra"}, 1, "(flags only; see floe serve -h)"},
		{[]string{"proxy", "-proxy-addr", "127.0.0.1:0", "extra"}, 1, `unexpected arguments ["extra"]`},
		{[]string{"serve", "-engine", "tgi", "-data-dir", t.TempDir()}, 1, `unknown inference engine "tgi"`},
		{[]string{"proxy", "-engine", "tgi"}, 1, `unknown inference engine "tgi"`},
		{[]string{"serve", "-group-timeout", "-1s", "-data-dir", t.TempDir()}, 1, "group timeout -1s must not be negative"},
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

// TestHelpDocumentsSharedFlags: the commands that take floe serve's settings take them
// under its names, and their help lists them.
func TestHelpDocumentsSharedFlags(t *testing.T) {
	for cmd, flags := range map[string][]string{
		"proxy": {"proxy-addr", "control-addr", "control-token-file", "upstream", "engine", "model", "open-sessions", "record", "session", "max-body-bytes"},
		"corpus-serve": {"flight-addr", "flight-token", "flight-token-file", "groups-per-step", "steps-ahead", "strategy", "advantage",
			"token-budget", "pad-multiple", "dp-size", "corpus", "groups", "seed", "fold-vocab", "dump-groups", "calls"},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), []string{cmd, "-h"}, &stdout, &stderr); code != 0 {
			t.Fatalf("floe %s -h: exit %d: %s", cmd, code, stderr.String())
		}
		help := stderr.String()
		if !strings.HasPrefix(help, "usage: floe "+cmd) {
			t.Errorf("floe %s -h does not start with its usage:\n%s", cmd, help)
		}
		for _, f := range flags {
			if !strings.Contains(help, "-"+f+" ") && !strings.Contains(help, "-"+f+"\n") {
				t.Errorf("floe %s -h lacks -%s", cmd, f)
			}
		}
	}
}

// TestFloeLinksNoBenchmarks: the product binary links none of the benchmarks (their
// orchestration, the plotting libraries): those live in cmd/floe-bench.
func TestFloeLinksNoBenchmarks(t *testing.T) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go tool on PATH")
	}
	out, err := exec.Command(gobin, "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	for _, pkg := range strings.Fields(string(out)) {
		for _, banned := range []string{"gonum.org/", "github.com/floe-rl/floe/benchmarks/e2e", "github.com/floe-rl/floe/benchmarks/packbench",
			"github.com/floe-rl/floe/benchmarks/proxybench"} {
			if strings.HasPrefix(pkg, banned) {
				t.Errorf("floe links %s", pkg)
			}
		}
	}
}

// TestServeRefusesAModelTheUpstreamDoesNotServe: the mistake is found at start-up, not as
// a 404 to the first harness call.
func TestServeRefusesAModelTheUpstreamDoesNotServe(t *testing.T) {
	up := fakeEngine() // serves "m"
	defer up.Close()
	for _, cmd := range [][]string{
		{"serve", "-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0", "-control-addr", "127.0.0.1:0"},
		{"proxy", "-proxy-addr", "127.0.0.1:0"},
	} {
		args := append(cmd, "-upstream", up.URL, "-model", "Qwen/Qwen3-8B")
		var stdout, stderr bytes.Buffer
		want := `-model "Qwen/Qwen3-8B": upstream ` + up.URL + ` serves "m"`
		if code := run(context.Background(), args, &stdout, &stderr); code != 1 || !strings.Contains(stderr.String(), want) {
			t.Errorf("floe %s: exit %d, stderr %q; want exit 1 mentioning %q", cmd[0], code, stderr.String(), want)
		}
		if stdout.Len() != 0 {
			t.Errorf("floe %s announced %q before refusing", cmd[0], stdout.String())
		}
	}
}
