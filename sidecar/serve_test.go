package sidecar

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow/flight"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/floe-rl/floe/gpu"
	"github.com/floe-rl/floe/internal/fakevllm"
	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace/bolt"
)

// fakeUpstream is a fake vLLM for the test's lifetime.
func fakeUpstream(t *testing.T) string {
	srv := httptest.NewServer(fakevllm.Handler())
	t.Cleanup(srv.Close)
	return srv.URL
}

// running is a floe serve started in-process.
type running struct {
	t     *testing.T
	proxy string
	// control is the control API's address: /floe/v1 and /metrics.
	control string
	flight  flight.Client
}

func startServe(t *testing.T, cfg Config) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	addrs := make(chan Addrs, 1)
	done := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if testing.Verbose() {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	go func() { done <- Serve(ctx, cfg, log, func(a Addrs) { addrs <- a }) }()
	var a Addrs
	select {
	case a = <-addrs:
	case err := <-done:
		cancel()
		t.Fatalf("Serve: %v", err)
	}
	c, err := flight.NewClientWithMiddleware(strings.TrimPrefix(a.Flight, "grpc+tcp://"), nil, nil,
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.Close() // a gRPC client: nothing of the test's in it
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve returned %v", err)
		}
	})
	return &running{t: t, proxy: a.Proxy, control: a.Control, flight: c}
}

func testConfig(t *testing.T) Config {
	cfg := DefaultConfig()
	cfg.DataDir = t.TempDir()
	cfg.ProxyAddr, cfg.ControlAddr, cfg.FlightAddr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.Upstream = fakeUpstream(t)
	cfg.GroupSize, cfg.MinGroupSize, cfg.StepsAhead = 2, 2, 2
	cfg.Batcher.PadMultiple, cfg.Batcher.TokenBudget = 16, 4096
	return cfg
}

func (r *running) post(path, key, body string, want int) map[string]any {
	r.t.Helper()
	base := r.proxy
	if strings.HasPrefix(path, "/floe/") {
		base = r.control // the control API is never on the proxy's listener
	}
	req, _ := http.NewRequest(http.MethodPost, base+path, strings.NewReader(body))
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		r.t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&out)
	if resp.StatusCode != want {
		r.t.Fatalf("POST %s: %d %v, want %d", path, resp.StatusCode, out, want)
	}
	return out
}

