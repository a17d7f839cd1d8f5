package main

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/floe-rl/floe/internal/fakevllm"
	"github.com/floe-rl/floe/proxy"
)

// countingEngine is a fake vLLM that counts the model calls that reach it.
func countingEngine() (*httptest.Server, *atomic.Int64) {
	var calls atomic.Int64
	fake := fakevllm.Handler()
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/chat/completions") {
			calls.Add(1)
		}
		fake.ServeHTTP(w, r)
	})), &calls
}

// harnessCall is one call as a harness's SDK sends it: the key in every dialect's own
// header, and the status, Retry-After and body of the answer (status 0 and the error when
// it got none). It may be called from any goroutine.
func harnessCall(t *testing.T, base, path, key string, body io.Reader) (code int, retryAfter, answer string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+path, body)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("x-api-key", key)
	req.Header.Set("x-goog-api-key", key)
	req.Header.Set("anthropic-version", "2023-06-01")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Retry-After"), string(b)
}

// The four dialects' paths, and a small call in each one's own wire shape.
const (
	chatPath      = "/v1/chat/completions"
	responsesPath = "/v1/responses"
	messagesPath  = "/v1/messages"
	geminiPath    = "/v1beta/models/x:generateContent"
)

func chatBody(extra string) string {
	return `{"model":"x","messages":[{"role":"user","content":"hi"}]` + extra + `}`
}

