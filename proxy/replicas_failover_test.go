package proxy_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/floe-rl/floe/internal/fakevllm"
	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/internal/ssetest"
	"github.com/floe-rl/floe/proxy/openai"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace/mem"
)

// replicaCounts is a proxy.ReplicaMetrics that keeps what it is told.
type replicaCounts struct {
	mu                               sync.Mutex
	calls, errors, failovers, health map[string]int
}

func newReplicaCounts() *replicaCounts {
	return &replicaCounts{calls: map[string]int{}, errors: map[string]int{}, failovers: map[string]int{}, health: map[string]int{}}
}

func (m *replicaCounts) ReplicaCalled(u string, _ time.Duration, failed bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls[u]++
	if failed {
		m.errors[u]++
	}
}

func (m *replicaCounts) ReplicaFailover(u string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.failovers[u]++
}

func (m *replicaCounts) ReplicaHealth(u string, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.health[u] = map[bool]int{true: 1, false: 0}[ok]
}

func (m *replicaCounts) get(which map[string]int, u string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return which[u]
}

type replicaFixture struct {
	fakes   []*fakevllm.Server
	byURL   map[string]*fakevllm.Server
	pool    *proxy.Pool
	metrics *replicaCounts
	store   *mem.Store
	url     string
}

// newReplicaFixture serves the proxy over n fake vLLMs with sessions key-i → sess-i; the
// pool checks health only when the test says (CheckAll), unless interval is set.
func newReplicaFixture(t *testing.T, n, sessions int, interval time.Duration, opts ...fakevllm.Options) *replicaFixture {
	t.Helper()
	f := &replicaFixture{byURL: map[string]*fakevllm.Server{}, metrics: newReplicaCounts(), store: &mem.Store{}}
	var rs []proxy.Replica
	for i := range n {
		var o fakevllm.Options
		if i < len(opts) {
			o = opts[i]
		}
		s, err := fakevllm.Start(o)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		f.fakes = append(f.fakes, s)
		f.byURL[s.URL] = s
		rs = append(rs, proxy.Replica{URL: s.URL, Engine: vllm.New(s.URL, "")})
	}
	p, err := proxy.NewPool(rs...)
	if err != nil {
		t.Fatal(err)
	}
	p.Metrics, p.Log = f.metrics, slog.New(slog.DiscardHandler)
	p.HealthInterval = interval
	if interval != 0 {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- p.Run(ctx) }()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("pool run: %v", err)
			}
		})
	}
	f.pool = p
	for i := range sessions {
		f.store.AddSession(fmt.Sprintf("key-%d", i), fmt.Sprintf("sess-%d", i))
	}
	ts := httptest.NewServer(&proxy.Server{Dialects: proxy.Dialects{openai.Chat{}}, Engine: p,
		Sessions: f.store, Recorder: f.store, Gate: &proxy.Gate{}, Log: slog.New(slog.DiscardHandler),
		SessionHeader: fakevllm.SessionHeader})
	t.Cleanup(ts.Close)
	f.url = ts.URL
	return f
}

