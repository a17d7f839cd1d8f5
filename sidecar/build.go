package sidecar

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
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
	"github.com/floe-rl/floe/trace/jsonl"
	"github.com/floe-rl/floe/trace/mem"
)

// Floe is floe assembled by New: its listeners bound, its store open and its Node built
// over them; Run serves until its context ends. floe serve, floe proxy and floe
// corpus-serve are three option sets of New (docs/architecture.md, "One builder").
type Floe struct {
	log   *slog.Logger
	node  *Node
	addrs Addrs
	// serving logs the line that says floe serves, with what it serves.
	serving func()
	// run are the goroutines Run owns, each until its context ends.
	run []func(context.Context) error
	// closers release what New acquired (the store, the READY buffer, a record file), in
	// the reverse order of acquiring: Run calls them once it stops, Close when Run is never
	// called.
	closers   []func()
	closeOnce sync.Once
}

// Option changes what New builds; without options New builds floe serve: the proxy, the
// control API, the durable store under the data dir, the step former, the archiver, the
// Flight service and the GPU monitor.
type Option func(*options)

type options struct {
	memory    bool
	keys      map[string]string
	record    string
	noFlight  bool
	fromSteps bool
	steps     []*batcher.Step
}

// InMemory records sessions and calls in memory instead of a bbolt store under the data
// dir, bounded by the config's Retention.MaxStoredBytes: nothing is durable and no step
// is formed, so it goes with WithoutFlight (floe proxy). keys are API keys accepted from
// the start, each for its session (floe proxy -session KEY=SESSION).
func InMemory(keys map[string]string) Option {
	return func(o *options) { o.memory, o.keys = true, keys }
}

// RecordFile appends every call the in-memory store recorded to path, as one JSON line,
// fsynced before the call's answer ends (floe proxy -record).
func RecordFile(path string) Option {
	return func(o *options) { o.record = path }
}

// WithoutFlight builds no Flight service: nothing trains here (floe proxy).
func WithoutFlight() Option {
	return func(o *options) { o.noFlight = true }
}

// FromSteps serves steps formed elsewhere (the synthetic corpus) over Flight, in order,
// and then ends the stream: no proxy, control API, store, step former or GPU monitor,
// and commits are not durable (floe corpus-serve).
func FromSteps(steps []*batcher.Step) Option {
	return func(o *options) { o.fromSteps, o.steps = true, steps }
}

// formsSteps is floe serve: steps formed from the durable store.
func (o options) formsSteps() bool { return !o.memory && !o.fromSteps }

func (o options) check() error {
	switch {
	case o.memory && o.fromSteps:
		return errors.New("InMemory and FromSteps: the corpus's steps take no calls")
	case o.memory && !o.noFlight:
		return errors.New("InMemory without WithoutFlight: an in-memory store forms no steps to serve")
	case o.fromSteps && o.noFlight:
		return errors.New("FromSteps and WithoutFlight: the steps would have no way out")
	case o.record != "" && !o.memory:
		return errors.New("RecordFile without InMemory: the durable store keeps every call already")
	}
	return nil
}

// validate checks cfg for what o builds: all of it for floe serve; for the others, the
// settings of the parts they have.
func (o options) validate(cfg Config) error {
	if o.formsSteps() {
		return cfg.Validate()
	}
	if !o.fromSteps {
		if _, err := ParseUpstreams(cfg.Upstream); err != nil {
			return err
		}
		if err := checkLoopback("-control-addr", cfg.ControlAddr, cfg.ControlToken, "-control-token-file or $"+ControlTokenEnv); err != nil {
			return err
		}
	}
	if !o.noFlight {
		return checkLoopback("-flight-addr", cfg.FlightAddr, cfg.FlightToken, "-flight-token-file or $"+FlightTokenEnv)
	}
	return nil
}

// New builds floe from cfg and opts and binds its listeners; Run serves. Tokens must be
// loaded (LoadTokens) before. With a durable store it recovers from the data dir:
// uncommitted steps are formed again from their groups by replaying the decisions their
// records hold, byte for byte as before whatever this start's settings, and committed
// steps are never served again. A failure releases whatever New had acquired.
func New(ctx context.Context, cfg Config, log *slog.Logger, opts ...Option) (_ *Floe, err error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	if err := o.check(); err != nil {
		return nil, fmt.Errorf("sidecar.New: %w", err)
	}
	if err := o.validate(cfg); err != nil {
		return nil, err
	}
	f := &Floe{log: log}
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	if o.fromSteps {
		err = f.buildFromSteps(cfg, o.steps)
	} else {
		err = f.build(ctx, cfg, o)
	}
	if err != nil {
		return nil, err
	}
	return f, nil
}

