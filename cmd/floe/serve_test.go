package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/flight"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/floe-rl/floe/internal/fakevllm"
)

// TestMain lets a test run the floe binary itself: the test binary re-executed with
// FLOE_MAIN_ARGS set is `floe` with those arguments.
func TestMain(m *testing.M) {
	if raw := os.Getenv("FLOE_MAIN_ARGS"); raw != "" {
		lowerNofile(os.Getenv("FLOE_TEST_NOFILE")) // as ulimit -n would
		var args []string
		if err := json.Unmarshal([]byte(raw), &args); err != nil {
			panic(err)
		}
		main2(args)
		return
	}
	os.Exit(m.Run())
}

func main2(args []string) {
	os.Args = append([]string{"floe"}, args...)
	main()
}

// fakeEngine is a fake vLLM; the caller closes it.
func fakeEngine() *httptest.Server { return httptest.NewServer(fakevllm.Handler()) }

type floeProc struct {
	cmd   *exec.Cmd
	proxy string
	// control is the control API's address (/floe/v1, /metrics): never the proxy's.
	control string
	flight  flight.Client
	// flightLoc is the Flight location floe announced.
	flightLoc string
	logs      *strings.Builder
}

// startFloe runs floe serve with args (and -control-addr 127.0.0.1:0 unless args give
// one) and waits for its announcement.
func startFloe(t *testing.T, args ...string) *floeProc {
	t.Helper()
	return startFloeEnv(t, nil, args...)
}

// startFloeEnv is startFloe with env added to the process's environment; the Flight
// client sends the bearer token of $FLOE_FLIGHT_TOKEN in env, if any.
func startFloeEnv(t *testing.T, env []string, args ...string) *floeProc {
	t.Helper()
	if !slices.Contains(args, "-control-addr") {
		args = append([]string{"-control-addr", "127.0.0.1:0"}, args...)
	}
	raw, _ := json.Marshal(append([]string{"serve"}, args...))
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(append(os.Environ(), env...), "FLOE_MAIN_ARGS="+string(raw))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	logs := &strings.Builder{}
	cmd.Stderr = logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("floe serve announced nothing: %v\n%s", err, logs.String())
	}
	var addrs struct{ Proxy, Control, Flight string }
	if err := json.Unmarshal([]byte(line), &addrs); err != nil || addrs.Proxy == "" || addrs.Control == "" || addrs.Flight == "" {
		t.Fatalf("announcement %q: %v; want proxy, control and flight", line, err)
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	for _, e := range env {
		if tok, ok := strings.CutPrefix(e, "FLOE_FLIGHT_TOKEN="); ok {
			opts = append(opts, grpc.WithPerRPCCredentials(bearer(tok)))
		}
	}
	c, err := flight.NewClientWithMiddleware(strings.TrimPrefix(addrs.Flight, "grpc+tcp://"), nil, nil, opts...)
	if err != nil {
		t.Fatal(err)
	}
	p := &floeProc{cmd: cmd, proxy: addrs.Proxy, control: addrs.Control, flight: c, flightLoc: addrs.Flight, logs: logs}
	t.Cleanup(func() {
		_ = c.Close() // a gRPC client: nothing of the test's in it
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return p
}

// proxyProc is a floe proxy child process: the addresses it announced and its log.
type proxyProc struct {
	proxy, control string
	logs           *strings.Builder
}

// startFloeProxy runs floe proxy with args (no control token) and waits for its
// announcement; the process is killed when the test ends.
func startFloeProxy(t *testing.T, args ...string) proxyProc {
	t.Helper()
	raw, _ := json.Marshal(append([]string{"proxy"}, args...))
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "FLOE_MAIN_ARGS="+string(raw), "FLOE_CONTROL_TOKEN=")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	logs := &strings.Builder{}
	cmd.Stderr = logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("floe proxy announced nothing: %v\n%s", err, logs.String())
	}
	var addrs struct{ Proxy, Control string }
	if err := json.Unmarshal([]byte(line), &addrs); err != nil || addrs.Proxy == "" || addrs.Control == "" || addrs.Proxy == addrs.Control {
		t.Fatalf("announcement %q: %v; want distinct proxy and control", line, err)
	}
	return proxyProc{proxy: addrs.Proxy, control: addrs.Control, logs: logs}
}

