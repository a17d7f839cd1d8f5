// Package capacity measures how far one floe serve goes: R concurrent streaming agent
// sessions and T trainer-rank processes against one floe serve child process, all on
// loopback, with floe's zero-latency fake vLLM as the inference server. For each (R, T)
// it reports durable calls recorded per second, the latency floe adds, floe's memory per
// open session, the Flight bytes per second to T ranks, and what forming a step costs
// against its size, and what the data dir keeps: the bbolt store's file, bounded because
// floe serve archives each committed step to Parquet and removes it from the store, and
// the archive's bytes per call (docs/scale.md reads them). After each point's drain it
// checks that every committed step's calls are in the archive and none in the store, and
// fails the point otherwise.
package capacity

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"
	bbolt "go.etcd.io/bbolt"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/sidecar"
	"github.com/floe-rl/floe/trace/archive"
)

// Options are one sweep's settings.
type Options struct {
	Sessions []int // R: concurrent agent sessions, one point each (with each T)
	Ranks    []int // T: trainer-rank processes, one point each (with each R)
	Workload Workload
	// GroupsPerStep is floe serve's -groups-per-step.
	GroupsPerStep int
	// TokenBudget is floe serve's -token-budget (0: the workload's longest call rounded up
	// to 1024 rows, at least 16384).
	TokenBudget int
	LoadFor     time.Duration // the saturating phase through floe, at least
	// MinCallsPerSession extends the load until the agents have made this many calls per
	// session on average (so that at large R the sessions have a history), up to LoadMax.
	MinCallsPerSession float64
	LoadMax            time.Duration
	// ProbeFor is the latency probe's length, after the load: the open sessions send
	// each call straight to the fake and then through floe, paced so that floe gets
	// ProbeLoad of the rate it sustained in the load.
	ProbeFor  time.Duration
	ProbeLoad float64
	// DrainFor bounds the phase after the load, in which the sessions finish and the
	// ranks fetch and commit the steps their groups form.
	DrainFor time.Duration
	Seed     uint64
	// Floe is floe serve's command line with args (its flags) appended.
	Floe func(args []string) *exec.Cmd
	// Rank is the command line of trainer rank r's process against Flight location
	// (floe-bench capacity-rank).
	Rank func(location string, rank int) *exec.Cmd
	Work string // data dirs and floe's logs go under it
	// FormGroups are the step sizes, in groups, the in-process forming cost is measured
	// at; none: not measured.
	FormGroups []int
	FormDPSize int // ranks the in-process steps are balanced over
	Progress   io.Writer
}

func (o *Options) budget() int {
	if o.TokenBudget > 0 {
		return o.TokenBudget
	}
	need := (o.Workload.LongestPrompt() + 128 + 1023) / 1024 * 1024
	return max(need, 16384)
}