// build assembles floe serve or, InMemory, floe proxy.
func (f *Floe) build(ctx context.Context, cfg Config, o options) error {
	log := f.log
	engine, err := newUpstream(cfg, log, nil)
	if err != nil {
		return err
	}
	if err := checkServedModel(ctx, cfg, http.DefaultClient, log); err != nil {
		return err
	}
	st, err := f.openStore(cfg, o)
	if err != nil {
		return err
	}

	var (
		rb    *Ready
		mon   *gpu.Monitor
		ctl   *gpu.BudgetController
		steps *stepTracker
	)
	if st.durable != nil {
		first := st.last + 1
		if len(st.pending) > 0 {
			first = min(first, st.pending[0].N)
		}
		rb = NewReady(cfg.StepsAhead, first)
		f.closers = append(f.closers, rb.Shutdown)
		lib := cfg.GPU
		if lib == nil {
			lib = gpu.SystemNVML()
		}
		mon = gpu.NewMonitor(lib, gpu.MonitorConfig{Logger: log})
		if ctl, err = cfg.budgetController(mon); err != nil {
			return err
		}
		if ctl != nil && cfg.GPUMemoryBytes == 0 && mon.DeviceCount() == 0 {
			log.Warn("token budget auto: device memory unknown (no GPU visible through NVML and no -gpu-memory given); the budget stays at -token-budget-min",
				"budget", ctl.Budget())
		}
	}
	metrics := newMetrics(State{Store: st.durable, Memory: st.memory, Ready: rb, Monitor: mon}, st.durable != nil)
	engine.Metrics = metrics // before its Run: per-replica calls, failovers and health
	if st.durable != nil {
		steps = newStepTracker(log, metrics, mon, ctl, cfg.Batcher.TokenBudget)
		steps.observer = cfg.Observer
	}

	// The Node owns the lifecycle and the policy version: it starts the gate at the
	// version the trainer last resumed rollouts with, and records every resume.
	gate := &proxy.Gate{DrainTimeout: cfg.DrainTimeout, MaxPause: cfg.MaxPause, OnPauseExpired: pauseExpired(log)}
	node, err := NewNode(NodeConfig{Log: log, Gate: gate, Ready: rb, Store: st.sessions})
	if err != nil {
		return fmt.Errorf("data dir %s: %w", cfg.DataDir, err)
	}
	f.node = node
	px := &proxy.Server{Dialects: providers.Dialects(), Engine: engine,
		Sessions: st.sessions, Recorder: st.recorder, Gate: gate, OpenSessions: cfg.OpenSessions, Log: log, Metrics: metrics,
		Limits: cfg.ProxyLimits, Sampling: cfg.Sampling, TrainTruncated: cfg.TrainTruncated, SessionHeader: cfg.UpstreamSessionHeader,
		MaxBodyBytes: cfg.MaxBodyBytes}
	if st.durable != nil {
		px.DiskFree = func() (uint64, error) { return diskFree(cfg.DataDir) }
	}
	pl, err := f.listen("proxy", cfg.ProxyAddr, func(a string) (net.Listener, error) { return net.Listen("tcp", a) })
	if err != nil {
		return err
	}
	cl, err := f.listen("control", cfg.ControlAddr, func(a string) (net.Listener, error) { return net.Listen("tcp", a) })
	if err != nil {
		return err
	}
	f.addrs = Addrs{Proxy: "http://" + pl.Addr().String(), Control: "http://" + cl.Addr().String()}
	alloc := memory.NewGoAllocator()
	control := &ControlAPI{Node: node, BaseURL: f.addrs.Proxy, Metrics: metrics.Handler(), Token: cfg.ControlToken}
	node.metrics, node.upstreams = metrics, engine
	if st.durable != nil {
		node.steps = steps
		node.former = &stepFormer{cfg: cfg, store: st.durable, ready: rb, mem: alloc, log: log, wake: make(chan struct{}, 1), now: time.Now,
			steps: steps, version: node.version, metrics: metrics, exams: map[string]*examined{}}
		if cfg.Retention.Archive {
			node.archiver = NewArchiver(st.durable, cfg.archiveDir(), alloc, log)
			node.archiver.Retention = cfg.Retention
			node.archiver.Metrics = metrics
		}
		// What a step-forming floe's sessions answer with: the group sizes the former
		// waits for, the reward bound and where their steps are archived.
		control.DefaultGroupSize, control.MinGroupSize = cfg.GroupSize, cfg.MinGroupSize
		control.MaxAbsReward, control.ArchiveDir = cfg.MaxAbsReward, cfg.archiveDir()
	}
	hs, conns := proxyHTTPServer(cfg, px, log) // connections bounded by the descriptor limit
	guardMetrics(metrics.Registry(), gate, conns)
	cs := &http.Server{Handler: control.Handler(), ReadHeaderTimeout: 30 * time.Second}

	if mon != nil {
		f.run = append(f.run, mon.Run)
	}
	f.run = append(f.run,
		engine.Run, // the replicas' health checks
		func(ctx context.Context) error { return serveHTTP(ctx, hs, conns.Listener(pl)) },
		func(ctx context.Context) error { return serveHTTP(ctx, cs, cl) })
	if st.durable != nil {
		f.run = append(f.run, func(ctx context.Context) error { return node.Run(ctx, st.pending) }) // the former and the archiver
	}
	if o.noFlight {
		f.serving = func() {
			log.Info("proxy serving", "addr", pl.Addr().String(), "control", cl.Addr().String(), "control_token", cfg.ControlToken != "",
				"upstreams", engine.Status())
			// As floe serve does: without a token the control API is open to every local process.
			warnOpenControl(cfg, log)
		}
		return nil
	}
	fl, err := f.listen("flight", cfg.FlightAddr, arrowflight.Listen)
	if err != nil {
		return err
	}
	f.addrs.Flight = arrowflight.Location(fl)
	fs := &arrowflight.Server[Status]{Source: node.Flight(), Control: node.Flight(), Token: cfg.FlightToken, Mem: alloc, Log: log, Observer: steps}
	f.run = append(f.run, func(ctx context.Context) error { return fs.Serve(ctx, fl) })
	f.serving = func() {
		log.Info("floe serving", "proxy", pl.Addr().String(), "control", cl.Addr().String(), "flight", f.addrs.Flight,
			"control_token", cfg.ControlToken != "", "flight_token", cfg.FlightToken != "", "data_dir", cfg.DataDir,
			"strategy", cfg.Batcher.Strategy, "token_budget", steps.Budget(), "token_budget_auto", cfg.TokenBudgetAuto,
			"gpus", mon.DeviceCount(), "recovered_steps", len(st.pending), "last_committed", st.last, "archive", cfg.Retention.Archive)
		warnOpenListeners(cfg, log)
	}
	return nil
}

