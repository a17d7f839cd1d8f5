package sidecar

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/floe-rl/floe/arrowflight"
	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/gpu"
	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/sidecar/plan"
	"github.com/floe-rl/floe/trace"
)

// Config is floe serve's configuration; DefaultConfig gives its defaults (docs/design.md).
type Config struct {
	// ProxyAddr is the agent-facing listener: the provider APIs and /healthz, nothing
	// else. ControlAddr serves /floe/v1 and /metrics; FlightAddr the Flight service.
	ProxyAddr    string
	ControlAddr  string
	FlightAddr   string
	Upstream     string // the inference replicas' base URLs, comma-separated (ParseUpstreams)
	Engine       string // vllm or sglang
	Model        string // served model; empty: the first the upstream lists
	DataDir      string
	Batcher      batcher.Config
	GroupSize    int // sessions per group when a session does not say
	MinGroupSize int // a complete group with fewer usable sessions is dropped
	// GroupsPerStep complete groups form one step.
	GroupsPerStep int
	StepsAhead    int
	// DropFailed drops failed and timed-out sessions from their group; otherwise they stay
	// in it (their reward counts for the advantages) with no token trained.
	DropFailed bool
	// GroupTimeout ends a group this long after its first session was created: its
	// running sessions finish as timeout (reward 0) and the group is complete with the
	// sessions it has (min_group_size still applies). 0 (default): groups wait for ever;
	// an open group holds back no other group's step, and agent rollouts have no
	// duration floe could guess.
	GroupTimeout time.Duration
	// MaxStaleness is how many policy versions a call may lag the current one (the
	// version of the last resume) and still be trained on; older calls stay in their
	// group as context with no loss, and are counted. Negative: no limit.
	MaxStaleness int64
	// ControlToken and FlightToken, when set, are required as bearer tokens on every
	// control API and Flight call. LoadTokens fills them from ControlTokenFile and
	// FlightTokenFile, or from $FLOE_CONTROL_TOKEN and $FLOE_FLIGHT_TOKEN. A control or
	// Flight listener beyond loopback needs its token.
	ControlToken, FlightToken         string
	ControlTokenFile, FlightTokenFile string
	// MaxAbsReward bounds a finished session's |reward| (0: DefaultMaxAbsReward).
	MaxAbsReward float64
	// OpenSessions lets a call with an unknown key create its session: floe proxy only
	// (such a session belongs to no group and could never be trained on, so floe serve
	// refuses it).
	OpenSessions bool
	// MaxBodyBytes bounds a request body the proxy accepts (floe proxy's -max-body-bytes;
	// 0: proxy.DefaultMaxBodyBytes).
	MaxBodyBytes int64

	// TokenBudgetAuto sizes the token budget with a gpu.BudgetController between
	// TokenBudgetMin and TokenBudgetMax (starting at the minimum) so that the predicted
	// peak memory stays under MemoryTarget of the device's; Batcher.TokenBudget is then
	// only the budget a recovered step is formed with when its own was not recorded.
	TokenBudgetAuto                bool
	TokenBudgetMin, TokenBudgetMax int
	MemoryTarget                   float64
	// GPUMemoryBytes is the trainer device's memory for the auto budget when NVML cannot
	// tell (no driver visible to floe); 0: NVML's.
	GPUMemoryBytes uint64
	// GPU is the NVML library the monitor samples; nil: gpu.SystemNVML().
	GPU gpu.Lib
	// Observer, when set, is told of every step's formation, reports and commit.
	Observer StepObserver

	// ProxyLimits bound what one harness can hold of the proxy: upstream and client
	// deadlines, concurrent calls, the stored copy of requests (docs/proxy.md, "Limits
	// and deadlines").
	ProxyLimits proxy.Limits
	// DrainTimeout bounds how long a pause waits for calls in flight before it cuts them
	// off (recorded untrainable); negative: no bound.
	DrainTimeout time.Duration
	// MaxPause bounds a pause the trainer does not end: past it, floe logs an error, sets
	// floe_pause_expired and the status's pause_expired, and refuses new calls with their
	// provider's overloaded error until a resume (0 or negative: a pause holds calls for
	// ever).
	MaxPause time.Duration
	// Sampling is the proxy's sampling policy (--sampling): record (default) passes the
	// caller's temperature and top_p upstream and records them with each call, so the
	// trainer scores each call at its temperature; force samples every call at T = 1,
	// top_p = 1 and counts the overrides.
	Sampling proxy.SamplingPolicy
	// TrainTruncated (-train-truncated) keeps calls sampled with top_p < 1, top_k > 0,
	// min_p > 0 or greedily trainable, for users who accept the biased ratio; by default
	// they are recorded untrainable (docs/proxy.md, "Sampling and what trains").
	TrainTruncated bool

	// UpstreamHealthInterval is how often each replica's GET /health is checked
	// (negative: never); UpstreamSessionHeader names the header each upstream call
	// carries its session id in, for a router's affinity ("": none).
	UpstreamHealthInterval time.Duration
	UpstreamSessionHeader  string

	// Retention is what floe keeps and for how long: archiving each committed step out
	// of the store into Parquet (default under <data-dir>/archive) and compacting the
	// store when that pays, so the data dir's store stays bounded (docs/archive.md).
	Retention trace.Retention
}