// bearer is a gRPC per-call credential: authorization: Bearer <token>.
type bearer string

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}
func (bearer) RequireTransportSecurity() bool { return false }

// post posts body to path: /floe/... on the control address, every other path on the
// proxy's, with key as the bearer token; it fails the test unless the answer is 200.
func (p *floeProc) post(t *testing.T, path, key, body string) map[string]any {
	t.Helper()
	base := p.proxy
	if strings.HasPrefix(path, "/floe/") {
		base = p.control
	}
	req, _ := http.NewRequest(http.MethodPost, base+path, strings.NewReader(body))
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&out)
	if resp.StatusCode != 200 {
		t.Fatalf("POST %s: %d %v", path, resp.StatusCode, out)
	}
	return out
}

// step reads rank 0's micro-batches of step n.
func (p *floeProc) step(t *testing.T, n int) ([]arrow.RecordBatch, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := p.flight.DoGet(ctx, &flight.Ticket{Ticket: fmt.Appendf(nil, `{"step": %d, "rank": 0}`, n)})
	if err != nil {
		return nil, err
	}
	rd, err := flight.NewRecordReader(stream)
	if err != nil {
		return nil, err
	}
	defer rd.Release()
	var out []arrow.RecordBatch
	for rd.Next() {
		rec := rd.RecordBatch()
		rec.Retain()
		out = append(out, rec)
	}
	return out, rd.Err()
}

func (p *floeProc) commit(t *testing.T, n int) error {
	t.Helper()
	s, err := p.flight.DoAction(context.Background(), &flight.Action{Type: "commit", Body: fmt.Appendf(nil, `{"step": %d}`, n)})
	if err != nil {
		return err
	}
	_, err = s.Recv()
	return err
}

// TestServeSurvivesKill9 runs the real binary: record calls, finish sessions, form steps,
// commit one, read part of the next, kill -9, restart on the same data dir. Nothing
// recorded is lost, the committed step is never served again, and the uncommitted step is
// served byte for byte as before.
func TestServeSurvivesKill9(t *testing.T) {
	up := fakeEngine()
	defer up.Close()
	dir := t.TempDir()
	args := []string{"-data-dir", dir, "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0", "-upstream", up.URL,
		"-group-size", "2", "-min-group-size", "2", "-groups-per-step", "1", "-steps-ahead", "2", "-token-budget", "4096", "-pad-multiple", "16"}
	f := startFloe(t, args...)
	var sessions []string
	for g := 0; g < 2; g++ {
		for i := 0; i < 2; i++ {
			s := f.post(t, "/floe/v1/sessions", "", fmt.Sprintf(`{"task_id": "t%d", "group_id": "g%d"}`, g, g))
			key := s["api_key"].(string)
			msgs := fmt.Sprintf(`[{"role":"user","content":"task %d session %d"}]`, g, i)
			first := f.post(t, "/v1/chat/completions", key, `{"model":"x","messages":`+msgs+`}`)
			reply := first["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
			msgs = fmt.Sprintf(`[{"role":"user","content":"task %d session %d"},{"role":"assistant","content":%q},{"role":"user","content":"more"}]`, g, i, reply)
			f.post(t, "/v1/chat/completions", key, `{"model":"x","messages":`+msgs+`}`)
			f.post(t, "/floe/v1/sessions/"+s["session_id"].(string)+"/finish", "", fmt.Sprintf(`{"reward": %d, "status": "completed"}`, i))
			sessions = append(sessions, s["session_id"].(string))
		}
	}
	var step0, step1 []arrow.RecordBatch
	deadline := time.Now().Add(10 * time.Second)
	for {
		var err0, err1 error
		step0, err0 = f.step(t, 0)
		step1, err1 = f.step(t, 1)
		if err0 == nil && err1 == nil && len(step0) > 0 && len(step1) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("steps not READY: %v / %v", err0, err1)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := f.commit(t, 0); err != nil {
		t.Fatal(err)
	}
	if err := f.cmd.Process.Kill(); err != nil { // SIGKILL: no shutdown, no flush
		t.Fatal(err)
	}
	_ = f.cmd.Wait()

	g := startFloe(t, args...)
	for _, id := range sessions {
		req, _ := http.NewRequest(http.MethodGet, g.control+"/floe/v1/sessions/"+id, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var s map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&s)
		resp.Body.Close()
		if s["status"] != "completed" || len(s["calls"].([]any)) != 2 {
			t.Fatalf("after the restart session %s is %v with %v calls", id, s["status"], s["calls"])
		}
	}
	if _, err := g.step(t, 0); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("the committed step 0 after the restart: %v, want FailedPrecondition", err)
	}
	again, err := g.step(t, 1)
	if err != nil {
		t.Fatalf("step 1 after the restart: %v", err)
	}
	if len(again) != len(step1) {
		t.Fatalf("step 1 has %d micro-batches after the restart, %d before", len(again), len(step1))
	}
	for i := range again {
		if !array.RecordEqual(again[i], step1[i]) {
			t.Fatalf("micro-batch %d of step 1 differs after the restart", i)
		}
		a, _ := again[i].(arrow.RecordBatchWithMetadata)
		b, _ := step1[i].(arrow.RecordBatchWithMetadata)
		if a == nil || b == nil || !a.Metadata().Equal(b.Metadata()) {
			t.Fatalf("micro-batch %d metadata differs after the restart", i)
		}
	}
	if err := g.commit(t, 1); err != nil {
		t.Fatal(err)
	}
	if err := g.commit(t, 1); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("second commit of step 1: %v", err)
	}
	for _, r := range append(append(step0, step1...), again...) {
		r.Release()
	}
}

