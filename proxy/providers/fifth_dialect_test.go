package providers_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/floe-rl/floe/internal/fakevllm"
	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/internal/echodialect"
	"github.com/floe-rl/floe/proxy/providers"
	"github.com/floe-rl/floe/proxy/vllm"
	"github.com/floe-rl/floe/trace/mem"
)

// TestAFifthDialectIsOnePackageAndOneLine: a dialect carries its routes, its claims on
// unrouted requests, its key extraction, its error shape and its base URL, so adding one
// is its package (proxy/internal/echodialect) and the one line below. Its call is routed,
// authenticated by its own header, served and recorded; a request with its header on an
// unknown path is answered in its error shape; and a session's base_urls name it.
func TestAFifthDialectIsOnePackageAndOneLine(t *testing.T) {
	dialects := append(providers.Dialects(), echodialect.Dialect{}) // the one line

	up := httptest.NewServer(fakevllm.Handler())
	defer up.Close()
	store := &mem.Store{}
	store.AddSession("k-echo", "s1")
	px := httptest.NewServer(&proxy.Server{Dialects: dialects, Engine: vllm.New(up.URL, "m"), Sessions: store, Recorder: store})
	defer px.Close()
	post := func(path, key, body string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, px.URL+path, strings.NewReader(body))
		req.Header.Set("X-Echo-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}

	code, body := post("/v1/echo", "k-echo", `{"model": "m", "prompt": "hi"}`)
	var got map[string]string
	if err := json.Unmarshal([]byte(body), &got); code != 200 || err != nil || got["echo"] == "" {
		t.Fatalf("echo call: %d %s; want 200 with the model's answer", code, body)
	}
	if calls := store.Calls("s1"); len(calls) != 1 || calls[0].API != "echo" {
		t.Errorf("recorded %+v; want one call of API echo", calls)
	}
	if code, body := post("/v1/echo", "wrong", `{"model": "m"}`); code != 401 || !strings.Contains(body, `"echo_error"`) {
		t.Errorf("unknown key: %d %s; want 401 in the echo error shape", code, body)
	}
	if code, body := post("/v1/nowhere", "k-echo", `{}`); code != 404 || !strings.Contains(body, `"echo_error"`) {
		t.Errorf("unknown path with the echo header: %d %s; want 404 in the echo error shape", code, body)
	}
	urls := dialects.BaseURLs("http://floe")
	if urls["echo"] != "http://floe/echo-api" || urls["openai"] != "http://floe/v1" || urls["anthropic"] != "http://floe" {
		t.Errorf("base URLs %v", urls)
	}
}
