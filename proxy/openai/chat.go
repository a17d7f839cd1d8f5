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
	"github.com/floe-rl/floe/proxy/reqjson"
)

// Chat is the OpenAI Chat Completions API (/v1/chat/completions): the upstream's own
// dialect, so decoding is mostly validation and encoding mostly renaming the model back.
type Chat struct{}

var _ proxy.Dialect = Chat{}

func (Chat) Name() string { return "openai_chat" }

// chatState is what the writers need from the request.
type chatState struct {
	includeUsage bool
}

// Decode reads a Chat Completions request as callers send it: stop may be a string, the
// token limit has two names, developer is a system role, reasoning_effort may turn
// thinking off.
func (Chat) Decode(_ *http.Request, body []byte) (*proxy.Request, error) {
	top, err := reqjson.Parse(body)
	if err != nil {
		return nil, err
	}
	model, err := top.Get("model").NonEmptyString()
	if err != nil {
		return nil, err
	}
	msgv := top.Get("messages")
	msgs, err := msgv.Array()
	if err != nil {
		return nil, err
	}
	if len(msgs) == 0 {
		return nil, msgv.Errorf("required (at least one message)")
	}
	out := proxy.ChatRequest{Model: model, ToolChoice: top.Get("tool_choice").Raw()}
	if out.Tools, err = chatTools(top.Get("tools")); err != nil {
		return nil, err
	}
	if pv := top.Get("parallel_tool_calls"); !pv.IsNull() {
		b, err := pv.Bool()
		if err != nil {
			return nil, err
		}
		out.ParallelToolCalls = &b
	}
	if out.MaxCompletionTokens, err = top.Get("max_completion_tokens").Int(); err != nil {
		return nil, err
	}
	maxTokens, err := top.Get("max_tokens").Int()
	if err != nil {
		return nil, err
	}
	if out.MaxCompletionTokens == nil {
		out.MaxCompletionTokens = maxTokens
	}
	if out.Temperature, err = top.Get("temperature").Number(); err != nil {
		return nil, err
	}
	if out.TopP, err = top.Get("top_p").Number(); err != nil {
		return nil, err
	}
	if out.N, err = top.Get("n").Int(); err != nil {
		return nil, err
	}
	if out.Stream, err = top.Get("stream").Bool(); err != nil {
		return nil, err
	}
	switch stop := top.Get("stop"); stop.Kind() {
	case reqjson.String:
		s, err := stop.String()
		if err != nil {
			return nil, err
		}
		out.Stop = []string{s}
	case reqjson.Null, reqjson.Array:
		if out.Stop, err = stop.Strings(); err != nil {
			return nil, err
		}
	default:
		return nil, stop.Wrong("string or array of strings")
	}
	so, err := top.Get("stream_options").Object()
	if err != nil {
		return nil, err
	}
	includeUsage, err := so.Get("include_usage").Bool()
	if err != nil {
		return nil, err
	}
	kw := top.Get("chat_template_kwargs")
	if _, err := kw.Object(); err != nil {
		return nil, err
	}
	if !kw.IsNull() {
		if err := json.Unmarshal(kw.Raw(), &out.ChatTemplateKwargs); err != nil {
			return nil, kw.Errorf("malformed object: %v", err)
		}
	}
	effort, err := top.Get("reasoning_effort").String()
	if err != nil {
		return nil, err
	}
	switch effort {
	case "none", "minimal":
		out.ChatTemplateKwargs = withKwarg(out.ChatTemplateKwargs, "enable_thinking", false)
	case "low", "medium", "high":
		out.ChatTemplateKwargs = withKwarg(out.ChatTemplateKwargs, "enable_thinking", true)
	}
	for _, mv := range msgs {
		cm, err := chatMessage(mv)
		if err != nil {
			return nil, err
		}
		out.Messages = append(out.Messages, cm)
	}
	return &proxy.Request{Chat: out, Model: model, Stream: out.Stream, State: chatState{includeUsage: includeUsage}}, nil
}