// TestServeLogsItsLifecycle: an operator reading floe's log sees which build started,
// that a SIGTERM was taken (the drain can take a while) and that floe stopped cleanly.
func TestServeLogsItsLifecycle(t *testing.T) {
	up := fakeEngine()
	defer up.Close()
	f := startFloe(t, "-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0",
		"-upstream", up.URL)
	if err := f.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := f.cmd.Wait(); err != nil {
		t.Fatalf("floe serve after SIGTERM: %v\n%s", err, f.logs.String())
	}
	logs := f.logs.String()
	// "floe serving" is logged after the announcement the test waits for, so the signal
	// may come before it: only these three lines have an order.
	want := []string{
		`msg="floe starting" version=`,
		`msg="floe stopping: no new calls; draining calls in flight, then closing the store"`,
		`msg="floe stopped"`,
	}
	at := 0
	for _, w := range want {
		i := strings.Index(logs[at:], w)
		if i < 0 {
			t.Fatalf("no %s after byte %d of the log:\n%s", w, at, logs)
		}
		at += i + len(w)
	}
}

// TestServeTakesTheUpstreamsOpenAIBaseURL: the URL vLLM and the reference server print
// ends in /v1; floe serve given it says so at start-up and its calls reach the engine.
func TestServeTakesTheUpstreamsOpenAIBaseURL(t *testing.T) {
	up := fakeEngine()
	defer up.Close()
	f := startFloe(t, "-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0",
		"-upstream", up.URL+"/v1")
	s := f.post(t, "/floe/v1/sessions", "", `{"task_id": "t", "group_id": "g", "group_size": 2}`)
	got := f.post(t, "/v1/chat/completions", s["api_key"].(string), `{"model":"x","messages":[{"role":"user","content":"hi"}]}`)
	if ch, _ := got["choices"].([]any); len(ch) != 1 {
		t.Fatalf("a call through -upstream .../v1: %v", got)
	}
	if err := f.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	_ = f.cmd.Wait()
	if want := `msg="-upstream is the inference server's root: floe adds /v1 itself"`; !strings.Contains(f.logs.String(), want) {
		t.Errorf("no %s in the log:\n%s", want, f.logs.String())
	}
}
