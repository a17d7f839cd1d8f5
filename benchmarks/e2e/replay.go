package e2e

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/floe-rl/floe/internal/corpus"
	"github.com/floe-rl/floe/trace"
)

// Session is one agent session to replay: its calls in order, then its outcome.
type Session struct {
	ID     string  `json:"id"`
	Group  string  `json:"group"`
	Task   string  `json:"task"`
	Reward float64 `json:"reward"`
	Status string  `json:"status"` // completed, failed or timeout
	// Tag is unique to the session and appears in every request it makes, so the
	// reference server hands each scripted output to the session it belongs to while
	// sessions run concurrently.
	Tag   string `json:"tag"`
	Calls []Call `json:"calls"`
}

// Call is one model call: the OpenAI Chat request the session sends and the output the
// reference server is scripted to produce for it.
type Call struct {
	Messages []Message `json:"messages"`
	// Tools is the request's tools field; nil: the one tool corpus replays offer.
	Tools json.RawMessage `json:"tools,omitempty"`
	// ToolChoice and ChatTemplateKwargs are the recorded request's, sent when set.
	ToolChoice         json.RawMessage `json:"tool_choice,omitempty"`
	ChatTemplateKwargs json.RawMessage `json:"chat_template_kwargs,omitempty"`
	// MaxTokens bounds the answer; an Output with Finish "length" is cut at it.
	MaxTokens int    `json:"max_tokens"`
	Output    Output `json:"output"`
}

// Message is an OpenAI Chat message.
type Message struct {
	Role             string     `json:"role"`
	Content          string     `json:"content"`
	ReasoningContent string     `json:"reasoning_content,omitempty"`
	ToolCalls        []ToolCall `json:"tool_calls,omitempty"`
	ToolCallID       string     `json:"tool_call_id,omitempty"`
}

// ToolCall is an assistant message's call of a function tool.
type ToolCall struct {
	ID       string       `json:"id"`
	Type     string       `json:"type"`
	Function FunctionCall `json:"function"`
}

// FunctionCall names the function and its JSON arguments.
type FunctionCall struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// Output is a scripted assistant output in the reference server's POST /script format.
type Output struct {
	Content   string         `json:"content,omitempty"`
	Reasoning string         `json:"reasoning,omitempty"`
	ToolCalls []ScriptedCall `json:"tool_calls,omitempty"`
	Finish    string         `json:"finish,omitempty"` // stop (default) or length
	Match     *Match         `json:"match,omitempty"`
}

// ScriptedCall is a tool call in a scripted output.
type ScriptedCall struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// Match restricts a scripted output to requests whose messages contain a string.
type Match struct {
	Contains string `json:"contains"`
}

// replayTool is the one tool replayed sessions offer; the corpus's tool calls all call it.
const replayTool = "run"

// Tools is the tools field of every replayed request.
var tools = []map[string]any{{
	"type": "function",
	"function": map[string]any{
		"name":        replayTool,
		"description": "Run a shell command in the repository and return its output.",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{
			"cmd": map[string]any{"type": "string", "description": "the command"}}, "required": []string{"cmd"}},
	},
}}

// Body is the OpenAI Chat request body of the call for model.
func (c Call) Body(model string) ([]byte, error) {
	var t any = tools
	if c.Tools != nil {
		t = c.Tools
	}
	body := map[string]any{"model": model, "messages": c.Messages, "tools": t, "max_tokens": c.MaxTokens, "temperature": 1.0}
	if c.ToolChoice != nil {
		body["tool_choice"] = c.ToolChoice
	}
	if c.ChatTemplateKwargs != nil {
		body["chat_template_kwargs"] = c.ChatTemplateKwargs
	}
	return json.Marshal(body)
}