// Point is one (R, T) measurement.
type Point struct {
	Sessions int `json:"sessions"` // R
	Ranks    int `json:"ranks"`    // T

	// Load phase through floe.
	LoadSeconds float64 `json:"load_seconds"` // from the first session created to the last call answered
	Calls       int64   `json:"calls"`        // answered 200 with the whole stream
	Errors      int64   `json:"errors"`
	FirstError  string  `json:"first_error,omitempty"`
	Recorded    int64   `json:"recorded"` // floe_calls_recorded_total at the end of the load
	CallsPerSec float64 `json:"calls_per_sec"`
	FloeCPU     float64 `json:"floe_cpu_seconds"` // floe's user+system CPU over the load phase
	// Latency of each call through floe in the load phase (saturated, closed loop), ms.
	SaturatedP50 float64 `json:"saturated_p50_ms"`
	SaturatedP99 float64 `json:"saturated_p99_ms"`
	// The latency probe: each call straight to the fake, then through floe, ms.
	ProbeCalls     int64   `json:"probe_calls"` // through floe (as many went direct)
	ProbeErrors    int64   `json:"probe_errors"`
	ProbeCallsPerS float64 `json:"probe_calls_per_sec"`
	ProxyP50       float64 `json:"proxy_p50_ms"`
	ProxyP99       float64 `json:"proxy_p99_ms"`
	DirectP50      float64 `json:"direct_p50_ms"`
	DirectP99      float64 `json:"direct_p99_ms"`
	// AddedP50 and AddedP99 are percentiles of each pair's difference (through floe −
	// direct), ms: what floe adds to a call.
	AddedP50 float64 `json:"added_p50_ms"`
	AddedP99 float64 `json:"added_p99_ms"`
	// RecordedAll is floe_calls_recorded_total after the probe: Calls + ProbeCalls.
	RecordedAll int64 `json:"recorded_all"`

	// Memory: floe's RSS idle (started, nothing open) and with the load's sessions open.
	IdleRSS      int64 `json:"idle_rss"`
	IdleAnon     int64 `json:"idle_anon"`
	OpenRSS      int64 `json:"open_rss"`
	OpenAnon     int64 `json:"open_anon"`
	OpenSessions int64 `json:"open_sessions"`

	// Steps and Flight.
	StepsFormed     int64   `json:"steps_formed"`
	StepsCommitted  int64   `json:"steps_committed"`
	FormSecondsMean float64 `json:"form_seconds_mean"` // floe_step_formation_seconds sum / count
	RowsPerStep     float64 `json:"rows_per_step"`
	// StoreFileBytes is the bbolt file's size after the drain (floe stopped): what the
	// store holds at once, bounded, since committed steps leave it for the archive.
	// StoreBytes is the part in use (pages up to its high-water mark).
	StoreFileBytes int64     `json:"store_file_bytes"`
	StoreBytes     int64     `json:"store_bytes"`
	Fetched        []fetched `json:"fetched"`

	// The archive after the drain (the status' store counters, and the archive's files).
	// CommittedCalls is the calls the agents got answered through floe in the groups of the
	// committed steps (as their sample tables name them): ArchivedCalls must equal it,
	// and StoreCalls (the calls the store still holds) must be RecordedAll − CommittedCalls.
	ArchivedSteps    int64 `json:"archived_steps"`
	ArchivedSessions int64 `json:"archived_sessions"`
	ArchivedCalls    int64 `json:"archived_calls"`
	CommittedCalls   int64 `json:"committed_calls"`
	StoreCalls       int64 `json:"store_calls"`
	ArchiveBytes     int64 `json:"archive_bytes"` // every file under <data-dir>/archive
}

// ArchiveBytesPerCall is the archive's size over the calls it holds.
func (p Point) ArchiveBytesPerCall() float64 {
	return float64(p.ArchiveBytes) / float64(max(p.ArchivedCalls, 1))
}

// BytesPerSession is floe's RSS growth per open session.
func (p Point) BytesPerSession() float64 {
	return float64(p.OpenRSS-p.IdleRSS) / float64(max(p.OpenSessions, 1))
}

// AnonPerSession is the same without the store's mapped file.
func (p Point) AnonPerSession() float64 {
	return float64(p.OpenAnon-p.IdleAnon) / float64(max(p.OpenSessions, 1))
}

// CPUPerCall is floe's CPU seconds per call recorded.
func (p Point) CPUPerCall() float64 { return p.FloeCPU / float64(max(p.Recorded, 1)) }

// FlightBytes and FlightSeconds sum the steps the ranks fetched.
func (p Point) FlightBytes() int64 {
	var n int64
	for _, f := range p.Fetched {
		n += f.Bytes
	}
	return n
}

func (p Point) FlightSeconds() float64 {
	var s float64
	for _, f := range p.Fetched {
		s += f.Took.Seconds()
	}
	return s
}

// FlightGBps is the bytes the T ranks fetched over the time the fetches took, GB/s.
func (p Point) FlightGBps() float64 {
	if s := p.FlightSeconds(); s > 0 {
		return float64(p.FlightBytes()) / s / 1e9
	}
	return 0
}

// Report is a whole sweep.
type Report struct {
	Started            time.Time  `json:"started"`
	WallSeconds        float64    `json:"wall_seconds"`
	Command            string     `json:"command"`
	Machine            string     `json:"machine"`
	Workload           Workload   `json:"workload"`
	GroupsPer          int        `json:"groups_per_step"`
	TokenBudget        int        `json:"token_budget"`
	LoadFor            string     `json:"load_for"`
	LoadMax            string     `json:"load_max"`
	MinCallsPerSession float64    `json:"min_calls_per_session"`
	ProbeFor           string     `json:"probe_for"`
	ProbeLoad          float64    `json:"probe_load"`
	Points             []Point    `json:"points"`
	Forming            []FormCost `json:"forming"`
	FormDPSize         int        `json:"form_dp_size"`
}