// call makes session i's call and returns the status and the body.
func (f *replicaFixture) call(t *testing.T, i int, stream bool) (int, string) {
	t.Helper()
	body := fmt.Sprintf(`{"model":"x","stream":%t,"messages":[{"role":"user","content":"turn of %d"}]}`, stream, i)
	req, _ := http.NewRequest(http.MethodPost, f.url+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", fmt.Sprintf("Bearer key-%d", i))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// answered says the call got the fake's whole answer: "ok", or its stream to [DONE].
func answered(code int, body string, stream bool) bool {
	if stream {
		return code == 200 && strings.Contains(body, `"content":"k"`) && strings.Contains(body, "[DONE]") && !strings.Contains(body, `"error"`)
	}
	return code == 200 && strings.Contains(body, `"ok `)
}

// where returns the replica each session's calls went to, failing the test if one
// session's calls went to several.
func (f *replicaFixture) where(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, s := range f.fakes {
		for sess := range s.Calls() {
			if prev, ok := out[sess]; ok && prev != s.URL {
				t.Fatalf("session %s called %s and %s", sess, prev, s.URL)
			}
			out[sess] = s.URL
		}
	}
	return out
}

// TestReplicaFailover runs the proxy over three fake vLLMs and stops one mid-run: the
// calls of its sessions go on, with no error, on the next replica of each session's
// order; the other sessions stay where they are; metrics and the status show it; and its
// sessions come back once it passes a health check again.
func TestReplicaFailover(t *testing.T) {
	const n = 24
	f := newReplicaFixture(t, 3, n, 0)
	for i := range n {
		for _, stream := range []bool{false, true} {
			if code, body := f.call(t, i, stream); !answered(code, body, stream) {
				t.Fatalf("session %d: %d %s", i, code, body)
			}
		}
	}
	first := f.where(t)
	counts := map[string]int{}
	for i := range n {
		sess := fmt.Sprintf("sess-%d", i)
		if first[sess] != f.pool.Choose(sess) {
			t.Fatalf("session %s called %s, its rendezvous choice is %s", sess, first[sess], f.pool.Choose(sess))
		}
		counts[first[sess]]++
	}
	if len(counts) != 3 {
		t.Fatalf("sessions went to %d replicas, want all 3: %v", len(counts), counts)
	}

	dead := f.fakes[1]
	dead.Stop()
	before := map[string]map[string]int{}
	for _, s := range f.fakes {
		before[s.URL] = s.Calls()
	}
	for i := range n {
		for _, stream := range []bool{false, true} {
			if code, body := f.call(t, i, stream); !answered(code, body, stream) {
				t.Fatalf("session %d after %s stopped (stream %t): %d %s", i, dead.URL, stream, code, body)
			}
		}
	}
	for i := range n {
		sess := fmt.Sprintf("sess-%d", i)
		order := f.pool.Order(sess)
		want := first[sess]
		if want == dead.URL {
			want = order[1]
			if order[0] != dead.URL {
				t.Fatalf("session %s was on %s, first in its order is %s", sess, dead.URL, order[0])
			}
		}
		got := f.byURL[want].Calls()[sess] - before[want][sess]
		if got != 2 {
			t.Errorf("session %s (was on %s): %d of its 2 calls reached %s, want both", sess, first[sess], got, want)
		}
	}
	if f.metrics.get(f.metrics.failovers, dead.URL) != 1 || f.metrics.get(f.metrics.errors, dead.URL) != 1 {
		t.Errorf("%s: %d failovers, %d errors; want 1 of each (the call that found it dead marks it down)",
			dead.URL, f.metrics.get(f.metrics.failovers, dead.URL), f.metrics.get(f.metrics.errors, dead.URL))
	}
	if f.metrics.get(f.metrics.health, dead.URL) != 0 {
		t.Error("the stopped replica's health gauge is not 0")
	}
	for _, st := range f.pool.Status() {
		if st.Healthy == (st.URL == dead.URL) {
			t.Errorf("status %+v", st)
		}
		if st.URL == dead.URL && !strings.Contains(st.Reason, "unreachable") {
			t.Errorf("the stopped replica's status says %q", st.Reason)
		}
	}

	// A check while it is still stopped keeps it down; once restarted, one brings it back,
	// and its sessions with it.
	f.pool.CheckAll(context.Background(), time.Second)
	if f.pool.Status()[1].Healthy {
		t.Fatal("a failing health check marked the stopped replica up")
	}
	if err := dead.Restart(); err != nil {
		t.Fatal(err)
	}
	f.pool.CheckAll(context.Background(), time.Second)
	if !f.pool.Status()[1].Healthy || f.metrics.get(f.metrics.health, dead.URL) != 1 {
		t.Fatalf("after a passing check: %+v", f.pool.Status())
	}
	back := dead.Calls()
	for i := range n {
		if code, body := f.call(t, i, false); code != 200 {
			t.Fatalf("session %d after the restart: %d %s", i, code, body)
		}
	}
	for sess, on := range first {
		if on == dead.URL && dead.Calls()[sess] != back[sess]+1 {
			t.Errorf("session %s did not come back to %s", sess, dead.URL)
		}
	}
}

// TestReplicaNoRetryOnceStreaming: a replica that dies after the caller's stream has
// begun ends that call with an error event; the call is not sent to another replica,
// which would stream a second answer after the first one's start.
func TestReplicaNoRetryOnceStreaming(t *testing.T) {
	var f *replicaFixture
	stopped := make(chan struct{})
	var once sync.Once
	f = newReplicaFixture(t, 2, 16, 0, fakevllm.Options{MidStream: func(r *http.Request) {
		once.Do(func() { go func() { f.fakes[0].Stop(); close(stopped) }() })
		<-r.Context().Done()
	}})
	// A session that lives on the replica that dies mid-stream.
	victim := -1
	for i := range 16 {
		if f.pool.Choose(fmt.Sprintf("sess-%d", i)) == f.fakes[0].URL {
			victim = i
			break
		}
	}
	if victim < 0 {
		t.Fatal("no session on the first replica")
	}
	code, body := f.call(t, victim, true)
	<-stopped
	if code != 200 {
		t.Fatalf("the stream began, so its status is 200; got %d %s", code, body)
	}
	var sawText, sawError bool
	for _, ev := range ssetest.Data(t, strings.NewReader(body)) {
		var chunk map[string]any
		if json.Unmarshal([]byte(ev), &chunk) != nil {
			continue
		}
		if chunk["error"] != nil {
			sawError = true
		}
		if strings.Contains(ev, `"content":"o"`) {
			sawText = true
		}
	}
	if !sawText || !sawError {
		t.Errorf("stream %q: want the first delta, then an error event", body)
	}
	if got := f.fakes[1].Calls()[fmt.Sprintf("sess-%d", victim)]; got != 0 {
		t.Errorf("the broken stream was retried on the other replica (%d calls)", got)
	}
	if fo := f.metrics.get(f.metrics.failovers, f.fakes[0].URL); fo != 0 {
		t.Errorf("%d failovers after the stream began", fo)
	}
}

// TestReplicaHealthChecksRun: the pool's own checks mark a replica whose /health fails
// down, its sessions move, and a passing check brings them back.
func TestReplicaHealthChecksRun(t *testing.T) {
	f := newReplicaFixture(t, 2, 1, 10*time.Millisecond)
	sick := f.byURL[f.pool.Choose("sess-0")]
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("waited 10s for %s", what)
			}
		}
	}
	sick.SetHealthy(false)
	waitFor("the sick replica to be marked down", func() bool { return f.pool.Choose("sess-0") != sick.URL })
	if code, _ := f.call(t, 0, false); code != 200 || sick.Calls()["sess-0"] != 0 {
		t.Fatalf("a call with its replica down: %d, %d calls on the sick one", code, sick.Calls()["sess-0"])
	}
	sick.SetHealthy(true)
	waitFor("the replica to be marked up", func() bool { return f.pool.Choose("sess-0") == sick.URL })
	if code, _ := f.call(t, 0, false); code != 200 || sick.Calls()["sess-0"] != 1 {
		t.Fatalf("the session did not come back: %d, %d calls", code, sick.Calls()["sess-0"])
	}
}

