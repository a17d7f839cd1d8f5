// Package proxy is the model-API boundary: it serves the provider APIs coding-agent
// harnesses speak (Anthropic Messages, OpenAI Chat Completions and Responses, Google
// Gemini), normalizes every request to OpenAI Chat Completions for the inference engine
// (vLLM or SGLang) with its token-id flags, translates the answer back — streamed as the
// caller's own SSE events — and records each call with its prompt ids, sampled ids and
// log-probabilities.
//
// A Dialect translates one provider API; an Engine talks to one inference server. Both
// meet in the normalized types of this file. This package holds what every call shares
// (routing, session keys, the weight-sync gate, recording, SSE); the dialects live in
// proxy/anthropic, proxy/openai and proxy/gemini, decoding requests with proxy/reqjson,
// the engines in proxy/vllm and proxy/sglang, and proxy/providers assembles them. They
// import this package, never the other way round.
package proxy

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
)

// ChatRequest is the normalized request: OpenAI Chat Completions as vLLM accepts it. The
// engine adds its token-id flags and replaces Model with the served model.
type ChatRequest struct {
	Model               string          `json:"model"`
	Messages            []ChatMessage   `json:"messages"`
	Tools               []ChatTool      `json:"tools,omitempty"`
	ToolChoice          json.RawMessage `json:"tool_choice,omitempty"` // "auto", "none", "required" or {"type":"function","function":{"name":...}}
	ParallelToolCalls   *bool           `json:"parallel_tool_calls,omitempty"`
	MaxCompletionTokens *int            `json:"max_completion_tokens,omitempty"`
	Temperature         *float64        `json:"temperature,omitempty"`
	TopP                *float64        `json:"top_p,omitempty"`
	Stop                []string        `json:"stop,omitempty"`
	N                   *int            `json:"n,omitempty"`
	Stream              bool            `json:"stream,omitempty"`
	// ChatTemplateKwargs carries reasoning on/off to the chat template:
	// {"enable_thinking": false} when the caller turned thinking off.
	ChatTemplateKwargs map[string]any `json:"chat_template_kwargs,omitempty"`
	// TopK and MinP are sent only under -sampling force (top_k -1, min_p 0: no
	// truncation), so that a model's generation config cannot truncate the distribution
	// behind floe's back; no dialect forwards a caller's. vLLM and SGLang both take these
	// names and values.
	TopK *int     `json:"top_k,omitempty"`
	MinP *float64 `json:"min_p,omitempty"`
}

// ChatMessage is one message of the conversation. Content is a string or a list of parts
// (ChatPart) for user messages with images; for assistant and tool messages floe always
// uses a plain string.
type ChatMessage struct {
	Role             string         `json:"role"` // system, user, assistant, tool
	Content          any            `json:"content"`
	Name             string         `json:"name,omitempty"`
	ToolCalls        []ChatToolCall `json:"tool_calls,omitempty"`
	ToolCallID       string         `json:"tool_call_id,omitempty"`
	ReasoningContent string         `json:"reasoning_content,omitempty"` // vLLM's reasoning field; the chat template renders it as <think>…</think>
}

// ChatPart is one part of a multi-part content list.
type ChatPart struct {
	Type     string        `json:"type"` // text, image_url
	Text     string        `json:"text,omitempty"`
	ImageURL *ChatImageURL `json:"image_url,omitempty"`
}

// ChatImageURL is an image by URL or data: URI.
type ChatImageURL struct {
	URL string `json:"url"`
}

// ChatToolCall is a function call the model made.
type ChatToolCall struct {
	ID       string           `json:"id"`
	Type     string           `json:"type"` // function
	Function ChatFunctionCall `json:"function"`
}

// ChatFunctionCall names the function and carries its arguments as a JSON string.
type ChatFunctionCall struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// ChatTool is a function the model may call.
type ChatTool struct {
	Type     string       `json:"type"` // function
	Function ChatFunction `json:"function"`
}

// ChatFunction declares a tool's name, description and JSON-schema parameters.
type ChatFunction struct {
	Name        string          `json:"name"`
	Description string          `json:"description,omitempty"`
	Parameters  json.RawMessage `json:"parameters,omitempty"`
}

// Usage counts tokens as the upstream reported them.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// Finish reasons, normalized to OpenAI's.
const (
	FinishStop      = "stop"
	FinishLength    = "length"
	FinishToolCalls = "tool_calls"
	FinishFilter    = "content_filter"
)

// Choice is one complete answer.
type Choice struct {
	Index        int
	Message      ChatMessage // role assistant; Content a string ("" when none)
	FinishReason string
	// StopSequence is the stop string of the request that ended the answer (FinishStop),
	// "" when none did (an end-of-sequence or stop token, or any other finish). Anthropic
	// answers it as stop_reason "stop_sequence" with stop_sequence set.
	StopSequence string
}

// Finish is how a streamed answer ended: its normalized finish reason and the stop
// string that ended it, as Choice holds them.
type Finish struct {
	Reason       string
	StopSequence string
}

// Finish is how c ended.
func (c Choice) Finish() Finish { return Finish{Reason: c.FinishReason, StopSequence: c.StopSequence} }

