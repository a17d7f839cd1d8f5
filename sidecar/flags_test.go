package sidecar

import (
	"flag"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/proxy"
)

func TestRegisterFlagsParses(t *testing.T) {
	def := DefaultConfig()
	with := func(f func(c *Config)) Config { c := def; f(&c); return c }
	tests := []struct {
		name    string
		args    []string
		want    Config
		wantErr string
	}{
		{name: "defaults", want: def},
		{name: "token budget auto", args: []string{"-token-budget", "auto"}, want: with(func(c *Config) { c.TokenBudgetAuto = true })},
		{name: "token budget rows", args: []string{"-token-budget", "4096"}, want: with(func(c *Config) { c.Batcher.TokenBudget = 4096 })},
		{name: "the last budget wins", args: []string{"-token-budget", "auto", "-token-budget", "2048"},
			want: with(func(c *Config) { c.Batcher.TokenBudget = 2048 })},
		{name: "bad token budget", args: []string{"-token-budget", "lots"}, wantErr: `invalid value "lots" for flag -token-budget: a number of rows or auto`},
		{name: "bad strategy", args: []string{"-strategy", "bfs"}, wantErr: `unknown strategy "bfs"`},
		{name: "sampling force", args: []string{"-sampling", "force"}, want: with(func(c *Config) { c.Sampling = proxy.SamplingForce })},
		{name: "sampling record", args: []string{"-sampling", "record"}, want: with(func(c *Config) { c.Sampling = proxy.SamplingRecord })},
		{name: "bad sampling", args: []string{"-sampling", "greedy"}, wantErr: `unknown sampling policy "greedy"`},
		{name: "train truncated", args: []string{"-train-truncated"}, want: with(func(c *Config) { c.TrainTruncated = true })},
		// Several inference replicas: comma-separated, the flag repeated, or both; the
		// first value replaces the default.
		{name: "one upstream", args: []string{"-upstream", "http://a:8000"}, want: with(func(c *Config) { c.Upstream = "http://a:8000" })},
		{name: "upstreams comma-separated", args: []string{"-upstream", "http://a:8000,http://b:8000"},
			want: with(func(c *Config) { c.Upstream = "http://a:8000,http://b:8000" })},
		{name: "upstream repeated", args: []string{"-upstream", "http://a:8000,http://b:8000", "-upstream", "https://c/v"},
			want: with(func(c *Config) { c.Upstream = "http://a:8000,http://b:8000,https://c/v" })},
		{name: "upstream not a URL", args: []string{"-upstream", "127.0.0.1:8000"}, wantErr: `-upstream: a URL that does not parse (first path segment in URL cannot contain colon): want an http://`},
		{name: "upstream without scheme", args: []string{"-upstream", "vllm-0:8000"}, wantErr: `-upstream vllm-0:8000: want an http:// or https:// base URL`},
		{name: "upstream with an empty URL", args: []string{"-upstream", "http://a:1,"}, wantErr: `-upstream "http://a:1,": an empty URL`},
		{name: "upstream given twice", args: []string{"-upstream", "http://a:1", "-upstream", "http://a:1/"}, wantErr: `-upstream http://a:1 is given twice`},
		{name: "upstream ftp", args: []string{"-upstream", "ftp://user:secret@a:1"}, wantErr: `-upstream ftp://user:xxxxx@a:1: want an http:// or https://`},
		{name: "upstream health and session header", args: []string{"-upstream-health-interval", "1s", "-upstream-session-header", ""},
			want: with(func(c *Config) { c.UpstreamHealthInterval, c.UpstreamSessionHeader = time.Second, "" })},
		{
			name: "proxy, batcher and step settings",
			args: []string{"-proxy-addr", "127.0.0.1:0", "-upstream", "http://up", "-engine", "sglang", "-model", "m",
				"-control-addr", "127.0.0.1:1", "-max-abs-reward", "10", "-strategy", "per_request", "-advantage", "rloo", "-dp-size", "2", "-pad-multiple", "16",
				"-groups-per-step", "4", "-steps-ahead", "3", "-group-timeout", "1m", "-max-staleness", "2", "-gpu-memory", "1024"},
			want: with(func(c *Config) {
				c.ProxyAddr, c.Upstream, c.Engine, c.Model = "127.0.0.1:0", "http://up", "sglang", "m"
				c.ControlAddr, c.MaxAbsReward = "127.0.0.1:1", 10
				c.Batcher.Strategy, c.Batcher.Advantage, c.Batcher.DPSize, c.Batcher.PadMultiple = batcher.PerRequest, batcher.RLOO, 2, 16
				c.GroupsPerStep, c.StepsAhead, c.GroupTimeout, c.MaxStaleness, c.GPUMemoryBytes = 4, 3, time.Minute, 2, 1024
			}),
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := def
			fs := flag.NewFlagSet("test", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			c.RegisterFlags(fs)
			err := fs.Parse(tt.args)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want it to mention %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(c, tt.want) {
				t.Errorf("config = %+v\nwant     %+v", c, tt.want)
			}
		})
	}
}

