package proxy_test

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/floe-rl/floe/proxy"
)

func pool(t *testing.T, urls ...string) *proxy.Pool {
	t.Helper()
	var rs []proxy.Replica
	for _, u := range urls {
		rs = append(rs, proxy.Replica{URL: u})
	}
	p, err := proxy.NewPool(rs...)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func sessions(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("session-%d", i)
	}
	return out
}

// TestPoolChoosesByRendezvous: a session's replica depends on the session and the set of
// healthy replicas only (not the order -upstream lists them in); a replica going down
// moves its own sessions and no other, spread over the rest; when it recovers, every
// session is back where it was.
func TestPoolChoosesByRendezvous(t *testing.T) {
	urls := []string{"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://10.0.0.4:8000"}
	tests := []struct {
		name     string
		replicas []string
		down     []string
	}{
		{"one of two down", urls[:2], urls[:1]},
		{"one of three down", urls[:3], urls[1:2]},
		{"two of four down", urls, urls[2:]},
		{"the last of four down", urls, urls[3:]},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := pool(t, tt.replicas...)
			reversed := slices.Clone(tt.replicas)
			slices.Reverse(reversed)
			other := pool(t, reversed...)
			before := map[string]string{}
			share := map[string]int{}
			for _, s := range sessions(2000) {
				before[s] = p.Choose(s)
				share[before[s]]++
				if again := p.Choose(s); again != before[s] {
					t.Fatalf("session %s chose %s, then %s", s, before[s], again)
				}
				if o := other.Choose(s); o != before[s] {
					t.Fatalf("session %s chose %s, or %s with the replicas listed the other way round", s, before[s], o)
				}
			}
			// Every replica takes a fair share: no one of them idles.
			for _, u := range tt.replicas {
				if min := 2000 / len(tt.replicas) / 2; share[u] < min {
					t.Errorf("replica %s takes %d of 2000 sessions, want at least %d: %v", u, share[u], min, share)
				}
			}

			for _, u := range tt.down {
				p.SetHealthy(u, false, "test")
			}
			moved := map[string]int{}
			for s, was := range before {
				now := p.Choose(s)
				switch {
				case slices.Contains(tt.down, was) && slices.Contains(tt.down, now):
					t.Fatalf("session %s stays on %s, which is down", s, now)
				case !slices.Contains(tt.down, was) && now != was:
					t.Fatalf("session %s moved from %s, which is up, to %s", s, was, now)
				case now != was:
					moved[now]++
				}
			}
			for _, u := range tt.replicas {
				if !slices.Contains(tt.down, u) && moved[u] == 0 {
					t.Errorf("no session of the replicas down moved to %s: %v", u, moved)
				}
			}

			for _, u := range tt.down {
				p.SetHealthy(u, true, "")
			}
			for s, was := range before {
				if now := p.Choose(s); now != was {
					t.Fatalf("after recovery session %s is on %s, was on %s", s, now, was)
				}
			}
		})
	}
}

// TestPoolOrderFailsOverInTurn: a session's order starts with its replica, and when that
// one is down the session goes to the next of its order; with every replica down it
// still tries its own first (one may have recovered since its last check).
func TestPoolOrderFailsOverInTurn(t *testing.T) {
	p := pool(t, "http://a:1", "http://b:1", "http://c:1")
	for _, s := range sessions(50) {
		order := p.Order(s)
		if len(order) != 3 || order[0] != p.Choose(s) {
			t.Fatalf("session %s: order %v, choice %s", s, order, p.Choose(s))
		}
		p.SetHealthy(order[0], false, "test")
		if got := p.Choose(s); got != order[1] {
			t.Errorf("session %s with %s down chose %s, want the next of its order %s", s, order[0], got, order[1])
		}
		p.SetHealthy(order[1], false, "test")
		if got := p.Choose(s); got != order[2] {
			t.Errorf("session %s with two down chose %s, want %s", s, got, order[2])
		}
		p.SetHealthy(order[2], false, "test")
		if got := p.Choose(s); got != order[0] {
			t.Errorf("session %s with all down chose %s, want its first %s", s, got, order[0])
		}
		for _, u := range order {
			p.SetHealthy(u, true, "")
		}
	}
}

func TestNewPoolRefusesDuplicatesAndNone(t *testing.T) {
	if _, err := proxy.NewPool(); err == nil {
		t.Error("a pool of no replica was accepted")
	}
	_, err := proxy.NewPool(proxy.Replica{URL: "http://a:1"}, proxy.Replica{URL: "http://user:secret@a:1/"})
	if err == nil || !slices.Contains([]string{"replica http://a:1 is given twice"}, err.Error()) {
		t.Errorf("duplicate replicas: %v", err)
	}
}

func TestReplicaLabelHidesCredentials(t *testing.T) {
	for raw, want := range map[string]string{
		"http://127.0.0.1:8000":                "http://127.0.0.1:8000",
		"http://127.0.0.1:8000/":               "http://127.0.0.1:8000",
		"https://user:secret@vllm.internal/v1": "https://vllm.internal/v1",
		"http://h:1/?token=secret":             "http://h:1",
		"not a url":                            "invalid-url",
	} {
		if got := proxy.ReplicaLabel(raw); got != want {
			t.Errorf("ReplicaLabel(%q) = %q, want %q", raw, got, want)
		}
	}
}

// scripted is an Engine whose calls fail with the errors it is given, in turn, and then
// answer; it counts its calls.
type scripted struct {
	errs  []error
	calls int
}

func (e *scripted) next() error {
	e.calls++
	if e.calls <= len(e.errs) {
		return e.errs[e.calls-1]
	}
	return nil
}

