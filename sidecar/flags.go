package sidecar

import (
	"errors"
	"flag"
	"fmt"
	"strconv"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/proxy"
)

// Flag groups for commands that take part of floe serve's settings. Each command takes a
// setting under the same name, help and meaning as floe serve, so one definition (here)
// serves them all.
var (
	// ProxyFlags are the proxy side's settings, shared by floe serve and floe proxy.
	ProxyFlags = []string{"proxy-addr", "control-addr", "control-token-file", "upstream", "upstream-health-interval",
		"upstream-session-header", "engine", "model", "open-sessions", "upstream-connect-timeout", "upstream-first-byte-timeout", "upstream-idle-timeout", "client-idle-timeout",
		"drain-timeout", "max-inflight", "max-inflight-per-session", "sampling", "train-truncated",
		"client-body-timeout", "unauthenticated-timeout", "max-conns", "max-n", "media-hosts", "chat-template-kwargs", "max-session-bytes", "max-pause"}
	// FlightFlags are the Flight service's, shared by floe serve and floe corpus-serve.
	FlightFlags = []string{"flight-addr", "flight-token-file", "flight-token"}
	// proxyOnly are the flags floe serve does not take: RegisterFlags with no names
	// leaves them out.
	proxyOnly = map[string]bool{"open-sessions": true}
	// StepFlags say how many groups make a step and how far ahead steps are formed.
	StepFlags = []string{"groups-per-step", "steps-ahead"}
)