// DefaultConfig returns floe serve's defaults (docs/design.md, "Defaults").
func DefaultConfig() Config {
	return Config{
		ProxyAddr: "127.0.0.1:8700", ControlAddr: "127.0.0.1:8701", FlightAddr: "127.0.0.1:8815", Upstream: "http://127.0.0.1:8000", Engine: "vllm",
		UpstreamHealthInterval: proxy.DefaultHealthInterval, UpstreamSessionHeader: DefaultUpstreamSessionHeader,
		DataDir: "./floe-data", Batcher: batcher.DefaultConfig(), GroupSize: 8, MinGroupSize: 2,
		GroupsPerStep: 1, StepsAhead: 2, MaxStaleness: -1, MaxAbsReward: DefaultMaxAbsReward,
		TokenBudgetMin: 8192, TokenBudgetMax: 65536, MemoryTarget: gpu.DefaultMemoryTarget,
		ProxyLimits: defaultProxyLimits(), DrainTimeout: proxy.DefaultDrainTimeout, MaxPause: DefaultMaxPause,
		Sampling: proxy.SamplingRecord, Retention: trace.Retention{Archive: true},
	}
}

// Validate reports a configuration floe serve cannot run with.
func (cfg Config) Validate() error {
	if err := cfg.Batcher.Validate(); err != nil {
		return err
	}
	if _, err := ParseUpstreams(cfg.Upstream); err != nil {
		return err
	}
	if err := cfg.policy().Validate(); err != nil {
		return err
	}
	if _, err := proxy.ParseSamplingPolicy(string(cfg.Sampling)); err != nil {
		return err
	}
	if cfg.StepsAhead < 1 {
		return fmt.Errorf("steps ahead (%d) must be at least 1", cfg.StepsAhead)
	}
	if cfg.TokenBudgetAuto && (cfg.MemoryTarget <= 0 || cfg.MemoryTarget > 1) {
		return fmt.Errorf("memory target %g must be in (0, 1]", cfg.MemoryTarget)
	}
	if cfg.MaxAbsReward < 0 || math.IsNaN(cfg.MaxAbsReward) || math.IsInf(cfg.MaxAbsReward, 0) {
		return fmt.Errorf("-max-abs-reward %g must be a positive finite number", cfg.MaxAbsReward)
	}
	if cfg.OpenSessions {
		return errors.New("-open-sessions is floe proxy's only: floe serve trains on groups, and a session opened by its first call belongs to none; create sessions with POST /floe/v1/sessions on the control address")
	}
	if err := checkLoopback("-control-addr", cfg.ControlAddr, cfg.ControlToken, "-control-token-file or $"+ControlTokenEnv); err != nil {
		return err
	}
	return checkLoopback("-flight-addr", cfg.FlightAddr, cfg.FlightToken, "-flight-token-file or $"+FlightTokenEnv)
}

// DefaultUpstreamSessionHeader is the header upstream calls carry their session id in
// by default: the one vLLM's routers read for session affinity (docs/proxy.md).
const DefaultUpstreamSessionHeader = "X-Session-ID"

// The environment variables floe reads its tokens from when no token file is given.
const (
	ControlTokenEnv = "FLOE_CONTROL_TOKEN"
	FlightTokenEnv  = "FLOE_FLIGHT_TOKEN"
)

// LoadTokens fills ControlToken and FlightToken: from ControlTokenFile and
// FlightTokenFile when given (surrounding white space trimmed; an empty file is an error),
// else, when the token is not set already, from $FLOE_CONTROL_TOKEN and
// $FLOE_FLIGHT_TOKEN.
func (cfg *Config) LoadTokens(getenv func(string) string) error {
	load := func(tok *string, file, flagName, env string) error {
		if file != "" {
			if *tok != "" {
				return fmt.Errorf("%s and a token on the command line or in the config: give one", flagName)
			}
			b, err := os.ReadFile(file)
			if err != nil {
				return fmt.Errorf("%s: %w", flagName, err)
			}
			if *tok = strings.TrimSpace(string(b)); *tok == "" {
				return fmt.Errorf("%s %s is empty", flagName, file)
			}
			return nil
		}
		if *tok == "" {
			*tok = strings.TrimSpace(getenv(env))
		}
		return nil
	}
	if err := load(&cfg.ControlToken, cfg.ControlTokenFile, "-control-token-file", ControlTokenEnv); err != nil {
		return err
	}
	return load(&cfg.FlightToken, cfg.FlightTokenFile, "-flight-token-file", FlightTokenEnv)
}