func (o *Options) progress(format string, args ...any) {
	if o.Progress != nil {
		_, _ = fmt.Fprintf(o.Progress, format+"\n", args...) // progress lines: a closed stderr must not stop a run
	}
}

// Run measures every (R, T) point, then the forming cost.
func Run(ctx context.Context, opt Options) (*Report, error) {
	if opt.Workload.GroupSize < 1 || opt.Workload.Turns < 1 {
		return nil, errors.New("the workload needs a group size and turns")
	}
	rep := &Report{Started: time.Now(), Workload: opt.Workload, GroupsPer: opt.GroupsPerStep, TokenBudget: opt.budget(),
		ProbeFor: opt.ProbeFor.String(), ProbeLoad: opt.ProbeLoad, LoadFor: opt.LoadFor.String(), LoadMax: opt.LoadMax.String(), MinCallsPerSession: opt.MinCallsPerSession, FormDPSize: opt.FormDPSize}
	up := &http.Server{Handler: Upstream(opt.Workload.AnswerTokens), ReadHeaderTimeout: time.Minute}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	go func() { _ = up.Serve(lis) }()
	defer func() { _ = up.Close() }() // the fake upstream: its Close error is no result
	upURL := "http://" + lis.Addr().String()
	for _, r := range opt.Sessions {
		for _, t := range opt.Ranks {
			opt.progress("point R=%d T=%d", r, t)
			p, err := runPoint(ctx, &opt, upURL, r, t)
			if err != nil {
				return nil, fmt.Errorf("point R=%d T=%d: %w", r, t, err)
			}
			opt.progress("  %.0f calls/s (%d calls, %d recorded, %d errors), added p50 %.2f ms p99 %.2f ms, %.1f KiB/session, %d steps, %.3f GB/s; "+
				"%d calls archived in %d steps (%.1f KiB/call), store file %.0f KiB holding %d calls",
				p.CallsPerSec, p.Calls, p.Recorded, p.Errors, p.AddedP50, p.AddedP99, p.BytesPerSession()/1024, p.StepsCommitted, p.FlightGBps(),
				p.ArchivedCalls, p.ArchivedSteps, p.ArchiveBytesPerCall()/1024, float64(p.StoreFileBytes)/1024, p.StoreCalls)
			rep.Points = append(rep.Points, *p)
		}
	}
	if len(opt.FormGroups) > 0 {
		opt.progress("forming steps in-process: %v groups", opt.FormGroups)
		cfg := batcher.DefaultConfig()
		cfg.TokenBudget, cfg.DPSize = opt.budget(), max(opt.FormDPSize, 1)
		rep.Forming, err = MeasureForming(opt.Workload, cfg, opt.FormGroups, 3, opt.Seed)
		if err != nil {
			return nil, err
		}
	}
	rep.WallSeconds = time.Since(rep.Started).Seconds()
	return rep, nil
}