// serveFlags defines every flag of floe serve, each bound to its Config field. The
// batcher's flags come from batcher.Config.RegisterFlags, except -token-budget, which here
// also takes auto.
var serveFlags = []struct {
	name   string
	define func(c *Config, fs *flag.FlagSet, name string)
}{
	{"proxy-addr", func(c *Config, fs *flag.FlagSet, n string) {
		fs.StringVar(&c.ProxyAddr, n, c.ProxyAddr,
			"agent-facing address: the provider APIs and /healthz only; port 0 picks one")
	}},
	{"control-addr", func(c *Config, fs *flag.FlagSet, n string) {
		fs.StringVar(&c.ControlAddr, n, c.ControlAddr,
			"control API address (/floe/v1 sessions, finish, pause, resume, status, and /metrics); port 0 picks one; beyond loopback only with a control token")
	}},
	{"control-token-file", func(c *Config, fs *flag.FlagSet, n string) {
		fs.StringVar(&c.ControlTokenFile, n, c.ControlTokenFile,
			"file holding the bearer token every control API call must carry (default: $"+ControlTokenEnv+"; none: no token, loopback only)")
	}},
	{"max-abs-reward", func(c *Config, fs *flag.FlagSet, n string) {
		fs.Float64Var(&c.MaxAbsReward, n, c.MaxAbsReward, "largest |reward| a session may be finished with; beyond it, or not finite: 400")
	}},
	{"flight-addr", func(c *Config, fs *flag.FlagSet, n string) {
		fs.StringVar(&c.FlightAddr, n, c.FlightAddr, "Flight address; port 0 picks one; unix:/path for a Unix socket")
	}},
	// The inference replicas: several URLs, each session sticking to one (docs/proxy.md,
	// "Several inference replicas").
	{"upstream", func(c *Config, fs *flag.FlagSet, n string) {
		fs.Var(&upstreamValue{c: c}, n,
			"inference server base URL; several replicas: comma-separated or the flag repeated (a session's calls stick to one, failing over when it is down)")
	}},
	{"upstream-health-interval", func(c *Config, fs *flag.FlagSet, n string) {
		fs.DurationVar(&c.UpstreamHealthInterval, n, c.UpstreamHealthInterval,
			"check every -upstream replica's GET /health this often; a failing one takes no sessions until it passes again (negative: no checks)")
	}},
	{"upstream-session-header", func(c *Config, fs *flag.FlagSet, n string) {
		fs.StringVar(&c.UpstreamSessionHeader, n, c.UpstreamSessionHeader,
			"header each upstream call carries its session id in (never the API key), for a router's session affinity; empty: none")
	}},
	{"engine", func(c *Config, fs *flag.FlagSet, n string) {
		fs.StringVar(&c.Engine, n, c.Engine, "inference engine: vllm or sglang")
	}},
	{"model", func(c *Config, fs *flag.FlagSet, n string) {
		fs.StringVar(&c.Model, n, c.Model, "served model name sent upstream (default: the first the upstream lists)")
	}},
	{"data-dir", func(c *Config, fs *flag.FlagSet, n string) {
		fs.StringVar(&c.DataDir, n, c.DataDir, "where the durable trace store lives")
	}},
	{"archive", func(c *Config, fs *flag.FlagSet, n string) {
		fs.BoolVar(&c.Retention.Archive, n, c.Retention.Archive,
			"move each committed step's calls, sessions and record from the store into Parquet under -archive-dir and compact the store, so it stays bounded; false: keep everything in the store")
	}},
	{"archive-dir", func(c *Config, fs *flag.FlagSet, n string) {
		fs.StringVar(&c.Retention.ArchiveDir, n, c.Retention.ArchiveDir, "where archived steps go (default: <data-dir>/archive)")
	}},
	{batcher.FlagStrategy, registerBatcherFlag},
	{batcher.FlagAdvantage, registerBatcherFlag},
	{"group-size", func(c *Config, fs *flag.FlagSet, n string) {
		fs.IntVar(&c.GroupSize, n, c.GroupSize, "sessions that complete a group whose session did not give group_size")
	}},
	{"min-group-size", func(c *Config, fs *flag.FlagSet, n string) {
		fs.IntVar(&c.MinGroupSize, n, c.MinGroupSize, "a complete group with fewer usable sessions is dropped")
	}},
	{"groups-per-step", func(c *Config, fs *flag.FlagSet, n string) {
		fs.IntVar(&c.GroupsPerStep, n, c.GroupsPerStep, "complete groups per step")
	}},
	{"steps-ahead", func(c *Config, fs *flag.FlagSet, n string) {
		fs.IntVar(&c.StepsAhead, n, c.StepsAhead, "most uncommitted steps formed ahead of the trainer")
	}},
	{batcher.FlagDPSize, registerBatcherFlag},
	{batcher.FlagTokenBudget, func(c *Config, fs *flag.FlagSet, n string) {
		fs.Var(&budgetValue{c}, n,
			"rows per micro-batch, padding included; auto: sized to the trainer GPU's memory between -token-budget-min and -token-budget-max")
	}},
	{"token-budget-min", func(c *Config, fs *flag.FlagSet, n string) {
		fs.IntVar(&c.TokenBudgetMin, n, c.TokenBudgetMin, "with -token-budget auto: the smallest budget, and the first")
	}},
	{"token-budget-max", func(c *Config, fs *flag.FlagSet, n string) {
		fs.IntVar(&c.TokenBudgetMax, n, c.TokenBudgetMax, "with -token-budget auto: the largest budget")
	}},
	{"memory-target", func(c *Config, fs *flag.FlagSet, n string) {
		fs.Float64Var(&c.MemoryTarget, n, c.MemoryTarget,
			"with -token-budget auto: the fraction of device memory the predicted peak stays under")
	}},
	{"gpu-memory", func(c *Config, fs *flag.FlagSet, n string) {
		fs.Uint64Var(&c.GPUMemoryBytes, n, c.GPUMemoryBytes,
			"with -token-budget auto: the trainer device's memory in bytes, when floe cannot see the GPU through NVML (0: NVML's)")
	}},
	{batcher.FlagPadMultiple, registerBatcherFlag},
	{"flight-token-file", func(c *Config, fs *flag.FlagSet, n string) {
		fs.StringVar(&c.FlightTokenFile, n, c.FlightTokenFile,
			"file holding the bearer token every Flight call must carry (default: $"+FlightTokenEnv+"; none: no token, loopback only)")
	}},
	{batcher.FlagPassCost, registerBatcherFlag},
	{"flight-token", func(c *Config, fs *flag.FlagSet, n string) {
		fs.StringVar(&c.FlightToken, n, c.FlightToken,
			"require this bearer token on every Flight call (deprecated: other users can read a command line; use -flight-token-file or $"+FlightTokenEnv+")")
	}},
	{"open-sessions", func(c *Config, fs *flag.FlagSet, n string) {
		fs.BoolVar(&c.OpenSessions, n, c.OpenSessions, "let a call with an unknown key create its session")
	}},
	{"drop-failed", func(c *Config, fs *flag.FlagSet, n string) {
		fs.BoolVar(&c.DropFailed, n, c.DropFailed,
			"drop failed and timed-out sessions from their group (default: keep them, training none of their tokens)")
	}},
	{"group-timeout", func(c *Config, fs *flag.FlagSet, n string) {
		fs.DurationVar(&c.GroupTimeout, n, c.GroupTimeout,
			"end a group this long after its first session started: it closes, its running sessions finish as timeout with reward 0 (0: never; set it above your longest rollout)")
	}},
	{"max-staleness", func(c *Config, fs *flag.FlagSet, n string) {
		fs.Int64Var(&c.MaxStaleness, n, c.MaxStaleness,
			"train on a call only if its policy version lags the current one (the last resume) by at most this many versions; older calls are counted and kept as context (-1: no limit)")
	}},
	{"upstream-connect-timeout", func(c *Config, fs *flag.FlagSet, n string) {
		fs.DurationVar(&c.ProxyLimits.UpstreamConnect, n, c.ProxyLimits.UpstreamConnect,
			"give up connecting to the inference server after this long: the caller gets a 504 and the call is recorded untrainable (negative: no limit)")
	}},
	{"upstream-first-byte-timeout", func(c *Config, fs *flag.FlagSet, n string) {
		fs.DurationVar(&c.ProxyLimits.UpstreamFirstByte, n, c.ProxyLimits.UpstreamFirstByte,
			"give up on an upstream call whose answer has not begun after this long; a non-streamed answer (every SGLang call) must be complete by then (negative: no limit)")
	}},
	{"upstream-idle-timeout", func(c *Config, fs *flag.FlagSet, n string) {
		fs.DurationVar(&c.ProxyLimits.UpstreamIdle, n, c.ProxyLimits.UpstreamIdle,
			"give up on an upstream answer that sends nothing for this long once begun (negative: no limit)")
	}},
	{"client-idle-timeout", func(c *Config, fs *flag.FlagSet, n string) {
		fs.DurationVar(&c.ProxyLimits.ClientIdle, n, c.ProxyLimits.ClientIdle,
			"drop a harness that reads nothing of its answer for this long; its call is recorded as aborted (negative: no limit)")
	}},
	{"drain-timeout", func(c *Config, fs *flag.FlagSet, n string) {
		fs.DurationVar(&c.DrainTimeout, n, c.DrainTimeout,
			"a pause for a weight sync waits this long for calls in flight, then cuts them off (recorded untrainable) (negative: no limit)")
	}},
	{"max-inflight-per-session", func(c *Config, fs *flag.FlagSet, n string) {
		fs.IntVar(&c.ProxyLimits.MaxInflightPerSession, n, c.ProxyLimits.MaxInflightPerSession,
			"most calls one session's key may have in flight, so one harness cannot take every -max-inflight slot (negative: no limit)")
	}},
	{"max-inflight", func(c *Config, fs *flag.FlagSet, n string) {
		fs.IntVar(&c.ProxyLimits.MaxInflight, n, c.ProxyLimits.MaxInflight,
			"most model calls served at once; past it a call gets its provider's overloaded error at once (negative: no limit)")
	}},
	// The guards against a harness that would exhaust floe (docs/security.md); defined in
	// guardFlags (sidecar/guardflags.go).
	{"client-body-timeout", defineGuardFlag},
	{"unauthenticated-timeout", defineGuardFlag},
	{"max-conns", defineGuardFlag},
	{"max-n", defineGuardFlag},
	{"media-hosts", defineGuardFlag},
	{"chat-template-kwargs", defineGuardFlag},
	{"max-session-bytes", defineGuardFlag},
	{"min-free-disk", defineGuardFlag},
	{"max-pause", defineGuardFlag},
	{"train-truncated", trainTruncatedFlag},
	{"sampling", func(c *Config, fs *flag.FlagSet, n string) {
		fs.Func(n, "sampling policy: record (pass the caller's temperature and top_p upstream and train each call at its temperature) or force (sample every call at T=1, top_p=1, counting overrides) (default "+string(c.Sampling)+")",
			func(v string) error {
				p, err := proxy.ParseSamplingPolicy(v)
				c.Sampling = p
				return err
			})
	}},
}