// group runs one group of two sessions of two calls each and finishes them.
func (r *running) group(g int) {
	r.t.Helper()
	for i := range 2 {
		s := r.post("/floe/v1/sessions", "", fmt.Sprintf(`{"task_id": "t%d", "group_id": "g%d"}`, g, g), 200)
		key := s["api_key"].(string)
		first := fmt.Sprintf(`{"role":"user","content":"task %d session %d"}`, g, i)
		res := r.post("/v1/chat/completions", key, `{"model":"x","messages":[`+first+`]}`, 200)
		reply := res["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
		r.post("/v1/chat/completions", key, fmt.Sprintf(`{"model":"x","messages":[%s,{"role":"assistant","content":%q},{"role":"user","content":"more"}]}`, first, reply), 200)
		r.post("/floe/v1/sessions/"+s["session_id"].(string)+"/finish", "", fmt.Sprintf(`{"reward": %d, "status": "completed"}`, i), 200)
	}
}

// fetch reads rank 0 of step n, waiting for it to be READY.
func (r *running) fetch(n int) {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := r.flight.DoGet(ctx, &flight.Ticket{Ticket: fmt.Appendf(nil, `{"step": %d, "rank": 0}`, n)})
	if err != nil {
		r.t.Fatal(err)
	}
	rd, err := flight.NewRecordReader(stream)
	if err != nil {
		r.t.Fatalf("step %d: %v", n, err)
	}
	defer rd.Release()
	for rd.Next() {
	}
	if err := rd.Err(); err != nil {
		r.t.Fatalf("step %d: %v", n, err)
	}
}

func (r *running) action(typ, body string) map[string]any {
	r.t.Helper()
	s, err := r.flight.DoAction(context.Background(), &flight.Action{Type: typ, Body: []byte(body)})
	if err != nil {
		r.t.Fatal(err)
	}
	res, err := s.Recv()
	if err != nil {
		r.t.Fatalf("%s %s: %v", typ, body, err)
	}
	var out map[string]any
	if err := json.Unmarshal(res.Body, &out); err != nil {
		r.t.Fatal(err)
	}
	return out
}

func (r *running) metrics() string {
	r.t.Helper()
	resp, err := http.Get(r.control + "/metrics")
	if err != nil {
		r.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		r.t.Fatalf("/metrics: %d %s", resp.StatusCode, b)
	}
	return string(b)
}

// metric returns the value of the series (name with its labels, as exposed), or -1
// when absent.
func metric(body, series string) float64 {
	for _, line := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				return -1
			}
			return f
		}
	}
	return -1
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestServeMetricsStatusAndAutoBudget runs groups through an in-process floe serve with
// --token-budget auto and no GPU (the device memory given): /metrics moves with calls,
// steps, the READY buffer and Flight; the status action carries the budget and the
// trainer's reports; calm reports grow the budget and a report over the memory target
// shrinks it for the next step.
func TestServeMetricsStatusAndAutoBudget(t *testing.T) {
	cfg := testConfig(t)
	cfg.TokenBudgetAuto = true
	cfg.TokenBudgetMin, cfg.TokenBudgetMax = 256, 4096
	cfg.GPUMemoryBytes = 1 << 30
	cfg.MemoryTarget = 0.9
	cfg.GPU = noDriver{}
	// The session and group gauges count what the store holds; archiving would take each
	// committed step's out of it (TestServeArchivesCommittedSteps).
	cfg.Retention.Archive = false
	r := startServe(t, cfg)
	limit := int64(9 * (1 << 30) / 10)

	// An unknown key is an authentication error, counted by kind.
	r.post("/v1/chat/completions", "sk-nobody", `{"model":"x","messages":[{"role":"user","content":"hi"}]}`, 401)

	budgets := []int{}
	var lastStatus map[string]any
	for n := range 6 {
		r.group(n)
		waitFor(t, fmt.Sprintf("step %d READY", n), func() bool {
			return metric(r.metrics(), "floe_ready_steps") == 1
		})
		st := r.action("status", "{}")
		budgets = append(budgets, int(st["token_budget"].(float64)))
		r.fetch(n)
		r.action("commit", fmt.Sprintf(`{"step": %d}`, n))
		peak := limit / 20 // calm: the model allows several times the rows of these small steps
		if n == 3 {
			peak = limit + limit/20 // over the target
		}
		r.action("report", fmt.Sprintf(`{"step": %d, "rank": 0, "peak_memory_bytes": %d, "step_seconds": 0.5, "wait_seconds": 0.1, "pid": %d}`,
			n, peak, os.Getpid()))
		lastStatus = r.action("status", "{}")
		if ls, ok := lastStatus["last_step"].(map[string]any); !ok || int(ls["step"].(float64)) != n {
			t.Fatalf("status after step %d's report: last_step %v", n, lastStatus["last_step"])
		}
	}
	t.Logf("budgets per step: %v", budgets)
	if budgets[0] != 256 || budgets[3] <= budgets[0] {
		t.Fatalf("budgets %v: want 256 first and growth after three calm steps", budgets)
	}
	if budgets[4] >= budgets[3] {
		t.Fatalf("budgets %v: the report over the memory target at step 3 did not shrink step 4's budget", budgets)
	}
	if lastStatus["token_budget_mode"] != "auto" || lastStatus["gpu_devices"] != 0.0 {
		t.Fatalf("status %v", lastStatus)
	}
	ls := lastStatus["last_step"].(map[string]any)
	if int(ls["token_budget"].(float64)) != budgets[5] || ls["fill"].(float64) <= 0 || ls["wait_seconds"] != 0.1 {
		t.Fatalf("last_step %v", ls)
	}
	if _, ok := ls["gpu_busy_fraction"]; ok {
		t.Fatalf("GPU figures without a GPU: %v", ls)
	}
	reports := lastStatus["reports"].([]any)
	if len(reports) != 1 || reports[0].(map[string]any)["pid"] != float64(os.Getpid()) {
		t.Fatalf("reports %v", reports)
	}
	// The control API answers the same status as Flight, with the sessions it created.
	resp, err := http.Get(r.control + "/floe/v1/status")
	if err != nil {
		t.Fatal(err)
	}
	var httpStatus map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&httpStatus); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if httpStatus["sessions"] != 12.0 {
		t.Fatalf("HTTP status sessions = %v, want 12", httpStatus["sessions"])
	}
	// the 6 steps' groups are each in a committed step (or archived: then the store no
	// longer holds them)
	if g, _ := httpStatus["groups"].(map[string]any); g == nil || g["waiting"] != 0.0 || g["complete"] != 0.0 || g["dropped"] != 0.0 {
		t.Errorf("HTTP status groups = %v, want none waiting, complete or dropped", httpStatus["groups"])
	}
	// One builder answers both doors: the Flight status has the sessions and groups too.
	flightStatus := r.action("status", "{}")
	if flightStatus["sessions"] != 12.0 || flightStatus["groups"] == nil {
		t.Errorf("Flight status sessions = %v, groups = %v; want the control API's", flightStatus["sessions"], flightStatus["groups"])
	}
	delete(httpStatus, "groups") // the archiver may move groups out between the two calls
	delete(httpStatus, "store")  // file sizes move with every write
	delete(flightStatus, "groups")
	delete(flightStatus, "store")
	if !reflect.DeepEqual(httpStatus, flightStatus) {
		t.Fatalf("HTTP status %v\ndiffers from Flight status %v", httpStatus, flightStatus)
	}
	for _, k := range []string{"ready", "next_step", "steps_ahead", "token_budget", "reports", "inflight", "paused", "policy_version"} {
		if _, ok := httpStatus[k]; !ok {
			t.Errorf("status lacks %q: %v", k, httpStatus)
		}
	}

	m := r.metrics()
	for series, want := range map[string]float64{
		`floe_calls_recorded_total{api="openai_chat",trainable="true"}`:    24,
		`floe_proxy_errors_total{api="openai_chat",kind="authentication"}`: 1,
		`floe_upstream_latency_seconds_count{api="openai_chat"}`:           24,
		`floe_sessions_finished_total{status="completed"}`:                 12,
		`floe_sessions{state="finished"}`:                                  12,
		`floe_sessions{state="running"}`:                                   0,
		`floe_groups{state="in_step"}`:                                     6,
		`floe_groups{state="dropped"}`:                                     0,
		`floe_steps_formed_total{recovered="false"}`:                       6,
		`floe_step_formation_seconds_count`:                                6,
		`floe_steps_committed_total`:                                       6,
		`floe_ready_steps`:                                                 0,
		`floe_trainer_wait_seconds_count`:                                  6,
		`floe_trainer_step_seconds_sum`:                                    3,
		`floe_token_budget_rows`:                                           float64(lastStatus["token_budget"].(float64)),
		`floe_trainer_peak_memory_bytes{rank="0"}`:                         float64(limit / 20),
	} {
		if got := metric(m, series); got != want {
			t.Errorf("%s = %v, want %v", series, got, want)
		}
	}
	for _, series := range []string{"floe_flight_bytes_sent_total", "floe_flight_micro_batches_served_total", "floe_flight_rows_sent_total",
		"floe_rows_forwarded_total", "floe_per_request_tokens_total", "floe_loss_tokens_total", "floe_step_fill", "floe_step_imbalance"} {
		if got := metric(m, series); got <= 0 {
			t.Errorf("%s = %v, want > 0", series, got)
		}
	}
	if saved, fwd, per := metric(m, "floe_tokens_saved_total"), metric(m, "floe_rows_forwarded_total"), metric(m, "floe_per_request_tokens_total"); saved != per-fwd {
		t.Errorf("tokens saved %v != per_request %v - forwarded %v", saved, per, fwd)
	}
	if metric(m, "floe_gpu_step_busy_fraction") != -1 || strings.Contains(m, "floe_gpu_utilization{") {
		t.Errorf("GPU metrics without a GPU")
	}
	if !strings.Contains(m, "go_goroutines") {
		t.Errorf("no Go runtime metrics")
	}
}