// ResponsesBody is the OpenAI Responses request body of the call for model: the same
// conversation as Body's as input items, as a stateless harness sends it (store false,
// the whole history every call). An assistant message becomes its reasoning item (the
// text as reasoning_text content), its message item and its function_call items, which
// floe's Responses dialect folds back into one assistant turn; a tool message becomes a
// function_call_output item.
func (c Call) ResponsesBody(model string) ([]byte, error) {
	var chatTools json.RawMessage
	if c.Tools != nil {
		chatTools = c.Tools
	} else {
		raw, err := json.Marshal(tools)
		if err != nil {
			return nil, err
		}
		chatTools = raw
	}
	var ct []struct {
		Type     string `json:"type"`
		Function struct {
			Name        string          `json:"name"`
			Description string          `json:"description,omitempty"`
			Parameters  json.RawMessage `json:"parameters,omitempty"`
		} `json:"function"`
	}
	if err := json.Unmarshal(chatTools, &ct); err != nil {
		return nil, fmt.Errorf("tools: %w", err)
	}
	rtools := make([]map[string]any, 0, len(ct))
	for _, t := range ct {
		rt := map[string]any{"type": "function", "name": t.Function.Name}
		if t.Function.Description != "" {
			rt["description"] = t.Function.Description
		}
		if t.Function.Parameters != nil {
			rt["parameters"] = t.Function.Parameters
		}
		rtools = append(rtools, rt)
	}
	var input []map[string]any
	for _, m := range c.Messages {
		switch m.Role {
		case "assistant":
			if m.ReasoningContent != "" {
				input = append(input, map[string]any{"type": "reasoning", "summary": []any{},
					"content": []map[string]any{{"type": "reasoning_text", "text": m.ReasoningContent}}})
			}
			if m.Content != "" || (m.ReasoningContent == "" && len(m.ToolCalls) == 0) {
				input = append(input, map[string]any{"type": "message", "role": "assistant",
					"content": []map[string]any{{"type": "output_text", "text": m.Content}}})
			}
			for _, tc := range m.ToolCalls {
				input = append(input, map[string]any{"type": "function_call", "call_id": tc.ID,
					"name": tc.Function.Name, "arguments": tc.Function.Arguments})
			}
		case "tool":
			input = append(input, map[string]any{"type": "function_call_output", "call_id": m.ToolCallID, "output": m.Content})
		default:
			input = append(input, map[string]any{"type": "message", "role": m.Role, "content": m.Content})
		}
	}
	body := map[string]any{"model": model, "input": input, "tools": rtools, "max_output_tokens": c.MaxTokens,
		"temperature": 1.0, "store": false}
	if len(c.ToolChoice) > 0 && c.ToolChoice[0] == '"' { // "auto", "none", "required": the same in both APIs
		body["tool_choice"] = c.ToolChoice
	}
	return json.Marshal(body)
}

// FromCorpus turns the synthetic corpus's token-level sessions into conversations the
// reference server can replay. Every content token becomes a word (id mod the word list),
// so a turn keeps its length in tokens within the reference tokenizer's merges, and every
// turn keeps its place: what two calls share as tokens they share as messages, drift
// (a re-tokenized turn) becomes differing words, stripped reasoning an assistant message
// without reasoning_content, a compaction a fresh conversation. Sibling choices (n > 1)
// are replayed as their first choice only. Every call needs its response tokens: the
// corpus must be generated with UntrainableProb 0.
func FromCorpus(groups []trace.Group) ([]Session, error) {
	var out []Session
	for _, g := range groups {
		for si, s := range g.Sessions {
			rs := Session{ID: s.ID, Group: g.ID, Task: g.TaskID, Reward: s.Reward, Status: string(s.Status),
				Tag: fmt.Sprintf("[%s]", s.ID)}
			if rs.Status == string(trace.StatusRunning) || rs.Status == "" {
				rs.Status = string(trace.StatusCompleted)
			}
			for _, c := range s.Calls {
				if c.Choice != 0 {
					continue
				}
				if len(c.ResponseIDs) == 0 {
					return nil, fmt.Errorf("group %s session %s call %d: no response tokens to script (generate the corpus with UntrainableProb 0)", g.ID, s.ID, c.Index)
				}
				msgs, err := promptMessages(c.PromptIDs)
				if err != nil {
					return nil, fmt.Errorf("group %s session %d (%s) call %d: %w", g.ID, si, s.ID, c.Index, err)
				}
				tagMessages(msgs, rs.Tag)
				out := output(corpus.ParseAssistant(c.ResponseIDs))
				limit := len(c.ResponseIDs) + 64
				if c.FinishReason == "length" {
					out.Finish, limit = "length", len(c.ResponseIDs)
				}
				rs.Calls = append(rs.Calls, Call{Messages: msgs, MaxTokens: limit, Output: out})
			}
			if len(rs.Calls) > 0 {
				out = append(out, rs)
			}
		}
	}
	return out, nil
}