// stores is what openStore opened: the durable store (floe serve) or the in-memory one
// (floe proxy), as the Node and the proxy see it.
type stores struct {
	// sessions is the store the Node creates and finishes sessions in and the proxy
	// resolves keys with: bolt or mem, which both are.
	sessions interface {
		trace.SessionStore
		trace.SessionKeys
	}
	recorder trace.CallRecorder
	durable  *bolt.Store // nil: in memory
	memory   *mem.Store  // nil: durable
	// pending are the steps saved and not committed before a restart; last is the last
	// step committed.
	pending []trace.StepRecord
	last    int64
}

// openStore opens the store o asks for: in memory with its keys (and the record file),
// or the bbolt store under the data dir, brought to this floe's step records.
func (f *Floe) openStore(cfg Config, o options) (stores, error) {
	log := f.log
	var st stores
	if o.memory {
		st.memory = &mem.Store{Retention: trace.Retention{MaxStoredBytes: cfg.Retention.MaxStoredBytes}}
		for k, s := range o.keys {
			st.memory.AddSession(k, s)
		}
		st.sessions, st.recorder = st.memory, st.memory
		if o.record != "" {
			file, err := jsonl.NewRecorder(o.record)
			if err != nil {
				return st, fmt.Errorf("record file: %w", err)
			}
			f.closers = append(f.closers, func() {
				if err := file.Close(); err != nil {
					log.Error("closing the record file", "path", o.record, "err", err)
				}
			})
			st.recorder = teeRecorder{st.memory, file}
		}
		return st, nil
	}
	durable, err := bolt.New(cfg.DataDir, bolt.Options{})
	if err != nil {
		return st, fmt.Errorf("data dir %s: %w", cfg.DataDir, err)
	}
	f.closers = append(f.closers, func() {
		if err := durable.Close(); err != nil {
			log.Error("closing the store", "data_dir", cfg.DataDir, "err", err)
		}
	})
	st.durable, st.sessions, st.recorder = durable, durable, durable
	// An older floe's steps get their decisions once, before any is formed again or
	// archived; from then on every step replays its record.
	if err := decideOlderSteps(durable, cfg, log); err != nil {
		return st, fmt.Errorf("data dir %s: %w", cfg.DataDir, err)
	}
	if st.pending, st.last, err = durable.Steps(); err != nil {
		return st, fmt.Errorf("reading steps: %w", err)
	}
	return st, nil
}

