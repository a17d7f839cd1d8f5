package sidecar

import (
	"flag"
	"io"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/floe-rl/floe/batcher"
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
		{
			name: "proxy, batcher and step settings",
			args: []string{"-proxy-addr", "127.0.0.1:0", "-upstream", "http://up", "-engine", "sglang", "-model", "m",
				"-open-sessions", "-strategy", "per_request", "-advantage", "rloo", "-dp-size", "2", "-pad-multiple", "16",
				"-groups-per-step", "4", "-steps-ahead", "3", "-group-timeout", "1m", "-max-staleness", "2", "-gpu-memory", "1024"},
			want: with(func(c *Config) {
				c.ProxyAddr, c.Upstream, c.Engine, c.Model, c.OpenSessions = "127.0.0.1:0", "http://up", "sglang", "m", true
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
// names DESIGN.md and the YAML config keys rely on); with names, exactly those.
func TestRegisterFlagsDefinesServesFlags(t *testing.T) {
	all := []string{"advantage", "data-dir", "dp-size", "drop-failed", "engine", "flight-addr", "flight-token",
		"gpu-memory", "group-size", "group-timeout", "groups-per-step", "max-staleness", "memory-target",
		"min-group-size", "model", "open-sessions", "pad-multiple", "pass-cost", "proxy-addr", "steps-ahead", "strategy",
		"token-budget", "token-budget-max", "token-budget-min", "upstream"}
	tests := []struct {
		name  string
		names []string
		want  []string
	}{
		{"all", nil, all},
		{"proxy", ProxyFlags, []string{"engine", "model", "open-sessions", "proxy-addr", "upstream"}},
		{"flight and steps", append(append([]string{}, FlightFlags...), StepFlags...),
			[]string{"flight-addr", "flight-token", "groups-per-step", "steps-ahead"}},
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
		"max-staleness": "-1", "model": "", "open-sessions": "false",
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
