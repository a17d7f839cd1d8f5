// Package openai holds the proxy's two OpenAI dialects: Chat Completions
// (/v1/chat/completions, the upstream's own format) and Responses (/v1/responses).
package openai

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"

	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/floe-rl/floe/proxy"
	gojson "github.com/goccy/go-json"
)

// OpenAIChat is the OpenAI Chat Completions API (/v1/chat/completions): the upstream's own
// dialect, so decoding is mostly validation and encoding mostly renaming the model back.
type Chat struct{}

var _ proxy.Dialect = Chat{}

func (Chat) Name() string { return "openai_chat" }

// chatState is what the writers need from the request.
type chatState struct {
	includeUsage bool
}

// chatIn is a Chat Completions request as callers send it: stop may be a string, the
// token limit has two names, developer is a system role, reasoning_effort may turn
// thinking off.
type chatIn struct {
	Model               string           `json:"model"`
	Messages            []chatInMessage  `json:"messages"`
	Tools               []proxy.ChatTool `json:"tools"`
	ToolChoice          json.RawMessage  `json:"tool_choice"`
	ParallelToolCalls   *bool            `json:"parallel_tool_calls"`
	MaxTokens           *int             `json:"max_tokens"`
	MaxCompletionTokens *int             `json:"max_completion_tokens"`
	Temperature         *float64         `json:"temperature"`
	TopP                *float64         `json:"top_p"`
	Stop                json.RawMessage  `json:"stop"`
	N                   *int             `json:"n"`
	Stream              bool             `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	ReasoningEffort    string         `json:"reasoning_effort"`
	ChatTemplateKwargs map[string]any `json:"chat_template_kwargs"`
}

type chatInMessage struct {
	Role             string               `json:"role"`
	Content          json.RawMessage      `json:"content"`
	Name             string               `json:"name"`
	ToolCalls        []proxy.ChatToolCall `json:"tool_calls"`
	ToolCallID       string               `json:"tool_call_id"`
	ReasoningContent string               `json:"reasoning_content"`
	Reasoning        string               `json:"reasoning"`
}

func (Chat) Decode(_ *http.Request, body []byte) (*proxy.Request, error) {
	var in chatIn
	if err := gojson.Unmarshal(body, &in); err != nil {
		return nil, proxy.InvalidRequest("the request body is not a valid chat completions request: %v", err)
	}
	if in.Model == "" {
		return nil, proxy.InvalidRequest("missing required field: model")
	}
	if len(in.Messages) == 0 {
		return nil, proxy.InvalidRequest("missing required field: messages (at least one message)")
	}
	out := proxy.ChatRequest{
		Model: in.Model, Tools: in.Tools, ToolChoice: in.ToolChoice, ParallelToolCalls: in.ParallelToolCalls,
		Temperature: in.Temperature, TopP: in.TopP, N: in.N, Stream: in.Stream, ChatTemplateKwargs: in.ChatTemplateKwargs,
	}
	out.MaxCompletionTokens = in.MaxCompletionTokens
	if out.MaxCompletionTokens == nil {
		out.MaxCompletionTokens = in.MaxTokens
	}
	if len(in.Stop) > 0 && string(in.Stop) != "null" {
		var one string
		if json.Unmarshal(in.Stop, &one) == nil {
			out.Stop = []string{one}
		} else if err := json.Unmarshal(in.Stop, &out.Stop); err != nil {
			return nil, proxy.InvalidRequest("stop must be a string or an array of strings")
		}
	}
	switch in.ReasoningEffort {
	case "none", "minimal":
		out.ChatTemplateKwargs = withKwarg(out.ChatTemplateKwargs, "enable_thinking", false)
	case "low", "medium", "high":
		out.ChatTemplateKwargs = withKwarg(out.ChatTemplateKwargs, "enable_thinking", true)
	}
	for i, m := range in.Messages {
		cm := proxy.ChatMessage{Role: m.Role, Name: m.Name, ToolCalls: m.ToolCalls, ToolCallID: m.ToolCallID, ReasoningContent: m.ReasoningContent}
		if cm.ReasoningContent == "" {
			cm.ReasoningContent = m.Reasoning
		}
		switch m.Role {
		case "developer":
			cm.Role = "system"
		case "system", "user", "assistant", "tool":
		default:
			return nil, proxy.InvalidRequest("messages[%d].role %q is not one of system, developer, user, assistant, tool", i, m.Role)
		}
		content, err := chatContent(m.Content)
		if err != nil {
			return nil, proxy.InvalidRequest("messages[%d].content: %v", i, err)
		}
		cm.Content = content
		out.Messages = append(out.Messages, cm)
	}
	st := chatState{includeUsage: in.StreamOptions != nil && in.StreamOptions.IncludeUsage}
	return &proxy.Request{Chat: out, Model: in.Model, Stream: in.Stream, State: st}, nil
}

func withKwarg(m map[string]any, k string, v any) map[string]any {
	out := map[string]any{k: v}
	for key, val := range m {
		if key != k {
			out[key] = val
		}
	}
	return out
}

// chatContent keeps a string as a string and a parts list as ChatParts; text-only part
// lists become one string, as the chat template would join them anyway.
func chatContent(raw json.RawMessage) (any, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	if raw[0] == '"' {
		var s string
		if err := gojson.Unmarshal(raw, &s); err != nil {
			return nil, fmt.Errorf("must be a string or an array of content parts")
		}
		return s, nil
	}
	var parts []proxy.ChatPart
	if err := gojson.Unmarshal(raw, &parts); err != nil {
		return nil, fmt.Errorf("must be a string or an array of content parts")
	}
	var text strings.Builder
	for i, p := range parts {
		switch p.Type {
		case "text", "input_text", "output_text":
			text.WriteString(p.Text)
		case "image_url":
			if p.ImageURL == nil || p.ImageURL.URL == "" {
				return nil, fmt.Errorf("part %d: image_url needs a url", i)
			}
			return parts, nil
		default:
			return nil, fmt.Errorf("part %d has unknown type %q", i, p.Type)
		}
	}
	return text.String(), nil
}

func newID(prefix string) string {
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// chatOutMessage is an assistant message as Chat Completions returns it.
type chatOutMessage struct {
	Role             string               `json:"role"`
	Content          *string              `json:"content"`
	ReasoningContent string               `json:"reasoning_content,omitempty"`
	ToolCalls        []proxy.ChatToolCall `json:"tool_calls,omitempty"`
}

func chatOut(m proxy.ChatMessage) chatOutMessage {
	out := chatOutMessage{Role: "assistant", ReasoningContent: m.ReasoningContent, ToolCalls: m.ToolCalls}
	if s, _ := m.Content.(string); s != "" || len(m.ToolCalls) == 0 {
		out.Content = &s
	}
	return out
}

func (Chat) WriteResponse(w http.ResponseWriter, req *proxy.Request, res *proxy.Response) error {
	type choice struct {
		Index        int            `json:"index"`
		Message      chatOutMessage `json:"message"`
		FinishReason string         `json:"finish_reason"`
		Logprobs     any            `json:"logprobs"`
	}
	var choices []choice
	for _, c := range res.Choices {
		choices = append(choices, choice{Index: c.Index, Message: chatOut(c.Message), FinishReason: c.FinishReason})
	}
	id := res.ID
	if id == "" {
		id = newID("chatcmpl-")
	}
	return proxy.WriteJSON(w, http.StatusOK, map[string]any{
		"id": id, "object": "chat.completion", "created": time.Now().Unix(), "model": req.Model,
		"choices": choices, "usage": res.Usage,
	})
}

type chatStream struct {
	sse     *proxy.SSEWriter
	req     *proxy.Request
	id      string
	created int64
	started bool
}

func (Chat) NewStream(w http.ResponseWriter, req *proxy.Request) proxy.Stream {
	return &chatStream{sse: proxy.NewSSE(w), req: req, id: newID("chatcmpl-"), created: time.Now().Unix()}
}

// chatChunk is one chat.completion.chunk.
type chatChunk struct {
	ID      string            `json:"id"`
	Object  string            `json:"object"`
	Created int64             `json:"created"`
	Model   string            `json:"model"`
	Choices []chatChunkChoice `json:"choices"`
	Usage   *proxy.Usage      `json:"usage,omitempty"`
}

type chatChunkChoice struct {
	Index        int            `json:"index"`
	Delta        map[string]any `json:"delta"`
	FinishReason *string        `json:"finish_reason"`
	Logprobs     any            `json:"logprobs"`
}

func (s *chatStream) chunk(delta map[string]any, finish *string, usage *proxy.Usage) error {
	c := chatChunk{ID: s.id, Object: "chat.completion.chunk", Created: s.created, Model: s.req.Model, Choices: []chatChunkChoice{}, Usage: usage}
	if delta != nil {
		c.Choices = append(c.Choices, chatChunkChoice{Delta: delta, FinishReason: finish})
	}
	return s.sse.Event("", c)
}

func (s *chatStream) start() error {
	if s.started {
		return nil
	}
	s.started = true
	return s.chunk(map[string]any{"role": "assistant", "content": ""}, nil, nil)
}

func (s *chatStream) Delta(d proxy.Delta) error {
	if err := s.start(); err != nil {
		return err
	}
	if d.Reasoning != "" {
		if err := s.chunk(map[string]any{"reasoning_content": d.Reasoning}, nil, nil); err != nil {
			return err
		}
	}
	if d.Content != "" {
		if err := s.chunk(map[string]any{"content": d.Content}, nil, nil); err != nil {
			return err
		}
	}
	if len(d.ToolCalls) > 0 {
		var calls []map[string]any
		for _, tc := range d.ToolCalls {
			fn := map[string]any{"arguments": tc.Arguments}
			call := map[string]any{"index": tc.Index, "function": fn}
			if tc.ID != "" {
				call["id"], call["type"] = tc.ID, "function"
			}
			if tc.Name != "" {
				fn["name"] = tc.Name
			}
			calls = append(calls, call)
		}
		return s.chunk(map[string]any{"tool_calls": calls}, nil, nil)
	}
	return nil
}

func (s *chatStream) End(finish string, usage proxy.Usage) error {
	if err := s.start(); err != nil {
		return err
	}
	if err := s.chunk(map[string]any{}, &finish, nil); err != nil {
		return err
	}
	if st, _ := s.req.State.(chatState); st.includeUsage {
		if err := s.chunk(nil, nil, &usage); err != nil {
			return err
		}
	}
	return s.sse.Raw("", "[DONE]")
}

func (s *chatStream) Fail(err *proxy.Error) error {
	if e := s.sse.Event("", map[string]any{"error": chatErrorBody(err)}); e != nil {
		return e
	}
	return s.sse.Raw("", "[DONE]")
}

func chatErrorBody(err *proxy.Error) map[string]any {
	typ, code := "invalid_request_error", any(nil)
	msg := err.Message
	switch err.Kind {
	case proxy.ErrAuthentication:
		typ, code = "authentication_error", "invalid_api_key"
	case proxy.ErrNotFound:
		typ, code = "invalid_request_error", "not_found"
	case proxy.ErrTooLarge:
		code = "request_too_large"
	case proxy.ErrContextLength:
		code = "context_length_exceeded"
		if err.MaxTokens > 0 && err.PromptTokens > 0 {
			msg = fmt.Sprintf("This model's maximum context length is %d tokens. However, your messages resulted in %d tokens. Please reduce the length of the messages.", err.MaxTokens, err.PromptTokens)
		}
	case proxy.ErrUpstreamUnavailable, proxy.ErrInternal:
		typ = "server_error"
	case proxy.ErrOverloaded:
		typ, code = "server_error", "overloaded"
	}
	return map[string]any{"message": msg, "type": typ, "param": nil, "code": code}
}

func (Chat) WriteError(w http.ResponseWriter, err *proxy.Error) {
	_ = proxy.WriteJSON(w, err.Status, map[string]any{"error": chatErrorBody(err)})
}

func (Chat) WriteModels(w http.ResponseWriter, models []string) {
	data := []map[string]any{}
	for _, m := range models {
		data = append(data, map[string]any{"id": m, "object": "model", "created": 0, "owned_by": "floe"})
	}
	_ = proxy.WriteJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}
