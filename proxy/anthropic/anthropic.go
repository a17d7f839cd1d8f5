// Package anthropic is the Anthropic Messages dialect of the proxy (POST /v1/messages,
// /v1/messages/count_tokens, GET /v1/models).
package anthropic

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"strconv"
	"strings"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/reqjson"
)

// Dialect is the Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens,
// GET /v1/models) as Claude Code and other harnesses speak it.
//
// Translation decisions, both ways:
//
//   - Thinking. floe signs each thinking block it returns with
//     "floe1." + standard base64 of the block's thinking text. The signature carries the
//     text itself, so when a harness echoes the block back floe restores exactly the
//     reasoning the model produced, even if the harness stripped or altered the thinking
//     text. A floe signature is authoritative; any other signature is accepted and the
//     block's thinking text is used. redacted_thinking blocks are restored the same way
//     when their data is a floe signature and skipped otherwise (foreign encrypted
//     reasoning means nothing to the served model). The thinking blocks of one assistant
//     message are concatenated without a separator into its ReasoningContent, which undoes
//     the split floe makes when reasoning resumes after text in a stream.
//   - Text. Text blocks of an assistant message are concatenated without a separator (again
//     undoing floe's own splits); text blocks of user and system content are joined with
//     "\n", as vLLM joins text parts. A user message with an image becomes a []ChatPart
//     list; otherwise its content is a string.
//   - Tool results become one "tool" message per tool_result, in block order: text blocks
//     before, between or after them become user messages at their place. Tool-result
//     content is always a string: text blocks joined with "\n", each image replaced by the
//     text "[image]" (served models are usually text-only, and a data URI as text would be
//     megabytes of tokens). is_error:true prefixes the content with "Error: " ("Error"
//     alone when empty) so the model sees the failure.
//   - Tool use. input is sent upstream as compact JSON arguments. Answers parse the
//     arguments back into input; arguments that are not a JSON object (invalid JSON from
//     the model) are returned as {"_raw": "<arguments>"}, and such an input is restored to
//     the raw string on the next request. Empty arguments read as {}. Streamed arguments
//     are forwarded as raw input_json_delta fragments, unchecked. Answers write inputs
//     without HTML escaping, and decoding undoes Go's \u003c-style escapes, so that
//     echoed arguments match what the model wrote.
//   - Sampling: max_tokens → max_completion_tokens, stop_sequences → stop, temperature and
//     top_p as they are; top_k, metadata, cache_control and thinking.budget_tokens are not
//     forwarded. thinking enabled (or adaptive) / disabled → chat_template_kwargs
//     enable_thinking true / false; absent, nothing.
//   - Unknown content blocks (server_tool_use, web_search_tool_result, …) are skipped, as
//     are server tools (a tool with a non-custom type and no input_schema). A tool_choice
//     without any forwarded tool, or naming a tool that was skipped, is dropped.
//   - Stop reasons: stop → end_turn, or stop_sequence with the matched string when one of
//     the request's stop_sequences ended the answer (vLLM's stop_reason, SGLang's
//     matched_stop), length → max_tokens, tool_calls → tool_use, content_filter →
//     refusal; a stop with tool calls is tool_use.
//   - Errors: invalid_request_error (400), authentication_error (401), permission_error
//     (403), not_found_error (404), request_too_large (413), rate_limit_error (429),
//     overloaded_error (ErrOverloaded, or any 503/529; 529 for floe's -max-inflight cap),
//     timeout_error (504, an upstream deadline), api_error otherwise (502, 500). A
//     context-length error reads as Anthropic words it, which Claude Code needs to compact:
//     400 invalid_request_error "prompt is too long: N tokens > M maximum". When the prompt
//     fits and only prompt + max_tokens does not (vLLM says so in both its wordings), it
//     reads "input length and `max_tokens` exceed context limit: N + T > M, …" instead:
//     Claude Code then retries with a smaller max_tokens, where "prompt is too long" would
//     make it give up (its default max_tokens exceeds a 32k window by itself).
type Dialect struct{}

var (
	_ proxy.Dialect      = Dialect{}
	_ proxy.TokenCounter = Dialect{}
)

// Name is the API kind recorded with each call.
func (Dialect) Name() string { return "anthropic" }

// ---- decoding ----