// Response is a complete, non-streamed answer.
type Response struct {
	ID      string
	Choices []Choice
	Usage   Usage
}

// Delta is one streamed increment of choice 0: text, reasoning, or tool-call fragments.
type Delta struct {
	Content   string
	Reasoning string
	ToolCalls []ToolCallDelta
}

// ToolCallDelta is a fragment of one tool call. The first fragment of a call carries its
// ID and Name; later ones only more Arguments.
type ToolCallDelta struct {
	Index     int
	ID        string
	Name      string
	Arguments string
}

// Request is a caller's request after decoding.
type Request struct {
	Chat   ChatRequest // what goes upstream
	Model  string      // the model the caller asked for, echoed back in answers
	Stream bool
	// State is the dialect's own data from Decode to the writers.
	State any
}

// ErrorKind classifies an error so each dialect can render its provider's own type.
type ErrorKind string

const (
	ErrInvalidRequest      ErrorKind = "invalid_request"
	ErrAuthentication      ErrorKind = "authentication"
	ErrNotFound            ErrorKind = "not_found"
	ErrTooLarge            ErrorKind = "too_large"
	ErrContextLength       ErrorKind = "context_length" // the prompt exceeds the model's context
	ErrUpstreamUnavailable ErrorKind = "upstream_unavailable"
	ErrOverloaded          ErrorKind = "overloaded"
	ErrInternal            ErrorKind = "internal"
	// ErrTimeout: the inference server ran past one of floe's upstream deadlines (504).
	ErrTimeout ErrorKind = "timeout"
	// ErrCapacity: floe is serving its -max-inflight calls already. Status 0: each
	// dialect answers its provider's own overloaded shape (Anthropic 529
	// overloaded_error, OpenAI 429, Gemini 429 RESOURCE_EXHAUSTED).
	ErrCapacity ErrorKind = "capacity"
)

// Error is an error to show the caller in its provider's shape, with Status as HTTP status.
type Error struct {
	Status  int
	Kind    ErrorKind
	Message string
	// For ErrContextLength, when the upstream said: the prompt's tokens and the limit.
	PromptTokens, MaxTokens int
	// CompletionTokens, for ErrContextLength, is the completion budget (max_tokens) the
	// request asked for when that budget, alone or with the prompt, is what exceeds the
	// context; 0 when the prompt alone does. Harnesses answer the two differently: Claude
	// Code lowers max_tokens for the one and compacts its history for the other.
	CompletionTokens int
}

func (e *Error) Error() string { return string(e.Kind) + ": " + e.Message }

// Dialect is one provider API as callers speak it.
type Dialect interface {
	// Name is the API kind recorded with each call: anthropic, openai_chat,
	// openai_responses or gemini.
	Name() string
	// Decode parses the caller's request (body, and for Gemini the path and query, which
	// carry the model and the stream flag) into the normalized request. It returns an
	// *Error of kind ErrInvalidRequest naming what is wrong.
	Decode(r *http.Request, body []byte) (*Request, error)
	// WriteResponse writes a complete answer.
	WriteResponse(w http.ResponseWriter, req *Request, res *Response) error
	// NewStream starts a streamed answer: SSE headers now, events as deltas arrive.
	NewStream(w http.ResponseWriter, req *Request) Stream
	// WriteError writes err in the provider's error shape.
	WriteError(w http.ResponseWriter, err *Error)
	// WriteModels answers the provider's list-models call.
	WriteModels(w http.ResponseWriter, models []string)

	// Routes are the paths the dialect serves (proxy/route.go).
	Routes() []Route
	// Claims says how strongly a request to a path floe does not serve looks like this
	// provider's, by its headers or its body's shape (nil when unread or not JSON), so
	// that its 404 takes this dialect's error shape.
	Claims(r *http.Request, body map[string]json.RawMessage) Claim
	// Key is the API key the caller sent (APIKey for every built-in dialect).
	Key(r *http.Request) string
	// Client names the provider in a session's base_urls.
	Client() Client
}

// TokenCounter is implemented by dialects with a token-counting endpoint (Anthropic's
// count_tokens, Gemini's countTokens).
type TokenCounter interface {
	WriteCount(w http.ResponseWriter, req *Request, tokens int)
}

// Stream writes one streamed answer. Calls come in order: any number of Delta, then
// exactly one of End or Fail. Each event is flushed to the caller as it is written.
type Stream interface {
	Delta(d Delta) error
	End(finish Finish, usage Usage) error
	// Fail ends a stream whose headers are already sent with an error event.
	Fail(err *Error) error
}

// InvalidRequest is a 400 naming what is wrong with the caller's request.
func InvalidRequest(format string, args ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Kind: ErrInvalidRequest, Message: fmt.Sprintf(format, args...)}
}

// ContentText is a message's content as text: a string as it is, parts' text joined.
func ContentText(c any) string {
	switch v := c.(type) {
	case string:
		return v
	case []ChatPart:
		var b strings.Builder
		for _, p := range v {
			b.WriteString(p.Text)
		}
		return b.String()
	}
	return ""
}