// TestHostileHarnessRequestGuards runs the real floe serve binary and sends, in each
// provider's official wire shape, the requests that multiply upstream work (n past
// -max-n, Gemini's candidateCount), put a value the trainer cannot use into the trace (a
// temperature of 1e308, a top_p out of range), make the inference server fetch a URL
// (image URLs and Gemini fileData naming the metadata service, loopback or floe's own
// control port) or change the chat template (chat_template_kwargs keys not allowed,
// chat_template above all). Each is refused with 400 naming the field in the caller's own
// API, and nothing of it reaches upstream; data: URLs, a host in -media-hosts, allowed
// kwargs and in-range values are answered.
func TestHostileHarnessRequestGuards(t *testing.T) {
	up, upstreamCalls := countingEngine()
	defer up.Close()
	f := startFloe(t, "-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0", "-upstream", up.URL,
		"-max-n", "4", "-media-hosts", "images.internal")
	key := f.post(t, "/floe/v1/sessions", "", `{"task_id": "t"}`)["api_key"].(string)
	const png = "data:image/png;base64,iVBORw0KGgo="
	chatImage := func(url string) string {
		return `{"model":"x","messages":[{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"` + url + `"}}]}]}`
	}
	control := strings.TrimPrefix(f.control, "http://")
	const forwarded = -1 // passes floe's guard: reaches upstream (the fake vLLM reads no images)
	for _, tc := range []struct {
		name, path, body string
		want             int
		field            string // named in the 400
	}{
		// Item 5: work multiplied upstream, values the trainer cannot use.
		{"n within -max-n", chatPath, chatBody(`,"n":4`), 200, ""},
		{"n 1000", chatPath, chatBody(`,"n":1000`), 400, "n: 1000 is more than floe's maximum of 4 choices per call (-max-n)"},
		{"gemini candidateCount 1000", geminiPath,
			`{"contents":[{"role":"user","parts":[{"text":"hi"}]}],"generationConfig":{"candidateCount":1000}}`, 400, "generationConfig.candidateCount: 1000"},
		{"chat temperature 1e308", chatPath, chatBody(`,"temperature":1e308`), 400, "temperature: 1e+308 is out of range"},
		{"anthropic temperature 1e308", messagesPath,
			`{"model":"x","max_tokens":8,"temperature":1e308,"messages":[{"role":"user","content":"hi"}]}`, 400, "temperature: 1e+308 is out of range"},
		{"responses top_p 1.5", responsesPath, `{"model":"x","input":"hi","top_p":1.5}`, 400, "top_p: 1.5 is out of range"},
		{"gemini temperature 1e308", geminiPath,
			`{"contents":[{"role":"user","parts":[{"text":"hi"}]}],"generationConfig":{"temperature":1e308}}`, 400, "generationConfig.temperature: 1e+308"},
		{"chat top_p 0", chatPath, chatBody(`,"top_p":0`), 400, "top_p: 0 is out of range"},
		{"sampling in range", chatPath, chatBody(`,"temperature":0.7,"top_p":0.95`), 200, ""},
		// Item 6: outbound fetches and the chat template.
		{"data: image", chatPath, chatImage(png), forwarded, ""},
		{"metadata service image", chatPath, chatImage("http://169.254.169.254/latest/meta-data/"), 400,
			"image_url (message 0, part 1): floe forwards images only as data: URLs"},
		{"floe's control port as an image", chatPath, chatImage("http://" + control + "/floe/v1/pause"), 400, "host 127.0.0.1 is not in -media-hosts"},
		{"a host in -media-hosts", chatPath, chatImage("https://images.internal/cat.png"), forwarded, ""},
		{"anthropic url image", messagesPath,
			`{"model":"x","max_tokens":8,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"http://169.254.169.254/"}},{"type":"text","text":"look"}]}]}`,
			400, "image.source.url"},
		{"anthropic base64 image", messagesPath,
			`{"model":"x","max_tokens":8,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBORw0KGgo="}},{"type":"text","text":"look"}]}]}`,
			forwarded, ""},
		{"responses input_image", responsesPath,
			`{"model":"x","input":[{"role":"user","content":[{"type":"input_text","text":"look"},{"type":"input_image","image_url":"http://127.0.0.1:8701/floe/v1/pause"}]}]}`,
			400, "input_image.image_url"},
		{"gemini fileData", geminiPath,
			`{"contents":[{"role":"user","parts":[{"text":"look"},{"fileData":{"mimeType":"image/png","fileUri":"http://169.254.169.254/x.png"}}]}]}`,
			400, "fileData.fileUri"},
		{"gemini inlineData", geminiPath,
			`{"contents":[{"role":"user","parts":[{"text":"look"},{"inlineData":{"mimeType":"image/png","data":"iVBORw0KGgo="}}]}]}`, forwarded, ""},
		{"chat_template", chatPath, chatBody(`,"chat_template_kwargs":{"chat_template":"{{ 'pwned' }}"}`), 400,
			"chat_template_kwargs.chat_template: floe does not forward this key"},
		{"a kwarg not allowed", chatPath, chatBody(`,"chat_template_kwargs":{"enable_thinking":true,"add_generation_prompt":false}`), 400,
			"chat_template_kwargs.add_generation_prompt"},
		{"enable_thinking", chatPath, chatBody(`,"chat_template_kwargs":{"enable_thinking":false}`), 200, ""},
	} {
		before := upstreamCalls.Load()
		code, _, answer := harnessCall(t, f.proxy, tc.path, key, strings.NewReader(tc.body))
		if tc.want == forwarded {
			if n := upstreamCalls.Load() - before; n != 1 {
				t.Errorf("%s: %d %s, and %d calls reached upstream; want it forwarded", tc.name, code, answer, n)
			}
			continue
		}
		if code != tc.want || !strings.Contains(answer, tc.field) {
			t.Errorf("%s: %d %s; want %d naming %q", tc.name, code, answer, tc.want, tc.field)
		}
		if n := upstreamCalls.Load() - before; tc.want != 200 && n != 0 {
			t.Errorf("%s: refused, yet %d calls reached upstream", tc.name, n)
		}
	}
}