// TestRegisterFlagsDefinesServesFlags: with no names, every flag of floe serve (the
// names docs/design.md lists and the YAML config keys rely on; -open-sessions is floe proxy's only);
// with names, exactly those.
func TestRegisterFlagsDefinesServesFlags(t *testing.T) {
	all := []string{"advantage", "archive", "archive-dir", "control-addr", "control-token-file", "data-dir", "dp-size", "drop-failed", "engine",
		"flight-addr", "flight-token", "flight-token-file", "gpu-memory", "group-size", "group-timeout", "groups-per-step",
		"max-abs-reward", "max-staleness", "memory-target", "min-group-size", "model", "pad-multiple", "pass-cost", "proxy-addr",
		"sampling", "steps-ahead", "strategy",
		"token-budget", "train-truncated", "token-budget-max", "token-budget-min", "upstream"}
	limits := []string{"client-idle-timeout", "drain-timeout", "max-inflight", "max-inflight-per-session",
		"upstream-connect-timeout", "upstream-first-byte-timeout", "upstream-idle-timeout",
		"client-body-timeout", "unauthenticated-timeout", "max-conns", "max-n", "media-hosts", "chat-template-kwargs",
		"max-session-bytes", "max-pause"}
	replicas := []string{"upstream-health-interval", "upstream-session-header"}
	all = append(append(append(all, limits...), replicas...), "min-free-disk") // floe serve's only: floe proxy stores in memory
	sort.Strings(all)
	tests := []struct {
		name  string
		names []string
		want  []string
	}{
		{"all", nil, all},
		{"proxy", ProxyFlags, sorted(append(append([]string{"control-addr", "control-token-file", "engine", "model", "open-sessions", "proxy-addr", "sampling", "train-truncated", "upstream"}, limits...), replicas...))},
		{"flight and steps", append(append([]string{}, FlightFlags...), StepFlags...),
			[]string{"flight-addr", "flight-token", "flight-token-file", "groups-per-step", "steps-ahead"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := DefaultConfig()
			fs := flag.NewFlagSet("test", flag.ContinueOnError)
			c.RegisterFlags(fs, tt.names...)
			var got []string
			fs.VisitAll(func(f *flag.Flag) {
				got = append(got, f.Name)
				if f.Usage == "" {
					t.Errorf("-%s has no help", f.Name)
				}
			})
			sort.Strings(got)
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("flags %v, want %v", got, tt.want)
			}
		})
	}
}

// TestRegisterFlagsDefaultsAreTheConfigs: the help shows the defaults the command set on
// its config, the budget's too.
func TestRegisterFlagsDefaultsAreTheConfigs(t *testing.T) {
	c := DefaultConfig()
	c.GroupsPerStep, c.Batcher.TokenBudget, c.ProxyAddr = 2, 4096, "127.0.0.1:0"
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	c.RegisterFlags(fs)
	for name, want := range map[string]string{
		"groups-per-step": "2", "token-budget": "4096", "proxy-addr": "127.0.0.1:0", "strategy": "tree",
		"max-staleness": "-1", "model": "", "control-addr": "127.0.0.1:8701", "max-abs-reward": "1e+06",
	} {
		if f := fs.Lookup(name); f == nil || f.DefValue != want {
			t.Errorf("-%s: flag %+v, want default %q", name, f, want)
		}
	}
	c = DefaultConfig()
	c.TokenBudgetAuto = true
	fs = flag.NewFlagSet("test", flag.ContinueOnError)
	c.RegisterFlags(fs, "token-budget")
	if d := fs.Lookup("token-budget").DefValue; d != "auto" {
		t.Errorf("auto budget's default %q, want auto", d)
	}
}

func TestRegisterFlagsPanicsOnAnUnknownName(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(r.(string), `no flag "upstreams"`) {
			t.Errorf("recovered %v, want a panic naming the flag", r)
		}
	}()
	c := DefaultConfig()
	c.RegisterFlags(flag.NewFlagSet("test", flag.ContinueOnError), "upstreams")
}

