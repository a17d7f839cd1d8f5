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

// Config is floe serve's configuration; DefaultConfig gives DESIGN.md's defaults.
type Config struct {
	ProxyAddr    string
	FlightAddr   string
	Upstream     string
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
	FlightToken  string
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
}

// DefaultConfig returns the defaults of DESIGN.md.
func DefaultConfig() Config {
	return Config{
		ProxyAddr: "127.0.0.1:8700", FlightAddr: "127.0.0.1:8815", Upstream: "http://127.0.0.1:8000", Engine: "vllm",
		DataDir: "./floe-data", Batcher: batcher.DefaultConfig(), GroupSize: 8, MinGroupSize: 2,
		GroupsPerStep: 1, StepsAhead: 2, MaxStaleness: -1,
		TokenBudgetMin: 8192, TokenBudgetMax: 65536, MemoryTarget: gpu.DefaultMemoryTarget,
	}
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
	Proxy  string `json:"proxy"`
	Flight string `json:"flight"`
}

// Serve runs floe until ctx ends: proxy and control API (with /metrics), durable store,
// step former, READY buffer, Flight service and GPU monitor. ready is called once both
// listeners are bound. On start it recovers from the data dir: uncommitted steps are
// formed again from their groups with the budget they were formed with, byte for byte
// as before, and committed steps are never served again.
func Serve(ctx context.Context, cfg Config, log *slog.Logger, ready func(Addrs)) error {
	if err := cfg.Batcher.Validate(); err != nil {
		return err
	}
	if cfg.GroupsPerStep < 1 || cfg.StepsAhead < 1 || cfg.MinGroupSize < 1 {
		return fmt.Errorf("groups per step (%d), steps ahead (%d) and min group size (%d) must be at least 1",
			cfg.GroupsPerStep, cfg.StepsAhead, cfg.MinGroupSize)
	}
	if cfg.GroupTimeout < 0 {
		return fmt.Errorf("group timeout %v must not be negative", cfg.GroupTimeout)
	}
	if cfg.TokenBudgetAuto && (cfg.MemoryTarget <= 0 || cfg.MemoryTarget > 1) {
		return fmt.Errorf("memory target %g must be in (0, 1]", cfg.MemoryTarget)
	}
	if cfg.Engine == "" {
		cfg.Engine = "vllm"
	}
	engine, err := providers.NewEngine(cfg.Engine, cfg.Upstream, cfg.Model)
	if err != nil {
		return err
	}
	store, err := bolt.New(cfg.DataDir, bolt.Options{})
	if err != nil {
		return fmt.Errorf("data dir %s: %w", cfg.DataDir, err)
	}
	defer store.Close()
	budgets, err := loadStepBudgets(cfg.DataDir)
	if err != nil {
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
	if err := budgets.forget(-1, first); err != nil {
		return fmt.Errorf("data dir %s: %w", cfg.DataDir, err)
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
	steps := newStepTracker(log, metrics, mon, ctl, cfg.Batcher.TokenBudget)
	steps.observer = cfg.Observer

	// Rollouts go on under the policy version the trainer last resumed them with.
	version, err := store.PolicyVersion()
	if err != nil {
		return fmt.Errorf("data dir %s: %w", cfg.DataDir, err)
	}
	gate := &proxy.Gate{}
	if err := gate.Resume(version); err != nil {
		return err
	}
	gate.Persist = store.SetPolicyVersion
	mem := memory.NewGoAllocator()
	wake := make(chan struct{}, 1)
	poke := func() {
		select {
		case wake <- struct{}{}:
		default:
		}
	}
	px := &proxy.Server{Dialects: providers.Dialects(), Engine: engine,
		Sessions: store, Recorder: store, Gate: gate, OpenSessions: cfg.OpenSessions, Log: log, Metrics: metrics}
	pl, err := net.Listen("tcp", cfg.ProxyAddr)
	if err != nil {
		return fmt.Errorf("proxy listen: %w", err)
	}
	fl, err := arrowflight.Listen(cfg.FlightAddr)
	if err != nil {
		pl.Close()
		return fmt.Errorf("flight listen: %w", err)
	}
	control := &ControlAPI{Store: sessionStore{store}, Gate: gate, BaseURL: "http://" + pl.Addr().String(),
		DefaultGroupSize: cfg.GroupSize, Finished: poke, FinishedStatus: metrics.sessionFinished,
		Metrics: metrics.Handler(), StatusFields: func() map[string]any {
			out := steps.status()
			if u, err := store.Usage(); err == nil {
				out["store"] = u // what the durable store holds and costs on disk
			} else {
				log.Warn("measuring the store", "err", err)
			}
			return out
		}}
	hs := &http.Server{Handler: control.Handler(px), ReadHeaderTimeout: 30 * time.Second}
	tc := &TrainerControl{Log: log, Gate: gate, OnReport: steps.report, StatusFields: steps.status}
	fs := &arrowflight.Server{Source: rb, Control: tc, Token: cfg.FlightToken, Mem: mem, Log: log, Observer: steps}
	former := &stepFormer{cfg: cfg, store: store, ready: rb, mem: mem, log: log, wake: wake, steps: steps, budgets: budgets,
		gate: gate, metrics: metrics}
	rb.OnCommit = func(n int64) error {
		if err := store.CommitStep(n); err != nil {
			return err
		}
		if err := budgets.forget(n, -1); err != nil {
			// The step is committed: its budget is never needed again.
			log.Warn("forgetting a committed step's budget", "step", n, "err", err)
		}
		steps.committed(n)
		poke() // room in the buffer
		return nil
	}

	if ready != nil {
		ready(Addrs{Proxy: "http://" + pl.Addr().String(), Flight: arrowflight.Location(fl)})
	}
	log.Info("floe serving", "proxy", pl.Addr().String(), "flight", arrowflight.Location(fl), "data_dir", cfg.DataDir,
		"strategy", cfg.Batcher.Strategy, "token_budget", steps.Budget(), "token_budget_auto", cfg.TokenBudgetAuto,
		"gpus", mon.DeviceCount(), "recovered_steps", len(pending), "last_committed", lastCommitted)

	p := pool.New().WithContext(ctx).WithCancelOnError()
	p.Go(mon.Run)
	p.Go(func(ctx context.Context) error { return former.run(ctx, pending) })
	p.Go(func(ctx context.Context) error { return fs.Serve(ctx, fl) })
	p.Go(func(ctx context.Context) error { return ServeHTTP(ctx, hs, pl) })
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
		<-errc // http.ErrServerClosed
		return nil
	}
}

// sessionStore also accepts a session's id as its key (x-floe-session).
type sessionStore struct{ *bolt.Store }

func (s sessionStore) CreateSession(sess trace.Session, key string) error {
	if err := s.Store.CreateSession(sess, key); err != nil {
		return err
	}
	return s.Store.AddKey(sess.ID, sess.ID)
}

// stepFormer forms steps from complete groups as they come, in order, and puts them into
// the READY buffer; it blocks while the buffer is full, so groups wait and nothing is
// dropped.
type stepFormer struct {
	cfg   Config
	store *bolt.Store
	ready *Ready
	mem   memory.Allocator
	log   *slog.Logger
	wake  chan struct{}
	// steps chooses the budget of each new step and is told of each formed step.
	steps *stepTracker
	// budgets records the budget of each new step formed with a budget other than the
	// fixed one, so a restart forms it again with the same.
	budgets *stepBudgets
	// gate holds the current policy version, against which staleness is measured.
	gate    *proxy.Gate
	metrics *Metrics
}

func (f *stepFormer) run(ctx context.Context, pending []trace.StepRecord) error {
	// Recovery: the steps saved but not committed, formed again from the same groups.
	for _, rec := range pending {
		for f.ready.NextNumber() < rec.N {
			if err := f.ready.Skip(f.ready.NextNumber()); err != nil {
				return err
			}
		}
		if err := f.put(ctx, rec, false); err != nil {
			return err
		}
	}
	// The tick times groups out and is a safety net; finishing a session wakes us at once.
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		if err := f.timeOutGroups(); err != nil {
			return err
		}
		if err := f.formReady(ctx); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-f.wake:
		case <-tick.C:
		}
	}
}

