package e2e

import (
	"encoding/json"
	"fmt"
	"sort"
	"strings"

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
	return json.Marshal(map[string]any{
		"model": model, "messages": c.Messages, "tools": t, "max_tokens": c.MaxTokens, "temperature": 1.0,
	})
}

// Template token ids of the synthetic corpus (Qwen's), which FromCorpus reads its
// ChatML token sequences back into messages with.
const (
	tokNewline       int32 = 198
	tokDoubleNewline int32 = 271
	tokUser          int32 = 872
	tokSystem        int32 = 8948
	tokAssistant     int32 = 77091
	tokImStart       int32 = 151_644
	tokImEnd         int32 = 151_645
	tokToolCall      int32 = 151_657
	tokToolCallEnd   int32 = 151_658
	tokToolResponse  int32 = 151_665
	tokToolRespEnd   int32 = 151_666
	tokThink         int32 = 151_667
	tokThinkEnd      int32 = 151_668
)

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
				out := outputOf(c.ResponseIDs)
				max := len(c.ResponseIDs) + 64
				if c.FinishReason == "length" {
					out.Finish, max = "length", len(c.ResponseIDs)
				}
				rs.Calls = append(rs.Calls, Call{Messages: msgs, MaxTokens: max, Output: out})
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

// promptMessages reads a ChatML prompt (ending in the assistant header) as messages.
func promptMessages(ids []int32) ([]Message, error) {
	var msgs []Message
	calls := 0 // tool calls so far: a tool message answers the latest
	i := 0
	for i < len(ids) {
		if ids[i] != tokImStart || i+2 >= len(ids) {
			return nil, fmt.Errorf("token %d: want <|im_start|> role newline, got id %d", i, ids[i])
		}
		role := ids[i+1]
		i += 3 // <|im_start|> role \n
		end := i
		for end < len(ids) && ids[end] != tokImEnd {
			end++
		}
		if end == len(ids) { // the open assistant header the model completes
			if role != tokAssistant || end != i {
				return nil, fmt.Errorf("prompt does not end in the assistant header")
			}
			break
		}
		body := ids[i:end]
		i = end + 1
		if i < len(ids) && ids[i] == tokNewline {
			i++
		}
		switch role {
		case tokSystem:
			msgs = append(msgs, Message{Role: "system", Content: words(body)})
		case tokUser:
			if len(body) > 0 && body[0] == tokToolResponse && calls > 0 {
				msgs = append(msgs, Message{Role: "tool", ToolCallID: fmt.Sprintf("call_%d", calls), Content: words(body)})
				continue
			}
			msgs = append(msgs, Message{Role: "user", Content: words(body)})
		case tokAssistant:
			o := outputOf(body)
			m := Message{Role: "assistant", Content: o.Content, ReasoningContent: o.Reasoning}
			for _, tc := range o.ToolCalls {
				calls++
				m.ToolCalls = append(m.ToolCalls, ToolCall{ID: fmt.Sprintf("call_%d", calls), Type: "function",
					Function: FunctionCall{Name: tc.Name, Arguments: tc.Arguments}})
			}
			msgs = append(msgs, m)
		default:
			return nil, fmt.Errorf("unknown role id %d", role)
		}
	}
	return msgs, nil
}

// outputOf reads an assistant turn's tokens: [<think> reasoning </think>] content
// [<tool_call> args </tool_call>] [<|im_end|>].
func outputOf(ids []int32) Output {
	var o Output
	var content, args []int32
	mode := 0 // 0 content, 1 reasoning, 2 tool call args
	for _, id := range ids {
		switch id {
		case tokThink:
			mode = 1
		case tokThinkEnd:
			mode = 0
		case tokToolCall:
			mode = 2
		case tokToolCallEnd:
			mode = 0
		case tokImEnd:
		default:
			switch mode {
			case 1:
				o.Reasoning += sep(o.Reasoning) + word(id)
			case 2:
				args = append(args, id)
			default:
				content = append(content, id)
			}
		}
	}
	o.Content = words(content)
	if mode == 2 || len(args) > 0 {
		a, _ := json.Marshal(map[string]string{"cmd": words(args)})
		o.ToolCalls = []ScriptedCall{{Name: replayTool, Arguments: string(a)}}
	}
	return o
}

func sep(s string) string {
	if s == "" {
		return ""
	}
	return " "
}

// words renders content tokens as words, dropping template tokens.
func words(ids []int32) string {
	var b strings.Builder
	for _, id := range ids {
		switch id {
		case tokNewline, tokDoubleNewline, tokUser, tokSystem, tokAssistant:
			continue
		}
		if id >= 151_643 {
			continue
		}
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(word(id))
	}
	return b.String()
}

func word(id int32) string { return vocabulary[int(id)%len(vocabulary)] }

// vocabulary is common English that a byte-level BPE trained on English text keeps as
// single tokens.
var vocabulary = strings.Fields(`the of and to in is for that with on as are this be by it from or at an
not file test code run error value type data name line function return new use can all list set
if when has will one list more read write call used path time make only build each how their
which other first into some than then also two these may its after work two use make like
out get over just any most where such should through up before while each over find same
start end first last next back check open close add remove update change fix bug issue case
module package import class method field string number true false null input output result
state config option flag default user model token batch step group session call tree node
root leaf left right size count index key map array slice byte int float bool char text word`)

// SortSessions orders sessions by group, then by id, so that a replay is the same run
// after run.
func SortSessions(ss []Session) {
	sort.SliceStable(ss, func(i, j int) bool {
		if ss[i].Group != ss[j].Group {
			return ss[i].Group < ss[j].Group
		}
		return ss[i].ID < ss[j].ID
	})
}
