package proxy_test

import (
	"crypto/rand"
	"encoding/base64"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/openai"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/bolt"
	"github.com/floe-rl/floe/trace/mem"
)

// countingUpstream is the fake vLLM, counting the model calls that reach it.
func countingUpstream(t *testing.T) (string, *atomic.Int64) {
	up := &fakeVLLM{t: t, prompt: []int32{1}, pieces: answer(), finish: "stop"}
	h := up.handler()
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/chat/completions") {
			n.Add(1)
		}
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv.URL, &n
}

func post(t *testing.T, url, key, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestSessionQuotaBoundsDiskGrowth: calls with 4 MiB images of random data (stored
// whole in upstream_request) grow the store by the image each; past -max-session-bytes
// the session's calls are refused (429, before any upstream call) and the store stops
// growing, while another session's calls go on.
func TestSessionQuotaBoundsDiskGrowth(t *testing.T) {
	store, err := bolt.New(t.TempDir(), bolt.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer testutil.Close(t, store)
	for _, s := range []struct{ id, key string }{{"s", "k"}, {"s2", "k2"}} {
		if err := store.CreateSession(trace.Session{ID: s.id, TaskID: "t", GroupID: "g"}, s.key, 0); err != nil {
			t.Fatal(err)
		}
	}
	upstream, reached := countingUpstream(t)
	const quota = 12 << 20
	srv := httptest.NewServer(&proxy.Server{Dialects: proxy.Dialects{openai.Chat{}}, Engine: &vllm.Engine{BaseURL: upstream, Model: "m"},
		Sessions: store, Recorder: store, Limits: proxy.Limits{MaxSessionBytes: quota}, Log: slog.New(slog.DiscardHandler)})
	defer srv.Close()
	// Each call sends a new image: nothing of it is stored already.
	imageCall := func() string {
		img := make([]byte, 4<<20)
		_, _ = rand.Read(img)
		return `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"data:image/png;base64,` +
			base64.StdEncoding.EncodeToString(img) + `"}}]}]}`
	}
	stored := func() int64 {
		u, err := store.Usage()
		if err != nil {
			t.Fatal(err)
		}
		return u.JSONBytes
	}
	var refused int
	start := stored()
	for i := range 6 {
		before, calls := stored(), reached.Load()
		code, answer := post(t, srv.URL, "k", imageCall())
		grew := stored() - before
		t.Logf("call %d: %d, store +%.1f MiB", i, code, float64(grew)/(1<<20))
		switch code {
		case 200:
			if refused > 0 {
				t.Fatalf("call %d served after a refusal", i)
			}
		case 429:
			refused++
			if !strings.Contains(answer, "-max-session-bytes") || grew != 0 || reached.Load() != calls {
				t.Errorf("call %d: %s, store +%d bytes, upstream reached %d times; want 429 naming -max-session-bytes, nothing stored or sent",
					i, answer, grew, reached.Load()-calls)
			}
		default:
			t.Fatalf("call %d: %d %s", i, code, answer)
		}
	}
	total := stored() - start
	t.Logf("the session stored %.1f MiB in all (-max-session-bytes %d MiB)", float64(total)/(1<<20), quota>>20)
	if refused == 0 || total > quota+8<<20 {
		t.Errorf("the session stored %d bytes with %d calls refused; want refusals, and at most the quota of %d and one call", total, refused, quota)
	}
	if code, answer := post(t, srv.URL, "k2", imageCall()); code != 200 {
		t.Errorf("another session's call: %d %s; want 200", code, answer)
	}
}

// TestDiskFloor: while the store's disk has less than -min-free-disk free, every call is
// refused in its provider's overloaded shape with Retry-After, before any upstream call;
// with room again, or when the free space cannot be measured, calls are served.
func TestDiskFloor(t *testing.T) {
	upstream, reached := countingUpstream(t)
	const floor = 1 << 30
	var free atomic.Int64
	var failing atomic.Bool
	srv := &proxy.Server{Dialects: proxy.Dialects{openai.Chat{}}, Engine: &vllm.Engine{BaseURL: upstream, Model: "m"},
		Limits: proxy.Limits{MinFreeDisk: floor}, Log: slog.New(slog.DiscardHandler),
		DiskFree: func() (uint64, error) {
			if failing.Load() {
				return 0, errors.New("statfs: no such file")
			}
			return uint64(free.Load()), nil
		}}
	sessions := &mem.Store{}
	sessions.AddSession("k", "s")
	srv.Sessions, srv.Recorder = sessions, sessions
	ts := httptest.NewServer(srv)
	defer ts.Close()
	px := ts.URL
	tests := []struct {
		name    string
		free    int64
		failing bool
		want    int
	}{
		{"plenty", 10 << 30, false, 200},
		{"below the floor", 100 << 20, false, 429},
		{"cannot measure", 0, true, 200},
		{"room again", floor, false, 200},
	}
	for _, tt := range tests {
		free.Store(tt.free)
		failing.Store(tt.failing)
		calls := reached.Load()
		code, answer := post(t, px, "k", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
		if code != tt.want {
			t.Errorf("%s: %d %s; want %d", tt.name, code, answer, tt.want)
		}
		if code == 429 && (!strings.Contains(answer, "short of disk space") || reached.Load() != calls) {
			t.Errorf("%s: %s, upstream reached %d times; want the disk named, nothing sent", tt.name, answer, reached.Load()-calls)
		}
	}
}
