// Package anthropic is the Anthropic Messages dialect of the proxy (POST /v1/messages,
// /v1/messages/count_tokens, GET /v1/models).
package anthropic

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"regexp"
	"strconv"
	"strings"

	"github.com/floe-rl/floe/proxy"
)

// Anthropic is the Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens,
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
//   - Stop reasons: stop → end_turn (stop_sequence is not knowable), length → max_tokens,
//     tool_calls → tool_use, content_filter → refusal; a stop with tool calls is tool_use.
//   - Errors: invalid_request_error (400), authentication_error (401), permission_error
//     (403), not_found_error (404), request_too_large (413), rate_limit_error (429),
//     overloaded_error (ErrOverloaded, or any 503/529), api_error otherwise (502, 500). A
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

func anthObject(raw json.RawMessage, field string) (map[string]json.RawMessage, error) {
	if proxy.JSONKind(raw) != '{' {
		return nil, proxy.InvalidRequest("%s: expected an object", field)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, proxy.InvalidRequest("%s: expected an object", field)
	}
	return m, nil
}

func anthArray(raw json.RawMessage, field string) ([]json.RawMessage, error) {
	if proxy.JSONKind(raw) != '[' {
		return nil, proxy.InvalidRequest("%s: expected an array", field)
	}
	var a []json.RawMessage
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, proxy.InvalidRequest("%s: expected an array", field)
	}
	return a, nil
}

// anthString decodes an optional string; null or absent reads as "".
func anthString(raw json.RawMessage, field string) (string, error) {
	if proxy.JSONIsNull(raw) {
		return "", nil
	}
	var s string
	if proxy.JSONKind(raw) != '"' || json.Unmarshal(raw, &s) != nil {
		return "", proxy.InvalidRequest("%s: expected a string", field)
	}
	return s, nil
}

// anthRequiredString decodes a string that must be present and non-empty.
func anthRequiredString(raw json.RawMessage, field string) (string, error) {
	if proxy.JSONIsNull(raw) {
		return "", proxy.InvalidRequest("%s: field required", field)
	}
	s, err := anthString(raw, field)
	if err != nil {
		return "", err
	}
	if s == "" {
		return "", proxy.InvalidRequest("%s: must not be empty", field)
	}
	return s, nil
}

func anthBool(raw json.RawMessage, field string) (bool, error) {
	if proxy.JSONIsNull(raw) {
		return false, nil
	}
	var b bool
	if err := json.Unmarshal(raw, &b); err != nil {
		return false, proxy.InvalidRequest("%s: expected a boolean", field)
	}
	return b, nil
}

func anthNumber(raw json.RawMessage, field string) (*float64, error) {
	if proxy.JSONIsNull(raw) {
		return nil, nil
	}
	var f float64
	if k := proxy.JSONKind(raw); !(k == '-' || (k >= '0' && k <= '9')) || json.Unmarshal(raw, &f) != nil {
		return nil, proxy.InvalidRequest("%s: expected a number", field)
	}
	return &f, nil
}

func anthInt(raw json.RawMessage, field string) (*int, error) {
	f, err := anthNumber(raw, field)
	if err != nil || f == nil {
		return nil, err
	}
	if *f != math.Trunc(*f) || *f < 1 || *f > math.MaxInt32 {
		return nil, proxy.InvalidRequest("%s: expected a positive integer", field)
	}
	n := int(*f)
	return &n, nil
}

