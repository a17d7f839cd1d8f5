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

// Decode parses a Responses request into the normalized Chat request.
func (Responses) Decode(_ *http.Request, body []byte) (*proxy.Request, error) {
	top, err := reqjson.Parse(body)
	if err != nil {
		return nil, err
	}

	st := &responsesState{parallelToolCalls: true}
	req := &proxy.Request{State: st}

	model, err := top.Get("model").NonEmptyString()
	if err != nil {
		return nil, err
	}
	req.Model, req.Chat.Model = model, model

	prev := top.Get("previous_response_id")
	if id, err := prev.String(); err != nil {
		return nil, err
	} else if id != "" {
		return nil, prev.Errorf("not supported: floe keeps no responses; send store: false and the full history in input")
	}

	var msgs []proxy.ChatMessage
	if iv := top.Get("instructions"); !iv.IsNull() {
		s, err := iv.String()
		if err != nil {
			return nil, err
		}
		st.instructions = &s
		msgs = append(msgs, proxy.ChatMessage{Role: "system", Content: s})
	}

	input := top.Get("input")
	switch input.Kind() {
	case reqjson.Null:
		return nil, input.Required()
	case reqjson.String:
		s, err := input.String()
		if err != nil {
			return nil, err
		}
		msgs = append(msgs, proxy.ChatMessage{Role: "user", Content: s})
	case reqjson.Array:
		items, err := input.Array()
		if err != nil {
			return nil, err
		}
		b := respBuilder{msgs: msgs}
		for _, it := range items {
			if err := b.item(it); err != nil {
				return nil, err
			}
		}
		b.closeTurn()
		msgs = b.msgs
	default:
		return nil, input.Wrong("string or array of items")
	}
	if len(msgs) == 0 {
		return nil, input.Errorf("has no messages")
	}
	req.Chat.Messages = msgs

	toolsv := top.Get("tools")
	tools, err := toolsv.Array()
	if err != nil {
		return nil, err
	}
	st.tools = toolsv.Raw()
	for _, t := range tools {
		ct, err := respTool(t)
		if err != nil {
			return nil, err
		}
		if ct != nil {
			req.Chat.Tools = append(req.Chat.Tools, *ct)
		}
	}
	if tcv := top.Get("tool_choice"); !tcv.IsNull() {
		choice, err := respToolChoice(tcv)
		if err != nil {
			return nil, err
		}
		st.toolChoice = tcv.Raw()
		if len(req.Chat.Tools) > 0 {
			req.Chat.ToolChoice = choice
		}
	}
	if pv := top.Get("parallel_tool_calls"); !pv.IsNull() {
		b, err := pv.Bool()
		if err != nil {
			return nil, err
		}
		st.parallelToolCalls = b
		if len(req.Chat.Tools) > 0 {
			req.Chat.ParallelToolCalls = &b
		}
	}
	maxv := top.Get("max_output_tokens")
	n, err := maxv.Int()
	if err != nil {
		return nil, err
	}
	if n != nil && *n < 1 {
		return nil, maxv.Errorf("must be at least 1")
	}
	st.maxOutputTokens, req.Chat.MaxCompletionTokens = n, n
	if st.temperature, err = top.Get("temperature").Number(); err != nil {
		return nil, err
	}
	req.Chat.Temperature = st.temperature
	if st.topP, err = top.Get("top_p").Number(); err != nil {
		return nil, err
	}
	req.Chat.TopP = st.topP
	if rv := top.Get("reasoning"); !rv.IsNull() {
		r, err := rv.Object()
		if err != nil {
			return nil, err
		}
		st.reasoning = rv.Raw()
		effort, err := r.Get("effort").String()
		if err != nil {
			return nil, err
		}
		if _, err := r.Get("summary").String(); err != nil {
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
	if req.Stream, err = top.Get("stream").Bool(); err != nil {
		return nil, err
	}
	req.Chat.Stream = req.Stream
	if st.store, err = top.Get("store").Bool(); err != nil {
		return nil, err
	}
	for _, key := range []string{"text", "metadata"} {
		v := top.Get(key)
		if _, err := v.Object(); err != nil {
			return nil, err
		}
		if key == "text" {
			st.text = v.Raw()
		} else {
			st.metadata = v.Raw()
		}
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

func (b *respBuilder) item(v reqjson.Value) error {
	if err := v.Required(); err != nil {
		return err
	}
	it, err := v.Object()
	if err != nil {
		return err
	}
	typv := it.Get("type")
	typ, err := typv.String()
	if err != nil {
		return err
	}
	if typ == "" {
		if !it.Has("role") {
			return typv.Required()
		}
		typ = "message" // EasyInputMessage: {role, content}
	}
	switch typ {
	case "message":
		rolev := it.Get("role")
		role, err := rolev.String()
		if err != nil {
			return err
		}
		content := it.Get("content")
		if err := content.Required(); err != nil {
			return err
		}
		switch role {
		case "assistant":
			text, err := respText(content, "")
			if err != nil {
				return err
			}
			b.turn()
			b.content.WriteString(text)
		case "system", "developer":
			text, err := respText(content, "\n")
			if err != nil {
				return err
			}
			b.add(proxy.ChatMessage{Role: "system", Content: text})
		case "user":
			c, err := respUserContent(content)
			if err != nil {
				return err
			}
			b.add(proxy.ChatMessage{Role: "user", Content: c})
		case "":
			return rolev.Required()
		default:
			return rolev.Errorf("must be user, assistant, system or developer, not %q", role)
		}
	case "function_call":
		callID, err := it.Get("call_id").NonEmptyString()
		if err != nil {
			return err
		}
		name, err := it.Get("name").NonEmptyString()
		if err != nil {
			return err
		}
		var args string
		switch av := it.Get("arguments"); av.Kind() {
		case reqjson.Null:
		case reqjson.String:
			if args, err = av.String(); err != nil {
				return err
			}
		default:
			args = string(av.Raw()) // lenient: arguments given as JSON
		}
		b.turn()
		b.calls = append(b.calls, proxy.ChatToolCall{ID: callID, Type: "function", Function: proxy.ChatFunctionCall{Name: name, Arguments: args}})
	case "function_call_output":
		callID, err := it.Get("call_id").NonEmptyString()
		if err != nil {
			return err
		}
		out, err := respToolOutput(it.Get("output"))
		if err != nil {
			return err
		}
		b.add(proxy.ChatMessage{Role: "tool", Content: out, ToolCallID: callID})
	case "reasoning":
		text, exact, err := respReasoningText(it)
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
func respReasoningText(it reqjson.Fields) (string, bool, error) {
	enc, err := it.Get("encrypted_content").String()
	if err != nil {
		return "", false, err
	}
	if s, ok := proxy.ReasoningFromSignature(enc); ok {
		return s, true, nil
	}
	join := func(key, sep string) (string, error) {
		parts, err := it.Get(key).Array()
		if err != nil {
			return "", err
		}
		var texts []string
		for _, p := range parts {
			po, err := p.Object()
			if err != nil {
				return "", err
			}
			t, err := po.Get("text").String()
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
func respContentParts(v reqjson.Value) ([]respPart, error) {
	switch v.Kind() {
	case reqjson.String:
		s, err := v.String()
		if err != nil {
			return nil, err
		}
		return []respPart{{text: s}}, nil
	case reqjson.Array:
	default:
		return nil, v.Wrong("string or array of content parts")
	}
	items, err := v.Array()
	if err != nil {
		return nil, err
	}
	var parts []respPart
	for _, p := range items {
		if err := p.Required(); err != nil {
			return nil, err
		}
		po, err := p.Object()
		if err != nil {
			return nil, err
		}
		typ, err := po.Get("type").String()
		if err != nil {
			return nil, err
		}
		switch typ {
		case "input_text", "output_text", "text", "summary_text", "reasoning_text":
			t, err := po.Get("text").String()
			if err != nil {
				return nil, err
			}
			parts = append(parts, respPart{text: t})
		case "refusal":
			t, err := po.Get("refusal").String()
			if err != nil {
				return nil, err
			}
			parts = append(parts, respPart{text: t})
		case "input_image":
			url, err := respImageURL(po.Get("image_url"))
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

// respImageURL is an input_image's image_url: a URL string, or (leniently) Chat's
// {"url": ...}. file_id is not supported.
func respImageURL(v reqjson.Value) (string, error) {
	if v.Kind() == reqjson.Object {
		o, err := v.Object()
		if err != nil {
			return "", err
		}
		v = o.Get("url")
	}
	if v.IsNull() {
		return "", v.Errorf("required (file_id is not supported)")
	}
	return v.NonEmptyString()
}

// respText joins a content's text parts with sep; images are dropped.
func respText(v reqjson.Value, sep string) (string, error) {
	parts, err := respContentParts(v)
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
func respUserContent(v reqjson.Value) (any, error) {
	parts, err := respContentParts(v)
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
func respToolOutput(v reqjson.Value) (string, error) {
	switch v.Kind() {
	case reqjson.Null:
		return "", nil
	case reqjson.String:
		return v.String()
	case reqjson.Array:
		return respText(v, "\n")
	case reqjson.Object: // older Codex: {"content": "...", "success": false}
		o, err := v.Object()
		if err != nil {
			return "", err
		}
		if c := o.Get("content"); c.Kind() == reqjson.String {
			return c.String()
		}
	}
	return string(v.Raw()), nil
}

// respTool converts a function tool; other tool types give nil (not forwarded).
func respTool(v reqjson.Value) (*proxy.ChatTool, error) {
	if err := v.Required(); err != nil {
		return nil, err
	}
	t, err := v.Object()
	if err != nil {
		return nil, err
	}
	typ, err := t.Get("type").NonEmptyString()
	if err != nil {
		return nil, err
	}
	if typ != "function" {
		return nil, nil // web_search, local_shell, custom, namespace, file_search …
	}
	src := t
	if !t.Has("name") && t.Has("function") { // lenient: Chat's nested shape
		if src, err = t.Get("function").Object(); err != nil {
			return nil, err
		}
	}
	name, err := src.Get("name").NonEmptyString()
	if err != nil {
		return nil, err
	}
	desc, err := src.Get("description").String()
	if err != nil {
		return nil, err
	}
	pv := src.Get("parameters")
	if _, err := pv.Object(); err != nil {
		return nil, err
	}
	var params json.RawMessage
	if !pv.IsNull() {
		params = append(json.RawMessage(nil), pv.Raw()...)
	}
	return &proxy.ChatTool{Type: "function", Function: proxy.ChatFunction{Name: name, Description: desc, Parameters: params}}, nil
}

// respToolChoice normalizes tool_choice; nil means "not forwarded".
func respToolChoice(v reqjson.Value) (json.RawMessage, error) {
	switch v.Kind() {
	case reqjson.String:
		s, err := v.String()
		if err != nil {
			return nil, err
		}
		switch s {
		case "auto", "none", "required":
			return json.RawMessage(`"` + s + `"`), nil
		}
		return nil, v.Errorf("must be auto, none, required or an object, not %q", s)
	case reqjson.Object:
		o, err := v.Object()
		if err != nil {
			return nil, err
		}
		typv := o.Get("type")
		typ, err := typv.String()
		if err != nil {
			return nil, err
		}
		switch typ {
		case "function":
			name, err := o.Get("name").NonEmptyString()
			if err != nil {
				return nil, err
			}
			b, _ := json.Marshal(map[string]any{"type": "function", "function": map[string]string{"name": name}})
			return b, nil
		case "allowed_tools":
			// The restriction is not expressible in Chat; keep its mode.
			mode, err := o.Get("mode").String()
			if err != nil {
				return nil, err
			}
			if mode == "required" {
				return json.RawMessage(`"required"`), nil
			}
			return json.RawMessage(`"auto"`), nil
		case "":
			return nil, typv.Required()
		}
		return nil, nil // a hosted or custom tool: not forwarded, so neither is the choice
	}
	return nil, v.Wrong("string or object")
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
		case err.CompletionTokens > 0 && err.MaxTokens > 0 && err.PromptTokens < err.MaxTokens:
			// The input fits; with max_output_tokens it does not.
			message = fmt.Sprintf("Your input (%d tokens) and max_output_tokens (%d) exceed the context window of this model (%d tokens). Please lower max_output_tokens and try again.",
				err.PromptTokens, err.CompletionTokens, err.MaxTokens)
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
	case proxy.ErrCapacity:
		status, typ, code = respOr(status, http.StatusTooManyRequests), "requests", "rate_limit_exceeded"
	case proxy.ErrTimeout:
		status, typ, code = respOr(status, http.StatusGatewayTimeout), "server_error", "timeout"
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

// respTextDelta is a response.output_text.delta event, respSummaryDelta a
// response.reasoning_summary_text.delta one and respArgumentsDelta a
// response.function_call_arguments.delta one: one per token or so, so encoded from a
// struct rather than a map (half the cost). Their fields are in the order of their
// names, as a map's keys are encoded: the events are the same bytes as emit's.
type respTextDelta struct {
	ContentIndex   int    `json:"content_index"`
	Delta          string `json:"delta"`
	ItemID         string `json:"item_id"`
	Logprobs       []any  `json:"logprobs"`
	OutputIndex    int    `json:"output_index"`
	SequenceNumber int    `json:"sequence_number"`
	Type           string `json:"type"`
}

type respSummaryDelta struct {
	Delta          string `json:"delta"`
	ItemID         string `json:"item_id"`
	OutputIndex    int    `json:"output_index"`
	SequenceNumber int    `json:"sequence_number"`
	SummaryIndex   int    `json:"summary_index"`
	Type           string `json:"type"`
}

type respArgumentsDelta struct {
	Delta          string `json:"delta"`
	ItemID         string `json:"item_id"`
	OutputIndex    int    `json:"output_index"`
	SequenceNumber int    `json:"sequence_number"`
	Type           string `json:"type"`
}

// emitDelta writes a delta event, numbered as emit numbers events.
func (s *responsesStream) emitDelta(ev interface {
	number(seq int) (typ string)
}) {
	if s.err != nil {
		return
	}
	typ := ev.number(s.seq)
	s.seq++
	s.err = s.sse.Event(typ, ev)
}

func (e *respTextDelta) number(seq int) string    { e.SequenceNumber = seq; return e.Type }
func (e *respSummaryDelta) number(seq int) string { e.SequenceNumber = seq; return e.Type }
func (e *respArgumentsDelta) number(seq int) string {
	e.SequenceNumber = seq
	return e.Type
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
		s.emitDelta(&respSummaryDelta{Delta: d.Reasoning, ItemID: s.reasoning.ID, OutputIndex: s.openIdx, Type: "response.reasoning_summary_text.delta"})
	}
	if d.Content != "" {
		if s.opened != respMessage {
			it := &respMessageItem{ID: respID("msg_"), Type: "message", Status: "in_progress", Role: "assistant", Content: []respOutputText{}}
			idx := s.open(respMessage, it)
			s.message = it
			s.emit("response.content_part.added", map[string]any{"item_id": it.ID, "output_index": idx, "content_index": 0, "part": respOutputText{Type: "output_text", Text: "", Annotations: []any{}}})
		}
		s.text.WriteString(d.Content)
		s.emitDelta(&respTextDelta{Delta: d.Content, ItemID: s.message.ID, Logprobs: []any{}, OutputIndex: s.openIdx, Type: "response.output_text.delta"})
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
		s.emitDelta(&respArgumentsDelta{Delta: tc.Arguments, ItemID: c.item.ID, OutputIndex: c.outIdx, Type: "response.function_call_arguments.delta"})
	}
	return s.err
}

// End closes the open item and sends response.completed, or response.incomplete when the
// answer was cut by the token limit or a content filter.
func (s *responsesStream) End(finish proxy.Finish, usage proxy.Usage) error {
	finishReason := finish.Reason
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