func runPoint(ctx context.Context, opt *Options, upURL string, r, t int) (*Point, error) {
	dir := filepath.Join(opt.Work, fmt.Sprintf("r%d-t%d", r, t))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	w := opt.Workload
	groups := (r + w.GroupSize - 1) / w.GroupSize
	r = groups * w.GroupSize
	p := &Point{Sessions: r, Ranks: t}
	cmd := opt.Floe([]string{"-data-dir", filepath.Join(dir, "data"), "-proxy-addr", "127.0.0.1:0", "-control-addr", "127.0.0.1:0",
		"-flight-addr", "127.0.0.1:0", "-upstream", upURL, "-model", "m", "-dp-size", strconv.Itoa(t),
		"-groups-per-step", strconv.Itoa(opt.GroupsPerStep), "-group-size", strconv.Itoa(w.GroupSize),
		"-token-budget", strconv.Itoa(opt.budget()), "-steps-ahead", "4",
		// Every session may have its call in flight: the default cap (1024) would answer
		// the rest "overloaded" at R = 4096.
		"-max-inflight", strconv.Itoa(max(2*r, 1024))})
	floe, err := startFloe(ctx, cmd, filepath.Join(dir, "floe.log"))
	if err != nil {
		return nil, err
	}
	defer floe.stop()
	pid := floe.cmd.Process.Pid

	transport := &http.Transport{MaxIdleConns: 4*r + 64, MaxIdleConnsPerHost: 2*r + 32, IdleConnTimeout: 5 * time.Minute,
		DisableCompression: true}
	defer transport.CloseIdleConnections()
	hc := &http.Client{Transport: transport}
	if err := waitIdle(ctx); err != nil {
		return nil, err
	}
	idle, err := readMemory(pid)
	if err != nil {
		return nil, err
	}
	p.IdleRSS, p.IdleAnon = idle.RSS, idle.Anon
	system := systemPrompt(w, opt.Seed)

	// The ranks fetch and commit every step as it is READY, from the load's start.
	rs, err := startRanks(floe.flight, t, opt.Rank)
	if err != nil {
		return nil, err
	}
	defer rs.stop()
	tctx, stopTrainer := context.WithCancel(ctx)
	var trainerErr error
	var fetchedMu sync.Mutex
	trainerDone := make(chan struct{})
	go func() {
		defer close(trainerDone)
		for n := int64(0); tctx.Err() == nil; {
			if err := rs.waitReady(tctx, n, time.Second); err != nil {
				continue // not READY yet, or the trainer is told to stop
			}
			f, err := rs.fetch(ctx, n)
			if err != nil {
				trainerErr = err
				return
			}
			fetchedMu.Lock()
			p.Fetched = append(p.Fetched, f)
			fetchedMu.Unlock()
			n++
		}
	}()
	defer func() {
		stopTrainer()
		<-trainerDone
	}()

	// The load.
	c := &client{http: hc}
	fl := &fleet{w: w, system: system, seed: opt.Seed, c: c, proxy: floe.proxy, control: floe.control,
		stop: make(chan struct{}), finish: make(chan struct{}), probe: make(chan struct{}), probeEnd: make(chan struct{}),
		upstream: upURL, direct: &client{http: hc}, probed: &client{http: hc}}
	cpu0, err := readCPU(pid)
	if err != nil {
		return nil, err
	}
	t0 := time.Now()
	var groupsWG sync.WaitGroup
	fl.settled.Add(groups)
	for g := 0; g < groups; g++ {
		groupsWG.Add(1)
		go func() {
			defer groupsWG.Done()
			fl.runGroup(ctx)
		}()
	}
	// Release the stopped sessions on every way out, so no goroutine outlives the point.
	var stopOnce, releaseOnce sync.Once
	stop := func() { stopOnce.Do(func() { close(fl.stop) }) }
	release := func() { releaseOnce.Do(func() { close(fl.finish) }) }
	defer func() {
		stop()
		release()
		groupsWG.Wait()
	}()
	select {
	case <-time.After(opt.LoadFor):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	for float64(c.calls.Load()) < opt.MinCallsPerSession*float64(r) && time.Since(t0) < opt.LoadMax && ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	fl.settled.Wait()
	p.LoadSeconds = time.Since(t0).Seconds()
	cpu1, err := readCPU(pid)
	if err != nil {
		return nil, err
	}
	p.FloeCPU = (cpu1 - cpu0).Seconds()
	p.Calls, p.Errors = c.calls.Load(), c.failed.Load()
	if e, ok := c.firstErr.Load().(string); ok {
		p.FirstError = e
	}
	p.CallsPerSec = float64(p.Calls) / p.LoadSeconds
	p.SaturatedP50, p.SaturatedP99 = percentileMs(c.latencies, 0.5), percentileMs(c.latencies, 0.99)
	m, err := scrape(ctx, hc, floe.control)
	if err != nil {
		return nil, err
	}
	p.Recorded = int64(m["floe_calls_recorded_total"])
	p.OpenSessions = fl.open.Load()
	open, err := readMemory(pid)
	if err != nil {
		return nil, err
	}
	p.OpenRSS, p.OpenAnon = open.RSS, open.Anon

	// The latency probe, on the open sessions.
	if p.OpenSessions > 0 && p.CallsPerSec > 0 {
		fl.think = time.Duration(float64(p.OpenSessions) / (opt.ProbeLoad * p.CallsPerSec) * float64(time.Second))
		t1 := time.Now()
		close(fl.probe)
		select {
		case <-time.After(opt.ProbeFor):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		close(fl.probeEnd)
		for fl.inProbe.Load() > 0 {
			time.Sleep(5 * time.Millisecond)
		}
		p.ProbeCalls, p.ProbeErrors = fl.probed.calls.Load(), fl.probed.failed.Load()+fl.direct.failed.Load()
		p.ProbeCallsPerS = float64(p.ProbeCalls) / time.Since(t1).Seconds()
		p.ProxyP50, p.ProxyP99 = percentileMs(fl.probed.latencies, 0.5), percentileMs(fl.probed.latencies, 0.99)
		p.DirectP50, p.DirectP99 = percentileMs(fl.direct.latencies, 0.5), percentileMs(fl.direct.latencies, 0.99)
		p.AddedP50, p.AddedP99 = percentileMs(fl.added, 0.5), percentileMs(fl.added, 0.99)
		if e, ok := fl.probed.firstErr.Load().(string); ok && p.FirstError == "" {
			p.FirstError = e
		}
	}
	m, err = scrape(ctx, hc, floe.control)
	if err != nil {
		return nil, err
	}
	p.RecordedAll = int64(m["floe_calls_recorded_total"])

	// The drain: the sessions finish, their groups complete, and the ranks take the steps.
	release()
	groupsWG.Wait()
	// Done when every group is decided, every step formed is committed and every step
	// committed is archived (floe archives after the commit, in the background); fewer
	// complete groups than a step takes wait for more, as in a run.
	deadline := time.Now().Add(opt.DrainFor)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
		m, err := scrape(ctx, hc, floe.control)
		if err != nil {
			return nil, err
		}
		st, err := readStatus(ctx, hc, floe.control)
		if err != nil {
			return nil, err
		}
		fetchedMu.Lock()
		got := float64(len(p.Fetched))
		fetchedMu.Unlock()
		if m[`floe_groups{state="open"}`] == 0 && m[`floe_groups{state="complete"}`] < float64(opt.GroupsPerStep) &&
			m["floe_steps_formed_total"] == got && float64(st.Store.ArchivedSteps) == m["floe_steps_committed_total"] {
			break
		}
	}
	stopTrainer()
	<-trainerDone
	if trainerErr != nil {
		return nil, fmt.Errorf("trainer ranks: %w", trainerErr)
	}
	m, err = scrape(ctx, hc, floe.control)
	if err != nil {
		return nil, err
	}
	p.StepsFormed = int64(m["floe_steps_formed_total"])
	p.StepsCommitted = int64(m["floe_steps_committed_total"])
	if n := m["floe_step_formation_seconds_count"]; n > 0 {
		p.FormSecondsMean = m["floe_step_formation_seconds_sum"] / n
		p.RowsPerStep = m["floe_rows_forwarded_total"] / n
	}
	st, err := readStatus(ctx, hc, floe.control)
	if err != nil {
		return nil, err
	}
	p.ArchivedSteps, p.ArchivedSessions, p.ArchivedCalls = int64(st.Store.ArchivedSteps), int64(st.Store.ArchivedSessions), int64(st.Store.ArchivedCalls)
	p.StoreCalls = int64(st.Store.Calls)
	floe.stop()
	data := filepath.Join(dir, "data")
	if p.StoreBytes, err = storeBytes(filepath.Join(data, storeFile)); err != nil {
		return nil, err
	}
	fi, err := os.Stat(filepath.Join(data, storeFile))
	if err != nil {
		return nil, err
	}
	p.StoreFileBytes = fi.Size()
	if p.ArchiveBytes, err = dirBytes(filepath.Join(data, archiveDir)); err != nil {
		return nil, fmt.Errorf("floe's archive: %w", err)
	}
	steps, err := archive.ReadSteps(filepath.Join(data, archiveDir), memory.NewGoAllocator())
	if err != nil {
		return nil, fmt.Errorf("reading the archive's steps: %w", err)
	}
	var committed []string
	for _, f := range p.Fetched {
		committed = append(committed, f.Groups...)
	}
	p.CommittedCalls = fl.callsOf(committed)
	if err := p.checkArchived(len(steps), m["floe_groups_dropped_total"]); err != nil {
		return nil, fmt.Errorf("after the drain: %w (floe's log: %s)", err, filepath.Join(dir, "floe.log"))
	}
	return p, nil
}

// checkArchived is the archive's invariant after the drain: every committed step is
// archived (status and step rows), its calls are all in the archive, and the store holds
// none of them, only the calls of groups no step took yet. stepRows is the archive's step
// rows; dropped is floe_groups_dropped_total (a dropped group is archived without a step,
// so its calls would count as archived outside any committed step).
func (p *Point) checkArchived(stepRows int, dropped float64) error {
	var errs []error
	if p.ArchivedSteps != p.StepsCommitted || int64(stepRows) != p.StepsCommitted {
		errs = append(errs, fmt.Errorf("%d steps committed, %d archived (status), %d step rows in the archive: "+
			"want every committed step archived", p.StepsCommitted, p.ArchivedSteps, stepRows))
	}
	if p.ArchivedCalls != p.CommittedCalls {
		errs = append(errs, fmt.Errorf("%d calls archived (status), %d calls in the committed steps' groups: want equal",
			p.ArchivedCalls, p.CommittedCalls))
	}
	if want := p.RecordedAll - p.CommittedCalls; p.StoreCalls != want {
		errs = append(errs, fmt.Errorf("the store holds %d calls, want %d (%d recorded − %d in committed steps): "+
			"committed steps' calls must leave it", p.StoreCalls, want, p.RecordedAll, p.CommittedCalls))
	}
	if len(errs) > 0 && dropped > 0 {
		errs = append(errs, fmt.Errorf("floe dropped %.0f groups (archived without a step)", dropped))
	}
	if len(errs) > 0 && p.Errors+p.ProbeErrors > 0 {
		errs = append(errs, fmt.Errorf("%d calls failed at the agents (floe may have recorded some): %s", p.Errors+p.ProbeErrors, p.FirstError))
	}
	return errors.Join(errs...)
}

// archiveDir is floe serve's archive in its data dir (the -archive-dir default).
const archiveDir = "archive"

// dirBytes is the size of the regular files under dir; 0 if there is no dir (floe
// archived nothing, which the point's check then reports).
func dirBytes(dir string) (int64, error) {
	var n int64
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if path == dir && errors.Is(err, fs.ErrNotExist) {
			return fs.SkipAll
		}
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			info, err := d.Info()
			if err != nil {
				return err
			}
			n += info.Size()
		}
		return nil
	})
	return n, err
}

