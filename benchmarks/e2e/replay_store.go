package e2e

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/bolt"
)

// FromStore reads the grouped sessions recorded in a floe data dir as sessions to replay:
// each call's normalized upstream request (OpenAI Chat) and the assistant message it got.
// Message content given as parts keeps its text parts only; calls recorded without their
// request or answer (recorded by an older floe, or aborted) end the session's replay
// there. The session's tag is added to its first user message.
func FromStore(dir string) ([]Session, error) {
	st, err := bolt.New(dir, bolt.Options{ReadOnly: true})
	if err != nil {
		return nil, err
	}
	defer func() { _ = st.Close() }() // read only: a Close error loses nothing
	gs, err := st.Groups()
	if err != nil {
		return nil, fmt.Errorf("listing groups: %w", err)
	}
	var out []Session
	for _, gst := range gs {
		g, err := st.Group(gst.ID)
		if err != nil {
			return nil, fmt.Errorf("group %s: %w", gst.ID, err)
		}
		for _, s := range g.Sessions {
			if s.Status == trace.StatusRunning {
				continue // never finished: no reward to replay
			}
			rs := Session{ID: s.ID, Group: g.ID, Task: g.TaskID, Reward: s.Reward, Status: string(s.Status), Tag: fmt.Sprintf("[%s]", s.ID)}
			for _, c := range s.Calls {
				if c.Choice != 0 {
					continue
				}
				call, ok, err := recordedCall(c)
				if err != nil {
					return nil, fmt.Errorf("session %s call %d: %w", s.ID, c.Index, err)
				}
				if !ok {
					break
				}
				tagMessages(call.Messages, rs.Tag)
				rs.Calls = append(rs.Calls, call)
			}
			if len(rs.Calls) > 0 {
				out = append(out, rs)
			}
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("data dir %s holds no finished grouped session with recorded requests", dir)
	}
	return out, nil
}

// recordedCall reads one call's upstream request and answer; ok is false when the call
// lacks them.
func recordedCall(c trace.Call) (Call, bool, error) {
	if len(c.UpstreamRequest) == 0 || len(c.Response) == 0 {
		return Call{}, false, nil
	}
	var req struct {
		Messages           []recordedMessage `json:"messages"`
		Tools              json.RawMessage   `json:"tools"`
		ToolChoice         json.RawMessage   `json:"tool_choice"`
		ChatTemplateKwargs json.RawMessage   `json:"chat_template_kwargs"`
		MaxTokens          int               `json:"max_tokens"`
	}
	if err := json.Unmarshal(c.UpstreamRequest, &req); err != nil {
		return Call{}, false, fmt.Errorf("upstream request: %w", err)
	}
	var ans recordedMessage
	if err := json.Unmarshal(c.Response, &ans); err != nil {
		return Call{}, false, fmt.Errorf("recorded answer: %w", err)
	}
	call := Call{Tools: req.Tools, ToolChoice: req.ToolChoice, ChatTemplateKwargs: req.ChatTemplateKwargs,
		MaxTokens: max(req.MaxTokens, len(c.ResponseIDs)+64)}
	if len(req.Tools) == 0 || string(req.Tools) == "null" {
		call.Tools = json.RawMessage("[]") // a request without tools is replayed without them
	}
	for _, m := range req.Messages {
		call.Messages = append(call.Messages, m.message())
	}
	am := ans.message()
	call.Output = Output{Content: am.Content, Reasoning: am.ReasoningContent}
	for _, tc := range am.ToolCalls {
		call.Output.ToolCalls = append(call.Output.ToolCalls, ScriptedCall{Name: tc.Function.Name, Arguments: tc.Function.Arguments})
	}
	if c.FinishReason == "length" {
		call.Output.Finish, call.MaxTokens = "length", len(c.ResponseIDs)
	}
	return call, true, nil
}

// recordedMessage is an OpenAI Chat message whose content may be a string or parts.
type recordedMessage struct {
	Role             string          `json:"role"`
	Content          json.RawMessage `json:"content"`
	ReasoningContent string          `json:"reasoning_content"`
	Reasoning        string          `json:"reasoning"`
	ToolCalls        []ToolCall      `json:"tool_calls"`
	ToolCallID       string          `json:"tool_call_id"`
}

func (m recordedMessage) message() Message {
	out := Message{Role: m.Role, ReasoningContent: m.ReasoningContent, ToolCalls: m.ToolCalls, ToolCallID: m.ToolCallID}
	if out.ReasoningContent == "" {
		out.ReasoningContent = m.Reasoning
	}
	var s string
	if json.Unmarshal(m.Content, &s) == nil {
		out.Content = s
		return out
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if json.Unmarshal(m.Content, &parts) == nil {
		var texts []string
		for _, p := range parts {
			if p.Text != "" {
				texts = append(texts, p.Text)
			}
		}
		out.Content = strings.Join(texts, "\n")
	}
	return out
}