// Decode parses a Messages (or count_tokens) request body.
func (Dialect) Decode(_ *http.Request, body []byte) (*proxy.Request, error) {
	top, err := reqjson.Parse(body)
	if err != nil {
		return nil, err
	}
	model, err := top.Get("model").NonEmptyString()
	if err != nil {
		return nil, err
	}
	chat := proxy.ChatRequest{Model: model}

	if sysv := top.Get("system"); !sysv.IsNull() {
		sys, err := textContent(sysv)
		if err != nil {
			return nil, err
		}
		if sys != "" {
			chat.Messages = append(chat.Messages, proxy.ChatMessage{Role: "system", Content: sys})
		}
	}

	msgv := top.Get("messages")
	if err := msgv.Required(); err != nil {
		return nil, err
	}
	msgs, err := msgv.Array()
	if err != nil {
		return nil, err
	}
	if len(msgs) == 0 {
		return nil, msgv.Errorf("at least one message is required")
	}
	for _, m := range msgs {
		out, err := decodeMessage(m)
		if err != nil {
			return nil, err
		}
		chat.Messages = append(chat.Messages, out...)
	}

	forwarded := map[string]bool{}
	tools, err := top.Get("tools").Array()
	if err != nil {
		return nil, err
	}
	for _, tv := range tools {
		t, ok, err := decodeTool(tv)
		if err != nil {
			return nil, err
		}
		if ok {
			chat.Tools = append(chat.Tools, t)
			forwarded[t.Function.Name] = true
		}
	}

	if tcv := top.Get("tool_choice"); !tcv.IsNull() {
		choice, named, parallel, err := decodeToolChoice(tcv)
		if err != nil {
			return nil, err
		}
		if len(chat.Tools) > 0 && (named == "" || forwarded[named]) {
			chat.ToolChoice = choice
			chat.ParallelToolCalls = parallel
		}
	}

	maxv := top.Get("max_tokens")
	if chat.MaxCompletionTokens, err = maxv.Int(); err != nil {
		return nil, err
	}
	if n := chat.MaxCompletionTokens; n != nil && *n < 1 {
		return nil, maxv.Errorf("must be at least 1")
	}
	if chat.Temperature, err = top.Get("temperature").Number(); err != nil {
		return nil, err
	}
	if chat.TopP, err = top.Get("top_p").Number(); err != nil {
		return nil, err
	}
	if _, err = top.Get("top_k").Number(); err != nil { // checked, not forwarded
		return nil, err
	}
	if chat.Stop, err = top.Get("stop_sequences").Strings(); err != nil {
		return nil, err
	}
	if chat.Stream, err = top.Get("stream").Bool(); err != nil {
		return nil, err
	}
	th, err := top.Get("thinking").Object()
	if err != nil {
		return nil, err
	}
	typ, err := th.Get("type").String()
	if err != nil {
		return nil, err
	}
	if _, err := th.Get("budget_tokens").Number(); err != nil {
		return nil, err
	}
	switch typ {
	case "enabled", "adaptive":
		chat.ChatTemplateKwargs = map[string]any{"enable_thinking": true}
	case "disabled":
		chat.ChatTemplateKwargs = map[string]any{"enable_thinking": false}
	}
	return &proxy.Request{Chat: chat, Model: model, Stream: chat.Stream}, nil
}

// textContent reads a string or an array of text blocks (system content) as one string.
func textContent(v reqjson.Value) (string, error) {
	if v.Kind() == reqjson.String {
		return v.String()
	}
	if v.Kind() != reqjson.Array {
		return "", v.Wrong("string or array of content blocks")
	}
	blocks, err := v.Array()
	if err != nil {
		return "", err
	}
	var texts []string
	for _, bv := range blocks {
		b, typ, err := block(bv)
		if err != nil {
			return "", err
		}
		if typ != "text" {
			continue
		}
		t, err := b.Get("text").String()
		if err != nil {
			return "", err
		}
		texts = append(texts, t)
	}
	return strings.Join(texts, "\n"), nil
}

// block reads a content block and its type.
func block(v reqjson.Value) (reqjson.Fields, string, error) {
	b, err := v.Object()
	if err != nil {
		return b, "", err
	}
	typ, err := b.Get("type").NonEmptyString()
	return b, typ, err
}

// contentBlocks reads message content, which is required: a string is one text block.
func contentBlocks(v reqjson.Value) (text string, blocks []reqjson.Value, isString bool, err error) {
	switch v.Kind() {
	case reqjson.Null:
		return "", nil, false, v.Required()
	case reqjson.String:
		s, err := v.String()
		return s, nil, true, err
	case reqjson.Array:
		blocks, err := v.Array()
		return "", blocks, false, err
	}
	return "", nil, false, v.Wrong("string or array of content blocks")
}

func decodeMessage(v reqjson.Value) ([]proxy.ChatMessage, error) {
	m, err := v.Object()
	if err != nil {
		return nil, err
	}
	rolev := m.Get("role")
	role, err := rolev.NonEmptyString()
	if err != nil {
		return nil, err
	}
	content := m.Get("content")
	switch role {
	case "user":
		return decodeUser(content)
	case "assistant":
		msg, err := decodeAssistant(content)
		if err != nil {
			return nil, err
		}
		return []proxy.ChatMessage{msg}, nil
	case "system": // not Anthropic, but tolerated
		if err := content.Required(); err != nil {
			return nil, err
		}
		s, err := textContent(content)
		if err != nil {
			return nil, err
		}
		return []proxy.ChatMessage{{Role: "system", Content: s}}, nil
	}
	return nil, rolev.Errorf("must be \"user\" or \"assistant\", got %q", role)
}

