package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/sourcegraph/conc/pool"
)

// Driver replays sessions through a running floe's proxy against the reference inference
// server in script mode: for each session it creates the session through the control
// API, queues the session's outputs on the server (matched on the session's tag), sends
// its calls in order with the session's key and finishes it with its reward and status.
type Driver struct {
	Proxy     string // floe's proxy base URL, http://host:port
	Control   string // floe's control API base URL (/floe/v1), http://host:port
	RefServer string // the reference server's base URL (without /v1)
	Model     string // model name sent in requests
	// Dialect is the API the calls are sent in: "chat" (OpenAI Chat, the default) or
	// "responses" (OpenAI Responses, the whole history as input items).
	Dialect string
	// Concurrency bounds the sessions in flight (default 8).
	Concurrency int
	Client      *http.Client // nil: http.DefaultClient
	// Progress, when set, is called after each call with the calls done so far, from one
	// goroutine at a time.
	Progress func(calls int)

	progressMu sync.Mutex
}

func (d *Driver) client() *http.Client {
	if d.Client != nil {
		return d.Client
	}
	return http.DefaultClient
}

// Run replays sessions, at most Concurrency at a time. Each group is created with its full
// size, so floe completes it when its last session finishes.
func (d *Driver) Run(ctx context.Context, sessions []Session) error {
	size := map[string]int{}
	for _, s := range sessions {
		size[s.Group]++
	}
	var calls atomic.Int64
	n := d.Concurrency
	if n <= 0 {
		n = 8
	}
	p := pool.New().WithContext(ctx).WithCancelOnError().WithMaxGoroutines(n)
	for _, s := range sessions {
		p.Go(func(ctx context.Context) error {
			if err := d.session(ctx, s, size[s.Group], &calls); err != nil {
				return fmt.Errorf("session %s (group %s): %w", s.ID, s.Group, err)
			}
			return nil
		})
	}
	return p.Wait()
}

func (d *Driver) session(ctx context.Context, s Session, groupSize int, calls *atomic.Int64) error {
	var created struct {
		SessionID string `json:"session_id"`
		APIKey    string `json:"api_key"`
	}
	if err := d.post(ctx, d.Control+"/floe/v1/sessions", "", map[string]any{
		"task_id": s.Task, "group_id": s.Group, "group_size": groupSize,
	}, &created); err != nil {
		return fmt.Errorf("creating the session: %w", err)
	}
	outputs := make([]Output, len(s.Calls))
	for i, c := range s.Calls {
		outputs[i] = c.Output
		if s.Tag != "" { // untagged: one session at a time takes the outputs in order
			outputs[i].Match = &Match{Contains: s.Tag}
		}
	}
	if err := d.post(ctx, d.RefServer+"/script", "", map[string]any{"outputs": outputs}, nil); err != nil {
		return fmt.Errorf("scripting the reference server: %w", err)
	}
	for i, c := range s.Calls {
		if err := d.call(ctx, c, created.APIKey); err != nil {
			return fmt.Errorf("call %d: %w", i, err)
		}
		n := calls.Add(1)
		if d.Progress != nil {
			d.progressMu.Lock()
			d.Progress(int(n))
			d.progressMu.Unlock()
		}
	}
	return d.post(ctx, d.Control+"/floe/v1/sessions/"+created.SessionID+"/finish", "",
		map[string]any{"reward": s.Reward, "status": s.Status}, nil)
}

// call sends one call in the driver's dialect and checks that the answer is the scripted
// output.
func (d *Driver) call(ctx context.Context, c Call, key string) error {
	if d.Dialect == "responses" {
		body, err := c.ResponsesBody(d.Model)
		if err != nil {
			return err
		}
		var answer struct {
			Output []struct {
				Type string `json:"type"`
			} `json:"output"`
		}
		if err := d.post(ctx, d.Proxy+"/v1/responses", key, json.RawMessage(body), &answer); err != nil {
			return err
		}
		calls := 0
		for _, it := range answer.Output {
			if it.Type == "function_call" {
				calls++
			}
		}
		if !c.Output.answeredBy(calls) {
			return fmt.Errorf("the answer is not the scripted output (%d function calls; want %d): is the server in script mode, and is another client taking its outputs?",
				calls, len(c.Output.ToolCalls))
		}
		return nil
	}
	body, err := c.Body(d.Model)
	if err != nil {
		return err
	}
	var answer struct {
		Choices []struct {
			FinishReason string `json:"finish_reason"`
			Message      struct {
				Content   *string           `json:"content"`
				ToolCalls []json.RawMessage `json:"tool_calls"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := d.post(ctx, d.Proxy+"/v1/chat/completions", key, json.RawMessage(body), &answer); err != nil {
		return err
	}
	if len(answer.Choices) != 1 || !c.Output.answeredBy(len(answer.Choices[0].Message.ToolCalls)) {
		return fmt.Errorf("the answer is not the scripted output (%d choices; want %d tool calls): is the server in script mode, and is another client taking its outputs?",
			len(answer.Choices), len(c.Output.ToolCalls))
	}
	return nil
}

// answeredBy reports whether an answer with this many tool calls can be o's. Real
// rollouts hold outputs a server parses otherwise than the recording did: text with a
// tool call in the server's own format (a hermes-style call the harness's parser did not
// take) is parsed into one more call, and calls after an unclosed <think> (a model that
// called a tool mid-thought) are parsed as reasoning. The tokens are the same either way.
func (o Output) answeredBy(toolCalls int) bool {
	lo, hi := len(o.ToolCalls), len(o.ToolCalls)+strings.Count(o.Content, "<tool_call>")
	if strings.Contains(o.Content, "<think>") && !strings.Contains(o.Content, "</think>") {
		lo = 0
	}
	return lo <= toolCalls && toolCalls <= hi
}

func (d *Driver) post(ctx context.Context, url, key string, body, out any) error {
	raw, err := json.Marshal(body)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(raw))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := d.client().Do(req)
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }() // the body is read or abandoned; its Close error changes nothing
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("POST %s: reading the answer: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST %s: %s: %s", url, resp.Status, strings.TrimSpace(string(b)))
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			return fmt.Errorf("POST %s: %w", url, err)
		}
	}
	return nil
}