// readStatus is floe's GET /floe/v1/status; it fails if floe reports no store.
func readStatus(ctx context.Context, c *http.Client, control string) (*sidecar.Status, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, control+"/floe/v1/status", nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, fmt.Errorf("floe's status: %w", err)
	}
	defer func() { _ = resp.Body.Close() }() // the body is read or abandoned; its Close error changes nothing
	var st sidecar.Status
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		return nil, fmt.Errorf("floe's status: %w", err)
	}
	if st.Store == nil {
		return nil, errors.New("floe's status has no store")
	}
	return &st, nil
}

// storeFile is floe's store in its data dir (trace/bolt.FileName).
const storeFile = "floe.db"

// storeBytes is the size in use of the bbolt file at path, which floe has closed.
func storeBytes(path string) (int64, error) {
	db, err := bbolt.Open(path, 0o600, &bbolt.Options{ReadOnly: true, Timeout: 10 * time.Second})
	if err != nil {
		return 0, fmt.Errorf("opening floe's store: %w", err)
	}
	defer func() { _ = db.Close() }() // read only: a Close error loses nothing
	var n int64
	err = db.View(func(tx *bbolt.Tx) error {
		n = tx.Size()
		return nil
	})
	return n, err
}

// waitIdle lets floe finish starting (its GC and first allocations) before its idle
// memory is read.
func waitIdle(ctx context.Context) error {
	select {
	case <-time.After(300 * time.Millisecond):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