// Decode parses a Messages (or count_tokens) request body.
func (Dialect) Decode(_ *http.Request, body []byte) (*proxy.Request, error) {
	if proxy.JSONKind(body) != '{' {
		return nil, proxy.InvalidRequest("request body: expected a JSON object")
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(body, &top); err != nil {
		return nil, proxy.InvalidRequest("request body: malformed JSON: %v", err)
	}
	model, err := anthRequiredString(top["model"], "model")
	if err != nil {
		return nil, err
	}
	chat := proxy.ChatRequest{Model: model}

	if !proxy.JSONIsNull(top["system"]) {
		sys, err := anthTextContent(top["system"], "system")
		if err != nil {
			return nil, err
		}
		if sys != "" {
			chat.Messages = append(chat.Messages, proxy.ChatMessage{Role: "system", Content: sys})
		}
	}

	if proxy.JSONIsNull(top["messages"]) {
		return nil, proxy.InvalidRequest("messages: field required")
	}
	msgs, err := anthArray(top["messages"], "messages")
	if err != nil {
		return nil, err
	}
	if len(msgs) == 0 {
		return nil, proxy.InvalidRequest("messages: at least one message is required")
	}
	for i, raw := range msgs {
		out, err := anthDecodeMessage(raw, fmt.Sprintf("messages[%d]", i))
		if err != nil {
			return nil, err
		}
		chat.Messages = append(chat.Messages, out...)
	}

	forwarded := map[string]bool{}
	if !proxy.JSONIsNull(top["tools"]) {
		tools, err := anthArray(top["tools"], "tools")
		if err != nil {
			return nil, err
		}
		for i, raw := range tools {
			t, ok, err := anthDecodeTool(raw, fmt.Sprintf("tools[%d]", i))
			if err != nil {
				return nil, err
			}
			if ok {
				chat.Tools = append(chat.Tools, t)
				forwarded[t.Function.Name] = true
			}
		}
	}

	if !proxy.JSONIsNull(top["tool_choice"]) {
		choice, named, parallel, err := anthDecodeToolChoice(top["tool_choice"])
		if err != nil {
			return nil, err
		}
		if len(chat.Tools) > 0 && (named == "" || forwarded[named]) {
			chat.ToolChoice = choice
			chat.ParallelToolCalls = parallel
		}
	}

	if chat.MaxCompletionTokens, err = anthInt(top["max_tokens"], "max_tokens"); err != nil {
		return nil, err
	}
	if chat.Temperature, err = anthNumber(top["temperature"], "temperature"); err != nil {
		return nil, err
	}
	if chat.TopP, err = anthNumber(top["top_p"], "top_p"); err != nil {
		return nil, err
	}
	if _, err = anthNumber(top["top_k"], "top_k"); err != nil { // checked, not forwarded
		return nil, err
	}
	if !proxy.JSONIsNull(top["stop_sequences"]) {
		stops, err := anthArray(top["stop_sequences"], "stop_sequences")
		if err != nil {
			return nil, err
		}
		for i, raw := range stops {
			s, err := anthString(raw, fmt.Sprintf("stop_sequences[%d]", i))
			if err != nil {
				return nil, err
			}
			chat.Stop = append(chat.Stop, s)
		}
	}
	if chat.Stream, err = anthBool(top["stream"], "stream"); err != nil {
		return nil, err
	}
	if !proxy.JSONIsNull(top["thinking"]) {
		th, err := anthObject(top["thinking"], "thinking")
		if err != nil {
			return nil, err
		}
		typ, err := anthString(th["type"], "thinking.type")
		if err != nil {
			return nil, err
		}
		if _, err := anthNumber(th["budget_tokens"], "thinking.budget_tokens"); err != nil {
			return nil, err
		}
		switch typ {
		case "enabled", "adaptive":
			chat.ChatTemplateKwargs = map[string]any{"enable_thinking": true}
		case "disabled":
			chat.ChatTemplateKwargs = map[string]any{"enable_thinking": false}
		}
	}
	return &proxy.Request{Chat: chat, Model: model, Stream: chat.Stream}, nil
}

// anthTextContent reads a string or an array of text blocks (system content) as one string.
func anthTextContent(raw json.RawMessage, field string) (string, error) {
	if proxy.JSONKind(raw) == '"' {
		return anthString(raw, field)
	}
	blocks, err := anthArray(raw, field)
	if err != nil {
		return "", proxy.InvalidRequest("%s: expected a string or an array of content blocks", field)
	}
	var texts []string
	for j, braw := range blocks {
		bf := fmt.Sprintf("%s[%d]", field, j)
		b, typ, err := anthBlock(braw, bf)
		if err != nil {
			return "", err
		}
		if typ != "text" {
			continue
		}
		t, err := anthString(b["text"], bf+".text")
		if err != nil {
			return "", err
		}
		texts = append(texts, t)
	}
	return strings.Join(texts, "\n"), nil
}

// anthBlock reads a content block and its type.
func anthBlock(raw json.RawMessage, field string) (map[string]json.RawMessage, string, error) {
	b, err := anthObject(raw, field)
	if err != nil {
		return nil, "", err
	}
	typ, err := anthRequiredString(b["type"], field+".type")
	return b, typ, err
}

// anthContentBlocks reads message content: a string is one text block.
func anthContentBlocks(raw json.RawMessage, field string) (text string, blocks []json.RawMessage, isString bool, err error) {
	switch proxy.JSONKind(raw) {
	case 0, 'n':
		return "", nil, false, proxy.InvalidRequest("%s: field required", field)
	case '"':
		s, err := anthString(raw, field)
		return s, nil, true, err
	case '[':
		blocks, err := anthArray(raw, field)
		return "", blocks, false, err
	}
	return "", nil, false, proxy.InvalidRequest("%s: expected a string or an array of content blocks", field)
}

func anthDecodeMessage(raw json.RawMessage, field string) ([]proxy.ChatMessage, error) {
	m, err := anthObject(raw, field)
	if err != nil {
		return nil, err
	}
	role, err := anthRequiredString(m["role"], field+".role")
	if err != nil {
		return nil, err
	}
	cf := field + ".content"
	switch role {
	case "user":
		return anthDecodeUser(m["content"], cf)
	case "assistant":
		msg, err := anthDecodeAssistant(m["content"], cf)
		if err != nil {
			return nil, err
		}
		return []proxy.ChatMessage{msg}, nil
	case "system": // not Anthropic, but tolerated
		if proxy.JSONIsNull(m["content"]) {
			return nil, proxy.InvalidRequest("%s: field required", cf)
		}
		s, err := anthTextContent(m["content"], cf)
		if err != nil {
			return nil, err
		}
		return []proxy.ChatMessage{{Role: "system", Content: s}}, nil
	}
	return nil, proxy.InvalidRequest("%s.role: must be \"user\" or \"assistant\", got %q", field, role)
}

func anthDecodeUser(raw json.RawMessage, field string) ([]proxy.ChatMessage, error) {
	text, blocks, isString, err := anthContentBlocks(raw, field)
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
		out = append(out, proxy.ChatMessage{Role: "user", Content: anthUserContent(parts, hasImage)})
		parts, hasImage = nil, false
	}
	for j, braw := range blocks {
		bf := fmt.Sprintf("%s[%d]", field, j)
		b, typ, err := anthBlock(braw, bf)
		if err != nil {
			return nil, err
		}
		switch typ {
		case "text":
			t, err := anthString(b["text"], bf+".text")
			if err != nil {
				return nil, err
			}
			parts = append(parts, proxy.ChatPart{Type: "text", Text: t})
		case "image":
			url, err := anthImageURL(b["source"], bf+".source")
			if err != nil {
				return nil, err
			}
			parts = append(parts, proxy.ChatPart{Type: "image_url", ImageURL: &proxy.ChatImageURL{URL: url}})
			hasImage = true
		case "document":
			t, err := anthDocumentText(b, bf)
			if err != nil {
				return nil, err
			}
			parts = append(parts, proxy.ChatPart{Type: "text", Text: t})
		case "tool_result":
			flush()
			msg, err := anthDecodeToolResult(b, bf)
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

// anthUserContent is a string when the parts are all text, else the parts.
func anthUserContent(parts []proxy.ChatPart, hasImage bool) any {
	if hasImage {
		return parts
	}
	texts := make([]string, len(parts))
	for i, p := range parts {
		texts[i] = p.Text
	}
	return strings.Join(texts, "\n")
}

func anthImageURL(raw json.RawMessage, field string) (string, error) {
	src, err := anthObject(raw, field)
	if err != nil {
		return "", err
	}
	typ, err := anthRequiredString(src["type"], field+".type")
	if err != nil {
		return "", err
	}
	switch typ {
	case "base64":
		mt, err := anthRequiredString(src["media_type"], field+".media_type")
		if err != nil {
			return "", err
		}
		data, err := anthRequiredString(src["data"], field+".data")
		if err != nil {
			return "", err
		}
		return "data:" + mt + ";base64," + data, nil
	case "url":
		return anthRequiredString(src["url"], field+".url")
	}
	return "", proxy.InvalidRequest("%s.type: unsupported image source %q (want base64 or url)", field, typ)
}

// anthDocumentText is a document block as text: its text source, else a placeholder.
func anthDocumentText(b map[string]json.RawMessage, field string) (string, error) {
	if proxy.JSONKind(b["source"]) == '{' {
		src, err := anthObject(b["source"], field+".source")
		if err != nil {
			return "", err
		}
		if typ, _ := anthString(src["type"], ""); typ == "text" {
			return anthString(src["data"], field+".source.data")
		}
	}
	return "[document]", nil
}

func anthDecodeToolResult(b map[string]json.RawMessage, field string) (proxy.ChatMessage, error) {
	id, err := anthRequiredString(b["tool_use_id"], field+".tool_use_id")
	if err != nil {
		return proxy.ChatMessage{}, err
	}
	isErr, err := anthBool(b["is_error"], field+".is_error")
	if err != nil {
		return proxy.ChatMessage{}, err
	}
	var content string
	cf := field + ".content"
	switch proxy.JSONKind(b["content"]) {
	case 0, 'n':
	case '"':
		content, err = anthString(b["content"], cf)
		if err != nil {
			return proxy.ChatMessage{}, err
		}
	case '[':
		blocks, err := anthArray(b["content"], cf)
		if err != nil {
			return proxy.ChatMessage{}, err
		}
		var texts []string
		for j, braw := range blocks {
			bf := fmt.Sprintf("%s[%d]", cf, j)
			cb, typ, err := anthBlock(braw, bf)
			if err != nil {
				return proxy.ChatMessage{}, err
			}
			switch typ {
			case "text":
				t, err := anthString(cb["text"], bf+".text")
				if err != nil {
					return proxy.ChatMessage{}, err
				}
				texts = append(texts, t)
			case "image":
				if _, err := anthImageURL(cb["source"], bf+".source"); err != nil {
					return proxy.ChatMessage{}, err
				}
				texts = append(texts, "[image]")
			case "document":
				t, err := anthDocumentText(cb, bf)
				if err != nil {
					return proxy.ChatMessage{}, err
				}
				texts = append(texts, t)
			}
		}
		content = strings.Join(texts, "\n")
	default:
		return proxy.ChatMessage{}, proxy.InvalidRequest("%s: expected a string or an array of content blocks", cf)
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

func anthDecodeAssistant(raw json.RawMessage, field string) (proxy.ChatMessage, error) {
	msg := proxy.ChatMessage{Role: "assistant", Content: ""}
	text, blocks, isString, err := anthContentBlocks(raw, field)
	if err != nil {
		return msg, err
	}
	if isString {
		msg.Content = text
		return msg, nil
	}
	var content, reasoning strings.Builder
	for j, braw := range blocks {
		bf := fmt.Sprintf("%s[%d]", field, j)
		b, typ, err := anthBlock(braw, bf)
		if err != nil {
			return msg, err
		}
		switch typ {
		case "text":
			t, err := anthString(b["text"], bf+".text")
			if err != nil {
				return msg, err
			}
			content.WriteString(t)
		case "thinking":
			t, err := anthString(b["thinking"], bf+".thinking")
			if err != nil {
				return msg, err
			}
			sig, err := anthString(b["signature"], bf+".signature")
			if err != nil {
				return msg, err
			}
			if st, ok := proxy.ReasoningFromSignature(sig); ok {
				t = st
			}
			reasoning.WriteString(t)
		case "redacted_thinking":
			data, err := anthString(b["data"], bf+".data")
			if err != nil {
				return msg, err
			}
			if st, ok := proxy.ReasoningFromSignature(data); ok {
				reasoning.WriteString(st)
			}
		case "tool_use":
			id, err := anthRequiredString(b["id"], bf+".id")
			if err != nil {
				return msg, err
			}
			name, err := anthRequiredString(b["name"], bf+".name")
			if err != nil {
				return msg, err
			}
			args, err := anthArguments(b["input"], bf+".input")
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

// anthArguments turns a tool_use input into the arguments string: compact JSON, or the raw
// string floe wrapped as {"_raw": ...} because the model's arguments were not an object.
func anthArguments(raw json.RawMessage, field string) (string, error) {
	if proxy.JSONIsNull(raw) {
		return "{}", nil
	}
	var buf bytes.Buffer
	if err := json.Compact(&buf, raw); err != nil {
		return "", proxy.InvalidRequest("%s: malformed JSON", field)
	}
	if proxy.JSONKind(raw) == '{' {
		var wrapped map[string]json.RawMessage
		if json.Unmarshal(raw, &wrapped) == nil && len(wrapped) == 1 && proxy.JSONKind(wrapped["_raw"]) == '"' {
			var s string
			if json.Unmarshal(wrapped["_raw"], &s) == nil {
				return s, nil
			}
		}
	}
	return anthUnescapeHTML(buf.Bytes()), nil
}

// anthUnescapeHTML undoes the escapes Go's encoder puts in JSON strings (\u003c, \u003e,
// \u0026, \u2028, \u2029) in compact JSON, so that arguments echoed by a Go client read as
// the model wrote them (a JavaScript client writes these characters as they are).
func anthUnescapeHTML(b []byte) string {
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

// anthDecodeTool reads one tool; ok is false for server tools, which are not forwarded.
func anthDecodeTool(raw json.RawMessage, field string) (proxy.ChatTool, bool, error) {
	t, err := anthObject(raw, field)
	if err != nil {
		return proxy.ChatTool{}, false, err
	}
	typ, err := anthString(t["type"], field+".type")
	if err != nil {
		return proxy.ChatTool{}, false, err
	}
	if typ != "" && typ != "custom" && proxy.JSONIsNull(t["input_schema"]) {
		return proxy.ChatTool{}, false, nil
	}
	name, err := anthRequiredString(t["name"], field+".name")
	if err != nil {
		return proxy.ChatTool{}, false, err
	}
	desc, err := anthString(t["description"], field+".description")
	if err != nil {
		return proxy.ChatTool{}, false, err
	}
	params := json.RawMessage(`{"type":"object","properties":{}}`)
	if !proxy.JSONIsNull(t["input_schema"]) {
		if _, err := anthObject(t["input_schema"], field+".input_schema"); err != nil {
			return proxy.ChatTool{}, false, err
		}
		var buf bytes.Buffer
		if err := json.Compact(&buf, t["input_schema"]); err != nil {
			return proxy.ChatTool{}, false, proxy.InvalidRequest("%s.input_schema: malformed JSON", field)
		}
		params = buf.Bytes()
	}
	return proxy.ChatTool{Type: "function", Function: proxy.ChatFunction{Name: name, Description: desc, Parameters: params}}, true, nil
}

// anthDecodeToolChoice maps tool_choice; named is the tool it forces, if any.
func anthDecodeToolChoice(raw json.RawMessage) (choice json.RawMessage, named string, parallel *bool, err error) {
	tc, err := anthObject(raw, "tool_choice")
	if err != nil {
		return nil, "", nil, err
	}
	typ, err := anthRequiredString(tc["type"], "tool_choice.type")
	if err != nil {
		return nil, "", nil, err
	}
	disable, err := anthBool(tc["disable_parallel_tool_use"], "tool_choice.disable_parallel_tool_use")
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
		named, err = anthRequiredString(tc["name"], "tool_choice.name")
		if err != nil {
			return nil, "", nil, err
		}
		choice, _ = json.Marshal(map[string]any{"type": "function", "function": map[string]string{"name": named}})
	default:
		return nil, "", nil, proxy.InvalidRequest("tool_choice.type: must be auto, any, tool or none, got %q", typ)
	}
	return choice, named, parallel, nil
}

// ---- answers ----

type anthUsage struct {
	InputTokens  int `json:"input_tokens"`
	OutputTokens int `json:"output_tokens"`
}

type anthMessage struct {
	ID           string    `json:"id"`
	Type         string    `json:"type"`
	Role         string    `json:"role"`
	Model        string    `json:"model"`
	Content      []any     `json:"content"`
	StopReason   *string   `json:"stop_reason"`
	StopSequence *string   `json:"stop_sequence"`
	Usage        anthUsage `json:"usage"`
}

type anthThinkingBlock struct {
	Type      string `json:"type"` // thinking
	Thinking  string `json:"thinking"`
	Signature string `json:"signature"`
}

type anthTextBlock struct {
	Type string `json:"type"` // text
	Text string `json:"text"`
}

type anthToolUseBlock struct {
	Type  string          `json:"type"` // tool_use
	ID    string          `json:"id"`
	Name  string          `json:"name"`
	Input json.RawMessage `json:"input"`
}

// anthStopReason maps a normalized finish reason to Anthropic's stop_reason.
func anthStopReason(finish string, toolCalls bool) string {
	switch finish {
	case proxy.FinishLength:
		return "max_tokens"
	case proxy.FinishToolCalls:
		return "tool_use"
	case proxy.FinishFilter:
		return "refusal"
	}
	if toolCalls {
		return "tool_use"
	}
	return "end_turn"
}

// anthInput turns arguments into a tool_use input: the JSON object, or {"_raw": arguments}.
func anthInput(args string) json.RawMessage {
	if strings.TrimSpace(args) == "" {
		return json.RawMessage(`{}`)
	}
	if proxy.JSONKind([]byte(args)) == '{' && json.Valid([]byte(args)) {
		return json.RawMessage(args)
	}
	b, _ := json.Marshal(map[string]string{"_raw": args})
	return b
}

func anthModel(req *proxy.Request) string {
	if req == nil {
		return ""
	}
	return req.Model
}

func anthNewID(prefix string) string { return prefix + rand.Text() }

// WriteResponse writes a complete answer as an Anthropic message.
func (Dialect) WriteResponse(w http.ResponseWriter, req *proxy.Request, res *proxy.Response) error {
	msg := anthMessage{
		ID: anthNewID("msg_"), Type: "message", Role: "assistant", Model: anthModel(req),
		Content: []any{},
	}
	if res == nil {
		res = &proxy.Response{}
	}
	if res.ID != "" {
		msg.ID = "msg_" + res.ID
	}
	finish := proxy.FinishStop
	var m proxy.ChatMessage
	if len(res.Choices) > 0 {
		m, finish = res.Choices[0].Message, res.Choices[0].FinishReason
	}
	if m.ReasoningContent != "" {
		msg.Content = append(msg.Content, anthThinkingBlock{"thinking", m.ReasoningContent, proxy.ReasoningSignature(m.ReasoningContent)})
	}
	if text := proxy.ContentText(m.Content); text != "" {
		msg.Content = append(msg.Content, anthTextBlock{"text", text})
	}
	for _, tc := range m.ToolCalls {
		id := tc.ID
		if id == "" {
			id = anthNewID("toolu_")
		}
		msg.Content = append(msg.Content, anthToolUseBlock{"tool_use", id, tc.Function.Name, anthInput(tc.Function.Arguments)})
	}
	stop := anthStopReason(finish, len(m.ToolCalls) > 0)
	msg.StopReason = &stop
	msg.Usage = anthUsage{InputTokens: res.Usage.PromptTokens, OutputTokens: res.Usage.CompletionTokens}

	// Not writeJSON: tool inputs are written byte for byte (no HTML escaping inside them),
	// so the harness echoes back exactly the arguments the model produced.
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(msg); err != nil {
		return fmt.Errorf("encoding anthropic message: %w", err)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_, err := w.Write(buf.Bytes())
	return err
}

// ---- errors, models, count ----

type anthErrorDetail struct {
	Type    string `json:"type"`
	Message string `json:"message"`
}

type anthErrorBody struct {
	Type  string          `json:"type"` // error
	Error anthErrorDetail `json:"error"`
}

var (
	// Older vLLM (and the reference server): "… However, you requested 49177 tokens
	// (17177 in the messages, 32000 in the completion). …"
	anthOldBudgetRE = regexp.MustCompile(`\((\d+) in the messages, (\d+) in the completion\)`)
	// Newer vLLM: "'max_tokens' or 'max_completion_tokens' is too large: 32000. This
	// model's maximum context length is 32768 tokens and your request has 17177 input
	// tokens (32000 > 32768 - 17177)."
	anthBudgetRE = regexp.MustCompile(`too large: (\d+)\.`)
	// "… your request has 17177 input tokens …" (both the budget and the prompt-only error)
	anthInputRE = regexp.MustCompile(`your request has (\d+) input tokens`)
)

// anthContextNumbers reads a context-length error's prompt tokens and, when the upstream
// named one, the completion budget (max_tokens) that pushed the request over the limit.
func anthContextNumbers(err *proxy.Error) (prompt, budget int) {
	prompt = err.PromptTokens
	if m := anthOldBudgetRE.FindStringSubmatch(err.Message); m != nil {
		prompt, _ = strconv.Atoi(m[1])
		budget, _ = strconv.Atoi(m[2])
		return prompt, budget
	}
	if m := anthInputRE.FindStringSubmatch(err.Message); m != nil {
		prompt, _ = strconv.Atoi(m[1])
	}
	if m := anthBudgetRE.FindStringSubmatch(err.Message); m != nil {
		budget, _ = strconv.Atoi(m[1])
	}
	return prompt, budget
}

// anthErrorShape gives the HTTP status, Anthropic error type and message for err.
func anthErrorShape(err *proxy.Error) (int, anthErrorDetail) {
	if err == nil {
		err = &proxy.Error{Kind: proxy.ErrInternal, Message: "internal error"}
	}
	if err.Kind == proxy.ErrContextLength {
		prompt, budget := anthContextNumbers(err)
		if budget > 0 && prompt > 0 && err.MaxTokens > 0 && prompt < err.MaxTokens {
			return http.StatusBadRequest, anthErrorDetail{"invalid_request_error", fmt.Sprintf(
				"input length and `max_tokens` exceed context limit: %d + %d > %d, decrease input length or `max_tokens` and try again",
				prompt, budget, err.MaxTokens)}
		}
		msg := "prompt is too long"
		if prompt > 0 && err.MaxTokens > 0 {
			msg = fmt.Sprintf("prompt is too long: %d tokens > %d maximum", prompt, err.MaxTokens)
		} else if err.Message != "" {
			msg += ": " + err.Message
		}
		return http.StatusBadRequest, anthErrorDetail{"invalid_request_error", msg}
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
		case proxy.ErrOverloaded:
			status = 529
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
	case proxy.ErrOverloaded:
		typ = "overloaded_error"
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
	return status, anthErrorDetail{typ, msg}
}

// WriteError writes err as an Anthropic error object.
func (Dialect) WriteError(w http.ResponseWriter, err *proxy.Error) {
	status, detail := anthErrorShape(err)
	_ = proxy.WriteJSON(w, status, anthErrorBody{Type: "error", Error: detail})
}

type anthModelInfo struct {
	Type        string `json:"type"` // model
	ID          string `json:"id"`
	DisplayName string `json:"display_name"`
	CreatedAt   string `json:"created_at"`
}

// WriteModels answers GET /v1/models.
func (Dialect) WriteModels(w http.ResponseWriter, models []string) {
	data := make([]anthModelInfo, len(models))
	for i, m := range models {
		data[i] = anthModelInfo{"model", m, m, "2025-01-01T00:00:00Z"}
	}
	var first, last *string
	if len(models) > 0 {
		first, last = &models[0], &models[len(models)-1]
	}
	_ = proxy.WriteJSON(w, http.StatusOK, struct {
		Data    []anthModelInfo `json:"data"`
		HasMore bool            `json:"has_more"`
		FirstID *string         `json:"first_id"`
		LastID  *string         `json:"last_id"`
	}{data, false, first, last})
}

// WriteCount answers POST /v1/messages/count_tokens.
func (Dialect) WriteCount(w http.ResponseWriter, _ *proxy.Request, tokens int) {
	_ = proxy.WriteJSON(w, http.StatusOK, struct {
		InputTokens int `json:"input_tokens"`
	}{tokens})
}

// ---- streaming ----

type anthBlockStart struct {
	Type         string `json:"type"` // content_block_start
	Index        int    `json:"index"`
	ContentBlock any    `json:"content_block"`
}

type anthBlockDelta struct {
	Type  string `json:"type"` // content_block_delta
	Index int    `json:"index"`
	Delta any    `json:"delta"`
}

type anthBlockStop struct {
	Type  string `json:"type"` // content_block_stop
	Index int    `json:"index"`
}

type anthTextDelta struct {
	Type string `json:"type"` // text_delta
	Text string `json:"text"`
}

type anthThinkingDelta struct {
	Type     string `json:"type"` // thinking_delta
	Thinking string `json:"thinking"`
}

type anthSignatureDelta struct {
	Type      string `json:"type"` // signature_delta
	Signature string `json:"signature"`
}

type anthInputJSONDelta struct {
	Type        string `json:"type"` // input_json_delta
	PartialJSON string `json:"partial_json"`
}

type anthMessageDelta struct {
	Type  string `json:"type"` // message_delta
	Delta struct {
		StopReason   string  `json:"stop_reason"`
		StopSequence *string `json:"stop_sequence"`
	} `json:"delta"`
	Usage anthUsage `json:"usage"`
}

type anthTypeOnly struct {
	Type string `json:"type"`
}

// anthropicStream writes one answer as Anthropic SSE events. Content blocks open and close
// as the kind of delta changes (thinking, text, a tool call); each thinking block gets its
// floe signature in a signature_delta just before it stops.
type anthropicStream struct {
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
	st := &anthropicStream{s: proxy.NewSSE(w), tools: map[int][2]string{}}
	start := struct {
		Type    string      `json:"type"`
		Message anthMessage `json:"message"`
	}{"message_start", anthMessage{
		ID: anthNewID("msg_"), Type: "message", Role: "assistant", Model: anthModel(req), Content: []any{},
	}}
	if err := st.s.Event("message_start", start); err != nil {
		st.err = err
		return st
	}
	st.err = st.s.Event("ping", anthTypeOnly{"ping"})
	return st
}

func (st *anthropicStream) check() error {
	if st.err != nil {
		return st.err
	}
	if st.done {
		return errors.New("anthropic stream: already ended")
	}
	return nil
}

func (st *anthropicStream) closeBlock() error {
	if st.open == "" {
		return nil
	}
	if st.open == "thinking" {
		sig := proxy.ReasoningSignature(st.thinking.String())
		st.thinking.Reset()
		if err := st.s.Event("content_block_delta", anthBlockDelta{"content_block_delta", st.next - 1, anthSignatureDelta{"signature_delta", sig}}); err != nil {
			return err
		}
	}
	st.open = ""
	return st.s.Event("content_block_stop", anthBlockStop{"content_block_stop", st.next - 1})
}

func (st *anthropicStream) startBlock(kind string, block any) error {
	if err := st.closeBlock(); err != nil {
		return err
	}
	st.open = kind
	st.next++
	return st.s.Event("content_block_start", anthBlockStart{"content_block_start", st.next - 1, block})
}

func (st *anthropicStream) delta(d any) error {
	return st.s.Event("content_block_delta", anthBlockDelta{"content_block_delta", st.next - 1, d})
}

// Delta writes one increment: its reasoning, then its text, then its tool-call fragments.
func (st *anthropicStream) Delta(d proxy.Delta) error {
	if err := st.check(); err != nil {
		return err
	}
	if err := st.writeDelta(d); err != nil {
		st.err = err
		return err
	}
	return nil
}

func (st *anthropicStream) writeDelta(d proxy.Delta) error {
	if d.Reasoning != "" {
		if st.open != "thinking" {
			if err := st.startBlock("thinking", anthThinkingBlock{Type: "thinking"}); err != nil {
				return err
			}
		}
		st.thinking.WriteString(d.Reasoning)
		if err := st.delta(anthThinkingDelta{"thinking_delta", d.Reasoning}); err != nil {
			return err
		}
	}
	if d.Content != "" {
		if st.open != "text" {
			if err := st.startBlock("text", anthTextBlock{Type: "text"}); err != nil {
				return err
			}
		}
		if err := st.delta(anthTextDelta{"text_delta", d.Content}); err != nil {
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
					known[0] = anthNewID("toolu_")
				}
				st.tools[tc.Index] = known
			}
			block := anthToolUseBlock{"tool_use", known[0], known[1], json.RawMessage(`{}`)}
			if err := st.startBlock("tool_use", block); err != nil {
				return err
			}
			st.openTool = tc.Index
			st.anyTool = true
		}
		if tc.Arguments != "" {
			if err := st.delta(anthInputJSONDelta{"input_json_delta", tc.Arguments}); err != nil {
				return err
			}
		}
	}
	return nil
}

// End closes the open block and writes message_delta (stop reason, usage) and message_stop.
func (st *anthropicStream) End(finishReason string, usage proxy.Usage) error {
	if err := st.check(); err != nil {
		return err
	}
	st.done = true
	if err := st.closeBlock(); err != nil {
		return err
	}
	var md anthMessageDelta
	md.Type = "message_delta"
	md.Delta.StopReason = anthStopReason(finishReason, st.anyTool)
	md.Usage = anthUsage{InputTokens: usage.PromptTokens, OutputTokens: usage.CompletionTokens}
	if err := st.s.Event("message_delta", md); err != nil {
		return err
	}
	return st.s.Event("message_stop", anthTypeOnly{"message_stop"})
}

// Fail writes an error event; the stream ends there.
func (st *anthropicStream) Fail(err *proxy.Error) error {
	if st.done {
		return errors.New("anthropic stream: already ended")
	}
	st.done = true
	_, detail := anthErrorShape(err)
	return st.s.Event("error", anthErrorBody{Type: "error", Error: detail})
}
