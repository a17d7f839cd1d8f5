package batcher

import (
	"flag"
	"io"
	"strings"
	"testing"
)

func TestRegisterFlags(t *testing.T) {
	def := DefaultConfig()
	tests := []struct {
		name    string
		names   []string
		args    []string
		want    Config
		wantErr string
	}{
		{name: "defaults", want: def},
		{
			name: "every flag",
			args: []string{"-strategy", "prefix_merging", "-advantage", "rloo", "-token-budget", "4096", "-pad-multiple", "16", "-dp-size", "4"},
			want: func() Config {
				c := def
				c.Strategy, c.Advantage, c.TokenBudget, c.PadMultiple, c.DPSize = PrefixMerging, RLOO, 4096, 16, 4
				return c
			}(),
		},
		{name: "bad strategy", args: []string{"-strategy", "bfs"}, wantErr: `invalid value "bfs" for flag -strategy: unknown strategy "bfs"`},
		{name: "bad advantage", args: []string{"-advantage", "ppo"}, wantErr: `unknown advantage "ppo"`},
		{name: "bad budget", args: []string{"-token-budget", "many"}, wantErr: `invalid value "many" for flag -token-budget`},
		{
			name:  "a subset",
			names: []string{FlagTokenBudget, FlagPadMultiple},
			args:  []string{"-pad-multiple", "64"},
			want:  func() Config { c := def; c.PadMultiple = 64; return c }(),
		},
		{name: "a flag not asked for", names: []string{FlagTokenBudget}, args: []string{"-strategy", "tree"}, wantErr: "flag provided but not defined: -strategy"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := def
			fs := flag.NewFlagSet("test", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			c.RegisterFlags(fs, tt.names...)
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
			if c != tt.want {
				t.Errorf("config = %+v, want %+v", c, tt.want)
			}
		})
	}
}

// TestRegisterFlagsDefaultsAreTheConfigs: a command's own defaults, set on the config
// before registering, are what its help shows.
func TestRegisterFlagsDefaultsAreTheConfigs(t *testing.T) {
	c := DefaultConfig()
	c.Strategy, c.DPSize, c.TokenBudget = PerRequest, 8, 4096
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	c.RegisterFlags(fs)
	for name, want := range map[string]string{
		FlagStrategy: "per_request", FlagAdvantage: "grpo", FlagTokenBudget: "4096", FlagPadMultiple: "128", FlagDPSize: "8",
	} {
		f := fs.Lookup(name)
		if f == nil {
			t.Fatalf("-%s not defined", name)
		}
		if f.DefValue != want {
			t.Errorf("-%s default %q, want %q", name, f.DefValue, want)
		}
	}
	var help strings.Builder
	fs.SetOutput(&help)
	fs.PrintDefaults()
	if !strings.Contains(help.String(), "per_request, prefix_merging or tree (default per_request)") {
		t.Errorf("help does not show the strategy's default:\n%s", help.String())
	}
}

func TestRegisterFlagsPanicsOnAnUnknownName(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(r.(string), `no flag "stratgy"`) {
			t.Errorf("recovered %v, want a panic naming the flag", r)
		}
	}()
	c := DefaultConfig()
	c.RegisterFlags(flag.NewFlagSet("test", flag.ContinueOnError), "stratgy")
}