// buildFromSteps assembles floe corpus-serve: a READY buffer fed from steps, a Node with
// no store over it, and the Flight service.
func (f *Floe) buildFromSteps(cfg Config, steps []*batcher.Step) error {
	log := f.log
	rb := NewReady(cfg.StepsAhead, 0)
	f.closers = append(f.closers, rb.Shutdown)
	rb.EndAt(int64(len(steps)))
	node, err := NewNode(NodeConfig{Log: log, Ready: rb}) // no store: commits are not durable
	if err != nil {
		return err
	}
	f.node = node
	fl, err := f.listen("flight", cfg.FlightAddr, arrowflight.Listen)
	if err != nil {
		return err
	}
	f.addrs.Flight = arrowflight.Location(fl)
	alloc := memory.NewGoAllocator()
	fs := &arrowflight.Server[Status]{Source: node.Flight(), Control: node.Flight(), Token: cfg.FlightToken, Mem: alloc, Log: log}
	f.run = append(f.run,
		func(ctx context.Context) error { return feedSteps(ctx, rb, steps, alloc, log) },
		func(ctx context.Context) error { return fs.Serve(ctx, fl) })
	groups := 0
	for _, st := range steps {
		groups += st.Stats.Groups
	}
	f.serving = func() {
		log.Info("serving corpus", "flight", f.addrs.Flight, "groups", groups, "steps", len(steps), "strategy", cfg.Batcher.Strategy)
	}
	return nil
}

// listen binds addr with bind. Close closes the listener too: a server that took it
// has closed it already, and a second close only fails.
func (f *Floe) listen(name, addr string, bind func(string) (net.Listener, error)) (net.Listener, error) {
	lis, err := bind(addr)
	if err != nil {
		return nil, fmt.Errorf("%s listen: %w", name, err)
	}
	f.closers = append(f.closers, func() { _ = lis.Close() })
	return lis, nil
}

// Addrs are where floe listens: "" for a listener it does not have.
func (f *Floe) Addrs() Addrs { return f.addrs }

// Node is the lifecycle's owner, for callers that act on floe in-process.
func (f *Floe) Node() *Node { return f.node }

// Run serves until ctx ends or a part fails, then stops every part and releases what New
// acquired; it is called once. A listener stops taking connections and gives calls in flight a bounded time
// to finish (and be recorded) before the store closes.
func (f *Floe) Run(ctx context.Context) error {
	defer f.Close()
	if f.serving != nil {
		f.serving()
	}
	p := pool.New().WithContext(ctx).WithCancelOnError()
	for _, run := range f.run {
		p.Go(run)
	}
	if err := p.Wait(); err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Close releases what New acquired; for a Floe whose Run is never called (Run closes
// it itself). Calling it again does nothing.
func (f *Floe) Close() {
	f.closeOnce.Do(func() {
		for i := len(f.closers) - 1; i >= 0; i-- {
			f.closers[i]()
		}
	})
}

// Serve builds floe (New) from cfg and opts, calls ready, when not nil, with the bound
// addresses, and runs it until ctx ends.
func Serve(ctx context.Context, cfg Config, log *slog.Logger, ready func(Addrs), opts ...Option) error {
	f, err := New(ctx, cfg, log, opts...)
	if err != nil {
		return err
	}
	if ready != nil {
		ready(f.Addrs())
	}
	return f.Run(ctx)
}

// teeRecorder records a call in memory (which knows the sessions, and refuses a call of
// an unknown or finished one) and then in the recorded-calls file, durably, before the
// answer ends. On a fresh file both give a call the same index; after a restart on an
// existing file the file's indexes go on while memory, which knows no session from
// before, starts anew.
type teeRecorder struct {
	mem  trace.CallRecorder
	file *jsonl.Recorder
}

func (t teeRecorder) Record(ctx context.Context, c *trace.Call) error {
	if err := t.mem.Record(ctx, c); err != nil {
		return err
	}
	return t.file.Record(ctx, c)
}

// newUpstream returns the engine over cfg's inference replicas (-upstream, -engine,
// -model): a proxy.Pool, whose Run the caller runs for the health checks.
func newUpstream(cfg Config, log *slog.Logger, metrics proxy.ReplicaMetrics) (*proxy.Pool, error) {
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

// Addrs are where a running floe listens; a listener it does not have is "" and left
// out of the JSON (floe proxy has no Flight service, floe corpus-serve only that).
type Addrs struct {
	Proxy   string `json:"proxy,omitempty"`
	Control string `json:"control,omitempty"`
	Flight  string `json:"flight,omitempty"`
}

// serveHTTP serves hs on lis until ctx ends, then stops accepting and gives calls in
// flight a bounded time to finish (and be recorded).
func serveHTTP(ctx context.Context, hs *http.Server, lis net.Listener) error {
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