func decodeUser(v reqjson.Value) ([]proxy.ChatMessage, error) {
	text, blocks, isString, err := contentBlocks(v)
	if err != nil {
		return nil, err
	}
	if isString {
		return []proxy.ChatMessage{{Role: "user", Content: text}}, nil
	}
	var out []proxy.ChatMessage
	var parts []proxy.ChatPart
	hasImage := false
	flush := func() {
		if len(parts) == 0 {
			return
		}
		out = append(out, proxy.ChatMessage{Role: "user", Content: userContent(parts, hasImage)})
		parts, hasImage = nil, false
	}
	for _, bv := range blocks {
		b, typ, err := block(bv)
		if err != nil {
			return nil, err
		}
		switch typ {
		case "text":
			t, err := b.Get("text").String()
			if err != nil {
				return nil, err
			}
			parts = append(parts, proxy.ChatPart{Type: "text", Text: t})
		case "image":
			url, err := imageURL(b.Get("source"))
			if err != nil {
				return nil, err
			}
			parts = append(parts, proxy.ChatPart{Type: "image_url", ImageURL: &proxy.ChatImageURL{URL: url}})
			hasImage = true
		case "document":
			t, err := documentText(b)
			if err != nil {
				return nil, err
			}
			parts = append(parts, proxy.ChatPart{Type: "text", Text: t})
		case "tool_result":
			flush()
			msg, err := decodeToolResult(b)
			if err != nil {
				return nil, err
			}
			out = append(out, msg)
		}
	}
	flush()
	if len(out) == 0 {
		out = append(out, proxy.ChatMessage{Role: "user", Content: ""})
	}
	return out, nil
}

// userContent is a string when the parts are all text, else the parts.
func userContent(parts []proxy.ChatPart, hasImage bool) any {
	if hasImage {
		return parts
	}
	texts := make([]string, len(parts))
	for i, p := range parts {
		texts[i] = p.Text
	}
	return strings.Join(texts, "\n")
}

// imageURL is an image source (required) as a URL or data: URI.
func imageURL(v reqjson.Value) (string, error) {
	if err := v.Required(); err != nil {
		return "", err
	}
	src, err := v.Object()
	if err != nil {
		return "", err
	}
	typv := src.Get("type")
	typ, err := typv.NonEmptyString()
	if err != nil {
		return "", err
	}
	switch typ {
	case "base64":
		mt, err := src.Get("media_type").NonEmptyString()
		if err != nil {
			return "", err
		}
		data, err := src.Get("data").NonEmptyString()
		if err != nil {
			return "", err
		}
		return "data:" + mt + ";base64," + data, nil
	case "url":
		return src.Get("url").NonEmptyString()
	}
	return "", typv.Errorf("unsupported image source %q (want base64 or url)", typ)
}

// documentText is a document block as text: its text source, else a placeholder.
func documentText(b reqjson.Fields) (string, error) {
	if sv := b.Get("source"); sv.Kind() == reqjson.Object {
		src, err := sv.Object()
		if err != nil {
			return "", err
		}
		if typ, _ := src.Get("type").String(); typ == "text" {
			return src.Get("data").String()
		}
	}
	return "[document]", nil
}

func decodeToolResult(b reqjson.Fields) (proxy.ChatMessage, error) {
	id, err := b.Get("tool_use_id").NonEmptyString()
	if err != nil {
		return proxy.ChatMessage{}, err
	}
	isErr, err := b.Get("is_error").Bool()
	if err != nil {
		return proxy.ChatMessage{}, err
	}
	var content string
	cv := b.Get("content")
	switch cv.Kind() {
	case reqjson.Null:
	case reqjson.String:
		if content, err = cv.String(); err != nil {
			return proxy.ChatMessage{}, err
		}
	case reqjson.Array:
		blocks, err := cv.Array()
		if err != nil {
			return proxy.ChatMessage{}, err
		}
		var texts []string
		for _, bv := range blocks {
			cb, typ, err := block(bv)
			if err != nil {
				return proxy.ChatMessage{}, err
			}
			switch typ {
			case "text":
				t, err := cb.Get("text").String()
				if err != nil {
					return proxy.ChatMessage{}, err
				}
				texts = append(texts, t)
			case "image":
				if _, err := imageURL(cb.Get("source")); err != nil {
					return proxy.ChatMessage{}, err
				}
				texts = append(texts, "[image]")
			case "document":
				t, err := documentText(cb)
				if err != nil {
					return proxy.ChatMessage{}, err
				}
				texts = append(texts, t)
			}
		}
		content = strings.Join(texts, "\n")
	default:
		return proxy.ChatMessage{}, cv.Wrong("string or array of content blocks")
	}
	if isErr {
		if content == "" {
			content = "Error"
		} else {
			content = "Error: " + content
		}
	}
	return proxy.ChatMessage{Role: "tool", Content: content, ToolCallID: id}, nil
}

