package sidecar

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"
	"github.com/sourcegraph/conc/pool"

	"github.com/floe-rl/floe/arrowflight"
	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/gpu"
	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/providers"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/bolt"
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
	if err := CheckLoopback("-control-addr", cfg.ControlAddr, cfg.ControlToken, "-control-token-file or $"+ControlTokenEnv); err != nil {
		return err
	}
	return CheckLoopback("-flight-addr", cfg.FlightAddr, cfg.FlightToken, "-flight-token-file or $"+FlightTokenEnv)
}

// DefaultUpstreamSessionHeader is the header upstream calls carry their session id in
// by default: the one vLLM's routers read for session affinity (docs/proxy.md).
const DefaultUpstreamSessionHeader = "X-Session-ID"

// NewUpstream returns the engine over cfg's inference replicas (-upstream, -engine,
// -model): a proxy.Pool, whose Run the caller runs for the health checks.
func NewUpstream(cfg Config, log *slog.Logger, metrics proxy.ReplicaMetrics) (*proxy.Pool, error) {
	urls, err := ParseUpstreams(cfg.Upstream)
	if err != nil {
		return nil, err
	}
	kind := cfg.Engine
	if kind == "" {
		kind = "vllm"
	}
	for _, raw := range strings.Split(cfg.Upstream, ",") {
		if root, trimmed := UpstreamRoot(strings.TrimSpace(raw)); trimmed {
			log.Info("-upstream is the inference server's root: floe adds /v1 itself", "given", proxy.ReplicaLabel(raw), "using", proxy.ReplicaLabel(root))
		}
	}
	var rs []proxy.Replica
	for _, u := range urls {
		// Each engine asks its own replica for the served model (when -model is not
		// given) on its first call: the replica that answers is a healthy one.
		e, err := providers.NewEngine(kind, u, cfg.Model)
		if err != nil {
			return nil, fmt.Errorf("-engine: %w", err)
		}
		rs = append(rs, proxy.Replica{URL: u, Engine: e})
	}
	pool, err := proxy.NewPool(rs...)
	if err != nil {
		return nil, fmt.Errorf("-upstream: %w", err)
	}
	pool.HealthInterval, pool.Metrics, pool.Log = cfg.UpstreamHealthInterval, metrics, log
	return pool, nil
}

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