// chatMessage reads one message; developer is a system role, reasoning another name of
// reasoning_content.
func chatMessage(v reqjson.Value) (proxy.ChatMessage, error) {
	var cm proxy.ChatMessage
	m, err := v.Object()
	if err != nil {
		return cm, err
	}
	rolev := m.Get("role")
	if cm.Role, err = rolev.String(); err != nil {
		return cm, err
	}
	switch cm.Role {
	case "developer":
		cm.Role = "system"
	case "system", "user", "assistant", "tool":
	default:
		return cm, rolev.Errorf("%q is not one of system, developer, user, assistant, tool", cm.Role)
	}
	for _, f := range []struct {
		key string
		to  *string
	}{{"name", &cm.Name}, {"tool_call_id", &cm.ToolCallID}, {"reasoning_content", &cm.ReasoningContent}} {
		if *f.to, err = m.Get(f.key).String(); err != nil {
			return cm, err
		}
	}
	if cm.ReasoningContent == "" {
		if cm.ReasoningContent, err = m.Get("reasoning").String(); err != nil {
			return cm, err
		}
	}
	if cm.ToolCalls, err = chatToolCalls(m.Get("tool_calls")); err != nil {
		return cm, err
	}
	cm.Content, err = chatContent(m.Get("content"))
	return cm, err
}

// chatToolCalls reads an assistant message's tool calls.
func chatToolCalls(v reqjson.Value) ([]proxy.ChatToolCall, error) {
	elems, err := v.Array()
	if err != nil {
		return nil, err
	}
	var out []proxy.ChatToolCall
	for _, e := range elems {
		c, err := e.Object()
		if err != nil {
			return nil, err
		}
		var tc proxy.ChatToolCall
		if tc.ID, err = c.Get("id").String(); err != nil {
			return nil, err
		}
		if tc.Type, err = c.Get("type").String(); err != nil {
			return nil, err
		}
		fn, err := c.Get("function").Object()
		if err != nil {
			return nil, err
		}
		if tc.Function.Name, err = fn.Get("name").String(); err != nil {
			return nil, err
		}
		if tc.Function.Arguments, err = fn.Get("arguments").String(); err != nil {
			return nil, err
		}
		out = append(out, tc)
	}
	return out, nil
}