// TestServeGPUWindow runs a step on a fake one-GPU machine: the step's GPU window (from
// its first micro-batch to its commit) is in the status action and /metrics, the
// trainer PID from the report is watched, and the device peak reaches the controller.
func TestServeGPUWindow(t *testing.T) {
	cfg := testConfig(t)
	cfg.TokenBudgetAuto = true
	cfg.TokenBudgetMin, cfg.TokenBudgetMax = 256, 4096
	dev := &fakeDevice{used: 60 << 30, total: 100 << 30, util: 80, pid: int32(os.Getpid())}
	cfg.GPU = fakeLib{dev}
	r := startServe(t, cfg)
	r.action("report", fmt.Sprintf(`{"step": 99, "rank": 0, "peak_memory_bytes": 1, "step_seconds": 0, "wait_seconds": 0, "pid": %d}`, os.Getpid()))
	r.group(0)
	r.fetch(0)
	time.Sleep(300 * time.Millisecond) // a few 10 Hz samples inside the window
	r.action("commit", `{"step": 0}`)
	r.action("report", fmt.Sprintf(`{"step": 0, "rank": 0, "peak_memory_bytes": %d, "step_seconds": 0.3, "wait_seconds": 0, "pid": %d}`, 10<<30, os.Getpid()))
	st := r.action("status", "{}")
	ls := st["last_step"].(map[string]any)
	if st["gpu_devices"] != 1.0 || math.Abs(ls["gpu_busy_fraction"].(float64)-0.8) > 1e-9 || ls["gpu_peak_memory_bytes"] != float64(60<<30) ||
		ls["gpu_memory_total_bytes"] != float64(100<<30) || ls["gpu_samples"].(float64) < 1 {
		t.Fatalf("status %v", st)
	}
	d := st["token_budget_decision"].(map[string]any)
	if d["peak_bytes"] != float64(60<<30) { // the device's peak, above the reported one
		t.Fatalf("decision %v", d)
	}
	m := r.metrics()
	if math.Abs(metric(m, "floe_gpu_step_busy_fraction")-0.8) > 1e-9 || metric(m, "floe_gpu_step_peak_memory_bytes") != float64(60<<30) ||
		metric(m, `floe_gpu_utilization{device="0"}`) != 0.8 || metric(m, `floe_gpu_memory_total_bytes{device="0"}`) != float64(100<<30) {
		t.Fatalf("GPU metrics:\n%s", m)
	}
}