// formReady forms as many steps as complete groups allow.
func (f *stepFormer) formReady(ctx context.Context) error {
	for {
		ids, err := f.store.FinishedGroups()
		if err != nil {
			return fmt.Errorf("listing complete groups: %w", err)
		}
		if len(ids) < f.cfg.GroupsPerStep {
			return nil
		}
		rec := trace.StepRecord{N: f.ready.NextNumber(), Groups: ids[:f.cfg.GroupsPerStep]}
		if f.cfg.MaxStaleness >= 0 {
			_, current, _ := f.gate.State()
			rec.MinPolicyVersion = max(0, current-f.cfg.MaxStaleness)
		}
		if err := f.put(ctx, rec, true); err != nil {
			return err
		}
	}
}

// timeOutGroups ends the open groups older than the group timeout.
func (f *stepFormer) timeOutGroups() error {
	if f.cfg.GroupTimeout <= 0 {
		return nil
	}
	gs, err := f.store.Groups()
	if err != nil {
		return fmt.Errorf("listing groups: %w", err)
	}
	for _, g := range gs {
		if g.Dropped || g.Step >= 0 || g.Complete() {
			continue
		}
		// A group already timed out with a session still running was cut short (a crash
		// between its two writes): finish the job.
		if !g.TimedOut && time.Since(g.Created) < f.cfg.GroupTimeout {
			continue
		}
		ended, err := f.store.TimeOutGroup(g.ID)
		if err != nil {
			return err
		}
		for range ended {
			f.metrics.sessionFinished(trace.StatusTimeout)
		}
		if !g.TimedOut {
			f.metrics.groupTimedOut()
		}
		f.log.Warn("group timed out", "group", g.ID, "age", time.Since(g.Created).Round(time.Second),
			"sessions", g.Sessions, "finished_before", g.Finished, "size", g.Size, "sessions_timed_out", len(ended))
	}
	return nil
}

