// Package proxybench measures what the proxy adds to a model call, in every dialect it
// serves: each request goes both straight to a zero-latency fake vLLM and through floe's
// proxy in front of it, alternately in one run, and the difference is the proxy's cost.
// The proxy runs as a child process, serving and recording as floe proxy does: with Go's
// default GOMAXPROCS for the latency phase (as floe proxy runs), and on one core
// (GOMAXPROCS=1) for the throughput phase, so that its CPU time per request and its memory can be read from
// outside; LiteLLM's proxy, when given, is measured the same way beside it.
package proxybench

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Options sizes the run.
type Options struct {
	Dialects     []Dialect     // nil: AllDialects
	Sizes        []int         // request body sizes (64 KiB and 512 KiB)
	Requests     int           // sequential requests per dialect, size, mode and target
	StreamChunks int           // chunks in a streamed answer
	Concurrency  int           // concurrent streaming sessions for the throughput figure
	Duration     time.Duration // how long each throughput phase runs
	// ProxyCommand starts floe's proxy as a child process: the argv of a program that
	// calls ServeFromEnv when ServeEnv is set in its environment (floe-bench proxy).
	ProxyCommand []string
	// BeforeCommand, when set, starts another build of floe's proxy the same way (a
	// floe-bench of an earlier commit, floe-bench proxy -before), measured in the same run
	// beside ProxyCommand's: each latency sample goes direct, through it and through
	// ProxyCommand's, alternately, and each throughput phase runs against both. Its rows
	// are named BeforeName.
	BeforeCommand []string
	BeforeName    string
	// LiteLLM, when set, is the litellm command (from its own venv) to measure beside floe,
	// with LiteLLMRequests sequential requests per mode (it is 20-70x slower).
	LiteLLM         string
	LiteLLMRequests int
	// Memory, when positive, also drives floe's proxy for this long with its stored calls
	// unbounded and then bounded by MaxStoredBytes, sampling its RSS each second.
	Memory         time.Duration
	MaxStoredBytes int64
	// CPUProfile, when set, is where floe's proxy writes its CPU profile of the
	// throughput phases, on one core (go tool pprof).
	CPUProfile string
	// LatencyProcs is the GOMAXPROCS of floe's proxy in the latency phase; 0: Go's
	// default (the machine's cores), as floe proxy runs. The throughput phase always runs
	// it on one core.
	LatencyProcs int
	Progress     io.Writer
}

// Latency is one dialect's, size's and mode's figures, in milliseconds.
type Latency struct {
	Proxy                string // floe or LiteLLM
	Dialect              Dialect
	Size                 int // request bytes
	Stream               bool
	DirectP50, DirectP99 float64
	ProxyP50, ProxyP99   float64
	Err                  string // why this proxy could not serve it ("" when it did)
}

// Throughput is one dialect's and size's concurrent streaming phase.
type Throughput struct {
	Proxy      string
	Dialect    Dialect
	Size       int
	Requests   int64   // completed
	Errors     int64   // of those, failed
	PerSecond  float64 // completed per second
	CPUPerCall float64 // proxy process CPU (user+system) per completed request, ms
	Err        string
}

// RSSSample is the proxy's resident memory at a time into the memory phase.
type RSSSample struct {
	At  time.Duration
	RSS int64 // bytes
}

// MemoryRun is one memory phase: floe's proxy recording calls under load.
type MemoryRun struct {
	MaxStoredBytes int64 // 0: unbounded
	Requests       int64
	Samples        []RSSSample
	Peak           int64
}

// Report is the whole run.
type Report struct {
	Options     Options
	Latencies   []Latency
	Throughputs []Throughput
	Memory      []MemoryRun
	LiteLLM     string // its version, when measured
}