// checkLoopback refuses a listener address beyond loopback (any other interface, or all
// of them) when it has no token: the control API and Flight change rewards, steps and
// the gate. A Unix socket (unix:/path) is local.
func checkLoopback(flagName, addr, token, how string) error {
	if token != "" || addr == "" || strings.HasPrefix(addr, "unix:") {
		return nil
	}
	host, _, err := net.SplitHostPort(strings.TrimPrefix(addr, "grpc://"))
	if err != nil {
		return fmt.Errorf("%s %q: %w", flagName, addr, err)
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return nil
	}
	return fmt.Errorf("%s %s is beyond loopback and has no token: anyone who reaches it controls training; set a token (%s) or bind 127.0.0.1", flagName, addr, how)
}

// budgetController builds the auto budget's controller; nil with a fixed budget.
func (cfg Config) budgetController(mon *gpu.Monitor) (*gpu.BudgetController, error) {
	if !cfg.TokenBudgetAuto {
		return nil, nil
	}
	total := cfg.GPUMemoryBytes
	if total == 0 {
		for _, d := range mon.Devices() {
			if d.MemoryTotal > 0 && (total == 0 || d.MemoryTotal < total) {
				total = d.MemoryTotal
			}
		}
	}
	return gpu.NewBudgetController(gpu.BudgetConfig{
		PadMultiple: cfg.Batcher.PadMultiple, Min: cfg.TokenBudgetMin, Max: cfg.TokenBudgetMax,
		MemoryTarget: cfg.MemoryTarget, MemoryTotal: total,
		// Grow only once a step packed with the current budget can have been observed.
		GrowAfter: max(gpu.DefaultGrowAfter, cfg.StepsAhead+1),
	})
}

// ParseUpstreams splits -upstream's value into its replicas' URLs: absolute http or
// https URLs, none given twice. Its errors say what is wrong and name the flag.
func ParseUpstreams(s string) ([]string, error) {
	var out []string
	seen := map[string]bool{}
	for _, raw := range strings.Split(s, ",") {
		raw = strings.TrimSpace(raw)
		if raw == "" {
			return nil, fmt.Errorf("-upstream %q: an empty URL (give base URLs separated by commas)", s)
		}
		u, err := url.Parse(raw)
		if err != nil {
			var ue *url.Error
			if errors.As(err, &ue) {
				err = ue.Err // its text would repeat the URL, credentials and all
			}
			return nil, fmt.Errorf("-upstream: a URL that does not parse (%w): want an http:// or https:// base URL such as http://127.0.0.1:8000", err)
		}
		if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			shown := *u
			shown.RawQuery, shown.Fragment = "", ""
			return nil, fmt.Errorf("-upstream %s: want an http:// or https:// base URL such as http://127.0.0.1:8000", shown.Redacted())
		}
		raw, _ = UpstreamRoot(raw)
		label := proxy.ReplicaLabel(raw)
		if seen[label] {
			return nil, fmt.Errorf("-upstream %s is given twice", label)
		}
		seen[label] = true
		out = append(out, raw)
	}
	return out, nil
}

// UpstreamRoot is an -upstream URL as floe uses it: the server's root, under which the
// engines add /v1/chat/completions, /tokenize and /health. vLLM and floe's reference
// server print their OpenAI base URL, which ends in /v1; given that, every call would go
// to /v1/v1/... and answer 404, so a trailing /v1 is taken off (trimmed reports it).
func UpstreamRoot(raw string) (root string, trimmed bool) {
	path := strings.TrimRight(raw, "/")
	if base, ok := strings.CutSuffix(path, "/v1"); ok {
		return base, true
	}
	return raw, false
}

// DefaultMaxPause is -max-pause's default: a weight sync takes seconds to a few minutes.
const DefaultMaxPause = 10 * time.Minute

// The disk guards' defaults: a session may store 1 GiB of calls (requests, answers and
// tokens; a long agent session with images stores tens of MiB), and calls are refused
// once the store's disk has less than 1 GiB free, ahead of bbolt's growth (it grows its
// file by up to 1 GiB at a time) and the archive's Parquet files.
const (
	DefaultMaxSessionBytes = 1 << 30
	DefaultMinFreeDisk     = 1 << 30
)

func defaultProxyLimits() proxy.Limits {
	l := proxy.DefaultLimits()
	l.MaxSessionBytes, l.MinFreeDisk = DefaultMaxSessionBytes, DefaultMinFreeDisk
	return l
}

// DefaultTemplateKwargs is proxy.DefaultTemplateKwargs, copied.
func DefaultTemplateKwargs() []string { return append([]string(nil), proxy.DefaultTemplateKwargs...) }

// DefaultMaxAbsReward bounds a session's reward when ControlAPI.MaxAbsReward is 0.
const DefaultMaxAbsReward = 1e6

// policy is the planner's part of the configuration.
func (cfg Config) policy() plan.Policy {
	return plan.Policy{GroupsPerStep: cfg.GroupsPerStep, MinGroupSize: cfg.MinGroupSize, GroupTimeout: cfg.GroupTimeout}
}

// StepObserver is told of each step's life: formed (READY), each rank's report, the
// commit. For benchmark timelines and tests; its methods are called on floe's own
// goroutines and must return quickly.
type StepObserver interface {
	StepFormed(st *batcher.Step, took time.Duration)
	TrainerReport(r arrowflight.Report)
	StepCommitted(n int64)
}
