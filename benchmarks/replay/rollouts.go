// Package replay rebuilds the model calls of real agent rollouts — NeMo Gym's format: one
// trajectory per line as OpenAI Responses output items — as sessions floe-bench replays
// through floe's proxy, and measures every packing strategy on what floe recorded: rows
// and passes per budget and data-parallel size, the cut floor, pack time, and the
// equality of each strategy's loss terms to per_request's, decoded from the Arrow
// micro-batches (docs/benchmarks.md).
package replay

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"

	"github.com/floe-rl/floe/benchmarks/e2e"
)

// Options says how to rebuild the calls.
type Options struct {
	// Harness, when set, is prepended to every call: its messages around the task, its
	// tools instead of the minimal ones. A rollout's own system messages are dropped then:
	// the harness speaks its own.
	Harness *Harness
	// MaxTokens is each call's max_tokens; 0: 65536 (a scripted answer is never cut).
	MaxTokens int
}

// Rollouts is a file of trajectories rebuilt as sessions to replay.
type Rollouts struct {
	Agent    string // agent_ref.name of the first line, "" when absent
	Sessions []e2e.Session
	Groups   int
	Calls    int
}

type rollout struct {
	Params struct {
		Input        json.RawMessage `json:"input"`
		Instructions *string         `json:"instructions"`
		Metadata     json.RawMessage `json:"metadata"`
	} `json:"responses_create_params"`
	Response struct {
		Output []item `json:"output"`
	} `json:"response"`
	Reward       float64         `json:"reward"`
	TaskIndex    *int            `json:"_ng_task_index"`
	RolloutIndex *int            `json:"_ng_rollout_index"`
	InstanceID   string          `json:"instance_id"`
	Metadata     json.RawMessage `json:"metadata"`
	AgentRef     struct {
		Name string `json:"name"`
	} `json:"agent_ref"`
}

// item is one Responses item; only the fields the replay reads.
type item struct {
	Type      string          `json:"type"`
	Role      string          `json:"role"`
	Content   json.RawMessage `json:"content"`
	Summary   json.RawMessage `json:"summary"`
	Name      string          `json:"name"`
	Arguments json.RawMessage `json:"arguments"`
	CallID    string          `json:"call_id"`
	Output    json.RawMessage `json:"output"`
}

// modelOutput reports whether the model produced the item: reasoning, an assistant
// message, a function call. Everything else (tool outputs, user or system messages) is
// the harness's, and ends a run of model outputs: one model call.
func (it item) modelOutput() bool {
	switch it.Type {
	case "reasoning", "function_call":
		return true
	case "message", "":
		return it.Role == "assistant"
	}
	return false
}

type metadata struct {
	InstanceID       string `json:"instance_id"`
	ProblemStatement string `json:"problem_statement"`
}

// Read rebuilds every model call of the trajectories in r: the request of a call is
// everything before a run of model outputs, the answer is that run. Rollouts are grouped
// by _ng_task_index into GRPO groups; reward is the session's reward.
func Read(r io.Reader, opt Options) (*Rollouts, error) {
	if opt.MaxTokens <= 0 {
		opt.MaxTokens = 1 << 16
	}
	var rs []rollout
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<30)
	for line := 1; sc.Scan(); line++ {
		if strings.TrimSpace(sc.Text()) == "" {
			continue
		}
		var ro rollout
		if err := json.Unmarshal(sc.Bytes(), &ro); err != nil {
			return nil, fmt.Errorf("line %d: %w", line, err)
		}
		rs = append(rs, ro)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading rollouts: %w", err)
	}
	if len(rs) == 0 {
		return nil, errors.New("no rollouts")
	}
	tools := opt.harnessTools()
	if tools == nil {
		tools = minimalTools(rs)
	}
	out := &Rollouts{Agent: rs[0].AgentRef.Name}
	groups := map[string]bool{}
	next := map[string]int{}
	for i, ro := range rs {
		task := strconv.Itoa(i) // no task index: every rollout is its own group
		if ro.TaskIndex != nil {
			task = strconv.Itoa(*ro.TaskIndex)
		}
		rollout := next[task]
		if ro.RolloutIndex != nil {
			rollout = *ro.RolloutIndex
		}
		next[task]++
		s, err := ro.session(opt, tools)
		if err != nil {
			return nil, fmt.Errorf("rollout %d (task %s): %w", i+1, task, err)
		}
		s.ID, s.Group = fmt.Sprintf("task%s-rollout%d", task, rollout), "task"+task
		groups[s.Group] = true
		out.Calls += len(s.Calls)
		out.Sessions = append(out.Sessions, s)
	}
	out.Groups = len(groups)
	return out, nil
}

func (o Options) harnessTools() json.RawMessage {
	if o.Harness == nil {
		return nil
	}
	return o.Harness.Tools
}