// upstream answers every POST at once with a fixed chat answer carrying token ids,
// streamed when the body or the path asks for it: the direct requests of every dialect
// and the proxy's translated ones cost it the same to read.
func upstream(chunks int) http.Handler {
	ids := make([]int32, chunks)
	for i := range ids {
		ids[i] = int32(100 + i)
	}
	lps := make([]map[string]any, chunks)
	for i := range lps {
		// Every field of OpenAI's token log-prob, which OpenAI's client (LiteLLM's) requires.
		lps[i] = map[string]any{"token": "x", "logprob": -0.5, "bytes": []int{120}, "top_logprobs": []any{}}
	}
	full := mustJSON(map[string]any{
		"id": "c", "object": "chat.completion", "created": 1, "model": "m", "prompt_token_ids": []int32{1, 2, 3},
		"choices": []any{map[string]any{"index": 0, "finish_reason": "stop", "token_ids": ids,
			"message": map[string]any{"role": "assistant", "content": strings.Repeat("x", chunks)}, "logprobs": map[string]any{"content": lps}}},
		"usage": map[string]int{"prompt_tokens": 3, "completion_tokens": chunks, "total_tokens": chunks + 3},
	})
	var stream bytes.Buffer
	head := mustJSON(map[string]any{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": []int32{1, 2, 3},
		"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}}}})
	fmt.Fprintf(&stream, "data: %s\n\n", head)
	for i := 0; i < chunks; i++ {
		c := mustJSON(map[string]any{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
			"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"content": "x"},
				"token_ids": []int32{ids[i]}, "logprobs": map[string]any{"content": lps[i : i+1]}}}})
		fmt.Fprintf(&stream, "data: %s\n\n", c)
	}
	fmt.Fprintf(&stream, "data: %s\n\ndata: [DONE]\n\n", `{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":`+strconv.Itoa(chunks)+`,"total_tokens":`+strconv.Itoa(chunks+3)+`}}`)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model"}]}`)
	})
	mux.HandleFunc("POST /", func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if bytes.Contains(body, []byte(`"stream":true`)) || strings.Contains(r.URL.Path, "stream") {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = w.Write(stream.Bytes())
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(full)
	})
	return mux
}

// call sends one request with the API key key and reads the whole answer.
func call(ctx context.Context, client *http.Client, base, key string, rq request) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+rq.path, bytes.NewReader(rq.body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("x-api-key", key)
	req.Header.Set("x-goog-api-key", key)
	req.Header.Set("anthropic-version", "2023-06-01")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }() // the body is read or abandoned; its Close error changes nothing
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %d: %.300s", resp.StatusCode, b)
	}
	if len(b) == 0 {
		return fmt.Errorf("empty answer")
	}
	return nil
}

func percentile(xs []time.Duration, p float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return float64(s[int(p*float64(len(s)-1))]) / 1e6
}

func (o Options) progress(format string, args ...any) {
	if o.Progress != nil {
		_, _ = fmt.Fprintf(o.Progress, format+"\n", args...) // progress lines: a closed stderr must not stop a run
	}
}

// Run measures; it needs nothing but loopback.
func Run(ctx context.Context, opt Options) (*Report, error) {
	if len(opt.Dialects) == 0 {
		opt.Dialects = AllDialects
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	up := httptest.NewServer(upstream(opt.StreamChunks))
	defer up.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: opt.Concurrency + 8, MaxIdleConns: 4 * (opt.Concurrency + 8)}}
	defer client.CloseIdleConnections()
	rep := &Report{Options: opt}
	var err error

	floe := target{name: "floe", command: opt.ProxyCommand}
	var before *target
	if len(opt.BeforeCommand) > 0 {
		if opt.BeforeName == "" || opt.BeforeName == "floe" || opt.BeforeName == "LiteLLM" {
			return nil, fmt.Errorf("BeforeName %q: want a name of its own for the earlier build", opt.BeforeName)
		}
		before = &target{name: opt.BeforeName, command: opt.BeforeCommand}
	}
	var started []*child
	defer func() {
		for _, c := range started {
			c.stop()
		}
	}()
	for _, tg := range []*target{&floe, before} {
		if tg == nil {
			continue
		}
		o := opt
		o.ProxyCommand = tg.command
		var err error
		if tg.lat, err = startFloe(ctx, o, up.URL, -1, "", opt.LatencyProcs); err != nil {
			return nil, err
		}
		started = append(started, tg.lat)
		profile := opt.CPUProfile
		if tg != &floe {
			profile = ""
		}
		if tg.thr, err = startFloe(ctx, o, up.URL, -1, profile, 1); err != nil {
			return nil, err
		}
		started = append(started, tg.thr)
	}
	if before == nil {
		err = measure(ctx, opt, rep, client, "floe", up.URL, floe.lat, floe.thr, opt.Dialects, max(opt.Requests, 1))
	} else {
		err = measureSideBySide(ctx, opt, rep, client, up.URL, *before, floe, opt.Dialects, max(opt.Requests, 1))
	}
	for _, c := range started {
		c.stop()
	}
	started = nil
	if err != nil {
		return nil, err
	}
	if opt.LiteLLM != "" {
		ll, version, err := startLiteLLM(ctx, opt.LiteLLM, up.URL, opt.Progress)
		if err != nil {
			return nil, fmt.Errorf("litellm: %w", err)
		}
		rep.LiteLLM = version
		err = measure(ctx, opt, rep, client, "LiteLLM", up.URL, ll, ll, opt.Dialects, max(opt.LiteLLMRequests, 1))
		ll.stop()
		if err != nil {
			return nil, err
		}
	}
	if opt.Memory > 0 {
		for _, limit := range []int64{0, opt.MaxStoredBytes} {
			run, err := memory(ctx, opt, client, up.URL, limit)
			if err != nil {
				return nil, err
			}
			rep.Memory = append(rep.Memory, *run)
		}
	}
	return rep, nil
}