// trainTruncatedFlag is -train-truncated, apart from serveFlags' literal because its help
// is long.
func trainTruncatedFlag(c *Config, fs *flag.FlagSet, n string) {
	fs.BoolVar(&c.TrainTruncated, n, c.TrainTruncated,
		"train calls sampled with truncation (top_p < 1, top_k > 0, min_p > 0, greedy T <= 1e-5) although their log-probs are of the truncated distribution, "+
			"which the trainer does not reproduce (a biased ratio); by default they are recorded untrainable. Constrained decoding (tool_choice required or named) is untrainable either way")
}

func registerBatcherFlag(c *Config, fs *flag.FlagSet, name string) { c.Batcher.RegisterFlags(fs, name) }

// RegisterFlags defines the named flags of floe serve (all of floe serve's when none is
// named; -open-sessions is floe proxy's only) on
// fs, bound to c's fields, with c's current values as their defaults: a command sets its
// own defaults on c first. -token-budget takes a number of rows or auto (TokenBudgetAuto).
// Naming an unknown flag is a programming error and panics, as defining one twice does.
func (c *Config) RegisterFlags(fs *flag.FlagSet, names ...string) {
	if len(names) == 0 {
		for _, f := range serveFlags {
			if !proxyOnly[f.name] {
				f.define(c, fs, f.name)
			}
		}
		return
	}
	for _, name := range names {
		found := false
		for _, f := range serveFlags {
			if f.name == name {
				f.define(c, fs, name)
				found = true
				break
			}
		}
		if !found {
			panic(fmt.Sprintf("sidecar.RegisterFlags: floe serve has no flag %q", name))
		}
	}
}

// budgetValue is -token-budget as floe serve takes it: a number of rows, or auto.
type budgetValue struct{ c *Config }

func (v *budgetValue) String() string {
	switch {
	case v.c == nil: // the flag package's zero value, for help
		return ""
	case v.c.TokenBudgetAuto:
		return "auto"
	}
	return strconv.Itoa(v.c.Batcher.TokenBudget)
}

func (v *budgetValue) Set(s string) error {
	if s == "auto" {
		v.c.TokenBudgetAuto = true
		return nil
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		return errors.New("a number of rows or auto")
	}
	v.c.TokenBudgetAuto, v.c.Batcher.TokenBudget = false, n
	return nil
}

// upstreamValue is -upstream: one URL or several, comma-separated, the flag repeatable.
// The first value given replaces the default; later ones add replicas.
type upstreamValue struct {
	c   *Config
	set bool
}

func (v *upstreamValue) String() string {
	if v.c == nil { // the flag package's zero value, for help
		return ""
	}
	return v.c.Upstream
}

func (v *upstreamValue) Set(s string) error {
	if v.set {
		s = v.c.Upstream + "," + s
	}
	if _, err := ParseUpstreams(s); err != nil {
		return err
	}
	v.c.Upstream, v.set = s, true
	return nil
}
