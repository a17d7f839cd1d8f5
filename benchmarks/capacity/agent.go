package capacity

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Workload is what one agent session does: a shared system prompt, its group's task,
// then turns of (the model's answer, a tool result of its own), each turn a streaming
// call carrying the whole history so far, as coding agents send it.
type Workload struct {
	GroupSize    int // sessions per GRPO group
	Turns        int // calls per session
	SystemBytes  int // the harness's system prompt, shared by every session
	TaskBytes    int // the task, shared by a group's sessions
	ToolBytes    int // each tool result, the session's own
	AnswerTokens int // tokens the fake samples per call
}

// LongestPrompt is the longest call's rows (prompt and answer, byte tokens).
func (w Workload) LongestPrompt() int {
	return w.SystemBytes + w.TaskBytes + 2 + w.Turns*(w.AnswerTokens+w.ToolBytes+2)
}

// history builds one session's messages. Its text is deterministic in (seed, group,
// session) so that a run can be repeated.
type history struct {
	w        Workload
	messages []map[string]string
	rng      *rand.Rand
}

func newHistory(w Workload, system string, seed uint64, group, session int) *history {
	h := &history{w: w, rng: rand.New(rand.NewPCG(seed, uint64(group)<<20|uint64(session)))}
	task := text(rand.New(rand.NewPCG(seed^0x7a5c, uint64(group))), w.TaskBytes)
	h.messages = []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": task}}
	return h
}

// body is the next call's request.
func (h *history) body() []byte {
	b, _ := json.Marshal(map[string]any{"model": "m", "stream": true, "messages": h.messages})
	return b
}

// advance appends the answer the call got and the tool result the agent then produced.
func (h *history) advance() {
	h.messages = append(h.messages,
		map[string]string{"role": "assistant", "content": answer(len(h.messages), h.w.AnswerTokens)},
		map[string]string{"role": "user", "content": text(h.rng, h.w.ToolBytes)})
}

// systemPrompt is the harness's system prompt every session of a run starts with.
func systemPrompt(w Workload, seed uint64) string {
	return text(rand.New(rand.NewPCG(seed, 0x5157e3)), w.SystemBytes)
}

// text is n bytes of lowercase words.
func text(rng *rand.Rand, n int) string {
	b := make([]byte, n)
	for i := range b {
		if rng.IntN(6) == 0 {
			b[i] = ' '
		} else {
			b[i] = byte('a' + rng.IntN(26))
		}
	}
	return string(b)
}

// client sends the agents' calls and keeps what the report needs.
type client struct {
	http *http.Client

	mu        sync.Mutex
	latencies []time.Duration
	calls     atomic.Int64
	failed    atomic.Int64
	firstErr  atomic.Value // string
}

func (c *client) fail(err error) {
	c.failed.Add(1)
	c.firstErr.CompareAndSwap(nil, err.Error())
}

// call sends one streaming chat request, reads the stream to its end and returns how
// long that took.
func (c *client) call(ctx context.Context, base, key string, body []byte) (time.Duration, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	t0 := time.Now()
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, err
	}
	defer func() { _ = resp.Body.Close() }() // the body is read or abandoned; its Close error changes nothing
	got, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, fmt.Errorf("reading the stream: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("status %d: %s", resp.StatusCode, strings.TrimSpace(string(got[:min(len(got), 300)])))
	}
	if !bytes.Contains(got, []byte("[DONE]")) {
		return 0, fmt.Errorf("the stream ended before [DONE]")
	}
	took := time.Since(t0)
	c.mu.Lock()
	c.latencies = append(c.latencies, took)
	c.mu.Unlock()
	c.calls.Add(1)
	return took, nil
}

// postJSON posts body to url and decodes the answer into out.
func (c *client) postJSON(ctx context.Context, url string, body, out any) error {
	raw, err := json.Marshal(body)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(raw))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }() // the body is read or abandoned; its Close error changes nothing
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST %s: %s: %s", url, resp.Status, strings.TrimSpace(string(b)))
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}

// fleet is R agent sessions in groups against floe: each group's sessions are created
// together, run their turns, and finish with rewards that differ within the group (so
// every group trains); then the group starts again with a new group id, until stop.
type fleet struct {
	w       Workload
	system  string
	seed    uint64
	c       *client
	proxy   string
	control string

	stop   chan struct{} // closed: no new turns and no new groups
	finish chan struct{} // closed: stopped sessions finish
	// The latency probe, between stop and finish: the stopped sessions each send their
	// next call straight to the fake and then through floe, one pair per think time.
	probe    chan struct{} // closed: the probe starts
	probeEnd chan struct{} // closed: no new probe calls
	think    time.Duration
	upstream string
	direct   *client // the probe's calls straight to the fake
	probed   *client // the probe's calls through floe
	inProbe  atomic.Int64
	pairsMu  sync.Mutex
	added    []time.Duration // per probe pair: through floe − direct
	// settled counts the group slots down once stop is seen: a slot is settled when its
	// sessions have stopped (or finished), so the open sessions can be measured.
	settled sync.WaitGroup
	open    atomic.Int64 // sessions created and not yet finished

	groups   atomic.Int64 // groups started
	sessions atomic.Int64 // sessions finished

	// groupCalls counts, per group id, the calls its sessions got answered through floe
	// (load and probe): what floe must have recorded for the group, and what the archive
	// must hold once the group's step is committed.
	groupCallsMu sync.Mutex
	groupCalls   map[string]*atomic.Int64
}