// TestValidateRefusesOpenControlAndFlight: the control and Flight listeners may be bound
// beyond loopback only with a token, and the refusal names the flag; floe serve takes no
// -open-sessions.
func TestValidateRefusesOpenControlAndFlight(t *testing.T) {
	for _, tc := range []struct {
		name    string
		set     func(*Config)
		wantErr string
	}{
		{"defaults", func(*Config) {}, ""},
		{"control on all interfaces", func(c *Config) { c.ControlAddr = ":8701" }, "-control-addr"},
		{"control on 0.0.0.0", func(c *Config) { c.ControlAddr = "0.0.0.0:0" }, "-control-addr"},
		{"control on a LAN address", func(c *Config) { c.ControlAddr = "10.1.2.3:8701" }, "-control-addr"},
		{"control on a host name", func(c *Config) { c.ControlAddr = "floe.example:8701" }, "-control-addr"},
		{"control beyond loopback with a token", func(c *Config) { c.ControlAddr, c.ControlToken = ":8701", "t" }, ""},
		{"control on localhost", func(c *Config) { c.ControlAddr = "localhost:0" }, ""},
		{"control on ::1", func(c *Config) { c.ControlAddr = "[::1]:0" }, ""},
		{"flight on all interfaces", func(c *Config) { c.FlightAddr = "0.0.0.0:8815" }, "-flight-addr"},
		{"flight beyond loopback with a token", func(c *Config) { c.FlightAddr, c.FlightToken = "0.0.0.0:8815", "t" }, ""},
		{"flight on a unix socket", func(c *Config) { c.FlightAddr = "unix:/tmp/floe.sock" }, ""},
		{"upstream from a config file, not a URL", func(c *Config) { c.Upstream = "http://a:1,vllm-1" }, "-upstream vllm-1: want an http://"},
		{"several upstreams", func(c *Config) { c.Upstream = "http://a:1, http://b:1" }, ""},
		{"proxy beyond loopback", func(c *Config) { c.ProxyAddr = "0.0.0.0:8700" }, ""},
		{"open sessions", func(c *Config) { c.OpenSessions = true }, "-open-sessions"},
		{"non-finite reward bound", func(c *Config) { c.MaxAbsReward = math.Inf(1) }, "-max-abs-reward"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := DefaultConfig()
			tc.set(&c)
			err := c.Validate()
			switch {
			case tc.wantErr == "" && err != nil:
				t.Errorf("Validate: %v", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Errorf("Validate: %v, want an error naming %s", err, tc.wantErr)
			}
		})
	}
}

// TestLoadTokens: token files win, then the environment; a file with nothing in it and a
// file given with a token are errors.
func TestLoadTokens(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	env := map[string]string{ControlTokenEnv: "env-control", FlightTokenEnv: " env-flight\n"}
	c := DefaultConfig()
	if err := c.LoadTokens(func(k string) string { return env[k] }); err != nil || c.ControlToken != "env-control" || c.FlightToken != "env-flight" {
		t.Errorf("from the environment: %q %q %v", c.ControlToken, c.FlightToken, err)
	}
	c = DefaultConfig()
	c.ControlTokenFile, c.FlightTokenFile = write("c", "file-control\n"), write("f", "file-flight")
	if err := c.LoadTokens(func(k string) string { return env[k] }); err != nil || c.ControlToken != "file-control" || c.FlightToken != "file-flight" {
		t.Errorf("from files: %q %q %v", c.ControlToken, c.FlightToken, err)
	}
	c = DefaultConfig()
	c.FlightToken = "flag"
	if err := c.LoadTokens(func(string) string { return "" }); err != nil || c.FlightToken != "flag" {
		t.Errorf("-flight-token: %q %v", c.FlightToken, err)
	}
	c = DefaultConfig()
	c.ControlTokenFile = write("empty", " \n")
	if err := c.LoadTokens(func(string) string { return "" }); err == nil || !strings.Contains(err.Error(), "-control-token-file") {
		t.Errorf("an empty token file: %v", err)
	}
	c = DefaultConfig()
	c.FlightToken, c.FlightTokenFile = "flag", write("f2", "x")
	if err := c.LoadTokens(func(string) string { return "" }); err == nil {
		t.Error("a token and a token file were both taken")
	}
	c = DefaultConfig()
	c.FlightTokenFile = filepath.Join(dir, "missing")
	if err := c.LoadTokens(func(string) string { return "" }); err == nil || !strings.Contains(err.Error(), "-flight-token-file") {
		t.Errorf("a missing token file: %v", err)
	}
}

func sorted(s []string) []string {
	sort.Strings(s)
	return s
}