// TestHostileHarnessSessionQuota runs the real floe serve binary with -max-session-bytes
// below what one call stores: a harness's first call is answered, and every call after it
// is refused with its provider's overloaded status (OpenAI and Gemini 429, Anthropic 529)
// and Retry-After, naming the flag, before any upstream call; another session is still
// answered.
func TestHostileHarnessSessionQuota(t *testing.T) {
	up, upstreamCalls := countingEngine()
	defer up.Close()
	f := startFloe(t, "-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0", "-upstream", up.URL,
		"-max-session-bytes", "4096")
	hostile := f.post(t, "/floe/v1/sessions", "", `{"task_id": "t"}`)
	other := f.post(t, "/floe/v1/sessions", "", `{"task_id": "t"}`)
	big := chatBody(`,"metadata":{"pad":"` + strings.Repeat("x", 8<<10) + `"}`)
	big = strings.Replace(big, `"content":"hi"`, `"content":"`+strings.Repeat("y", 8<<10)+`"`, 1)
	if code, _, answer := harnessCall(t, f.proxy, chatPath, hostile["api_key"].(string), strings.NewReader(big)); code != 200 {
		t.Fatalf("the session's first call: %d %s", code, answer)
	}
	before := upstreamCalls.Load()
	for _, tc := range []struct {
		path, body string
		want       int
	}{
		{chatPath, chatBody(""), http.StatusTooManyRequests},
		{chatPath, chatBody(`,"stream":true`), http.StatusTooManyRequests},
		{responsesPath, `{"model":"x","input":"hi"}`, http.StatusTooManyRequests},
		{messagesPath, `{"model":"x","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`, 529},
		{geminiPath, `{"contents":[{"role":"user","parts":[{"text":"hi"}]}]}`, http.StatusTooManyRequests},
	} {
		code, retry, answer := harnessCall(t, f.proxy, tc.path, hostile["api_key"].(string), strings.NewReader(tc.body))
		if code != tc.want || retry == "" || !strings.Contains(answer, "-max-session-bytes") {
			t.Errorf("%s past the session's quota: %d (Retry-After %q) %s; want %d with Retry-After naming -max-session-bytes",
				tc.path, code, retry, answer, tc.want)
		}
	}
	if n := upstreamCalls.Load() - before; n != 0 {
		t.Errorf("%d calls past the quota reached upstream", n)
	}
	if code, _, answer := harnessCall(t, f.proxy, chatPath, other["api_key"].(string), strings.NewReader(chatBody(""))); code != 200 {
		t.Errorf("another session's call: %d %s", code, answer)
	}
	if calls, _ := f.get(t, "/floe/v1/sessions/"+hostile["session_id"].(string))["calls"].([]any); len(calls) != 1 {
		t.Errorf("the session over its quota recorded %d calls, want the 1 before it", len(calls))
	}
}

// TestHostileHarnessDiskFloor runs the real floe serve binary with -min-free-disk above
// any disk's free space: every call, in every dialect and streamed too, is refused with its
// provider's overloaded status and Retry-After before any upstream call (it was answered
// and stored until ENOSPC, then every harness got 500s), while the control API answers.
func TestHostileHarnessDiskFloor(t *testing.T) {
	up, upstreamCalls := countingEngine()
	defer up.Close()
	f := startFloe(t, "-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0", "-upstream", up.URL,
		"-min-free-disk", strconv.FormatInt(1<<62, 10))
	key := f.post(t, "/floe/v1/sessions", "", `{"task_id": "t"}`)["api_key"].(string)
	for _, tc := range []struct {
		path, body string
		want       int
	}{
		{chatPath, chatBody(""), http.StatusTooManyRequests},
		{chatPath, chatBody(`,"stream":true`), http.StatusTooManyRequests},
		{responsesPath, `{"model":"x","input":"hi"}`, http.StatusTooManyRequests},
		{messagesPath, `{"model":"x","max_tokens":8,"stream":true,"messages":[{"role":"user","content":"hi"}]}`, 529},
		{geminiPath, `{"contents":[{"role":"user","parts":[{"text":"hi"}]}]}`, http.StatusTooManyRequests},
	} {
		code, retry, answer := harnessCall(t, f.proxy, tc.path, key, strings.NewReader(tc.body))
		if code != tc.want || retry == "" || !strings.Contains(answer, "disk") {
			t.Errorf("%s below the free-disk floor: %d (Retry-After %q) %s; want %d with Retry-After, saying floe is short of disk",
				tc.path, code, retry, answer, tc.want)
		}
	}
	if n := upstreamCalls.Load(); n != 0 {
		t.Errorf("%d calls below the free-disk floor reached upstream", n)
	}
	if st := f.get(t, "/floe/v1/status"); st["sessions"] != 1.0 {
		t.Errorf("status below the floor: %v", st)
	}
}