func (e *scripted) Complete(context.Context, *proxy.ChatRequest) (*proxy.Result, error) {
	if err := e.next(); err != nil {
		return nil, err
	}
	return &proxy.Result{}, nil
}

func (e *scripted) Stream(ctx context.Context, req *proxy.ChatRequest, _ proxy.StreamSink) (*proxy.Result, error) {
	return e.Complete(ctx, req)
}

func (e *scripted) CountTokens(context.Context, *proxy.ChatRequest) (int, error) { return 1, e.next() }
func (e *scripted) Models(context.Context) ([]string, error)                     { return []string{"m"}, e.next() }

// TestPoolFailoverPolicy: what a call's error does, on a pool of three replicas whose
// engines fail as the row says (each replica's errors in turn, by its place in the
// session's order): which replicas it reaches, how often, and which end down.
func TestPoolFailoverPolicy(t *testing.T) {
	var (
		dial      = &proxy.UnreachableError{Err: &proxy.Error{Status: 502, Kind: proxy.ErrUpstreamUnavailable, Message: "dial: connection refused"}}
		dropped   = &proxy.DroppedError{Err: &proxy.Error{Status: 502, Kind: proxy.ErrUpstreamUnavailable, Message: "connection reset"}}
		server500 = &proxy.Error{Status: 502, Kind: proxy.ErrUpstreamUnavailable, Message: "inference server error 500"}
		busy      = &proxy.Error{Status: 503, Kind: proxy.ErrOverloaded, Message: "inference server busy"}
		timeout   = proxy.TimeoutError("sent no answer", time.Second, "upstream-first-byte-timeout")
		rejected  = &proxy.Error{Status: http.StatusBadRequest, Kind: proxy.ErrInvalidRequest, Message: "rejected"}
	)
	tests := []struct {
		name  string
		errs  [3][]error
		calls [3]int
		ok    bool
		down  []int
	}{
		{"answers at once", [3][]error{}, [3]int{1, 0, 0}, true, nil},
		{"a 500 fails over once", [3][]error{{server500}, {server500}, {}}, [3]int{1, 1, 0}, false, nil},
		{"busy fails over once", [3][]error{{busy}, {busy}, {}}, [3]int{1, 1, 0}, false, nil},
		{"a 500, then busy: still once", [3][]error{{server500}, {busy}, {}}, [3]int{1, 1, 0}, false, nil},
		{"refused goes through all", [3][]error{{dial}, {dial}, {}}, [3]int{1, 1, 1}, true, []int{0, 1}},
		{"refused everywhere", [3][]error{{dial}, {dial}, {dial}}, [3]int{1, 1, 1}, false, []int{0, 1, 2}},
		{"refused, then a 500 fails over once more", [3][]error{{dial}, {server500}, {}}, [3]int{1, 1, 1}, true, []int{0}},
		{"a 500, then refused, then an answer", [3][]error{{server500}, {dial}, {}}, [3]int{1, 1, 1}, true, []int{1}},
		{"a dropped connection is retried on the same replica", [3][]error{{dropped}, {}, {}}, [3]int{2, 0, 0}, true, nil},
		{"dropped twice, then fails over once", [3][]error{{dropped, dropped}, {}, {}}, [3]int{2, 1, 0}, true, nil},
		{"dropped everywhere: three calls, two replicas", [3][]error{{dropped, dropped}, {dropped, dropped}, {dropped}}, [3]int{2, 1, 0}, false, nil},
		{"dropped, then a 500 everywhere", [3][]error{{dropped, server500}, {server500}, {}}, [3]int{2, 1, 0}, false, nil},
		{"dropped, then refused on the retry", [3][]error{{dropped, dial}, {}, {}}, [3]int{2, 1, 0}, true, []int{0}},
		// A request that kills the replicas it reaches (dropped, then refused) reaches two.
		{"dropped then refused everywhere", [3][]error{{dropped, dial}, {dropped, dial}, {dropped, dial}}, [3]int{2, 1, 0}, false, []int{0}},
		{"a 500, then dropped then refused", [3][]error{{server500}, {dropped, dial}, {}}, [3]int{1, 2, 0}, false, []int{1}},
		{"a timeout is not retried", [3][]error{{timeout}, {}, {}}, [3]int{1, 0, 0}, false, nil},
		{"a rejected request is not retried", [3][]error{{rejected}, {}, {}}, [3]int{1, 0, 0}, false, nil},
	}
	const session = "sess-policy"
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			urls := []string{"http://a:1", "http://b:1", "http://c:1"}
			order := pool(t, urls...).Order(session)
			engines := map[string]*scripted{}
			var rs []proxy.Replica
			for place, u := range order {
				engines[u] = &scripted{errs: tt.errs[place]}
				rs = append(rs, proxy.Replica{URL: u, Engine: engines[u]})
			}
			p, err := proxy.NewPool(rs...)
			if err != nil {
				t.Fatal(err)
			}
			_, err = p.Complete(proxy.WithSession(context.Background(), session, ""), &proxy.ChatRequest{})
			if (err == nil) != tt.ok {
				t.Errorf("err %v, want ok %t", err, tt.ok)
			}
			healthy := map[string]bool{}
			for _, st := range p.Status() {
				healthy[st.URL] = st.Healthy
			}
			for place, u := range order {
				if got := engines[u].calls; got != tt.calls[place] {
					t.Errorf("replica %d of the order got %d calls, want %d", place, got, tt.calls[place])
				}
				if want := !slices.Contains(tt.down, place); healthy[u] != want {
					t.Errorf("replica %d of the order: healthy %t, want %t", place, healthy[u], want)
				}
			}
		})
	}
}