// noDriver is a machine without an NVIDIA driver.
type noDriver struct{}

func (noDriver) Init() error                    { return fmt.Errorf("no driver") }
func (noDriver) Shutdown() error                { panic("Shutdown after a failed Init") }
func (noDriver) DeviceCount() (int, error)      { panic("DeviceCount after a failed Init") }
func (noDriver) Device(int) (gpu.Device, error) { panic("Device after a failed Init") }

// fakeLib is a machine with one GPU at constant utilization and memory.
type fakeLib struct{ d *fakeDevice }

func (fakeLib) Init() error                      { return nil }
func (fakeLib) Shutdown() error                  { return nil }
func (fakeLib) DeviceCount() (int, error)        { return 1, nil }
func (l fakeLib) Device(int) (gpu.Device, error) { return l.d, nil }

type fakeDevice struct {
	used, total uint64
	util        uint32
	pid         int32
}

func (d *fakeDevice) Name() (string, error)                { return "Fake H200", nil }
func (d *fakeDevice) UUID() (string, error)                { return "GPU-fake", nil }
func (d *fakeDevice) Memory() (uint64, uint64, error)      { return d.used, d.total, nil }
func (d *fakeDevice) Utilization() (uint32, uint32, error) { return d.util, 10, nil }
func (d *fakeDevice) ComputeProcesses() ([]gpu.ProcessMemory, error) {
	return []gpu.ProcessMemory{{PID: d.pid, MemoryUsed: d.used / 2}}, nil
}
func (d *fakeDevice) ProcessUtilization(uint64) ([]gpu.ProcessUtilization, error) { return nil, nil }