// minimalTools offers every function the rollouts call, by name only: the files hold no
// tool schemas, and a request without tools would not have its tool calls parsed.
func minimalTools(rs []rollout) json.RawMessage {
	var names []string
	for _, ro := range rs {
		for _, it := range ro.Response.Output {
			if it.Type == "function_call" && it.Name != "" && !slices.Contains(names, it.Name) {
				names = append(names, it.Name)
			}
		}
	}
	slices.Sort(names)
	tools := make([]map[string]any, len(names))
	for i, n := range names {
		tools[i] = map[string]any{"type": "function", "function": map[string]any{
			"name": n, "parameters": map[string]any{"type": "object"}}}
	}
	raw, _ := json.Marshal(tools)
	return raw
}

func (ro rollout) session(opt Options, tools json.RawMessage) (e2e.Session, error) {
	s := e2e.Session{Reward: ro.Reward, Status: "completed", Task: ro.taskID()}
	history, err := ro.prompt(opt)
	if err != nil {
		return s, err
	}
	var run []item
	flush := func() error {
		if len(run) == 0 {
			return nil
		}
		out, msg, err := answer(run)
		if err != nil {
			return err
		}
		s.Calls = append(s.Calls, e2e.Call{Messages: slices.Clone(history), Tools: tools, MaxTokens: opt.MaxTokens, Output: out})
		history = append(history, msg)
		run = nil
		return nil
	}
	for k, it := range ro.Response.Output {
		if it.modelOutput() {
			run = append(run, it)
			continue
		}
		if err := flush(); err != nil {
			return s, fmt.Errorf("output item %d: %w", k, err)
		}
		msg, ok, err := it.message()
		if err != nil {
			return s, fmt.Errorf("output item %d: %w", k, err)
		}
		if ok {
			history = append(history, msg)
		}
	}
	if err := flush(); err != nil {
		return s, fmt.Errorf("last output: %w", err)
	}
	if len(s.Calls) == 0 {
		return s, errors.New("no model output in the trajectory")
	}
	return s, nil
}

func (ro rollout) taskID() string {
	for _, raw := range []json.RawMessage{ro.Params.Metadata, ro.Metadata} {
		var m metadata
		if json.Unmarshal(raw, &m) == nil && m.InstanceID != "" {
			return m.InstanceID
		}
	}
	if ro.InstanceID != "" {
		return ro.InstanceID
	}
	if ro.TaskIndex != nil {
		return "task" + strconv.Itoa(*ro.TaskIndex)
	}
	return "task"
}

// prompt is the conversation before the trajectory: instructions and input, or, where
// the harness's own request was not recorded (an empty input), the task's problem
// statement as the user's message; with a harness, its messages around the task.
func (ro rollout) prompt(opt Options) ([]e2e.Message, error) {
	var msgs []e2e.Message
	if ro.Params.Instructions != nil && *ro.Params.Instructions != "" {
		msgs = append(msgs, e2e.Message{Role: "system", Content: *ro.Params.Instructions})
	}
	var input []item
	if len(ro.Params.Input) > 0 && ro.Params.Input[0] == '"' {
		var s string
		if err := json.Unmarshal(ro.Params.Input, &s); err != nil {
			return nil, fmt.Errorf("input: %w", err)
		}
		input = []item{{Type: "message", Role: "user", Content: ro.Params.Input}}
	} else if len(ro.Params.Input) > 0 && string(ro.Params.Input) != "null" {
		if err := json.Unmarshal(ro.Params.Input, &input); err != nil {
			return nil, fmt.Errorf("input: %w", err)
		}
	}
	for k, it := range input {
		if it.modelOutput() {
			return nil, fmt.Errorf("input item %d: model output in the input is not supported", k)
		}
		m, ok, err := it.message()
		if err != nil {
			return nil, fmt.Errorf("input item %d: %w", k, err)
		}
		if ok {
			msgs = append(msgs, m)
		}
	}
	if !slices.ContainsFunc(msgs, func(m e2e.Message) bool { return m.Role == "user" }) {
		var m metadata
		_ = json.Unmarshal(ro.Params.Metadata, &m)
		if m.ProblemStatement == "" {
			return nil, errors.New("no user message in input and no metadata.problem_statement: the task is unknown")
		}
		msgs = append(msgs, e2e.Message{Role: "user", Content: m.ProblemStatement})
	}
	if opt.Harness == nil {
		return msgs, nil
	}
	// The harness's context around the first user message; the rest follows it.
	first := slices.IndexFunc(msgs, func(m e2e.Message) bool { return m.Role == "user" })
	task := msgs[first].Content
	var out []e2e.Message
	for _, hm := range opt.Harness.Messages {
		out = append(out, e2e.Message{Role: hm.Role, Content: strings.ReplaceAll(hm.Content, TaskPlaceholder, task)})
	}
	for _, m := range msgs[first+1:] {
		if m.Role != "system" {
			out = append(out, m)
		}
	}
	return out, nil
}