// measure runs the latency phases of every dialect and size against px and the
// throughput phases against thr (the same proxy, or another process of it). A dialect
// the proxy cannot serve (its first request fails) is reported as such.
func measure(ctx context.Context, opt Options, rep *Report, client *http.Client, name, direct string, px, thr *child, dialects []Dialect, n int) error {
	for _, d := range dialects {
		for _, size := range opt.Sizes {
			served := true
			for _, stream := range []bool{false, true} {
				rq := request{path: d.path(stream), body: Body(d, size, stream)}
				l := Latency{Proxy: name, Dialect: d, Size: size, Stream: stream}
				if err := call(ctx, client, px.url, px.key(0), rq); err != nil {
					if ctx.Err() != nil {
						return ctx.Err()
					}
					l.Err = err.Error()
					rep.Latencies = append(rep.Latencies, l)
					served = false
					opt.progress("%s %s %d KiB stream=%v: not served: %v", name, d, size>>10, stream, err)
					continue
				}
				var directs, proxied []time.Duration
				for i := 0; i < n; i++ {
					// Alternate, so both see the same machine.
					for _, target := range []string{direct, px.url} {
						t0 := time.Now()
						if err := call(ctx, client, target, px.key(0), rq); err != nil {
							return fmt.Errorf("%s %s %d bytes stream=%v to %s: %w", name, d, size, stream, target, err)
						}
						if target == direct {
							directs = append(directs, time.Since(t0))
						} else {
							proxied = append(proxied, time.Since(t0))
						}
					}
				}
				l.DirectP50, l.DirectP99 = percentile(directs, 0.5), percentile(directs, 0.99)
				l.ProxyP50, l.ProxyP99 = percentile(proxied, 0.5), percentile(proxied, 0.99)
				rep.Latencies = append(rep.Latencies, l)
				opt.progress("%s %s %d KiB stream=%v: added p50 %.3f ms, p99 %.3f ms", name, d, size>>10, stream, l.ProxyP50-l.DirectP50, l.ProxyP99-l.DirectP99)
			}
			t := Throughput{Proxy: name, Dialect: d, Size: size}
			if !served {
				t.Err = "not served"
				rep.Throughputs = append(rep.Throughputs, t)
				continue
			}
			if err := throughput(ctx, opt, client, thr, request{path: d.path(true), body: Body(d, size, true)}, &t); err != nil {
				return err
			}
			rep.Throughputs = append(rep.Throughputs, t)
			opt.progress("%s %s %d KiB: %.0f requests/s, %.3f ms CPU per request, %d errors", name, d, size>>10, t.PerSecond, t.CPUPerCall, t.Errors)
		}
	}
	return nil
}

// target is one build of floe's proxy: its latency and throughput children.
type target struct {
	name     string
	command  []string
	lat, thr *child
}