// emptyArrays is a chat request of exactly size bytes whose bulk, in a field floe
// ignores, is empty arrays ([],[],…): the body shape that cost 175-213 MiB per 30 MiB.
func emptyArrays(size int) []byte {
	head, tail := `{"model":"x","messages":[{"role":"user","content":"hi"}],"junk":[`, `0]}`
	n := (size - len(head) - len(tail)) / 3
	pad := size - len(head) - len(tail) - 3*n
	return []byte(head + strings.Repeat("[],", n) + strings.Repeat(" ", pad) + tail)
}

// procStatusKB reads a field of /proc/PID/status in kB (VmHWM: the peak resident set).
func procStatusKB(pid int, field string) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
		}
	}
	return 0, fmt.Errorf("no %s in /proc/%d/status", field, pid)
}

// TestHostileHarnessIndexMemory runs the real floe serve binary and sends it 4 concurrent
// bodies of the largest size it takes (32 MiB), each 11 million empty arrays in a field
// floe ignores. Each is answered, and floe's peak resident memory (VmHWM) rises by less
// than 3.5 bodies per request: the request index is bounded by the body (1.0-1.3 bodies
// per request in proxy's TestPeakMemoryPerBodyShape; on 9eafcf5 the index alone cost
// about 5 bodies per body of this shape, 16 bodies from one key took floe to 2.8 GiB).
// The bound is generous, for the collector's lag on a busy machine; only the amplified
// index exceeds it.
func TestHostileHarnessIndexMemory(t *testing.T) {
	if testing.Short() || raceEnabled || runtime.GOOS != "linux" {
		t.Skip("sends 128 MiB and reads the peak resident memory from /proc; meaningless under the race detector")
	}
	up, _ := countingEngine()
	defer up.Close()
	f := startFloe(t, "-data-dir", t.TempDir(), "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0", "-upstream", up.URL)
	key := f.post(t, "/floe/v1/sessions", "", `{"task_id": "t"}`)["api_key"].(string)
	if code, _, answer := harnessCall(t, f.proxy, chatPath, key, bytes.NewReader(emptyArrays(64<<10))); code != 200 {
		t.Fatalf("a small call of the shape: %d %s", code, answer)
	}
	pid := f.cmd.Process.Pid
	// The peak from here on: reset it to the resident set now (clear_refs 5), or, where
	// that is not allowed, count from the peak so far.
	_ = os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", pid), []byte("5"), 0)
	base, err := procStatusKB(pid, "VmHWM")
	if err != nil {
		t.Skip(err)
	}
	const n, size, bound = 4, proxy.DefaultMaxBodyBytes, 3.5
	body := emptyArrays(size) // one copy in this process, sent n times
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if code, _, answer := harnessCall(t, f.proxy, chatPath, key, bytes.NewReader(body)); code != 200 {
				t.Errorf("body %d of empty arrays: %d %.300s", i, code, answer)
			}
		}()
	}
	wg.Wait()
	peak, err := procStatusKB(pid, "VmHWM")
	if err != nil {
		t.Fatal(err)
	}
	per := float64(peak-base) * 1024 / n / size
	t.Logf("%d concurrent %d MiB bodies of empty arrays: floe's peak RSS rose by %d MiB, %.2f bodies per request", n, size>>20, (peak-base)>>10, per)
	if per > bound {
		t.Errorf("floe's peak RSS rose by %.2f bodies per request (%d MiB for %d bodies of %d MiB); want at most %.1f",
			per, (peak-base)>>10, n, size>>20, bound)
	}
}