// message is the Chat message a harness item stands for; ok is false for items the
// engine never sees.
func (it item) message() (e2e.Message, bool, error) {
	switch it.Type {
	case "function_call_output":
		text, err := partsText(it.Output, "\n")
		if err != nil {
			return e2e.Message{}, false, fmt.Errorf("function_call_output: %w", err)
		}
		return e2e.Message{Role: "tool", ToolCallID: it.CallID, Content: text}, true, nil
	case "message", "":
		text, err := partsText(it.Content, "\n")
		if err != nil {
			return e2e.Message{}, false, fmt.Errorf("%s message: %w", it.Role, err)
		}
		role := it.Role
		if role == "developer" {
			role = "system"
		}
		if role != "user" && role != "system" {
			return e2e.Message{}, false, fmt.Errorf("message role %q", it.Role)
		}
		return e2e.Message{Role: role, Content: text}, true, nil
	}
	return e2e.Message{}, false, nil // other item types are not for the engine (floe drops them too)
}

// answer is one run of model outputs as the output the server is scripted to produce and
// the assistant message it leaves in the history. Items are joined as floe's Responses
// dialect joins one assistant turn: texts concatenated, reasoning items by a blank line.
func answer(run []item) (e2e.Output, e2e.Message, error) {
	var content, reasoning strings.Builder
	var calls []e2e.ScriptedCall
	var toolCalls []e2e.ToolCall
	for _, it := range run {
		switch it.Type {
		case "reasoning":
			text, err := partsText(it.Content, "")
			if err != nil {
				return e2e.Output{}, e2e.Message{}, fmt.Errorf("reasoning: %w", err)
			}
			if text == "" {
				if text, err = partsText(it.Summary, "\n\n"); err != nil {
					return e2e.Output{}, e2e.Message{}, fmt.Errorf("reasoning summary: %w", err)
				}
			}
			if reasoning.Len() > 0 && text != "" {
				reasoning.WriteString("\n\n")
			}
			reasoning.WriteString(text)
		case "function_call":
			args := string(it.Arguments)
			var s string
			if json.Unmarshal(it.Arguments, &s) == nil {
				args = s
			}
			if py, ok := pythonJSON(args); ok {
				args = py
			}
			if it.Name == "" {
				return e2e.Output{}, e2e.Message{}, errors.New("function_call without a name")
			}
			id := it.CallID
			if id == "" {
				id = fmt.Sprintf("call_%d", len(calls))
			}
			calls = append(calls, e2e.ScriptedCall{Name: it.Name, Arguments: args})
			toolCalls = append(toolCalls, e2e.ToolCall{ID: id, Type: "function", Function: e2e.FunctionCall{Name: it.Name, Arguments: args}})
		default:
			text, err := partsText(it.Content, "")
			if err != nil {
				return e2e.Output{}, e2e.Message{}, fmt.Errorf("assistant message: %w", err)
			}
			content.WriteString(text)
		}
	}
	r, c := splitThink(reasoning.String(), content.String())
	out := e2e.Output{Content: c, Reasoning: r, ToolCalls: calls}
	return out, e2e.Message{Role: "assistant", Content: c, ReasoningContent: r, ToolCalls: toolCalls}, nil
}

// splitThink moves reasoning the model wrote inline (<think>…</think> in its text, as
// Qwen3 models do without a reasoning parser) into the reasoning, exactly as the chat
// template splits it when rendering the turn: the same tokens either way, but the history
// then carries the reasoning the way a server with a reasoning parser hands it back.
func splitThink(reasoning, content string) (string, string) {
	before, after, ok := strings.Cut(content, "</think>")
	if !ok {
		return reasoning, content
	}
	parts := strings.Split(strings.TrimRight(before, "\n"), "<think>")
	inline := strings.TrimLeft(parts[len(parts)-1], "\n")
	if reasoning != "" && inline != "" {
		reasoning += "\n\n"
	}
	return reasoning + inline, strings.TrimLeft(after, "\n")
}

// partsText reads a string, or a list of content parts whose text parts are joined with
// sep; absent is "".
func partsText(raw json.RawMessage, sep string) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []struct {
		Type    string `json:"type"`
		Text    string `json:"text"`
		Refusal string `json:"refusal"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", fmt.Errorf("content is neither text nor a list of parts: %w", err)
	}
	var texts []string
	for _, p := range parts {
		switch p.Type {
		case "refusal":
			texts = append(texts, p.Refusal)
		case "input_image", "input_file", "input_audio":
		default:
			texts = append(texts, p.Text)
		}
	}
	return strings.Join(texts, sep), nil
}
