package proxy_test

import (
	"fmt"
	"slices"
	"testing"

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