func decodeAssistant(v reqjson.Value) (proxy.ChatMessage, error) {
	msg := proxy.ChatMessage{Role: "assistant", Content: ""}
	text, blocks, isString, err := contentBlocks(v)
	if err != nil {
		return msg, err
	}
	if isString {
		msg.Content = text
		return msg, nil
	}
	var content, reasoning strings.Builder
	for _, bv := range blocks {
		b, typ, err := block(bv)
		if err != nil {
			return msg, err
		}
		switch typ {
		case "text":
			t, err := b.Get("text").String()
			if err != nil {
				return msg, err
			}
			content.WriteString(t)
		case "thinking":
			t, err := b.Get("thinking").String()
			if err != nil {
				return msg, err
			}
			sig, err := b.Get("signature").String()
			if err != nil {
				return msg, err
			}
			if st, ok := proxy.ReasoningFromSignature(sig); ok {
				t = st
			}
			reasoning.WriteString(t)
		case "redacted_thinking":
			data, err := b.Get("data").String()
			if err != nil {
				return msg, err
			}
			if st, ok := proxy.ReasoningFromSignature(data); ok {
				reasoning.WriteString(st)
			}
		case "tool_use":
			id, err := b.Get("id").NonEmptyString()
			if err != nil {
				return msg, err
			}
			name, err := b.Get("name").NonEmptyString()
			if err != nil {
				return msg, err
			}
			args, err := arguments(b.Get("input"))
			if err != nil {
				return msg, err
			}
			msg.ToolCalls = append(msg.ToolCalls, proxy.ChatToolCall{
				ID: id, Type: "function", Function: proxy.ChatFunctionCall{Name: name, Arguments: args},
			})
		}
	}
	msg.Content = content.String()
	msg.ReasoningContent = reasoning.String()
	return msg, nil
}

// arguments turns a tool_use input into the arguments string: compact JSON, or the raw
// string floe wrapped as {"_raw": ...} because the model's arguments were not an object.
func arguments(v reqjson.Value) (string, error) {
	if v.IsNull() {
		return "{}", nil
	}
	var buf bytes.Buffer
	if err := json.Compact(&buf, v.Raw()); err != nil {
		return "", v.Errorf("malformed JSON")
	}
	if v.Kind() == reqjson.Object {
		if wrapped, err := v.Object(); err == nil && wrapped.Len() == 1 && wrapped.Get("_raw").Kind() == reqjson.String {
			if s, err := wrapped.Get("_raw").String(); err == nil {
				return s, nil
			}
		}
	}
	return unescapeHTML(buf.Bytes()), nil
}

// unescapeHTML undoes the escapes Go's encoder puts in JSON strings (\u003c, \u003e,
// \u0026, \u2028, \u2029) in compact JSON, so that arguments echoed by a Go client read as
// the model wrote them (a JavaScript client writes these characters as they are).
func unescapeHTML(b []byte) string {
	if !bytes.Contains(b, []byte(`\u`)) {
		return string(b)
	}
	var out strings.Builder
	for i := 0; i < len(b); i++ {
		if b[i] != '\\' || i+1 >= len(b) {
			out.WriteByte(b[i])
			continue
		}
		if b[i+1] == 'u' && i+6 <= len(b) {
			switch strings.ToLower(string(b[i+2 : i+6])) {
			case "003c":
				out.WriteByte('<')
				i += 5
				continue
			case "003e":
				out.WriteByte('>')
				i += 5
				continue
			case "0026":
				out.WriteByte('&')
				i += 5
				continue
			case "2028":
				out.WriteRune('\u2028')
				i += 5
				continue
			case "2029":
				out.WriteRune('\u2029')
				i += 5
				continue
			}
		}
		out.WriteByte(b[i]) // any other escape is kept whole
		out.WriteByte(b[i+1])
		i++
	}
	return out.String()
}