// measureSideBySide is measure for two builds of floe's proxy at once: each latency
// sample goes straight to the upstream and through both proxies, the two in turn first,
// so that both see the same machine; each throughput phase runs against both, the two in
// turn first.
func measureSideBySide(ctx context.Context, opt Options, rep *Report, client *http.Client, direct string, a, b target, dialects []Dialect, n int) error {
	turn := 0
	for _, d := range dialects {
		for _, size := range opt.Sizes {
			for _, stream := range []bool{false, true} {
				rq := request{path: d.path(stream), body: Body(d, size, stream)}
				for _, tg := range []target{a, b} {
					if err := call(ctx, client, tg.lat.url, tg.lat.key(0), rq); err != nil {
						return fmt.Errorf("%s %s %d bytes stream=%v: %w", tg.name, d, size, stream, err)
					}
				}
				var directs, viaA, viaB []time.Duration
				for i := 0; i < n; i++ {
					order := []int{0, 1, 2} // direct, a, b
					if i%2 == 1 {
						order = []int{0, 2, 1}
					}
					for _, k := range order {
						url := direct
						switch k {
						case 1:
							url = a.lat.url
						case 2:
							url = b.lat.url
						}
						t0 := time.Now()
						if err := call(ctx, client, url, benchKey(0), rq); err != nil {
							return fmt.Errorf("%s %d bytes stream=%v to %s: %w", d, size, stream, url, err)
						}
						took := time.Since(t0)
						switch k {
						case 0:
							directs = append(directs, took)
						case 1:
							viaA = append(viaA, took)
						case 2:
							viaB = append(viaB, took)
						}
					}
				}
				dp50, dp99 := percentile(directs, 0.5), percentile(directs, 0.99)
				for _, v := range []struct {
					name string
					via  []time.Duration
				}{{a.name, viaA}, {b.name, viaB}} {
					l := Latency{Proxy: v.name, Dialect: d, Size: size, Stream: stream, DirectP50: dp50, DirectP99: dp99,
						ProxyP50: percentile(v.via, 0.5), ProxyP99: percentile(v.via, 0.99)}
					rep.Latencies = append(rep.Latencies, l)
					opt.progress("%s %s %d KiB stream=%v: added p50 %.3f ms, p99 %.3f ms", v.name, d, size>>10, stream, l.ProxyP50-l.DirectP50, l.ProxyP99-l.DirectP99)
				}
			}
			pair := []target{a, b}
			if turn%2 == 1 {
				pair = []target{b, a}
			}
			turn++
			for _, tg := range pair {
				t := Throughput{Proxy: tg.name, Dialect: d, Size: size}
				if err := throughput(ctx, opt, client, tg.thr, request{path: d.path(true), body: Body(d, size, true)}, &t); err != nil {
					return err
				}
				rep.Throughputs = append(rep.Throughputs, t)
				opt.progress("%s %s %d KiB: %.0f requests/s, %.3f ms CPU per request, %d errors", tg.name, d, size>>10, t.PerSecond, t.CPUPerCall, t.Errors)
			}
		}
	}
	return nil
}

// load drives the proxy with opt.Concurrency streaming sessions for d, each with its own
// key, as harnesses are. Each starts requests until d is over and finishes the one it is
// in, so every request started is counted, on a loaded machine too, and the rate is over
// the time they all took.
func load(ctx context.Context, opt Options, client *http.Client, px *child, rq request, d time.Duration) (done, failed int64, took time.Duration) {
	var wg sync.WaitGroup
	var nDone, nFailed atomic.Int64
	start := time.Now()
	for i := 0; i < opt.Concurrency; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil && time.Since(start) < d {
				err := call(ctx, client, px.url, px.key(i), rq)
				if ctx.Err() != nil {
					return
				}
				if err != nil {
					nFailed.Add(1)
				}
				nDone.Add(1)
			}
		}()
	}
	wg.Wait()
	return nDone.Load(), nFailed.Load(), time.Since(start)
}

func throughput(ctx context.Context, opt Options, client *http.Client, px *child, rq request, t *Throughput) error {
	cpu0, err := px.cpu()
	if err != nil {
		return err
	}
	done, failed, took := load(ctx, opt, client, px, rq, opt.Duration)
	if err := ctx.Err(); err != nil {
		return err
	}
	cpu1, err := px.cpu()
	if err != nil {
		return err
	}
	t.Requests, t.Errors = done, failed
	t.PerSecond = float64(done) / took.Seconds()
	if done > 0 {
		t.CPUPerCall = float64(cpu1-cpu0) / float64(time.Millisecond) / float64(done)
	}
	return nil
}