// TestServeGroupTimeoutAndStaleness: a group whose second session never finishes is
// ended by the group timeout and still trained (the timed-out session as context only);
// with max_staleness 1, calls sampled two policy versions back are counted and not
// trained, and the step is formed from the fresh ones.
func TestServeGroupTimeoutAndStaleness(t *testing.T) {
	cfg := testConfig(t)
	cfg.GroupTimeout = 300 * time.Millisecond
	cfg.MaxStaleness = 1
	r := startServe(t, cfg)
	call := func(key, text string) {
		r.post("/v1/chat/completions", key, fmt.Sprintf(`{"model":"x","messages":[{"role":"user","content":%q}]}`, text), 200)
	}
	session := func(group string) (id, key string) {
		s := r.post("/floe/v1/sessions", "", fmt.Sprintf(`{"task_id": "t-%s", "group_id": %q}`, group, group), 200)
		return s["session_id"].(string), s["api_key"].(string)
	}

	done, doneKey := session("slow")
	hung, hungKey := session("slow")
	call(doneKey, "a")
	call(hungKey, "b")
	r.post("/floe/v1/sessions/"+done+"/finish", "", `{"reward": 1, "status": "completed"}`, 200)
	r.fetch(0) // formed only once the timeout ends the group
	req, _ := http.NewRequest(http.MethodGet, r.control+"/floe/v1/sessions/"+hung, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	err = json.NewDecoder(resp.Body).Decode(&got)
	_ = resp.Body.Close() // read above
	if err != nil {
		t.Fatal(err)
	}
	if got["status"] != "timeout" || got["reward"] != 0.0 {
		t.Fatalf("the hung session after the group timeout: %v", got)
	}
	m := r.metrics()
	if v := metric(m, "floe_groups_timed_out_total"); v != 1 {
		t.Fatalf("floe_groups_timed_out_total = %v", v)
	}
	if v := metric(m, `floe_sessions_finished_total{status="timeout"}`); v != 1 {
		t.Fatalf(`floe_sessions_finished_total{status="timeout"} = %v`, v)
	}

	// Staleness: session old samples two calls at policy version 0, then the trainer
	// moves to version 2; session fresh samples at version 2.
	old, oldKey := session("mixed")
	call(oldKey, "c")
	call(oldKey, "d")
	r.action("pause", `{}`)
	r.action("resume", `{"policy_version": 2}`)
	fresh, freshKey := session("mixed")
	call(freshKey, "e")
	r.post("/floe/v1/sessions/"+old+"/finish", "", `{"reward": 0, "status": "completed"}`, 200)
	r.post("/floe/v1/sessions/"+fresh+"/finish", "", `{"reward": 1, "status": "completed"}`, 200)
	r.fetch(1)
	if v := metric(r.metrics(), "floe_calls_stale_total"); v != 2 {
		t.Fatalf("floe_calls_stale_total = %v, want the old session's 2 calls", v)
	}
}

// serveUntil runs Serve in-process until stop is called (which waits for it to return).
func serveUntil(t *testing.T, cfg Config) (Addrs, func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	addrs := make(chan Addrs, 1)
	done := make(chan error, 1)
	go func() {
		done <- Serve(ctx, cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), func(a Addrs) { addrs <- a })
	}()
	select {
	case a := <-addrs:
		return a, func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Serve: %v", err)
			}
		}
	case err := <-done:
		cancel()
		t.Fatalf("Serve: %v", err)
		return Addrs{}, nil
	}
}