// decodeTool reads one tool; ok is false for server tools, which are not forwarded.
func decodeTool(v reqjson.Value) (proxy.ChatTool, bool, error) {
	t, err := v.Object()
	if err != nil {
		return proxy.ChatTool{}, false, err
	}
	typ, err := t.Get("type").String()
	if err != nil {
		return proxy.ChatTool{}, false, err
	}
	schema := t.Get("input_schema")
	if typ != "" && typ != "custom" && schema.IsNull() {
		return proxy.ChatTool{}, false, nil
	}
	name, err := t.Get("name").NonEmptyString()
	if err != nil {
		return proxy.ChatTool{}, false, err
	}
	desc, err := t.Get("description").String()
	if err != nil {
		return proxy.ChatTool{}, false, err
	}
	params := json.RawMessage(`{"type":"object","properties":{}}`)
	if !schema.IsNull() {
		if _, err := schema.Object(); err != nil {
			return proxy.ChatTool{}, false, err
		}
		var buf bytes.Buffer
		if err := json.Compact(&buf, schema.Raw()); err != nil {
			return proxy.ChatTool{}, false, schema.Errorf("malformed JSON")
		}
		params = buf.Bytes()
	}
	return proxy.ChatTool{Type: "function", Function: proxy.ChatFunction{Name: name, Description: desc, Parameters: params}}, true, nil
}

// decodeToolChoice maps tool_choice; named is the tool it forces, if any.
func decodeToolChoice(v reqjson.Value) (choice json.RawMessage, named string, parallel *bool, err error) {
	tc, err := v.Object()
	if err != nil {
		return nil, "", nil, err
	}
	typv := tc.Get("type")
	typ, err := typv.NonEmptyString()
	if err != nil {
		return nil, "", nil, err
	}
	disable, err := tc.Get("disable_parallel_tool_use").Bool()
	if err != nil {
		return nil, "", nil, err
	}
	if disable {
		f := false
		parallel = &f
	}
	switch typ {
	case "auto":
		choice = json.RawMessage(`"auto"`)
	case "any":
		choice = json.RawMessage(`"required"`)
	case "none":
		choice = json.RawMessage(`"none"`)
	case "tool":
		named, err = tc.Get("name").NonEmptyString()
		if err != nil {
			return nil, "", nil, err
		}
		choice, _ = json.Marshal(map[string]any{"type": "function", "function": map[string]string{"name": named}})
	default:
		return nil, "", nil, typv.Errorf("must be auto, any, tool or none, got %q", typ)
	}
	return choice, named, parallel, nil
}

// ---- answers ----

type messageUsage struct {
	InputTokens  int `json:"input_tokens"`
	OutputTokens int `json:"output_tokens"`
}

type message struct {
	ID           string       `json:"id"`
	Type         string       `json:"type"`
	Role         string       `json:"role"`
	Model        string       `json:"model"`
	Content      []any        `json:"content"`
	StopReason   *string      `json:"stop_reason"`
	StopSequence *string      `json:"stop_sequence"`
	Usage        messageUsage `json:"usage"`
}

type thinkingBlock struct {
	Type      string `json:"type"` // thinking
	Thinking  string `json:"thinking"`
	Signature string `json:"signature"`
}

type textBlock struct {
	Type string `json:"type"` // text
	Text string `json:"text"`
}

type toolUseBlock struct {
	Type  string          `json:"type"` // tool_use
	ID    string          `json:"id"`
	Name  string          `json:"name"`
	Input json.RawMessage `json:"input"`
}

// stopReason maps a normalized finish to Anthropic's stop_reason and stop_sequence: a
// stop string of the request that ended the answer is "stop_sequence" with that string
// (tool calls still win: the harness must run them); any other stop is end_turn with a
// null stop_sequence.
func stopReason(finish proxy.Finish, toolCalls bool) (reason string, sequence *string) {
	switch finish.Reason {
	case proxy.FinishLength:
		return "max_tokens", nil
	case proxy.FinishToolCalls:
		return "tool_use", nil
	case proxy.FinishFilter:
		return "refusal", nil
	}
	if toolCalls {
		return "tool_use", nil
	}
	if finish.Reason == proxy.FinishStop && finish.StopSequence != "" {
		seq := finish.StopSequence
		return "stop_sequence", &seq
	}
	return "end_turn", nil
}

// input turns arguments into a tool_use input: the JSON object, or {"_raw": arguments}.
func input(args string) json.RawMessage {
	if strings.TrimSpace(args) == "" {
		return json.RawMessage(`{}`)
	}
	if strings.HasPrefix(strings.TrimSpace(args), "{") && json.Valid([]byte(args)) {
		return json.RawMessage(args)
	}
	b, _ := json.Marshal(map[string]string{"_raw": args})
	return b
}

func modelOf(req *proxy.Request) string {
	if req == nil {
		return ""
	}
	return req.Model
}

func newID(prefix string) string { return prefix + rand.Text() }