// tagMessages appends tag to the first user message, or to the system message when there
// is no user message, so that every request of the session carries it.
func tagMessages(msgs []Message, tag string) {
	for i := range msgs {
		if msgs[i].Role == "user" {
			msgs[i].Content += " " + tag
			return
		}
	}
	if len(msgs) > 0 {
		msgs[0].Content += " " + tag
	}
}

// promptMessages reads a corpus prompt as messages; a tool message answers the latest
// tool call.
func promptMessages(ids []int32) ([]Message, error) {
	turns, err := corpus.ParsePrompt(ids)
	if err != nil {
		return nil, err
	}
	msgs := make([]Message, 0, len(turns))
	calls := 0
	for _, t := range turns {
		switch {
		case t.Role == "assistant":
			o := output(t.Assistant)
			m := Message{Role: "assistant", Content: o.Content, ReasoningContent: o.Reasoning}
			for _, tc := range o.ToolCalls {
				calls++
				m.ToolCalls = append(m.ToolCalls, ToolCall{ID: fmt.Sprintf("call_%d", calls), Type: "function",
					Function: FunctionCall(tc)})
			}
			msgs = append(msgs, m)
		case t.Role == "tool" && calls > 0:
			msgs = append(msgs, Message{Role: "tool", ToolCallID: fmt.Sprintf("call_%d", calls), Content: words(t.Content)})
		case t.Role == "tool": // no call to answer: the harness's words as a user turn
			msgs = append(msgs, Message{Role: "user", Content: words(t.Content)})
		default:
			msgs = append(msgs, Message{Role: t.Role, Content: words(t.Content)})
		}
	}
	return msgs, nil
}

// output is the scripted output an assistant turn or response stands for.
func output(a corpus.Assistant) Output {
	o := Output{Content: words(a.Content), Reasoning: words(a.Reasoning)}
	if a.ToolCall {
		// Spaced as Python's json.dumps (the template's tojson) writes it: servers hand the
		// arguments of earlier calls to the chat template as an object, so the history
		// renders the call exactly as the model wrote it only in that spacing.
		cmd, _ := json.Marshal(words(a.ToolArgs))
		o.ToolCalls = []ScriptedCall{{Name: replayTool, Arguments: `{"cmd": ` + string(cmd) + `}`}}
	}
	return o
}

// words renders content tokens as words.
func words(ids []int32) string {
	var b strings.Builder
	for i, id := range ids {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(word(id))
	}
	return b.String()
}

func word(id int32) string { return vocabulary[int(id)%len(vocabulary)] }

// vocabulary holds words that the reference server's tokenizer encodes as one token each,
// with or without a leading space, so a replayed turn has its corpus length in tokens.
var vocabulary = strings.Fields(`the of and to in is for with on as are by it from or at an not file test code error
value type data name line function return new use all list set if one read used path
time make only other its like out get any most where up find end next back check open
add fix case import class method string true false input state default user model token
step group session tree root left right size count key array int float char text word
self def con object par pro len heap stream item indent tra comp allow cur flo except
wrap rep max ran pre version row ser try per log order arg args com pos cls sub format
width break head whitespace imple response parse current ele part lines queue col rows
func sample http loss obj exp message str print floe server json sort items range und
script quo tuple space match micro see types res mark empty prompt recur direct ter ass
sequen che cor rest inter trainer maxsize headers repr sys words top doc wrapped rank
app ite block form iter bound bench`)