// TestPlanStepsAgreesWithTheStepFormer records six groups (two whose sessions all
// failed) without forming steps, asks PlanSteps which steps floe would form, then lets
// floe serve form them: the counts agree. It also checks that the policy version of the last
// resume survives the restart.
func TestPlanStepsAgreesWithTheStepFormer(t *testing.T) {
	cfg := testConfig(t)
	cfg.GroupsPerStep = 1 << 30 // record only
	// The dropped groups must stay in the store to be counted: archiving would move them
	// out at the restart's first pass, racing the count below.
	cfg.Retention.Archive = false
	a, stop := serveUntil(t, cfg)
	r := &running{t: t, proxy: a.Proxy, control: a.Control}
	for g := range 6 {
		status := "completed"
		if g == 2 || g == 3 {
			status = "failed"
		}
		for i := range 2 {
			s := r.post("/floe/v1/sessions", "", fmt.Sprintf(`{"task_id": "t%d", "group_id": "g%d"}`, g, g), 200)
			r.post("/v1/chat/completions", s["api_key"].(string), fmt.Sprintf(`{"model":"x","messages":[{"role":"user","content":"g%d s%d"}]}`, g, i), 200)
			r.post("/floe/v1/sessions/"+s["session_id"].(string)+"/finish", "", fmt.Sprintf(`{"reward": %d, "status": %q}`, i, status), 200)
		}
	}
	// Groups that cannot train are dropped as they complete, and the status lists them.
	waitFor(t, "g2 and g3 dropped", func() bool { return metric(r.metrics(), `floe_groups{state="dropped"}`) == 2 })
	resp, err := http.Get(r.control + "/floe/v1/status")
	if err != nil {
		t.Fatal(err)
	}
	var status Status
	if err := json.NewDecoder(resp.Body).Decode(&status); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if len(status.DroppedGroups) != 2 || status.DroppedGroups[0].Group != "g2" || status.DroppedGroups[1].Kind != "too_few_sessions" {
		t.Fatalf("status dropped_groups %+v, want g2 and g3 without a usable session (all failed: none is in the baseline)", status.DroppedGroups)
	}
	r.post("/floe/v1/pause", "", `{}`, 200)
	r.post("/floe/v1/resume", "", `{"policy_version": 4}`, 200)
	stop()

	cfg.GroupsPerStep, cfg.StepsAhead = 2, 10
	st, err := bolt.New(cfg.DataDir, bolt.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	forms, err := PlanSteps(st, cfg)
	testutil.Close(t, st)
	want := len(forms)
	if err != nil || want != 2 || !slices.Equal(forms[0].Groups, []string{"g0", "g1"}) || !slices.Equal(forms[1].Groups, []string{"g4", "g5"}) {
		t.Fatalf("PlanSteps = %+v %v; want [g0 g1], [g4 g5] ([g2 g3] have no usable session)", forms, err)
	}
	r = startServe(t, cfg)
	waitFor(t, "every complete group formed or dropped", func() bool {
		m := r.metrics()
		return metric(m, `floe_groups{state="complete"}`) == 0 && metric(m, `floe_groups{state="dropped"}`) == 2
	})
	if got := metric(r.metrics(), `floe_steps_formed_total{recovered="false"}`); got != float64(want) {
		t.Fatalf("floe formed %v steps, PlanSteps said %d", got, want)
	}
	if v := r.action("status", `{}`)["policy_version"]; v != 4.0 {
		t.Fatalf("policy version after a restart: %v, want 4", v)
	}
}