// WriteResponse writes a complete answer as an Anthropic message.
func (Dialect) WriteResponse(w http.ResponseWriter, req *proxy.Request, res *proxy.Response) error {
	msg := message{
		ID: newID("msg_"), Type: "message", Role: "assistant", Model: modelOf(req),
		Content: []any{},
	}
	if res == nil {
		res = &proxy.Response{}
	}
	if res.ID != "" {
		msg.ID = "msg_" + res.ID
	}
	finish := proxy.Finish{Reason: proxy.FinishStop}
	var m proxy.ChatMessage
	if len(res.Choices) > 0 {
		m, finish = res.Choices[0].Message, res.Choices[0].Finish()
	}
	if m.ReasoningContent != "" {
		msg.Content = append(msg.Content, thinkingBlock{"thinking", m.ReasoningContent, proxy.ReasoningSignature(m.ReasoningContent)})
	}
	if text := proxy.ContentText(m.Content); text != "" {
		msg.Content = append(msg.Content, textBlock{"text", text})
	}
	for _, tc := range m.ToolCalls {
		id := tc.ID
		if id == "" {
			id = newID("toolu_")
		}
		msg.Content = append(msg.Content, toolUseBlock{"tool_use", id, tc.Function.Name, input(tc.Function.Arguments)})
	}
	stop, sequence := stopReason(finish, len(m.ToolCalls) > 0)
	msg.StopReason, msg.StopSequence = &stop, sequence
	msg.Usage = messageUsage{InputTokens: res.Usage.PromptTokens, OutputTokens: res.Usage.CompletionTokens}

	// Not proxy.WriteJSON: tool inputs are written byte for byte (no HTML escaping inside them),
	// so the harness echoes back exactly the arguments the model produced.
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(msg); err != nil {
		return fmt.Errorf("encoding anthropic message: %w", err)
	}
	return proxy.WriteJSONBytes(w, http.StatusOK, buf.Bytes())
}

// ---- errors, models, count ----

type errorDetail struct {
	Type    string `json:"type"`
	Message string `json:"message"`
}

type errorBody struct {
	Type  string      `json:"type"` // error
	Error errorDetail `json:"error"`
}

var (
	// Older vLLM (and the reference server): "… However, you requested 49177 tokens
	// (17177 in the messages, 32000 in the completion). …"
	oldBudgetRE = regexp.MustCompile(`\((\d+) in the messages, (\d+) in the completion\)`)
	// Newer vLLM: "'max_tokens' or 'max_completion_tokens' is too large: 32000. This
	// model's maximum context length is 32768 tokens and your request has 17177 input
	// tokens (32000 > 32768 - 17177)."
	budgetRE = regexp.MustCompile(`too large: (\d+)\.`)
	// "… your request has 17177 input tokens …" (both the budget and the prompt-only error)
	inputRE = regexp.MustCompile(`your request has (\d+) input tokens`)
)

// contextNumbers reads a context-length error's prompt tokens and, when the upstream
// named one, the completion budget (max_tokens) that pushed the request over the limit:
// the engine's numbers, else those of vLLM's words.
func contextNumbers(err *proxy.Error) (prompt, budget int) {
	prompt, budget = err.PromptTokens, err.CompletionTokens
	if budget > 0 {
		return prompt, budget
	}
	if m := oldBudgetRE.FindStringSubmatch(err.Message); m != nil {
		prompt, _ = strconv.Atoi(m[1])
		budget, _ = strconv.Atoi(m[2])
		return prompt, budget
	}
	if m := inputRE.FindStringSubmatch(err.Message); m != nil {
		prompt, _ = strconv.Atoi(m[1])
	}
	if m := budgetRE.FindStringSubmatch(err.Message); m != nil {
		budget, _ = strconv.Atoi(m[1])
	}
	return prompt, budget
}

