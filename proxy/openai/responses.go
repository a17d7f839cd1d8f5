package openai

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/floe-rl/floe/proxy"
)

var _ proxy.Dialect = Responses{}

// Responses is the OpenAI Responses API (POST /v1/responses) as the Codex CLI speaks it:
// stateless (store: false), the whole history in input on every call.
//
// Decoding. instructions becomes the first system message. input is a string (one user
// message) or a list of items:
//   - message: roles user, assistant, system and developer (developer becomes system);
//     content a string or parts. Text parts of a user or system message are joined with
//     "\n" (what vLLM does with a list of text parts); a user message with images keeps
//     its parts. Assistant text parts are concatenated as the model produced them.
//   - reasoning, assistant message and function_call items that follow one another are
//     one assistant turn and become ONE assistant message (ReasoningContent, Content,
//     ToolCalls), as the model produced them in one call.
//   - function_call_output becomes a tool message; an output given as parts is reduced to
//     its text parts joined with "\n".
//   - Items of other types (web_search_call, local_shell_call, custom_tool_call,
//     item_reference, compaction …) are dropped: the engine cannot run them.
//
// Reasoning state. Every reasoning item floe returns carries the exact reasoning text in
// encrypted_content as "floe1." + base64(text) (standard encoding, padded); its summary
// holds the same text for display. On decode a floe1 encrypted_content restores the exact
// text, so the next prompt renders the reasoning token for token as it was sampled;
// without one (another provider's item, or a harness that dropped it) the reasoning_text
// content parts are used, else the summary texts joined with "\n\n".
//
// Tools: function tools are forwarded (strict is dropped: ChatFunction has no field for
// it); every other tool type is accepted and not forwarded. tool_choice and
// parallel_tool_calls are only forwarded when at least one tool is, because vLLM refuses
// a tool_choice without tools. previous_response_id is refused: floe keeps no responses.
type Responses struct{}

// Name is the API kind recorded with each call.
func (Responses) Name() string { return "openai_responses" }

// responsesContextMessage is OpenAI's wording for an over-long input; Codex keys on the code
// context_length_exceeded, people on the text.
const responsesContextMessage = "Your input exceeds the context window of this model. Please adjust your input and try again."

// responsesState is what the writers echo back from the caller's request.
type responsesState struct {
	instructions      *string
	tools             json.RawMessage
	toolChoice        json.RawMessage
	parallelToolCalls bool
	temperature       *float64
	topP              *float64
	maxOutputTokens   *int
	reasoning         json.RawMessage
	text              json.RawMessage
	metadata          json.RawMessage
	store             bool
}

// ---------------------------------------------------------------------------------------
// Decode

// respObject decodes a JSON object; null or absent gives nil.
func respObject(raw json.RawMessage, field string) (map[string]json.RawMessage, error) {
	if proxy.JSONIsNull(raw) {
		return nil, nil
	}
	var m map[string]json.RawMessage
	if proxy.JSONKind(raw) != '{' || json.Unmarshal(raw, &m) != nil {
		return nil, proxy.InvalidRequest("%s must be an object", field)
	}
	return m, nil
}

func respArray(raw json.RawMessage, field string) ([]json.RawMessage, error) {
	var a []json.RawMessage
	if proxy.JSONKind(raw) != '[' || json.Unmarshal(raw, &a) != nil {
		return nil, proxy.InvalidRequest("%s must be an array", field)
	}
	return a, nil
}

func respString(raw json.RawMessage, field string) (string, error) {
	var s string
	if proxy.JSONKind(raw) != '"' || json.Unmarshal(raw, &s) != nil {
		return "", proxy.InvalidRequest("%s must be a string", field)
	}
	return s, nil
}

// respOptString decodes an optional string field of obj; absent or null gives "".
func respOptString(obj map[string]json.RawMessage, key, field string) (string, error) {
	raw, ok := obj[key]
	if !ok || proxy.JSONIsNull(raw) {
		return "", nil
	}
	return respString(raw, field)
}

func respBool(raw json.RawMessage, field string) (bool, error) {
	var b bool
	if err := json.Unmarshal(raw, &b); err != nil {
		return false, proxy.InvalidRequest("%s must be a boolean", field)
	}
	return b, nil
}

func respFloat(raw json.RawMessage, field string) (float64, error) {
	var f float64
	if err := json.Unmarshal(raw, &f); err != nil {
		return 0, proxy.InvalidRequest("%s must be a number", field)
	}
	return f, nil
}

func respInt(raw json.RawMessage, field string) (int, error) {
	var n int
	if err := json.Unmarshal(raw, &n); err != nil {
		return 0, proxy.InvalidRequest("%s must be an integer", field)
	}
	return n, nil
}