// put forms step rec.N from rec's groups and puts it into the buffer. A new step is saved
// first; groups that cannot be trained on (too few usable sessions, nothing trainable, a
// path longer than the budget) are dropped with the reason, and the step formed without
// them.
func (f *stepFormer) put(ctx context.Context, rec trace.StepRecord, fresh bool) error {
	n, ids := rec.N, rec.Groups
	began := time.Now()
	bc := f.cfg.Batcher
	switch {
	case fresh:
		bc.TokenBudget = f.steps.Budget()
	default:
		// A recovered step is formed with the budget it was formed with: recorded when it
		// was not the fixed one.
		if b, ok := f.budgets.get(n); ok {
			bc.TokenBudget = b
		}
	}
	var groups []trace.Group
	var keep []string
	for _, id := range ids {
		g, err := f.store.Group(id)
		if err != nil {
			return fmt.Errorf("step %d: group %s: %w", n, id, err)
		}
		g, stale := f.cfg.usable(g, rec.MinPolicyVersion)
		if fresh && stale > 0 {
			f.metrics.staleCalls(stale)
			f.log.Info("stale calls not trained", "group", id, "calls", stale, "min_policy_version", rec.MinPolicyVersion)
		}
		if fresh {
			if reason := f.cfg.untrainable(n, g, bc); reason != "" {
				f.drop(id, reason)
				continue
			}
		}
		groups, keep = append(groups, g), append(keep, id)
	}
	if len(groups) == 0 {
		return nil
	}
	st, err := batcher.FormStep(n, groups, bc)
	if err != nil {
		return fmt.Errorf("forming step %d: %w", n, err)
	}
	if fresh {
		if bc.TokenBudget != f.cfg.Batcher.TokenBudget {
			if err := f.budgets.set(n, bc.TokenBudget); err != nil {
				return fmt.Errorf("recording step %d's token budget: %w", n, err)
			}
		}
		if err := f.store.SaveStepRecord(trace.StepRecord{N: n, Groups: keep, MinPolicyVersion: rec.MinPolicyVersion}); err != nil {
			return fmt.Errorf("saving step %d: %w", n, err)
		}
	}
	fs, err := FlightStep(st, f.mem)
	if err != nil {
		return err
	}
	f.steps.formed(st, bc.TokenBudget, time.Since(began), !fresh)
	if err := f.ready.Put(ctx, fs); err != nil {
		fs.Release()
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	f.log.Info("step READY", "step", n, "groups", len(groups), "micro_batches", st.Stats.MicroBatches,
		"rows", st.Stats.Rows, "loss_tokens", st.Stats.LossRows, "fill", fmt.Sprintf("%.3f", st.Stats.Fill),
		"token_budget", bc.TokenBudget, "recovered", !fresh)
	return nil
}

// usable applies the failed-session policy and the staleness cut-off: calls sampled by a
// policy older than minVersion stay as context with no loss. It returns how many
// trainable calls were stale.
func (cfg Config) usable(g trace.Group, minVersion int64) (trace.Group, int) {
	out := g
	out.Sessions = nil
	stale := 0
	for _, s := range g.Sessions {
		if s.Status == trace.StatusFailed || s.Status == trace.StatusTimeout {
			if cfg.DropFailed {
				continue
			}
			for i := range s.Calls {
				if s.Calls[i].Trainable {
					s.Calls[i].MarkUntrainable("session " + string(s.Status))
				}
			}
		}
		for i := range s.Calls {
			if c := &s.Calls[i]; c.Trainable && c.PolicyVersion < minVersion {
				c.MarkUntrainable(fmt.Sprintf("stale: policy version %d, older than %d", c.PolicyVersion, minVersion))
				stale++
			}
		}
		out.Sessions = append(out.Sessions, s)
	}
	return out, stale
}

// untrainable says why a usable group cannot go into a step (too few usable sessions,
// nothing to train, a path longer than the budget), or "" when it can.
func (cfg Config) untrainable(n int64, g trace.Group, bc batcher.Config) string {
	if len(g.Sessions) < cfg.MinGroupSize {
		return fmt.Sprintf("%d usable sessions, fewer than the minimum %d", len(g.Sessions), cfg.MinGroupSize)
	}
	if _, err := batcher.FormStep(n, []trace.Group{g}, bc); err != nil {
		return err.Error()
	}
	return ""
}

// FormableSteps is how many new steps floe serve with cfg (its fixed token budget, no
// staleness cut-off) would form from the complete groups of the store, as its step former
// does: groups in order, GroupsPerStep at a time, an untrainable group dropped from its
// step, and a step left with no group not formed. For benchmarks that must tell a trainer
// how many steps to expect.
func FormableSteps(store *bolt.Store, cfg Config) (int, error) {
	ids, err := store.FinishedGroups()
	if err != nil {
		return 0, err
	}
	steps := 0
	for ; len(ids) >= cfg.GroupsPerStep; ids = ids[cfg.GroupsPerStep:] {
		for _, id := range ids[:cfg.GroupsPerStep] {
			g, err := store.Group(id)
			if err != nil {
				return 0, fmt.Errorf("group %s: %w", id, err)
			}
			if g, _ = cfg.usable(g, 0); cfg.untrainable(int64(steps), g, cfg.Batcher) == "" {
				steps++
				break
			}
		}
	}
	return steps, nil
}

func (f *stepFormer) drop(id, reason string) {
	f.log.Warn("group dropped", "group", id, "reason", reason)
	if err := f.store.DropGroup(id, reason); err != nil {
		f.log.Error("dropping a group", "group", id, "err", err)
	}
}

// AnnounceJSON writes the bound addresses as one JSON line, as DESIGN.md asks when a port
// is 0.
func AnnounceJSON(w io.Writer) func(Addrs) {
	return func(a Addrs) {
		b, _ := json.Marshal(a)
		fmt.Fprintln(w, string(b))
	}
}
