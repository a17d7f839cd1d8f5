package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/apache/arrow-go/v18/arrow/flight"
)

// TestServeConfigFile runs the real binary with a YAML config: the file's settings
// apply, and a flag on the command line wins over the file's value.
func TestServeConfigFile(t *testing.T) {
	up := fakeEngine()
	defer up.Close()
	path := filepath.Join(t.TempDir(), "floe.yaml")
	yaml := "# floe serve settings\ndata_dir: " + t.TempDir() + "\nproxy_addr: 127.0.0.1:0\nflight_addr: 127.0.0.1:0\nupstream: " + up.URL +
		"\ntoken_budget: auto\ntoken_budget_min: 512\ntoken_budget_max: 4096\npad_multiple: 16\nmemory_target: 0.8\nmax_abs_reward: 100\n"
	if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	f := startFloe(t, "-config", path, "-token-budget-min", "256")
	s, err := f.flight.DoAction(context.Background(), &flight.Action{Type: "status"})
	if err != nil {
		t.Fatal(err)
	}
	res, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var st map[string]any
	_ = json.Unmarshal(res.Body, &st)
	if st["token_budget_mode"] != "auto" || st["token_budget"] != 256.0 {
		t.Fatalf("status %v: want the file's auto budget at the command line's minimum 256", st)
	}
	resp, err := http.Get(f.control + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), "\nfloe_token_budget_rows 256\n") {
		t.Fatalf("/metrics lacks floe_token_budget_rows 256:\n%s", body)
	}
	// max_abs_reward: 100 from the file bounds rewards.
	sess := f.post(t, "/floe/v1/sessions", "", `{"task_id": "t"}`)
	f.post(t, "/v1/chat/completions", sess["api_key"].(string), `{"model":"x","messages":[{"role":"user","content":"hi"}]}`)
	resp, err = http.Post(f.control+"/floe/v1/sessions/"+sess["session_id"].(string)+"/finish", "application/json", strings.NewReader(`{"reward": 101}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("reward 101 with max_abs_reward: 100: %d, want 400", resp.StatusCode)
	}
}

func TestServeConfigFileRefusesUnknownKeys(t *testing.T) {
	dir := t.TempDir()
	for name, body := range map[string]string{
		"unknown":  "token_budget: auto\ntokn_budget_max: 4096\n",
		"kebab":    "token-budget: auto\n",
		"nested":   "token_budget:\n  max: 4096\n",
		"bad":      "group_size: many\n",
		"strategy": "strategy: bfs\n",
		"budget":   "token_budget: lots\n",
		"notamap":  "- a\n- b\n",
		"twice":    "group_size: 2\ngroup_size: 3\n",
		"selfnest": "config: other.yaml\n",
	} {
		path := filepath.Join(dir, name+".yaml")
		if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), []string{"serve", "-config", path, "-data-dir", filepath.Join(dir, "data")}, &stdout, &stderr)
		if code == 0 || !strings.Contains(stderr.String(), path) {
			t.Errorf("%s: exit %d, stderr %q: want a failure naming the file", name, code, stderr.String())
		}
		t.Logf("%s: %s", name, strings.TrimSpace(stderr.String()))
	}
	var stdout, stderr bytes.Buffer
	run(context.Background(), []string{"serve", "-config", filepath.Join(dir, "unknown.yaml")}, &stdout, &stderr)
	if !strings.Contains(stderr.String(), `unknown key "tokn_budget_max"`) || !strings.Contains(stderr.String(), "token_budget_max") {
		t.Errorf("unknown key message %q: want the key and the known keys", stderr.String())
	}
}

// TestServeHelpDocumentsEveryOption: floe serve -h lists every flag and the config file.
func TestServeHelpDocumentsEveryOption(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"serve", "-h"}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	help := stderr.String()
	for _, flag := range []string{"proxy-addr", "flight-addr", "upstream", "engine", "model", "data-dir", "strategy", "advantage",
		"group-size", "min-group-size", "groups-per-step", "steps-ahead", "dp-size", "token-budget", "token-budget-min",
		"token-budget-max", "memory-target", "gpu-memory", "pad-multiple", "flight-token", "flight-token-file", "control-addr", "control-token-file", "max-abs-reward", "drop-failed", "config"} {
		if !strings.Contains(help, "-"+flag+" ") && !strings.Contains(help, "-"+flag+"\n") {
			t.Errorf("help lacks -%s", flag)
		}
	}
	if !strings.Contains(help, "snake_case") || !strings.Contains(help, "/metrics") {
		t.Errorf("help does not explain the config file or /metrics:\n%s", help)
	}
}

// TestServeWithUnreachablePyroscope: profiling to a server that accepts connections and
// never answers neither holds up start-up nor shutdown; SIGTERM still exits 0.
func TestServeWithUnreachablePyroscope(t *testing.T) {
	up := fakeEngine()
	defer up.Close()
	hole, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = hole.Close() }() // closed again below; the listener holds nothing
	held := make(chan net.Conn, 64)
	defer func() {
		_ = hole.Close() // stops the accept loop; the listener holds nothing
		for len(held) > 0 {
			_ = (<-held).Close() // a held connection: nothing read or written
		}
	}()
	go func() {
		for {
			c, err := hole.Accept()
			if err != nil {
				return
			}
			select {
			case held <- c: // read nothing, answer nothing
			default:
				_ = c.Close() // a held connection: nothing read or written
			}
		}
	}()
	f := startFloe(t, "-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0",
		"-upstream", up.URL, "-pyroscope", "http://"+hole.Addr().String())
	sess := f.post(t, "/floe/v1/sessions", "", `{"task_id": "t"}`)
	f.post(t, "/v1/chat/completions", sess["api_key"].(string), `{"model":"x","messages":[{"role":"user","content":"hi"}]}`)
	if err := f.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := f.cmd.Wait(); err != nil {
		t.Fatalf("floe serve after SIGTERM with pyroscope unreachable: %v", err)
	}
}

func TestServeRefusesABadPyroscopeURL(t *testing.T) {
	var stderr bytes.Buffer
	err := runServe(context.Background(), []string{"-data-dir", t.TempDir(), "-pyroscope", "pyroscope:4040"}, io.Discard, &stderr)
	if err == nil || !strings.Contains(err.Error(), "want an http(s) URL") {
		t.Fatalf("err = %v", err)
	}
}