// Decode parses a Responses request into the normalized Chat request.
func (Responses) Decode(_ *http.Request, body []byte) (*proxy.Request, error) {
	if proxy.JSONKind(body) != '{' {
		return nil, proxy.InvalidRequest("the request body must be a JSON object")
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(body, &top); err != nil {
		return nil, proxy.InvalidRequest("malformed JSON body: %v", err)
	}
	get := func(key string) (json.RawMessage, bool) {
		raw, ok := top[key]
		if !ok || proxy.JSONIsNull(raw) {
			return nil, false
		}
		return raw, true
	}

	st := &responsesState{parallelToolCalls: true}
	req := &proxy.Request{State: st}

	raw, ok := get("model")
	if !ok {
		return nil, proxy.InvalidRequest("model is required")
	}
	model, err := respString(raw, "model")
	if err != nil {
		return nil, err
	}
	if model == "" {
		return nil, proxy.InvalidRequest("model is required")
	}
	req.Model, req.Chat.Model = model, model

	if raw, ok := get("previous_response_id"); ok {
		if id, err := respString(raw, "previous_response_id"); err != nil {
			return nil, err
		} else if id != "" {
			return nil, proxy.InvalidRequest("previous_response_id is not supported: floe keeps no responses; send store: false and the full history in input")
		}
	}

	var msgs []proxy.ChatMessage
	if raw, ok := get("instructions"); ok {
		s, err := respString(raw, "instructions")
		if err != nil {
			return nil, err
		}
		st.instructions = &s
		msgs = append(msgs, proxy.ChatMessage{Role: "system", Content: s})
	}

	raw, ok = get("input")
	if !ok {
		return nil, proxy.InvalidRequest("input is required")
	}
	switch proxy.JSONKind(raw) {
	case '"':
		s, err := respString(raw, "input")
		if err != nil {
			return nil, err
		}
		msgs = append(msgs, proxy.ChatMessage{Role: "user", Content: s})
	case '[':
		items, err := respArray(raw, "input")
		if err != nil {
			return nil, err
		}
		b := respBuilder{msgs: msgs}
		for i, it := range items {
			if err := b.item(it, fmt.Sprintf("input[%d]", i)); err != nil {
				return nil, err
			}
		}
		b.closeTurn()
		msgs = b.msgs
	default:
		return nil, proxy.InvalidRequest("input must be a string or an array of items")
	}
	if len(msgs) == 0 {
		return nil, proxy.InvalidRequest("input has no messages")
	}
	req.Chat.Messages = msgs

	if raw, ok := get("tools"); ok {
		tools, err := respArray(raw, "tools")
		if err != nil {
			return nil, err
		}
		st.tools = raw
		for i, t := range tools {
			ct, err := respTool(t, fmt.Sprintf("tools[%d]", i))
			if err != nil {
				return nil, err
			}
			if ct != nil {
				req.Chat.Tools = append(req.Chat.Tools, *ct)
			}
		}
	}
	if raw, ok := get("tool_choice"); ok {
		choice, err := respToolChoice(raw)
		if err != nil {
			return nil, err
		}
		st.toolChoice = raw
		if len(req.Chat.Tools) > 0 {
			req.Chat.ToolChoice = choice
		}
	}
	if raw, ok := get("parallel_tool_calls"); ok {
		b, err := respBool(raw, "parallel_tool_calls")
		if err != nil {
			return nil, err
		}
		st.parallelToolCalls = b
		if len(req.Chat.Tools) > 0 {
			req.Chat.ParallelToolCalls = &b
		}
	}
	if raw, ok := get("max_output_tokens"); ok {
		n, err := respInt(raw, "max_output_tokens")
		if err != nil {
			return nil, err
		}
		if n < 1 {
			return nil, proxy.InvalidRequest("max_output_tokens must be at least 1")
		}
		st.maxOutputTokens = &n
		req.Chat.MaxCompletionTokens = &n
	}
	if raw, ok := get("temperature"); ok {
		f, err := respFloat(raw, "temperature")
		if err != nil {
			return nil, err
		}
		st.temperature = &f
		req.Chat.Temperature = &f
	}
	if raw, ok := get("top_p"); ok {
		f, err := respFloat(raw, "top_p")
		if err != nil {
			return nil, err
		}
		st.topP = &f
		req.Chat.TopP = &f
	}
	if raw, ok := get("reasoning"); ok {
		r, err := respObject(raw, "reasoning")
		if err != nil {
			return nil, err
		}
		st.reasoning = raw
		effort, err := respOptString(r, "effort", "reasoning.effort")
		if err != nil {
			return nil, err
		}
		if _, err := respOptString(r, "summary", "reasoning.summary"); err != nil {
			return nil, err
		}
		switch effort {
		case "":
		case "none", "minimal":
			req.Chat.ChatTemplateKwargs = map[string]any{"enable_thinking": false}
		default:
			req.Chat.ChatTemplateKwargs = map[string]any{"enable_thinking": true}
		}
	}
	if raw, ok := get("stream"); ok {
		b, err := respBool(raw, "stream")
		if err != nil {
			return nil, err
		}
		req.Stream, req.Chat.Stream = b, b
	}
	if raw, ok := get("store"); ok {
		b, err := respBool(raw, "store")
		if err != nil {
			return nil, err
		}
		st.store = b
	}
	if raw, ok := get("text"); ok {
		if _, err := respObject(raw, "text"); err != nil {
			return nil, err
		}
		st.text = raw
	}
	if raw, ok := get("metadata"); ok {
		if _, err := respObject(raw, "metadata"); err != nil {
			return nil, err
		}
		st.metadata = raw
	}
	return req, nil
}

// respBuilder turns input items into Chat messages, gathering one assistant turn — the
// reasoning, message and function_call items of one model call — into one message.
type respBuilder struct {
	msgs []proxy.ChatMessage
	// The open assistant turn.
	open      bool
	reasoning strings.Builder
	content   strings.Builder
	calls     []proxy.ChatToolCall
}

func (b *respBuilder) turn() { b.open = true }

func (b *respBuilder) closeTurn() {
	if !b.open {
		return
	}
	b.msgs = append(b.msgs, proxy.ChatMessage{
		Role:             "assistant",
		Content:          b.content.String(),
		ToolCalls:        b.calls,
		ReasoningContent: b.reasoning.String(),
	})
	b.open = false
	b.reasoning.Reset()
	b.content.Reset()
	b.calls = nil
}

func (b *respBuilder) add(m proxy.ChatMessage) {
	b.closeTurn()
	b.msgs = append(b.msgs, m)
}

func (b *respBuilder) item(raw json.RawMessage, field string) error {
	it, err := respObject(raw, field)
	if err != nil {
		return err
	}
	if it == nil {
		return proxy.InvalidRequest("%s must be an object", field)
	}
	typ, err := respOptString(it, "type", field+".type")
	if err != nil {
		return err
	}
	if typ == "" {
		if _, ok := it["role"]; !ok {
			return proxy.InvalidRequest("%s.type is required", field)
		}
		typ = "message" // EasyInputMessage: {role, content}
	}
	switch typ {
	case "message":
		role, err := respOptString(it, "role", field+".role")
		if err != nil {
			return err
		}
		content, ok := it["content"]
		if !ok || proxy.JSONIsNull(content) {
			return proxy.InvalidRequest("%s.content is required", field)
		}
		switch role {
		case "assistant":
			text, err := respText(content, field+".content", "")
			if err != nil {
				return err
			}
			b.turn()
			b.content.WriteString(text)
		case "system", "developer":
			text, err := respText(content, field+".content", "\n")
			if err != nil {
				return err
			}
			b.add(proxy.ChatMessage{Role: "system", Content: text})
		case "user":
			c, err := respUserContent(content, field+".content")
			if err != nil {
				return err
			}
			b.add(proxy.ChatMessage{Role: "user", Content: c})
		case "":
			return proxy.InvalidRequest("%s.role is required", field)
		default:
			return proxy.InvalidRequest("%s.role must be user, assistant, system or developer, not %q", field, role)
		}
	case "function_call":
		callID, err := respOptString(it, "call_id", field+".call_id")
		if err != nil {
			return err
		}
		if callID == "" {
			return proxy.InvalidRequest("%s.call_id is required", field)
		}
		name, err := respOptString(it, "name", field+".name")
		if err != nil {
			return err
		}
		if name == "" {
			return proxy.InvalidRequest("%s.name is required", field)
		}
		var args string
		if raw, ok := it["arguments"]; ok && !proxy.JSONIsNull(raw) {
			if proxy.JSONKind(raw) == '"' {
				if args, err = respString(raw, field+".arguments"); err != nil {
					return err
				}
			} else {
				args = string(bytes.TrimSpace(raw)) // lenient: arguments given as JSON
			}
		}
		b.turn()
		b.calls = append(b.calls, proxy.ChatToolCall{ID: callID, Type: "function", Function: proxy.ChatFunctionCall{Name: name, Arguments: args}})
	case "function_call_output":
		callID, err := respOptString(it, "call_id", field+".call_id")
		if err != nil {
			return err
		}
		if callID == "" {
			return proxy.InvalidRequest("%s.call_id is required", field)
		}
		out, err := respToolOutput(it["output"], field+".output")
		if err != nil {
			return err
		}
		b.add(proxy.ChatMessage{Role: "tool", Content: out, ToolCallID: callID})
	case "reasoning":
		text, exact, err := respReasoningText(it, field)
		if err != nil {
			return err
		}
		// Several reasoning items in one turn: floe's own pieces are exact continuations
		// (a stream whose reasoning resumed after text); others are separate summaries.
		b.turn()
		if b.reasoning.Len() > 0 && !exact && text != "" {
			b.reasoning.WriteString("\n\n")
		}
		b.reasoning.WriteString(text)
	default:
		// web_search_call, local_shell_call(_output), custom_tool_call(_output),
		// item_reference, compaction, image_generation_call …: not for the engine.
	}
	return nil
}

// respReasoningText returns a reasoning item's text and whether it is floe's exact text.
func respReasoningText(it map[string]json.RawMessage, field string) (string, bool, error) {
	enc, err := respOptString(it, "encrypted_content", field+".encrypted_content")
	if err != nil {
		return "", false, err
	}
	if s, ok := proxy.ReasoningFromSignature(enc); ok {
		return s, true, nil
	}
	join := func(key, sep string) (string, error) {
		raw, ok := it[key]
		if !ok || proxy.JSONIsNull(raw) {
			return "", nil
		}
		parts, err := respArray(raw, field+"."+key)
		if err != nil {
			return "", err
		}
		var texts []string
		for j, p := range parts {
			po, err := respObject(p, fmt.Sprintf("%s.%s[%d]", field, key, j))
			if err != nil {
				return "", err
			}
			t, err := respOptString(po, "text", fmt.Sprintf("%s.%s[%d].text", field, key, j))
			if err != nil {
				return "", err
			}
			texts = append(texts, t)
		}
		return strings.Join(texts, sep), nil
	}
	content, err := join("content", "")
	if err != nil {
		return "", false, err
	}
	summary, err := join("summary", "\n\n")
	if err != nil {
		return "", false, err
	}
	if content != "" {
		return content, false, nil
	}
	return summary, false, nil
}

// respPart is one part of a content list: text, or an image URL.
type respPart struct {
	text  string
	image string // image URL; text is unused then
}

// respContentParts decodes a string or a content list into its text and image parts, in
// order; unsupported part types are dropped.
func respContentParts(raw json.RawMessage, field string) ([]respPart, error) {
	if proxy.JSONKind(raw) == '"' {
		s, err := respString(raw, field)
		if err != nil {
			return nil, err
		}
		return []respPart{{text: s}}, nil
	}
	if proxy.JSONKind(raw) != '[' {
		return nil, proxy.InvalidRequest("%s must be a string or an array of content parts", field)
	}
	items, err := respArray(raw, field)
	if err != nil {
		return nil, err
	}
	var parts []respPart
	for j, p := range items {
		pf := fmt.Sprintf("%s[%d]", field, j)
		po, err := respObject(p, pf)
		if err != nil {
			return nil, err
		}
		if po == nil {
			return nil, proxy.InvalidRequest("%s must be an object", pf)
		}
		typ, err := respOptString(po, "type", pf+".type")
		if err != nil {
			return nil, err
		}
		switch typ {
		case "input_text", "output_text", "text", "summary_text", "reasoning_text":
			t, err := respOptString(po, "text", pf+".text")
			if err != nil {
				return nil, err
			}
			parts = append(parts, respPart{text: t})
		case "refusal":
			t, err := respOptString(po, "refusal", pf+".refusal")
			if err != nil {
				return nil, err
			}
			parts = append(parts, respPart{text: t})
		case "input_image":
			url, err := respImageURL(po, pf)
			if err != nil {
				return nil, err
			}
			parts = append(parts, respPart{image: url})
		default:
			// input_file, input_audio …: not supported by the engine path; dropped.
		}
	}
	return parts, nil
}

func respImageURL(po map[string]json.RawMessage, pf string) (string, error) {
	raw, ok := po["image_url"]
	if !ok || proxy.JSONIsNull(raw) {
		return "", proxy.InvalidRequest("%s.image_url is required (file_id is not supported)", pf)
	}
	if proxy.JSONKind(raw) == '{' { // lenient: Chat's {"url": ...}
		o, err := respObject(raw, pf+".image_url")
		if err != nil {
			return "", err
		}
		raw = o["url"]
	}
	url, err := respString(raw, pf+".image_url")
	if err != nil {
		return "", err
	}
	if url == "" {
		return "", proxy.InvalidRequest("%s.image_url is required", pf)
	}
	return url, nil
}

// respText joins a content's text parts with sep; images are dropped.
func respText(raw json.RawMessage, field, sep string) (string, error) {
	parts, err := respContentParts(raw, field)
	if err != nil {
		return "", err
	}
	var texts []string
	for _, p := range parts {
		if p.image == "" {
			texts = append(texts, p.text)
		}
	}
	return strings.Join(texts, sep), nil
}

// respUserContent is a string when the message is text only, else Chat parts.
func respUserContent(raw json.RawMessage, field string) (any, error) {
	parts, err := respContentParts(raw, field)
	if err != nil {
		return nil, err
	}
	images := false
	for _, p := range parts {
		if p.image != "" {
			images = true
		}
	}
	if !images {
		texts := make([]string, len(parts))
		for i, p := range parts {
			texts[i] = p.text
		}
		return strings.Join(texts, "\n"), nil
	}
	out := make([]proxy.ChatPart, len(parts))
	for i, p := range parts {
		if p.image != "" {
			out[i] = proxy.ChatPart{Type: "image_url", ImageURL: &proxy.ChatImageURL{URL: p.image}}
		} else {
			out[i] = proxy.ChatPart{Type: "text", Text: p.text}
		}
	}
	return out, nil
}

// respToolOutput reduces a function_call_output's output to the tool message's string.
func respToolOutput(raw json.RawMessage, field string) (string, error) {
	switch proxy.JSONKind(raw) {
	case 0, 'n':
		return "", nil
	case '"':
		return respString(raw, field)
	case '[':
		return respText(raw, field, "\n")
	case '{': // older Codex: {"content": "...", "success": false}
		o, err := respObject(raw, field)
		if err != nil {
			return "", err
		}
		if c, ok := o["content"]; ok && proxy.JSONKind(c) == '"' {
			return respString(c, field+".content")
		}
	}
	return string(bytes.TrimSpace(raw)), nil
}

// respTool converts a function tool; other tool types give nil (not forwarded).
func respTool(raw json.RawMessage, field string) (*proxy.ChatTool, error) {
	t, err := respObject(raw, field)
	if err != nil {
		return nil, err
	}
	if t == nil {
		return nil, proxy.InvalidRequest("%s must be an object", field)
	}
	typ, err := respOptString(t, "type", field+".type")
	if err != nil {
		return nil, err
	}
	if typ == "" {
		return nil, proxy.InvalidRequest("%s.type is required", field)
	}
	if typ != "function" {
		return nil, nil // web_search, local_shell, custom, namespace, file_search …
	}
	src, srcField := t, field
	if _, ok := t["name"]; !ok {
		if fn, ok := t["function"]; ok { // lenient: Chat's nested shape
			if src, err = respObject(fn, field+".function"); err != nil {
				return nil, err
			}
			srcField = field + ".function"
		}
	}
	if src == nil {
		return nil, proxy.InvalidRequest("%s.name is required", field)
	}
	name, err := respOptString(src, "name", srcField+".name")
	if err != nil {
		return nil, err
	}
	if name == "" {
		return nil, proxy.InvalidRequest("%s.name is required", srcField)
	}
	desc, err := respOptString(src, "description", srcField+".description")
	if err != nil {
		return nil, err
	}
	var params json.RawMessage
	if p, ok := src["parameters"]; ok && !proxy.JSONIsNull(p) {
		if proxy.JSONKind(p) != '{' {
			return nil, proxy.InvalidRequest("%s.parameters must be an object", srcField)
		}
		params = append(json.RawMessage(nil), bytes.TrimSpace(p)...)
	}
	return &proxy.ChatTool{Type: "function", Function: proxy.ChatFunction{Name: name, Description: desc, Parameters: params}}, nil
}

// respToolChoice normalizes tool_choice; nil means "not forwarded".
func respToolChoice(raw json.RawMessage) (json.RawMessage, error) {
	switch proxy.JSONKind(raw) {
	case '"':
		s, err := respString(raw, "tool_choice")
		if err != nil {
			return nil, err
		}
		switch s {
		case "auto", "none", "required":
			return json.RawMessage(`"` + s + `"`), nil
		}
		return nil, proxy.InvalidRequest("tool_choice must be auto, none, required or an object, not %q", s)
	case '{':
		o, err := respObject(raw, "tool_choice")
		if err != nil {
			return nil, err
		}
		typ, err := respOptString(o, "type", "tool_choice.type")
		if err != nil {
			return nil, err
		}
		switch typ {
		case "function":
			name, err := respOptString(o, "name", "tool_choice.name")
			if err != nil {
				return nil, err
			}
			if name == "" {
				return nil, proxy.InvalidRequest("tool_choice.name is required")
			}
			b, _ := json.Marshal(map[string]any{"type": "function", "function": map[string]string{"name": name}})
			return b, nil
		case "allowed_tools":
			// The restriction is not expressible in Chat; keep its mode.
			mode, err := respOptString(o, "mode", "tool_choice.mode")
			if err != nil {
				return nil, err
			}
			if mode == "required" {
				return json.RawMessage(`"required"`), nil
			}
			return json.RawMessage(`"auto"`), nil
		case "":
			return nil, proxy.InvalidRequest("tool_choice.type is required")
		}
		return nil, nil // a hosted or custom tool: not forwarded, so neither is the choice
	}
	return nil, proxy.InvalidRequest("tool_choice must be a string or an object")
}

// ---------------------------------------------------------------------------------------
// Response objects

type respSummaryText struct {
	Type string `json:"type"` // summary_text
	Text string `json:"text"`
}

type respReasoningItem struct {
	ID               string            `json:"id"`
	Type             string            `json:"type"` // reasoning
	Summary          []respSummaryText `json:"summary"`
	EncryptedContent *string           `json:"encrypted_content,omitempty"`
}

type respOutputText struct {
	Type        string `json:"type"` // output_text
	Text        string `json:"text"`
	Annotations []any  `json:"annotations"`
}

type respMessageItem struct {
	ID      string           `json:"id"`
	Type    string           `json:"type"` // message
	Status  string           `json:"status"`
	Role    string           `json:"role"` // assistant
	Content []respOutputText `json:"content"`
}

type respFunctionCallItem struct {
	ID        string `json:"id"`
	Type      string `json:"type"` // function_call
	Status    string `json:"status"`
	CallID    string `json:"call_id"`
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

type respInputTokensDetails struct {
	CachedTokens     int `json:"cached_tokens"`
	CacheWriteTokens int `json:"cache_write_tokens"`
}

type respOutputTokensDetails struct {
	ReasoningTokens int `json:"reasoning_tokens"`
}

type respUsage struct {
	InputTokens         int                     `json:"input_tokens"`
	InputTokensDetails  respInputTokensDetails  `json:"input_tokens_details"`
	OutputTokens        int                     `json:"output_tokens"`
	OutputTokensDetails respOutputTokensDetails `json:"output_tokens_details"`
	TotalTokens         int                     `json:"total_tokens"`
}

type respErrorBody struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

type respIncomplete struct {
	Reason string `json:"reason"`
}

// responsesObject is the Response object, with the fields the openai SDK's model declares
// required and the defaults OpenAI sends.
type responsesObject struct {
	ID                 string          `json:"id"`
	Object             string          `json:"object"`
	CreatedAt          int64           `json:"created_at"`
	Status             string          `json:"status"`
	CompletedAt        *int64          `json:"completed_at"`
	Background         bool            `json:"background"`
	Error              *respErrorBody  `json:"error"`
	IncompleteDetails  *respIncomplete `json:"incomplete_details"`
	Instructions       *string         `json:"instructions"`
	MaxOutputTokens    *int            `json:"max_output_tokens"`
	Model              string          `json:"model"`
	Output             []any           `json:"output"`
	ParallelToolCalls  bool            `json:"parallel_tool_calls"`
	PreviousResponseID *string         `json:"previous_response_id"`
	Reasoning          json.RawMessage `json:"reasoning"`
	ServiceTier        string          `json:"service_tier"`
	Store              bool            `json:"store"`
	Temperature        *float64        `json:"temperature"`
	Text               json.RawMessage `json:"text"`
	ToolChoice         json.RawMessage `json:"tool_choice"`
	Tools              json.RawMessage `json:"tools"`
	TopP               *float64        `json:"top_p"`
	Truncation         string          `json:"truncation"`
	Usage              *respUsage      `json:"usage"`
	User               *string         `json:"user"`
	Metadata           json.RawMessage `json:"metadata"`
}

func respID(prefix string) string {
	b := make([]byte, 24)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// respNewObject starts a Response object for req with the caller's settings echoed.
func respNewObject(req *proxy.Request, status string) *responsesObject {
	o := &responsesObject{
		ID:                respID("resp_"),
		Object:            "response",
		CreatedAt:         time.Now().Unix(),
		Status:            status,
		Output:            []any{},
		ParallelToolCalls: true,
		Reasoning:         json.RawMessage(`{"effort":null,"summary":null}`),
		ServiceTier:       "default",
		Text:              json.RawMessage(`{"format":{"type":"text"}}`),
		ToolChoice:        json.RawMessage(`"auto"`),
		Tools:             json.RawMessage(`[]`),
		Truncation:        "disabled",
		Metadata:          json.RawMessage(`{}`),
	}
	if req == nil {
		return o
	}
	o.Model = req.Model
	st, _ := req.State.(*responsesState)
	if st == nil {
		return o
	}
	o.Instructions = st.instructions
	o.MaxOutputTokens = st.maxOutputTokens
	o.ParallelToolCalls = st.parallelToolCalls
	o.Store = st.store
	o.Temperature = st.temperature
	o.TopP = st.topP
	for _, f := range []struct {
		dst *json.RawMessage
		src json.RawMessage
	}{{&o.Reasoning, st.reasoning}, {&o.Text, st.text}, {&o.ToolChoice, st.toolChoice}, {&o.Tools, st.tools}, {&o.Metadata, st.metadata}} {
		if len(f.src) > 0 {
			*f.dst = f.src
		}
	}
	return o
}

// finish sets the terminal status of o from the finish reason and usage.
func (o *responsesObject) finish(finishReason string, usage proxy.Usage) {
	switch finishReason {
	case proxy.FinishLength:
		o.Status = "incomplete"
		o.IncompleteDetails = &respIncomplete{Reason: "max_output_tokens"}
	case proxy.FinishFilter:
		o.Status = "incomplete"
		o.IncompleteDetails = &respIncomplete{Reason: "content_filter"}
	default:
		o.Status = "completed"
		now := time.Now().Unix()
		o.CompletedAt = &now
	}
	u := respUsageOf(usage)
	o.Usage = &u
}

func respUsageOf(u proxy.Usage) respUsage {
	total := u.TotalTokens
	if total == 0 {
		total = u.PromptTokens + u.CompletionTokens
	}
	return respUsage{InputTokens: u.PromptTokens, OutputTokens: u.CompletionTokens, TotalTokens: total}
}

// respItemStatus is the status of the last output item: incomplete when the answer was cut.
func respItemStatus(finishReason string) string {
	if finishReason == proxy.FinishLength || finishReason == proxy.FinishFilter {
		return "incomplete"
	}
	return "completed"
}

func respEncrypt(reasoning string) *string {
	s := proxy.ReasoningSignature(reasoning)
	return &s
}

// WriteResponse writes a complete answer as a Response object.
func (Responses) WriteResponse(w http.ResponseWriter, req *proxy.Request, res *proxy.Response) error {
	o := respNewObject(req, "completed")
	var usage proxy.Usage
	finish := proxy.FinishStop
	if res != nil {
		usage = res.Usage
		if len(res.Choices) > 0 {
			c := res.Choices[0]
			finish = c.FinishReason
			msg := c.Message
			if msg.ReasoningContent != "" {
				o.Output = append(o.Output, &respReasoningItem{
					ID: respID("rs_"), Type: "reasoning",
					Summary:          []respSummaryText{{Type: "summary_text", Text: msg.ReasoningContent}},
					EncryptedContent: respEncrypt(msg.ReasoningContent),
				})
			}
			if text := proxy.ContentText(msg.Content); text != "" {
				o.Output = append(o.Output, &respMessageItem{
					ID: respID("msg_"), Type: "message", Status: "completed", Role: "assistant",
					Content: []respOutputText{{Type: "output_text", Text: text, Annotations: []any{}}},
				})
			}
			for _, tc := range msg.ToolCalls {
				id := tc.ID
				if id == "" {
					id = respID("call_")
				}
				o.Output = append(o.Output, &respFunctionCallItem{
					ID: respID("fc_"), Type: "function_call", Status: "completed",
					CallID: id, Name: tc.Function.Name, Arguments: tc.Function.Arguments,
				})
			}
		}
	}
	if n := len(o.Output); n > 0 {
		switch it := o.Output[n-1].(type) {
		case *respMessageItem:
			it.Status = respItemStatus(finish)
		case *respFunctionCallItem:
			it.Status = respItemStatus(finish)
		}
	}
	o.finish(finish, usage)
	return proxy.WriteJSON(w, http.StatusOK, o)
}

// ---------------------------------------------------------------------------------------
// Errors and models

func respErrorShape(err *proxy.Error) (status int, typ, code, message string) {
	status = err.Status
	message = err.Message
	switch err.Kind {
	case proxy.ErrInvalidRequest:
		status, typ = respOr(status, http.StatusBadRequest), "invalid_request_error"
	case proxy.ErrAuthentication:
		status, typ, code = respOr(status, http.StatusUnauthorized), "invalid_request_error", "invalid_api_key"
	case proxy.ErrNotFound:
		status, typ = respOr(status, http.StatusNotFound), "invalid_request_error"
	case proxy.ErrTooLarge:
		status, typ = respOr(status, http.StatusRequestEntityTooLarge), "invalid_request_error"
	case proxy.ErrContextLength:
		status, typ, code = respOr(status, http.StatusBadRequest), "invalid_request_error", "context_length_exceeded"
		message = responsesContextMessage
		switch {
		case err.PromptTokens > 0 && err.MaxTokens > 0:
			message += fmt.Sprintf(" Your input is %d tokens; the context window is %d tokens.", err.PromptTokens, err.MaxTokens)
		case err.PromptTokens > 0:
			message += fmt.Sprintf(" Your input is %d tokens.", err.PromptTokens)
		case err.MaxTokens > 0:
			message += fmt.Sprintf(" The context window is %d tokens.", err.MaxTokens)
		}
	case proxy.ErrUpstreamUnavailable:
		status, typ, code = respOr(status, http.StatusServiceUnavailable), "server_error", "server_error"
	case proxy.ErrOverloaded:
		status, typ, code = respOr(status, http.StatusServiceUnavailable), "server_error", "server_is_overloaded"
	default:
		status, typ, code = respOr(status, http.StatusInternalServerError), "server_error", "server_error"
	}
	return status, typ, code, message
}

func respOr(status, def int) int {
	if status == 0 {
		return def
	}
	return status
}

// WriteError writes err as OpenAI's {"error": {message, type, param, code}}.
func (Responses) WriteError(w http.ResponseWriter, err *proxy.Error) {
	if err == nil {
		err = &proxy.Error{Kind: proxy.ErrInternal, Message: "unknown error"}
	}
	status, typ, code, message := respErrorShape(err)
	var c *string
	if code != "" {
		c = &code
	}
	_ = proxy.WriteJSON(w, status, map[string]any{"error": map[string]any{
		"message": message, "type": typ, "param": nil, "code": c,
	}})
}

// WriteModels answers GET /v1/models.
func (Responses) WriteModels(w http.ResponseWriter, models []string) {
	data := make([]map[string]any, 0, len(models))
	for _, m := range models {
		data = append(data, map[string]any{"id": m, "object": "model", "created": 0, "owned_by": "floe"})
	}
	_ = proxy.WriteJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}

// ---------------------------------------------------------------------------------------
// Streaming

// responsesStream writes the Responses event sequence. Items are opened as their first
// delta arrives and closed when a different one starts (or at End), so the caller sees
// reasoning, message and function_call items one after another, each as
// output_item.added … output_item.done.
type responsesStream struct {
	sse    *proxy.SSEWriter
	obj    *responsesObject
	seq    int
	err    error
	ended  bool
	opened int // kind of the open item
	// The open reasoning or message item and its text so far.
	reasoning *respReasoningItem
	message   *respMessageItem
	text      strings.Builder
	openIdx   int
	// Tool calls by their upstream index; call is the open one.
	calls map[int]*respStreamCall
	call  *respStreamCall
}

type respStreamCall struct {
	item   *respFunctionCallItem
	outIdx int
	args   strings.Builder
}

const (
	respNone = iota
	respReasoning
	respMessage
	respCall
)

// NewStream sends the SSE headers, response.created and response.in_progress.
func (Responses) NewStream(w http.ResponseWriter, req *proxy.Request) proxy.Stream {
	s := &responsesStream{sse: proxy.NewSSE(w), obj: respNewObject(req, "in_progress"), calls: map[int]*respStreamCall{}}
	s.emit("response.created", map[string]any{"response": s.obj})
	s.emit("response.in_progress", map[string]any{"response": s.obj})
	return s
}

func (s *responsesStream) emit(typ string, ev map[string]any) {
	if s.err != nil {
		return
	}
	ev["type"] = typ
	ev["sequence_number"] = s.seq
	s.seq++
	s.err = s.sse.Event(typ, ev)
}

// open appends item to the output and announces it.
func (s *responsesStream) open(kind int, item any) int {
	s.close("completed")
	idx := len(s.obj.Output)
	s.obj.Output = append(s.obj.Output, item)
	s.opened, s.openIdx = kind, idx
	s.emit("response.output_item.added", map[string]any{"output_index": idx, "item": item})
	return idx
}

// close finishes the open item, if any, giving a message or call status.
func (s *responsesStream) close(status string) {
	idx := s.openIdx
	switch s.opened {
	case respReasoning:
		it, text := s.reasoning, s.text.String()
		part := respSummaryText{Type: "summary_text", Text: text}
		s.emit("response.reasoning_summary_text.done", map[string]any{"item_id": it.ID, "output_index": idx, "summary_index": 0, "text": text})
		s.emit("response.reasoning_summary_part.done", map[string]any{"item_id": it.ID, "output_index": idx, "summary_index": 0, "part": part})
		it.Summary = []respSummaryText{part}
		it.EncryptedContent = respEncrypt(text)
		s.emit("response.output_item.done", map[string]any{"output_index": idx, "item": it})
	case respMessage:
		it, text := s.message, s.text.String()
		part := respOutputText{Type: "output_text", Text: text, Annotations: []any{}}
		s.emit("response.output_text.done", map[string]any{"item_id": it.ID, "output_index": idx, "content_index": 0, "text": text, "logprobs": []any{}})
		s.emit("response.content_part.done", map[string]any{"item_id": it.ID, "output_index": idx, "content_index": 0, "part": part})
		it.Content = []respOutputText{part}
		it.Status = status
		s.emit("response.output_item.done", map[string]any{"output_index": idx, "item": it})
	case respCall:
		c := s.call
		c.item.Arguments = c.args.String()
		s.emit("response.function_call_arguments.done", map[string]any{"item_id": c.item.ID, "output_index": idx, "name": c.item.Name, "arguments": c.item.Arguments})
		c.item.Status = status
		s.emit("response.output_item.done", map[string]any{"output_index": idx, "item": c.item})
		s.call = nil
	}
	s.opened = respNone
	s.reasoning, s.message = nil, nil
	s.text.Reset()
}

// Delta streams one increment: reasoning, then text, then tool-call fragments.
func (s *responsesStream) Delta(d proxy.Delta) error {
	if s.ended {
		return fmt.Errorf("responses stream: delta after the end")
	}
	if d.Reasoning != "" {
		if s.opened != respReasoning {
			it := &respReasoningItem{ID: respID("rs_"), Type: "reasoning", Summary: []respSummaryText{}}
			idx := s.open(respReasoning, it)
			s.reasoning = it
			s.emit("response.reasoning_summary_part.added", map[string]any{"item_id": it.ID, "output_index": idx, "summary_index": 0, "part": respSummaryText{Type: "summary_text", Text: ""}})
		}
		s.text.WriteString(d.Reasoning)
		s.emit("response.reasoning_summary_text.delta", map[string]any{"item_id": s.reasoning.ID, "output_index": s.openIdx, "summary_index": 0, "delta": d.Reasoning})
	}
	if d.Content != "" {
		if s.opened != respMessage {
			it := &respMessageItem{ID: respID("msg_"), Type: "message", Status: "in_progress", Role: "assistant", Content: []respOutputText{}}
			idx := s.open(respMessage, it)
			s.message = it
			s.emit("response.content_part.added", map[string]any{"item_id": it.ID, "output_index": idx, "content_index": 0, "part": respOutputText{Type: "output_text", Text: "", Annotations: []any{}}})
		}
		s.text.WriteString(d.Content)
		s.emit("response.output_text.delta", map[string]any{"item_id": s.message.ID, "output_index": s.openIdx, "content_index": 0, "delta": d.Content, "logprobs": []any{}})
	}
	for _, tc := range d.ToolCalls {
		c := s.calls[tc.Index]
		if c == nil {
			id := tc.ID
			if id == "" {
				id = respID("call_")
			}
			// The added event shows the call with empty arguments; they follow as deltas.
			c = &respStreamCall{item: &respFunctionCallItem{ID: respID("fc_"), Type: "function_call", Status: "in_progress", CallID: id, Name: tc.Name}}
			c.outIdx = s.open(respCall, c.item)
			s.calls[tc.Index], s.call = c, c
		} else if c.item.Name == "" && tc.Name != "" {
			c.item.Name = tc.Name
		}
		if tc.Arguments == "" {
			continue
		}
		c.args.WriteString(tc.Arguments)
		if c != s.call {
			// A fragment for a call already closed (the upstream interleaved calls): it
			// can no longer be streamed, but the final response carries it.
			c.item.Arguments = c.args.String()
			continue
		}
		s.emit("response.function_call_arguments.delta", map[string]any{"item_id": c.item.ID, "output_index": c.outIdx, "delta": tc.Arguments})
	}
	return s.err
}

// End closes the open item and sends response.completed, or response.incomplete when the
// answer was cut by the token limit or a content filter.
func (s *responsesStream) End(finishReason string, usage proxy.Usage) error {
	if s.ended {
		return fmt.Errorf("responses stream: already ended")
	}
	s.ended = true
	s.close(respItemStatus(finishReason))
	s.obj.finish(finishReason, usage)
	typ := "response.completed"
	if s.obj.Status == "incomplete" {
		typ = "response.incomplete"
	}
	s.emit(typ, map[string]any{"response": s.obj})
	return s.err
}

// Fail sends response.failed with the error's code, which Codex classifies
// (context_length_exceeded ends the turn as a full context window; others are retried).
func (s *responsesStream) Fail(err *proxy.Error) error {
	if s.ended {
		return fmt.Errorf("responses stream: already ended")
	}
	s.ended = true
	if err == nil {
		err = &proxy.Error{Kind: proxy.ErrInternal, Message: "unknown error"}
	}
	_, _, code, message := respErrorShape(err)
	switch err.Kind {
	case proxy.ErrInvalidRequest, proxy.ErrTooLarge, proxy.ErrNotFound:
		code = "invalid_prompt"
	case proxy.ErrAuthentication:
		code = "unauthorized"
	}
	s.obj.Status = "failed"
	s.obj.Error = &respErrorBody{Code: code, Message: message}
	s.emit("response.failed", map[string]any{"response": s.obj})
	return s.err
}