// groupCounter is group's call counter, created on first use.
func (f *fleet) groupCounter(group string) *atomic.Int64 {
	f.groupCallsMu.Lock()
	defer f.groupCallsMu.Unlock()
	if f.groupCalls == nil {
		f.groupCalls = map[string]*atomic.Int64{}
	}
	c, ok := f.groupCalls[group]
	if !ok {
		c = new(atomic.Int64)
		f.groupCalls[group] = c
	}
	return c
}

// callsOf sums the calls answered through floe for groups.
func (f *fleet) callsOf(groups []string) int64 {
	f.groupCallsMu.Lock()
	defer f.groupCallsMu.Unlock()
	var n int64
	for _, g := range groups {
		if c, ok := f.groupCalls[g]; ok {
			n += c.Load()
		}
	}
	return n
}

func (f *fleet) stopped() bool {
	select {
	case <-f.stop:
		return true
	default:
		return false
	}
}

// runGroup is one group slot: generations of GroupSize sessions until stop. It calls
// settled.Done once, after stop, when none of its sessions will call again.
func (f *fleet) runGroup(ctx context.Context) {
	for {
		if f.stopped() || ctx.Err() != nil {
			f.settled.Done()
			return
		}
		id := int(f.groups.Add(1))
		group := fmt.Sprintf("g%d", id)
		var parked, done sync.WaitGroup
		for s := 0; s < f.w.GroupSize; s++ {
			parked.Add(1)
			done.Add(1)
			go func() {
				defer done.Done()
				f.session(ctx, group, id, s, parked.Done)
			}()
		}
		parked.Wait()
		if f.stopped() {
			f.settled.Done()
			done.Wait()
			return
		}
		done.Wait()
	}
}

// session runs one agent session. It calls park once it will make no more calls: after
// its last turn, or at stop, when it waits for finish before finishing, so that the open
// sessions can be measured.
func (f *fleet) session(ctx context.Context, group string, gid, s int, park func()) {
	var once sync.Once
	defer once.Do(park)
	var created struct {
		SessionID string `json:"session_id"`
		APIKey    string `json:"api_key"`
	}
	if err := f.c.postJSON(ctx, f.control+"/floe/v1/sessions", map[string]any{
		"task_id": "task-" + group, "group_id": group, "group_size": f.w.GroupSize,
	}, &created); err != nil {
		f.c.fail(fmt.Errorf("creating a session: %w", err))
		return
	}
	f.open.Add(1)
	defer f.open.Add(-1)
	h := newHistory(f.w, f.system, f.seed, gid, s)
	answered := f.groupCounter(group)
	stopped := false
	for turn := 0; turn < f.w.Turns; turn++ {
		if stopped = f.stopped(); stopped {
			break
		}
		if _, err := f.c.call(ctx, f.proxy, created.APIKey, h.body()); err != nil {
			if ctx.Err() != nil {
				return
			}
			f.c.fail(err)
		} else {
			answered.Add(1)
		}
		h.advance()
	}
	once.Do(park)
	if stopped || f.stopped() {
		select {
		case <-f.probe:
			f.paced(ctx, created.APIKey, h, uint64(gid)<<8|uint64(s), answered)
		case <-f.finish:
		case <-ctx.Done():
			return
		}
		select {
		case <-f.finish:
		case <-ctx.Done():
			return
		}
	}
	// Rewards differ within the group, so its advantages are not all zero.
	reward := float64(s%2) + 0.01*float64(s)
	if err := f.c.postJSON(ctx, f.control+"/floe/v1/sessions/"+created.SessionID+"/finish", map[string]any{
		"reward": reward, "status": "completed",
	}, nil); err != nil {
		f.c.fail(fmt.Errorf("finishing a session: %w", err))
		return
	}
	f.sessions.Add(1)
}

// paced is one open session's part of the latency probe: after a random start within
// one think time, its next call straight to the fake and then the same call through floe,
// again every think time (± half), until probeEnd; answered counts the calls through floe. The history does not advance, so the
// session's longest call stays within the token budget.
func (f *fleet) paced(ctx context.Context, key string, h *history, seed uint64, answered *atomic.Int64) {
	rng := rand.New(rand.NewPCG(f.seed, seed))
	wait := time.Duration(rng.Float64() * float64(f.think))
	body := h.body()
	for {
		select {
		case <-time.After(wait):
		case <-f.probeEnd:
			return
		case <-ctx.Done():
			return
		}
		// Counted before probeEnd is read, so that whoever closes probeEnd and then
		// waits for inProbe to reach 0 never misses a call.
		f.inProbe.Add(1)
		select {
		case <-f.probeEnd:
			f.inProbe.Add(-1)
			return
		default:
		}
		d, derr := f.direct.call(ctx, f.upstream, "", body)
		if derr != nil {
			f.direct.fail(derr)
		}
		v, verr := f.probed.call(ctx, f.proxy, key, body)
		if verr != nil {
			f.probed.fail(verr)
		} else {
			answered.Add(1)
		}
		if derr == nil && verr == nil {
			f.pairsMu.Lock()
			f.added = append(f.added, v-d)
			f.pairsMu.Unlock()
		}
		f.inProbe.Add(-1)
		wait = time.Duration((0.5 + rng.Float64()) * float64(f.think))
	}
}