// chatTools reads the tools, forwarded as they are.
func chatTools(v reqjson.Value) ([]proxy.ChatTool, error) {
	elems, err := v.Array()
	if err != nil {
		return nil, err
	}
	var out []proxy.ChatTool
	for _, e := range elems {
		t, err := e.Object()
		if err != nil {
			return nil, err
		}
		var ct proxy.ChatTool
		if ct.Type, err = t.Get("type").String(); err != nil {
			return nil, err
		}
		fn, err := t.Get("function").Object()
		if err != nil {
			return nil, err
		}
		if ct.Function.Name, err = fn.Get("name").String(); err != nil {
			return nil, err
		}
		if ct.Function.Description, err = fn.Get("description").String(); err != nil {
			return nil, err
		}
		ct.Function.Parameters = fn.Get("parameters").Raw()
		out = append(out, ct)
	}
	return out, nil
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
func chatContent(v reqjson.Value) (any, error) {
	switch v.Kind() {
	case reqjson.Null:
		return "", nil
	case reqjson.String:
		return v.String()
	case reqjson.Array:
	default:
		return nil, v.Wrong("string or array of content parts")
	}
	elems, err := v.Array()
	if err != nil {
		return nil, err
	}
	parts := make([]proxy.ChatPart, 0, len(elems))
	var text strings.Builder
	image := false
	for _, e := range elems {
		po, err := e.Object()
		if err != nil {
			return nil, err
		}
		var p proxy.ChatPart
		typv := po.Get("type")
		if p.Type, err = typv.String(); err != nil {
			return nil, err
		}
		if p.Text, err = po.Get("text").String(); err != nil {
			return nil, err
		}
		switch p.Type {
		case "text", "input_text", "output_text":
			text.WriteString(p.Text)
		case "image_url":
			iv := po.Get("image_url")
			img, err := iv.Object()
			if err != nil {
				return nil, err
			}
			url, err := img.Get("url").String()
			if err != nil {
				return nil, err
			}
			if url == "" {
				return nil, iv.Errorf("needs a url")
			}
			p.ImageURL = &proxy.ChatImageURL{URL: url}
			image = true
		default:
			return nil, typv.Errorf("unknown content part type %q", p.Type)
		}
		parts = append(parts, p)
	}
	if image {
		return parts, nil
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
	Index        int     `json:"index"`
	Delta        any     `json:"delta"` // a map, or contentDelta / reasoningDelta
	FinishReason *string `json:"finish_reason"`
	Logprobs     any     `json:"logprobs"`
}

// contentDelta and reasoningDelta are the deltas of most chunks, encoded from a struct
// rather than a map (half the cost; the same bytes as map[string]any{"content": …}).
type contentDelta struct {
	Content string `json:"content"`
}

type reasoningDelta struct {
	ReasoningContent string `json:"reasoning_content"`
}

// toolCallsDelta is a chunk's tool-call fragments; its fields are in the order of their
// names, as the map it replaces was encoded: the first fragment of a call carries its id
// and type, and a name when it has one.
type toolCallsDelta struct {
	ToolCalls []toolCallDelta `json:"tool_calls"`
}

type toolCallDelta struct {
	Function toolCallFunctionDelta `json:"function"`
	ID       string                `json:"id,omitempty"`
	Index    int                   `json:"index"`
	Type     string                `json:"type,omitempty"`
}

type toolCallFunctionDelta struct {
	Arguments string `json:"arguments"`
	Name      string `json:"name,omitempty"`
}

func (s *chatStream) chunk(delta any, finish *string, usage *proxy.Usage) error {
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
		if err := s.chunk(reasoningDelta{d.Reasoning}, nil, nil); err != nil {
			return err
		}
	}
	if d.Content != "" {
		if err := s.chunk(contentDelta{d.Content}, nil, nil); err != nil {
			return err
		}
	}
	if len(d.ToolCalls) > 0 {
		calls := make([]toolCallDelta, 0, len(d.ToolCalls))
		for _, tc := range d.ToolCalls {
			call := toolCallDelta{Function: toolCallFunctionDelta{Arguments: tc.Arguments, Name: tc.Name}, ID: tc.ID, Index: tc.Index}
			if tc.ID != "" {
				call.Type = "function"
			}
			calls = append(calls, call)
		}
		return s.chunk(toolCallsDelta{calls}, nil, nil)
	}
	return nil
}

func (s *chatStream) End(finish proxy.Finish, usage proxy.Usage) error {
	if err := s.start(); err != nil {
		return err
	}
	if err := s.chunk(map[string]any{}, &finish.Reason, nil); err != nil {
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
		// OpenAI's own wordings, with its code: SDK users and harnesses match on these.
		code = "context_length_exceeded"
		switch {
		case err.MaxTokens > 0 && err.CompletionTokens > 0 && err.PromptTokens > 0 && err.PromptTokens < err.MaxTokens:
			// The prompt fits; with max_tokens it does not.
			msg = fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.",
				err.MaxTokens, err.PromptTokens+err.CompletionTokens, err.PromptTokens, err.CompletionTokens)
		case err.MaxTokens > 0 && err.CompletionTokens > 0 && err.PromptTokens == 0:
			msg = fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens in the completion. Please reduce the length of the completion.",
				err.MaxTokens, err.CompletionTokens)
		case err.MaxTokens > 0 && err.PromptTokens > 0:
			msg = fmt.Sprintf("This model's maximum context length is %d tokens. However, your messages resulted in %d tokens. Please reduce the length of the messages.", err.MaxTokens, err.PromptTokens)
		}
	case proxy.ErrUpstreamUnavailable, proxy.ErrInternal:
		typ = "server_error"
	case proxy.ErrOverloaded:
		typ, code = "server_error", "overloaded"
	case proxy.ErrCapacity:
		typ, code = "requests", "rate_limit_exceeded"
	case proxy.ErrTimeout:
		typ, code = "server_error", "timeout"
	}
	return map[string]any{"message": msg, "type": typ, "param": nil, "code": code}
}

// errorStatus is err's HTTP status; floe's -max-inflight cap (no status of its own) is
// OpenAI's 429.
func errorStatus(err *proxy.Error) int {
	switch {
	case err.Status != 0:
		return err.Status
	case err.Kind == proxy.ErrCapacity:
		return http.StatusTooManyRequests
	case err.Kind == proxy.ErrTimeout:
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

func (Chat) WriteError(w http.ResponseWriter, err *proxy.Error) {
	_ = proxy.WriteJSON(w, errorStatus(err), map[string]any{"error": chatErrorBody(err)})
}

func (Chat) WriteModels(w http.ResponseWriter, models []string) {
	data := []map[string]any{}
	for _, m := range models {
		data = append(data, map[string]any{"id": m, "object": "model", "created": 0, "owned_by": "floe"})
	}
	_ = proxy.WriteJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}