// TestSessionHeaderNeverCarriesTheKey: upstream calls name their session in the session
// header; a session opened by its first call (-open-sessions), whose id is its key, is
// named by a digest, the same for each of its calls, never by the key.
func TestSessionHeaderNeverCarriesTheKey(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	up, err := fakevllm.Start(fakevllm.Options{OnCall: func(r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, r.Header.Get(fakevllm.SessionHeader))
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	store := &mem.Store{}
	store.AddSession("key-made", "sess-made")
	ts := httptest.NewServer(&proxy.Server{Dialects: proxy.Dialects{openai.Chat{}}, Engine: vllm.New(up.URL, "m"),
		Sessions: store, Recorder: store, OpenSessions: true, Log: slog.New(slog.DiscardHandler), SessionHeader: fakevllm.SessionHeader})
	defer ts.Close()
	for _, key := range []string{"key-made", "sk-opened-by-its-call", "sk-opened-by-its-call"} {
		req, _ := http.NewRequest(http.MethodPost, ts.URL+"/v1/chat/completions", strings.NewReader(`{"model":"x","messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d", key, resp.StatusCode)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 3 || seen[0] != "sess-made" || seen[1] == "" || seen[1] != seen[2] || strings.Contains(seen[1], "opened") {
		t.Errorf("session headers upstream %q: want sess-made, then one digest twice, never the key", seen)
	}
}

// refused is a behaviour of TestReplicaFailoverIsBounded's replicas: the fake is stopped,
// so that dialling it is refused.
const refused = -100

// TestReplicaFailoverIsBounded: a session's call meets replicas, in its order, that
// fail as the row says. A replica that refuses the connection (the request never reached
// it) is marked down and the call goes on to the next, through every one; an answer the
// request may have provoked (a 500, a 429 or 503, the connection reset or hung up after
// the request was read) sends the call to one more replica, never more, and marks no
// replica down, so a crafted request reaches at most two replicas and empties none of
// them of the other sessions. A dropped connection is first retried on the same replica
// once (the keep-alive race drops a request the server never read).
func TestReplicaFailoverIsBounded(t *testing.T) {
	const ok = 0
	reset, hangup := fakevllm.Reset, fakevllm.Hangup
	tests := []struct {
		name string
		// fail is what each replica of the session's order does with every call: a
		// status, fakevllm.Reset or Hangup, refused, or ok (answers).
		fail []int
		// calls is how many times each replica, in order, gets the call (a refused one
		// counts its tries); answered, whether the caller gets the answer; down, which
		// replicas (by place in the order) end down.
		calls    []int
		answered bool
		down     []int
	}{
		{"a 500 everywhere reaches two replicas", []int{500, 500, 500, 500}, []int{1, 1, 0, 0}, false, nil},
		{"a 500 then an answer", []int{500, ok, ok, ok}, []int{1, 1, 0, 0}, true, nil},
		{"a 429 everywhere fails over once", []int{429, 429, 429, 429}, []int{1, 1, 0, 0}, false, nil},
		{"a 503 everywhere fails over once", []int{503, 503, 503, 503}, []int{1, 1, 0, 0}, false, nil},
		{"a reset after the request everywhere", []int{reset, reset, reset, ok}, []int{2, 1, 0, 0}, false, nil},
		{"a hang-up after the request everywhere", []int{hangup, hangup, ok, ok}, []int{2, 1, 0, 0}, false, nil},
		{"a reset then an answer", []int{reset, ok, ok, ok}, []int{2, 1, 0, 0}, true, nil},
		{"refused through all to the last", []int{refused, refused, refused, ok}, []int{1, 1, 1, 1}, true, []int{0, 1, 2}},
		{"refused, then a 500 fails over once more", []int{refused, 500, ok, ok}, []int{1, 1, 1, 0}, true, []int{0}},
		{"refused, then a 500 everywhere", []int{refused, 500, 500, ok}, []int{1, 1, 1, 0}, false, []int{0}},
		{"a 500, then refused, then an answer", []int{500, refused, ok, ok}, []int{1, 1, 1, 0}, true, []int{1}},
	}
	for _, tt := range tests {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/stream=%t", tt.name, stream), func(t *testing.T) {
				var mu sync.Mutex
				failOf := map[string]int{} // by the fake's host:port
				opts := make([]fakevllm.Options, len(tt.fail))
				for i := range opts {
					opts[i].Fail = func(r *http.Request) int {
						mu.Lock()
						defer mu.Unlock()
						return failOf[r.Host]
					}
				}
				f := newReplicaFixture(t, len(tt.fail), 1, 0, opts...)
				order := f.pool.Order("sess-0")
				mu.Lock()
				for place, u := range order {
					failOf[strings.TrimPrefix(u, "http://")] = tt.fail[place]
					if tt.fail[place] == refused {
						f.byURL[u].Stop()
					}
				}
				mu.Unlock()

				code, body := f.call(t, 0, stream)
				if got := answered(code, body, stream); got != tt.answered {
					t.Errorf("answered %t, want %t: %d %s", got, tt.answered, code, body)
				}
				failovers := 0
				for place, u := range order {
					n := f.byURL[u].Calls()["sess-0"]
					if tt.fail[place] == refused {
						n = f.metrics.get(f.metrics.calls, u) // a stopped fake counts nothing
					}
					if n != tt.calls[place] {
						t.Errorf("replica %d of the order got the call %d times, want %d", place, n, tt.calls[place])
					}
					if m := f.metrics.get(f.metrics.calls, u); m != n {
						t.Errorf("replica %d of the order: %d calls in the metrics, %d made", place, m, n)
					}
					failovers += f.metrics.get(f.metrics.failovers, u)
				}
				reached := 0
				for _, n := range tt.calls {
					if n > 0 {
						reached++
					}
				}
				if failovers != reached-1 {
					t.Errorf("%d failovers counted, want %d", failovers, reached-1)
				}
				healthy := map[string]bool{}
				for _, st := range f.pool.Status() {
					healthy[st.URL] = st.Healthy
				}
				for place, u := range order {
					if want := !slices.Contains(tt.down, place); healthy[u] != want {
						t.Errorf("replica %d of the order (%d): healthy %t, want %t", place, tt.fail[place], healthy[u], want)
					}
				}
			})
		}
	}
}

// TestReplicaHealthNeedsFailedChecksInARow: one failed health check does not mark a
// replica down (a blip would move its sessions off their prefix cache); the
// FailedChecksToMarkDown-th in a row does; a pass between failures starts the count
// again, and one pass marks a replica up.
func TestReplicaHealthNeedsFailedChecksInARow(t *testing.T) {
	tests := []struct {
		name   string
		checks []bool // what /health answers at each check: true 200, false 503
		down   bool
	}{
		{"one failed check", []bool{false}, false},
		{"two failed checks", []bool{false, false}, true},
		{"failed, passed, failed", []bool{false, true, false}, false},
		{"two failed, then one pass", []bool{false, false, true}, false},
		{"two failed, a pass, one failed", []bool{false, false, true, false}, false},
		{"three failed", []bool{false, false, false}, true},
	}
	if proxy.FailedChecksToMarkDown != 2 {
		t.Fatalf("the rows assume FailedChecksToMarkDown 2, it is %d", proxy.FailedChecksToMarkDown)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newReplicaFixture(t, 2, 1, 0)
			sick := f.fakes[0]
			for _, ok := range tt.checks {
				sick.SetHealthy(ok)
				f.pool.CheckAll(context.Background(), time.Second)
			}
			if st := f.pool.Status()[0]; st.Healthy == tt.down {
				t.Errorf("after checks %v: %+v, want down %t", tt.checks, st, tt.down)
			}
			if !f.pool.Status()[1].Healthy {
				t.Error("the replica that passed every check is down")
			}
			f.metrics.mu.Lock()
			gauge, set := f.metrics.health[sick.URL]
			f.metrics.mu.Unlock()
			if tt.down && (!set || gauge != 0) || !tt.down && set && gauge != 1 {
				t.Errorf("the health gauge is %d (set %t), want down %t", gauge, set, tt.down)
			}
		})
	}
}