// errorShape gives the HTTP status, Anthropic error type and message for err.
func errorShape(err *proxy.Error) (int, errorDetail) {
	if err == nil {
		err = &proxy.Error{Kind: proxy.ErrInternal, Message: "internal error"}
	}
	if err.Kind == proxy.ErrContextLength {
		prompt, budget := contextNumbers(err)
		// The prompt fits (or, max_tokens alone being over the limit, was not counted):
		// max_tokens is the problem.
		if budget > 0 && err.MaxTokens > 0 && prompt < err.MaxTokens {
			return http.StatusBadRequest, errorDetail{"invalid_request_error", fmt.Sprintf(
				"input length and `max_tokens` exceed context limit: %d + %d > %d, decrease input length or `max_tokens` and try again",
				prompt, budget, err.MaxTokens)}
		}
		msg := "prompt is too long"
		if prompt > 0 && err.MaxTokens > 0 {
			msg = fmt.Sprintf("prompt is too long: %d tokens > %d maximum", prompt, err.MaxTokens)
		} else if err.Message != "" {
			msg += ": " + err.Message
		}
		return http.StatusBadRequest, errorDetail{"invalid_request_error", msg}
	}
	status := err.Status
	if status == 0 {
		switch err.Kind {
		case proxy.ErrInvalidRequest:
			status = http.StatusBadRequest
		case proxy.ErrAuthentication:
			status = http.StatusUnauthorized
		case proxy.ErrNotFound:
			status = http.StatusNotFound
		case proxy.ErrTooLarge:
			status = http.StatusRequestEntityTooLarge
		case proxy.ErrUpstreamUnavailable:
			status = http.StatusBadGateway
		case proxy.ErrOverloaded, proxy.ErrCapacity:
			status = 529
		case proxy.ErrTimeout:
			status = http.StatusGatewayTimeout
		default:
			status = http.StatusInternalServerError
		}
	}
	var typ string
	switch err.Kind {
	case proxy.ErrInvalidRequest:
		typ = "invalid_request_error"
	case proxy.ErrAuthentication:
		typ = "authentication_error"
	case proxy.ErrNotFound:
		typ = "not_found_error"
	case proxy.ErrTooLarge:
		typ = "request_too_large"
	case proxy.ErrOverloaded, proxy.ErrCapacity:
		typ = "overloaded_error"
	case proxy.ErrTimeout:
		typ = "timeout_error"
	default: // upstream unavailable, internal, unknown kinds: by status
		switch status {
		case http.StatusBadRequest:
			typ = "invalid_request_error"
		case http.StatusUnauthorized:
			typ = "authentication_error"
		case http.StatusForbidden:
			typ = "permission_error"
		case http.StatusNotFound:
			typ = "not_found_error"
		case http.StatusRequestEntityTooLarge:
			typ = "request_too_large"
		case http.StatusTooManyRequests:
			typ = "rate_limit_error"
		case http.StatusServiceUnavailable, 529:
			typ = "overloaded_error"
		default:
			typ = "api_error"
		}
	}
	msg := err.Message
	if msg == "" {
		msg = string(err.Kind)
	}
	return status, errorDetail{typ, msg}
}

// WriteError writes err as an Anthropic error object.
func (Dialect) WriteError(w http.ResponseWriter, err *proxy.Error) {
	status, detail := errorShape(err)
	_ = proxy.WriteJSON(w, status, errorBody{Type: "error", Error: detail})
}

type modelInfo struct {
	Type        string `json:"type"` // model
	ID          string `json:"id"`
	DisplayName string `json:"display_name"`
	CreatedAt   string `json:"created_at"`
}

// WriteModels answers GET /v1/models.
func (Dialect) WriteModels(w http.ResponseWriter, models []string) {
	data := make([]modelInfo, len(models))
	for i, m := range models {
		data[i] = modelInfo{"model", m, m, "2025-01-01T00:00:00Z"}
	}
	var first, last *string
	if len(models) > 0 {
		first, last = &models[0], &models[len(models)-1]
	}
	_ = proxy.WriteJSON(w, http.StatusOK, struct {
		Data    []modelInfo `json:"data"`
		HasMore bool        `json:"has_more"`
		FirstID *string     `json:"first_id"`
		LastID  *string     `json:"last_id"`
	}{data, false, first, last})
}

// WriteCount answers POST /v1/messages/count_tokens.
func (Dialect) WriteCount(w http.ResponseWriter, _ *proxy.Request, tokens int) {
	_ = proxy.WriteJSON(w, http.StatusOK, struct {
		InputTokens int `json:"input_tokens"`
	}{tokens})
}

// ---- streaming ----

type blockStart struct {
	Type         string `json:"type"` // content_block_start
	Index        int    `json:"index"`
	ContentBlock any    `json:"content_block"`
}

type blockDelta struct {
	Type  string `json:"type"` // content_block_delta
	Index int    `json:"index"`
	Delta any    `json:"delta"`
}

type blockStop struct {
	Type  string `json:"type"` // content_block_stop
	Index int    `json:"index"`
}

type textDelta struct {
	Type string `json:"type"` // text_delta
	Text string `json:"text"`
}

type thinkingDelta struct {
	Type     string `json:"type"` // thinking_delta
	Thinking string `json:"thinking"`
}

type signatureDelta struct {
	Type      string `json:"type"` // signature_delta
	Signature string `json:"signature"`
}

type inputJSONDelta struct {
	Type        string `json:"type"` // input_json_delta
	PartialJSON string `json:"partial_json"`
}

type messageDelta struct {
	Type  string `json:"type"` // message_delta
	Delta struct {
		StopReason   string  `json:"stop_reason"`
		StopSequence *string `json:"stop_sequence"`
	} `json:"delta"`
	Usage messageUsage `json:"usage"`
}

type typeOnly struct {
	Type string `json:"type"`
}

// stream writes one answer as Anthropic SSE events. Content blocks open and close
// as the kind of delta changes (thinking, text, a tool call); each thinking block gets its
// floe signature in a signature_delta just before it stops.
type stream struct {
	s        *proxy.SSEWriter
	next     int    // index of the next content block
	open     string // kind of the open block: "", "thinking", "text" or "tool_use"
	openTool int    // tool-call index of the open tool_use block
	thinking strings.Builder
	tools    map[int][2]string // tool-call index → id, name (for a call resumed after another)
	anyTool  bool
	done     bool
	err      error // a write error from NewStream, returned by the next call
}