// memory drives floe's proxy, recording in memory with at most limit stored bytes (0:
// unbounded), with 64 KiB streaming chat calls for opt.Memory, sampling its RSS each second.
func memory(ctx context.Context, opt Options, client *http.Client, upURL string, limit int64) (*MemoryRun, error) {
	px, err := startFloe(ctx, opt, upURL, limit, "", 1)
	if err != nil {
		return nil, err
	}
	defer px.stop()
	run := &MemoryRun{MaxStoredBytes: limit}
	rq := request{path: Chat.path(true), body: Body(Chat, 64<<10, true)}
	stop := make(chan struct{})
	sampled := make(chan struct{})
	start := time.Now()
	go func() { // owned here: ends when stop closes, before memory returns
		defer close(sampled)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				if rss, err := px.rss(); err == nil {
					run.Samples = append(run.Samples, RSSSample{At: time.Since(start).Round(time.Second), RSS: rss})
					run.Peak = max(run.Peak, rss)
				}
			}
		}
	}()
	done, _, _ := load(ctx, opt, client, px, rq, opt.Memory)
	close(stop)
	<-sampled
	run.Requests = done
	opt.progress("memory, max stored bytes %d: %d requests, peak RSS %d MiB", limit, done, run.Peak>>20)
	return run, ctx.Err()
}

func benchKey(i int) string { return fmt.Sprintf("bench-%d", i) }

// child is a proxy running as a process of its own.
type child struct {
	cmd  *exec.Cmd
	url  string
	done chan struct{}
	// masterKey, when set, is the one key every caller sends (LiteLLM's); otherwise
	// caller i sends benchKey(i), its own session's.
	masterKey string
}

// key is the API key caller i sends.
func (c *child) key(i int) string {
	if c.masterKey != "" {
		return c.masterKey
	}
	return benchKey(i)
}

// launch starts cmd, handing each line of its stdout to onLine (when set).
func launch(cmd *exec.Cmd, onLine func(string)) (*child, error) {
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", cmd.Path, err)
	}
	c := &child{cmd: cmd, done: make(chan struct{})}
	go func() { // owned by c: ends when the child's stdout closes, at its exit
		defer close(c.done)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if onLine != nil {
				onLine(sc.Text())
			}
		}
		_ = cmd.Wait()
	}()
	return c, nil
}

// stop interrupts the child, so that it can write its profile, and kills it if it has
// not exited within 10 s.
func (c *child) stop() {
	_ = c.cmd.Process.Signal(os.Interrupt)
	select {
	case <-c.done:
	case <-time.After(10 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}

// cpu is the child's CPU time so far, user and system (Linux /proc).
func (c *child) cpu() (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", c.cmd.Process.Pid))
	if err != nil {
		return 0, fmt.Errorf("proxy CPU time: %w", err)
	}
	// Fields after the command name, which may hold spaces, in parentheses.
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+2:]))
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("proxy CPU time: bad /proc stat %q", f[11:13])
	}
	const ticks = 100 // USER_HZ, 100 on every Linux floe runs on
	return time.Duration(utime+stime) * time.Second / ticks, nil
}

// rss is the child's resident memory (Linux /proc).
func (c *child) rss() (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", c.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc status")
}

// startFloe starts floe's proxy as a child with GOMAXPROCS procs (0: Go's default);
// limit is its MaxStoredBytes (-1: the default).
func startFloe(ctx context.Context, opt Options, upURL string, limit int64, profile string, procs int) (*child, error) {
	if len(opt.ProxyCommand) == 0 {
		return nil, fmt.Errorf("no ProxyCommand to start floe's proxy with")
	}
	if limit < 0 {
		limit = opt.MaxStoredBytes
	}
	cfg := mustJSON(ServeConfig{Upstream: upURL, Keys: max(opt.Concurrency, 1), MaxStoredBytes: limit, CPUProfile: profile})
	cmd := exec.CommandContext(ctx, opt.ProxyCommand[0], opt.ProxyCommand[1:]...)
	cmd.Env = append(os.Environ(), ServeEnv+"="+string(cfg))
	if procs > 0 {
		cmd.Env = append(cmd.Env, "GOMAXPROCS="+strconv.Itoa(procs))
	}
	cmd.Stderr = os.Stderr
	urls := make(chan string, 1)
	c, err := launch(cmd, func(line string) {
		if u, ok := strings.CutPrefix(line, "serving "); ok {
			select {
			case urls <- u:
			default:
			}
		}
	})
	if err != nil {
		return nil, err
	}
	select {
	case c.url = <-urls:
		return c, nil
	case <-c.done:
		return nil, fmt.Errorf("%s exited before serving", cmd.Path)
	case <-time.After(30 * time.Second):
		c.stop()
		return nil, fmt.Errorf("%s did not serve within 30s", cmd.Path)
	case <-ctx.Done():
		c.stop()
		return nil, ctx.Err()
	}
}