// CheckLoopback refuses a listener address beyond loopback (any other interface, or all
// of them) when it has no token: the control API and Flight change rewards, steps and
// the gate. A Unix socket (unix:/path) is local.
func CheckLoopback(flagName, addr, token, how string) error {
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

// Addrs are where a running floe listens.
type Addrs struct {
	Proxy   string `json:"proxy"`
	Control string `json:"control"`
	Flight  string `json:"flight"`
}

// Serve runs floe until ctx ends: proxy, control API (with /metrics), durable store,
// step former, READY buffer, Flight service and GPU monitor, each listener on its own
// address (the harness-facing proxy reaches no control). ready is called once all three
// listeners are bound. Tokens must be loaded (LoadTokens) before. On start it recovers from the data dir: uncommitted steps are
// formed again from their groups by replaying the decisions their records hold, byte for
// byte as before whatever this start's settings, and committed steps are never served
// again.
func Serve(ctx context.Context, cfg Config, log *slog.Logger, ready func(Addrs)) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	engine, err := NewUpstream(cfg, log, nil)
	if err != nil {
		return err
	}
	if err := CheckServedModel(ctx, cfg, http.DefaultClient, log); err != nil {
		return err
	}
	store, err := bolt.New(cfg.DataDir, bolt.Options{})
	if err != nil {
		return fmt.Errorf("data dir %s: %w", cfg.DataDir, err)
	}
	// Close flushes the store's last writes; Serve's return value is decided by then, so a
	// failure is logged.
	defer func() {
		if err := store.Close(); err != nil {
			log.Error("closing the trace store", "dir", cfg.DataDir, "err", err)
		}
	}()
	// An older floe's steps get their decisions once, before any is formed again or
	// archived; from then on every step replays its record.
	if err := decideOlderSteps(store, cfg, log); err != nil {
		return fmt.Errorf("data dir %s: %w", cfg.DataDir, err)
	}
	pending, lastCommitted, err := store.Steps()
	if err != nil {
		return fmt.Errorf("reading steps: %w", err)
	}
	first := lastCommitted + 1
	if len(pending) > 0 {
		first = min(first, pending[0].N)
	}
	rb := NewReady(cfg.StepsAhead, first)
	defer rb.Shutdown()

	lib := cfg.GPU
	if lib == nil {
		lib = gpu.SystemNVML()
	}
	mon := gpu.NewMonitor(lib, gpu.MonitorConfig{Logger: log})
	ctl, err := cfg.budgetController(mon)
	if err != nil {
		return err
	}
	if ctl != nil && cfg.GPUMemoryBytes == 0 && mon.DeviceCount() == 0 {
		log.Warn("token budget auto: device memory unknown (no GPU visible through NVML and no -gpu-memory given); the budget stays at -token-budget-min",
			"budget", ctl.Budget())
	}
	metrics := NewMetrics(State{Store: store, Ready: rb, Monitor: mon})
	engine.Metrics = metrics // before its Run: per-replica calls, failovers and health
	steps := newStepTracker(log, metrics, mon, ctl, cfg.Batcher.TokenBudget)
	steps.observer = cfg.Observer

	// The Node owns the lifecycle and the policy version: it starts the gate at the
	// version the trainer last resumed rollouts with, and records every resume.
	gate := &proxy.Gate{DrainTimeout: cfg.DrainTimeout, MaxPause: cfg.MaxPause, OnPauseExpired: PauseExpired(log)}
	node, err := NewNode(NodeConfig{Log: log, Gate: gate, Ready: rb, Store: store})
	if err != nil {
		return fmt.Errorf("data dir %s: %w", cfg.DataDir, err)
	}
	mem := memory.NewGoAllocator()
	px := &proxy.Server{Dialects: providers.Dialects(), Engine: engine,
		Sessions: store, Recorder: store, Gate: gate, OpenSessions: cfg.OpenSessions, Log: log, Metrics: metrics,
		Limits: cfg.ProxyLimits, Sampling: cfg.Sampling, TrainTruncated: cfg.TrainTruncated, SessionHeader: cfg.UpstreamSessionHeader,
		DiskFree: func() (uint64, error) { return diskFree(cfg.DataDir) }}
	pl, err := net.Listen("tcp", cfg.ProxyAddr)
	if err != nil {
		return fmt.Errorf("proxy listen: %w", err)
	}
	cl, err := net.Listen("tcp", cfg.ControlAddr)
	if err != nil {
		_ = pl.Close() // the error above is the one to report
		return fmt.Errorf("control listen: %w", err)
	}
	fl, err := arrowflight.Listen(cfg.FlightAddr)
	if err != nil {
		// The error above is the one to report.
		_ = pl.Close()
		_ = cl.Close()
		return fmt.Errorf("flight listen: %w", err)
	}
	node.steps, node.metrics, node.upstreams = steps, metrics, engine
	node.former = &stepFormer{cfg: cfg, store: store, ready: rb, mem: mem, log: log, wake: make(chan struct{}, 1), now: time.Now,
		steps: steps, version: node.version, metrics: metrics, exams: map[string]*examined{}}
	if cfg.Retention.Archive {
		node.archiver = NewArchiver(store, cfg.archiveDir(), mem, log)
		node.archiver.Retention = cfg.Retention
		node.archiver.Metrics = metrics
	}
	control := &ControlAPI{Node: node, BaseURL: "http://" + pl.Addr().String(), DefaultGroupSize: cfg.GroupSize,
		Metrics: metrics.Handler(), Token: cfg.ControlToken, MaxAbsReward: cfg.MaxAbsReward,
		ArchiveDir: cfg.archiveDir(), MinGroupSize: cfg.MinGroupSize}
	hs, conns := ProxyHTTPServer(cfg, px, log) // connections bounded by the descriptor limit
	guardMetrics(metrics.Registry(), gate, conns)
	cs := &http.Server{Handler: control.Handler(), ReadHeaderTimeout: 30 * time.Second}
	door := node.Flight()
	fs := &arrowflight.Server[Status]{Source: door, Control: door, Token: cfg.FlightToken, Mem: mem, Log: log, Observer: steps}

	if ready != nil {
		ready(Addrs{Proxy: "http://" + pl.Addr().String(), Control: "http://" + cl.Addr().String(), Flight: arrowflight.Location(fl)})
	}
	log.Info("floe serving", "proxy", pl.Addr().String(), "control", cl.Addr().String(), "flight", arrowflight.Location(fl),
		"control_token", cfg.ControlToken != "", "flight_token", cfg.FlightToken != "", "data_dir", cfg.DataDir,
		"strategy", cfg.Batcher.Strategy, "token_budget", steps.Budget(), "token_budget_auto", cfg.TokenBudgetAuto,
		"gpus", mon.DeviceCount(), "recovered_steps", len(pending), "last_committed", lastCommitted, "archive", cfg.Retention.Archive)
	warnOpenListeners(cfg, log)

	p := pool.New().WithContext(ctx).WithCancelOnError()
	p.Go(mon.Run)
	p.Go(engine.Run)                                                        // the replicas' health checks
	p.Go(func(ctx context.Context) error { return node.Run(ctx, pending) }) // the former and the archiver
	p.Go(func(ctx context.Context) error { return fs.Serve(ctx, fl) })
	p.Go(func(ctx context.Context) error { return ServeHTTP(ctx, hs, conns.Listener(pl)) })
	p.Go(func(ctx context.Context) error { return ServeHTTP(ctx, cs, cl) })
	if err := p.Wait(); err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// ServeHTTP serves hs on lis until ctx ends, then stops accepting and gives calls in
// flight a bounded time to finish (and be recorded).
func ServeHTTP(ctx context.Context, hs *http.Server, lis net.Listener) error {
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(lis) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		shut, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := hs.Shutdown(shut); err != nil {
			return err
		}
		if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	}
}

// AnnounceJSON writes the bound addresses as one JSON line: how a launcher learns the
// ports when one is 0 (docs/design.md, "The start line").
func AnnounceJSON(w io.Writer) func(Addrs) {
	return func(a Addrs) {
		b, _ := json.Marshal(a)
		_, _ = fmt.Fprintln(w, string(b)) // a launcher gone from the pipe ends floe by SIGPIPE (os/signal)
	}
}