// NewStream sends the SSE headers, message_start and a ping.
func (Dialect) NewStream(w http.ResponseWriter, req *proxy.Request) proxy.Stream {
	st := &stream{s: proxy.NewSSE(w), tools: map[int][2]string{}}
	start := struct {
		Type    string  `json:"type"`
		Message message `json:"message"`
	}{"message_start", message{
		ID: newID("msg_"), Type: "message", Role: "assistant", Model: modelOf(req), Content: []any{},
	}}
	if err := st.s.Event("message_start", start); err != nil {
		st.err = err
		return st
	}
	st.err = st.s.Event("ping", typeOnly{"ping"})
	return st
}

func (st *stream) check() error {
	if st.err != nil {
		return st.err
	}
	if st.done {
		return errors.New("anthropic stream: already ended")
	}
	return nil
}

func (st *stream) closeBlock() error {
	if st.open == "" {
		return nil
	}
	if st.open == "thinking" {
		sig := proxy.ReasoningSignature(st.thinking.String())
		st.thinking.Reset()
		if err := st.s.Event("content_block_delta", blockDelta{"content_block_delta", st.next - 1, signatureDelta{"signature_delta", sig}}); err != nil {
			return err
		}
	}
	st.open = ""
	return st.s.Event("content_block_stop", blockStop{"content_block_stop", st.next - 1})
}

func (st *stream) startBlock(kind string, block any) error {
	if err := st.closeBlock(); err != nil {
		return err
	}
	st.open = kind
	st.next++
	return st.s.Event("content_block_start", blockStart{"content_block_start", st.next - 1, block})
}

func (st *stream) delta(d any) error {
	return st.s.Event("content_block_delta", blockDelta{"content_block_delta", st.next - 1, d})
}

// Delta writes one increment: its reasoning, then its text, then its tool-call fragments.
func (st *stream) Delta(d proxy.Delta) error {
	if err := st.check(); err != nil {
		return err
	}
	if err := st.writeDelta(d); err != nil {
		st.err = err
		return err
	}
	return nil
}

func (st *stream) writeDelta(d proxy.Delta) error {
	if d.Reasoning != "" {
		if st.open != "thinking" {
			if err := st.startBlock("thinking", thinkingBlock{Type: "thinking"}); err != nil {
				return err
			}
		}
		st.thinking.WriteString(d.Reasoning)
		if err := st.delta(thinkingDelta{"thinking_delta", d.Reasoning}); err != nil {
			return err
		}
	}
	if d.Content != "" {
		if st.open != "text" {
			if err := st.startBlock("text", textBlock{Type: "text"}); err != nil {
				return err
			}
		}
		if err := st.delta(textDelta{"text_delta", d.Content}); err != nil {
			return err
		}
	}
	for _, tc := range d.ToolCalls {
		if st.open != "tool_use" || st.openTool != tc.Index {
			// A new call, or (if the engine interleaves calls) one resumed after another:
			// a resumed call gets a new block with the id and name it had.
			known, seen := st.tools[tc.Index]
			if !seen {
				known = [2]string{tc.ID, tc.Name}
				if known[0] == "" {
					known[0] = newID("toolu_")
				}
				st.tools[tc.Index] = known
			}
			block := toolUseBlock{"tool_use", known[0], known[1], json.RawMessage(`{}`)}
			if err := st.startBlock("tool_use", block); err != nil {
				return err
			}
			st.openTool = tc.Index
			st.anyTool = true
		}
		if tc.Arguments != "" {
			if err := st.delta(inputJSONDelta{"input_json_delta", tc.Arguments}); err != nil {
				return err
			}
		}
	}
	return nil
}

// End closes the open block and writes message_delta (stop reason, usage) and message_stop.
func (st *stream) End(finish proxy.Finish, usage proxy.Usage) error {
	if err := st.check(); err != nil {
		return err
	}
	st.done = true
	if err := st.closeBlock(); err != nil {
		return err
	}
	var md messageDelta
	md.Type = "message_delta"
	md.Delta.StopReason, md.Delta.StopSequence = stopReason(finish, st.anyTool)
	md.Usage = messageUsage{InputTokens: usage.PromptTokens, OutputTokens: usage.CompletionTokens}
	if err := st.s.Event("message_delta", md); err != nil {
		return err
	}
	return st.s.Event("message_stop", typeOnly{"message_stop"})
}

// Fail writes an error event; the stream ends there.
func (st *stream) Fail(err *proxy.Error) error {
	if st.done {
		return errors.New("anthropic stream: already ended")
	}
	st.done = true
	_, detail := errorShape(err)
	return st.s.Event("error", errorBody{Type: "error", Error: detail})
}
