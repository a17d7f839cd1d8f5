// Package gemini is the Google Gemini dialect of the proxy (…:generateContent,
// …:streamGenerateContent, …:countTokens, GET /v1beta/models).
package gemini

// Gemini dialect: Google's Generative Language API (v1beta) as Gemini CLI and the
// @google/genai SDK speak it.
//
//   POST /v1beta/models/{model}:generateContent        complete answer
//   POST /v1beta/models/{model}:streamGenerateContent  SSE "data:" events (with or without ?alt=sse)
//   POST /v1beta/models/{model}:countTokens            {"totalTokens": n}
//   GET  /v1beta/models                                model list
//
// The model and the method come from the path ("/v1/…", "/v1alpha/…", ".../tunedModels/…"
// and Vertex-style ".../publishers/google/models/…" are accepted too). Bodies may use the
// API's camelCase or the snake_case the API also accepts; keys inside function arguments,
// function responses and schemas are left alone.
//
// Decisions worth knowing:
//
//   - Reasoning and thoughtSignature. Gemini CLI drops thought parts from its history but
//     keeps a part's thoughtSignature, and merges later text parts into the first one.
//     So when floe answers with reasoning it puts its own signature,
//     base64("floe1." + reasoning), on the FIRST non-thought part of the answer (the first
//     text part or function call; a part carrying only the signature when there is
//     neither). On decode, a model turn's reasoning is taken from floe's signatures when
//     any are present (they are exact; distinct ones are concatenated in order), else
//     from its thought parts. Signatures floe did not write (Gemini's own, Gemini CLI's
//     "skip_thought_signature_validator") are ignored.
//   - Thought parts are sent to the caller only when generationConfig.thinkingConfig.
//     includeThoughts is true, as Gemini does; the signature is sent either way, so the
//     reasoning survives a harness that never saw it.
//   - Tool-call ids: a functionCall's id when present, else "call_<turn>_<k>" (turn = index
//     in contents, k = index among the turn's function calls), stable across requests.
//     A functionResponse takes its own id, else the first unanswered call of the previous
//     model turn with its name (any unanswered one when it has no name), else
//     "call_<turn>_<k>" of its own position. Tool messages are emitted before any other
//     user parts of the same content, as Chat Completions requires.
//   - Text parts are joined with "" in model turns (they are stream deltas) and with "\n"
//     in user turns and the system instruction (as vLLM joins a list of text parts).
//   - inlineData / fileData of image/* become image_url parts (data: URI for inlineData);
//     other media become a short text placeholder, since the engine takes text and images.
//   - Gemini Schema `parameters` have their upper-case type names (OBJECT, STRING, …)
//     lower-cased into JSON Schema, key order kept; parametersJsonSchema is forwarded
//     verbatim. Non-function tools (googleSearch, codeExecution, urlContext, …) are
//     accepted and not forwarded.
//   - Answers: finishReason STOP for stop and tool calls, MAX_TOKENS for length, SAFETY for
//     content_filter, OTHER for anything else. Function-call args are the parsed JSON
//     object of the arguments ({} when they are empty or not a JSON object). Usage has no
//     reasoning-token count, so thoughtsTokenCount is never sent and candidatesTokenCount
//     includes reasoning tokens.

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strings"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/reqjson"
)

// Dialect is the Google Gemini API.
type Dialect struct{}

var (
	_ proxy.Dialect      = Dialect{}
	_ proxy.TokenCounter = Dialect{}
)

// Gemini API methods floe serves.
const (
	methodGenerate = "generateContent"
	methodStream   = "streamGenerateContent"
	methodCount    = "countTokens"
)

// state is the Gemini dialect's Request.State.
type state struct {
	Method          string // generateContent, streamGenerateContent or countTokens
	IncludeThoughts bool   // send thought parts to the caller
}

// Name implements Dialect.
func (Dialect) Name() string { return "gemini" }

// ---- wire types ----

type request struct {
	Contents               []wireContent     `json:"contents"`
	SystemInstruction      *wireContent      `json:"systemInstruction,omitempty"`
	Tools                  []tool            `json:"tools,omitempty"`
	ToolConfig             *toolConfig       `json:"toolConfig,omitempty"`
	GenerationConfig       *generationConfig `json:"generationConfig,omitempty"`
	GenerateContentRequest *request          `json:"generateContentRequest,omitempty"` // countTokens
}

type wireContent struct {
	Role  string `json:"role,omitempty"`
	Parts []part `json:"parts"`
}

type part struct {
	Text             *string           `json:"text,omitempty"`
	Thought          bool              `json:"thought,omitempty"`
	ThoughtSignature string            `json:"thoughtSignature,omitempty"`
	InlineData       *blob             `json:"inlineData,omitempty"`
	FileData         *fileData         `json:"fileData,omitempty"`
	FunctionCall     *functionCall     `json:"functionCall,omitempty"`
	FunctionResponse *functionResponse `json:"functionResponse,omitempty"`
}

type blob struct {
	MimeType string `json:"mimeType"`
	Data     string `json:"data"`
}

type fileData struct {
	MimeType string `json:"mimeType,omitempty"`
	FileURI  string `json:"fileUri"`
}

type functionCall struct {
	ID   string          `json:"id,omitempty"`
	Name string          `json:"name"`
	Args json.RawMessage `json:"args,omitempty"`
}

type functionResponse struct {
	ID       string          `json:"id,omitempty"`
	Name     string          `json:"name"`
	Response json.RawMessage `json:"response,omitempty"`
	Parts    []part          `json:"parts,omitempty"` // multimodal function responses
}

type tool struct {
	FunctionDeclarations []functionDeclaration `json:"functionDeclarations,omitempty"`
	// googleSearch, codeExecution, urlContext, … are accepted and not forwarded.
}

type functionDeclaration struct {
	Name                 string          `json:"name"`
	Description          string          `json:"description,omitempty"`
	Parameters           json.RawMessage `json:"parameters,omitempty"`
	ParametersJSONSchema json.RawMessage `json:"parametersJsonSchema,omitempty"`
}

type toolConfig struct {
	FunctionCallingConfig *functionCallingConfig `json:"functionCallingConfig"`
}

type functionCallingConfig struct {
	Mode                 string   `json:"mode"`
	AllowedFunctionNames []string `json:"allowedFunctionNames"`
}

type generationConfig struct {
	MaxOutputTokens *float64        `json:"maxOutputTokens"`
	Temperature     *float64        `json:"temperature"`
	TopP            *float64        `json:"topP"`
	TopK            *float64        `json:"topK"` // ignored
	StopSequences   []string        `json:"stopSequences"`
	CandidateCount  *float64        `json:"candidateCount"`
	ThinkingConfig  *thinkingConfig `json:"thinkingConfig"`
}

type thinkingConfig struct {
	ThinkingBudget  *float64 `json:"thinkingBudget"`
	IncludeThoughts *bool    `json:"includeThoughts"`
}

type response struct {
	Candidates    []candidate `json:"candidates"`
	UsageMetadata *wireUsage  `json:"usageMetadata,omitempty"`
	ModelVersion  string      `json:"modelVersion,omitempty"`
	ResponseID    string      `json:"responseId,omitempty"`
}

type candidate struct {
	Content      wireContent `json:"content"`
	FinishReason string      `json:"finishReason,omitempty"`
	Index        int         `json:"index"`
}

type wireUsage struct {
	PromptTokenCount     int `json:"promptTokenCount"`
	CandidatesTokenCount int `json:"candidatesTokenCount"`
	TotalTokenCount      int `json:"totalTokenCount"`
}

type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
	Status  string `json:"status"`
}

// ---- Decode ----

// Decode implements Dialect.
func (Dialect) Decode(r *http.Request, body []byte) (*proxy.Request, error) {
	if r == nil || r.URL == nil {
		return nil, proxy.InvalidRequest("path: the request has no URL")
	}
	model, method, perr := parsePath(r.URL.Path)
	if perr != nil {
		return nil, perr
	}
	top, err := reqjson.Parse(body)
	if err != nil {
		return nil, err
	}
	gr, err := decodeRequest(top)
	if err != nil {
		return nil, err
	}
	at := ""
	if method == methodCount && len(gr.Contents) == 0 && gr.GenerateContentRequest != nil {
		gr = *gr.GenerateContentRequest
		at = "generateContentRequest."
	}
	chat, include, derr := toChat(&gr, at)
	if derr != nil {
		return nil, derr
	}
	chat.Model = model
	chat.Stream = method == methodStream
	return &proxy.Request{
		Chat:   chat,
		Model:  model,
		Stream: chat.Stream,
		State:  &state{Method: method, IncludeThoughts: include},
	}, nil
}

// parsePath splits ".../models/{model}:{method}" into its model and method.
func parsePath(p string) (model, method string, err *proxy.Error) {
	bad := func(why string) (string, string, *proxy.Error) {
		return "", "", proxy.InvalidRequest("path %q: %s; expected /v1beta/models/{model}:{generateContent|streamGenerateContent|countTokens}", p, why)
	}
	colon := strings.LastIndexByte(p, ':')
	if colon < 0 || colon < strings.LastIndexByte(p, '/') {
		return bad("no :method after the model")
	}
	method, res := p[colon+1:], p[:colon]
	start := -1
	if strings.HasPrefix(res, "models/") {
		start = len("models/")
	}
	for _, seg := range []string{"/models/", "/tunedModels/"} {
		if k := strings.LastIndex(res, seg); k >= 0 && k+len(seg) > start {
			start = k + len(seg)
		}
	}
	if start < 0 {
		return bad("no models/ segment")
	}
	model = res[start:]
	if model == "" || strings.ContainsRune(model, '/') {
		return bad("model name is empty or malformed")
	}
	switch method {
	case methodGenerate, methodStream, methodCount:
	default:
		return bad(fmt.Sprintf("unsupported method %q", method))
	}
	return model, method, nil
}

// field reads the field named key in camelCase, or in the snake_case the API also
// accepts when the camelCase one is absent; errors name the spelling the caller used.
func field(f reqjson.Fields, key string) reqjson.Value {
	if v := f.Get(key); !v.IsNull() {
		return v
	}
	return f.Get(snakeCase(key))
}

// snakeCase maps "maxOutputTokens" to "max_output_tokens".
func snakeCase(k string) string {
	var b strings.Builder
	for _, c := range k {
		if c >= 'A' && c <= 'Z' {
			b.WriteByte('_')
			c += 'a' - 'A'
		}
		b.WriteRune(c)
	}
	return b.String()
}

// object reads the field key as an object; present is false when it is absent or null.
func object(f reqjson.Fields, key string) (obj reqjson.Fields, present bool, err error) {
	v := field(f, key)
	if v.IsNull() {
		return obj, false, nil
	}
	obj, err = v.Object()
	return obj, err == nil, err
}

// objects reads the field key as an array of objects and calls each on every element.
func objects(f reqjson.Fields, key string, each func(reqjson.Fields) error) error {
	elems, err := field(f, key).Array()
	if err != nil {
		return err
	}
	for _, e := range elems {
		o, err := e.Object()
		if err != nil {
			return err
		}
		if err := each(o); err != nil {
			return err
		}
	}
	return nil
}

// decodeRequest reads a GenerateContentRequest (or a countTokens request, which may wrap
// one in generateContentRequest).
func decodeRequest(f reqjson.Fields) (request, error) {
	var gr request
	err := objects(f, "contents", func(o reqjson.Fields) error {
		c, err := decodeContent(o)
		gr.Contents = append(gr.Contents, c)
		return err
	})
	if err != nil {
		return gr, err
	}
	if si, ok, err := object(f, "systemInstruction"); err != nil {
		return gr, err
	} else if ok {
		c, err := decodeContent(si)
		if err != nil {
			return gr, err
		}
		gr.SystemInstruction = &c
	}
	err = objects(f, "tools", func(o reqjson.Fields) error {
		var t tool
		err := objects(o, "functionDeclarations", func(d reqjson.Fields) error {
			fd, err := decodeDeclaration(d)
			t.FunctionDeclarations = append(t.FunctionDeclarations, fd)
			return err
		})
		gr.Tools = append(gr.Tools, t)
		return err
	})
	if err != nil {
		return gr, err
	}
	if tc, ok, err := object(f, "toolConfig"); err != nil {
		return gr, err
	} else if ok {
		if gr.ToolConfig, err = decodeToolConfig(tc); err != nil {
			return gr, err
		}
	}
	if gc, ok, err := object(f, "generationConfig"); err != nil {
		return gr, err
	} else if ok {
		if gr.GenerationConfig, err = decodeGenerationConfig(gc); err != nil {
			return gr, err
		}
	}
	if inner, ok, err := object(f, "generateContentRequest"); err != nil {
		return gr, err
	} else if ok {
		r, err := decodeRequest(inner)
		if err != nil {
			return gr, err
		}
		gr.GenerateContentRequest = &r
	}
	return gr, nil
}

func decodeContent(f reqjson.Fields) (wireContent, error) {
	var c wireContent
	var err error
	if c.Role, err = field(f, "role").String(); err != nil {
		return c, err
	}
	c.Parts, err = decodeParts(f)
	return c, err
}

func decodeParts(f reqjson.Fields) ([]part, error) {
	var parts []part
	err := objects(f, "parts", func(o reqjson.Fields) error {
		p, err := decodePart(o)
		parts = append(parts, p)
		return err
	})
	return parts, err
}

func decodePart(f reqjson.Fields) (part, error) {
	var p part
	var err error
	if tv := field(f, "text"); !tv.IsNull() {
		s, err := tv.String()
		if err != nil {
			return p, err
		}
		p.Text = &s
	}
	if p.Thought, err = field(f, "thought").Bool(); err != nil {
		return p, err
	}
	if p.ThoughtSignature, err = field(f, "thoughtSignature").String(); err != nil {
		return p, err
	}
	if o, ok, err := object(f, "inlineData"); err != nil {
		return p, err
	} else if ok {
		var b blob
		if b.MimeType, err = field(o, "mimeType").String(); err != nil {
			return p, err
		}
		if b.Data, err = field(o, "data").String(); err != nil {
			return p, err
		}
		p.InlineData = &b
	}
	if o, ok, err := object(f, "fileData"); err != nil {
		return p, err
	} else if ok {
		var fd fileData
		if fd.MimeType, err = field(o, "mimeType").String(); err != nil {
			return p, err
		}
		if fd.FileURI, err = field(o, "fileUri").String(); err != nil {
			return p, err
		}
		p.FileData = &fd
	}
	if o, ok, err := object(f, "functionCall"); err != nil {
		return p, err
	} else if ok {
		var fc functionCall
		if fc.ID, err = field(o, "id").String(); err != nil {
			return p, err
		}
		if fc.Name, err = field(o, "name").String(); err != nil {
			return p, err
		}
		fc.Args = field(o, "args").Raw()
		p.FunctionCall = &fc
	}
	if o, ok, err := object(f, "functionResponse"); err != nil {
		return p, err
	} else if ok {
		var fr functionResponse
		if fr.ID, err = field(o, "id").String(); err != nil {
			return p, err
		}
		if fr.Name, err = field(o, "name").String(); err != nil {
			return p, err
		}
		fr.Response = field(o, "response").Raw()
		if fr.Parts, err = decodeParts(o); err != nil {
			return p, err
		}
		p.FunctionResponse = &fr
	}
	return p, nil
}

func decodeDeclaration(f reqjson.Fields) (functionDeclaration, error) {
	var fd functionDeclaration
	var err error
	if fd.Name, err = field(f, "name").String(); err != nil {
		return fd, err
	}
	if fd.Description, err = field(f, "description").String(); err != nil {
		return fd, err
	}
	fd.Parameters = field(f, "parameters").Raw()
	fd.ParametersJSONSchema = field(f, "parametersJsonSchema").Raw()
	return fd, nil
}

func decodeToolConfig(f reqjson.Fields) (*toolConfig, error) {
	fcc, ok, err := object(f, "functionCallingConfig")
	if err != nil || !ok {
		return &toolConfig{}, err
	}
	tc := &toolConfig{FunctionCallingConfig: &functionCallingConfig{}}
	if tc.FunctionCallingConfig.Mode, err = field(fcc, "mode").String(); err != nil {
		return nil, err
	}
	if tc.FunctionCallingConfig.AllowedFunctionNames, err = field(fcc, "allowedFunctionNames").Strings(); err != nil {
		return nil, err
	}
	return tc, nil
}

func decodeGenerationConfig(f reqjson.Fields) (*generationConfig, error) {
	g := &generationConfig{}
	var err error
	for _, n := range []struct {
		key string
		to  **float64
	}{
		{"maxOutputTokens", &g.MaxOutputTokens}, {"temperature", &g.Temperature}, {"topP", &g.TopP},
		{"topK", &g.TopK}, {"candidateCount", &g.CandidateCount},
	} {
		if *n.to, err = field(f, n.key).Number(); err != nil {
			return nil, err
		}
	}
	if g.StopSequences, err = field(f, "stopSequences").Strings(); err != nil {
		return nil, err
	}
	if tc, ok, err := object(f, "thinkingConfig"); err != nil {
		return nil, err
	} else if ok {
		g.ThinkingConfig = &thinkingConfig{}
		if g.ThinkingConfig.ThinkingBudget, err = field(tc, "thinkingBudget").Number(); err != nil {
			return nil, err
		}
		if iv := field(tc, "includeThoughts"); !iv.IsNull() {
			b, err := iv.Bool()
			if err != nil {
				return nil, err
			}
			g.ThinkingConfig.IncludeThoughts = &b
		}
	}
	return g, nil
}

// pendingCall is a function call of the previous model turn awaiting its response.
type pendingCall struct {
	id, name string
	answered bool
}

func toChat(gr *request, at string) (proxy.ChatRequest, bool, *proxy.Error) {
	var chat proxy.ChatRequest
	if len(gr.Contents) == 0 {
		return chat, false, proxy.InvalidRequest("%scontents: required and must not be empty", at)
	}
	if si := gr.SystemInstruction; si != nil {
		if text := joinText(si.Parts, "\n"); text != "" {
			chat.Messages = append(chat.Messages, proxy.ChatMessage{Role: "system", Content: text})
		}
	}
	var pending []pendingCall
	for i, c := range gr.Contents {
		where := fmt.Sprintf("%scontents[%d]", at, i)
		switch strings.ToLower(c.Role) {
		case "model":
			msg, calls, err := modelMessage(c, i, where)
			if err != nil {
				return chat, false, err
			}
			chat.Messages = append(chat.Messages, msg)
			pending = calls
		case "user", "", "function", "tool":
			chat.Messages = append(chat.Messages, userMessages(c, i, pending)...)
		default:
			return chat, false, proxy.InvalidRequest("%s.role: %q is not user or model", where, c.Role)
		}
	}

	for ti, t := range gr.Tools {
		for fi, fd := range t.FunctionDeclarations {
			where := fmt.Sprintf("%stools[%d].functionDeclarations[%d]", at, ti, fi)
			if fd.Name == "" {
				return chat, false, proxy.InvalidRequest("%s.name: required", where)
			}
			fn := proxy.ChatFunction{Name: fd.Name, Description: fd.Description}
			switch {
			case isPresent(fd.ParametersJSONSchema):
				fn.Parameters = compact(fd.ParametersJSONSchema)
			case isPresent(fd.Parameters):
				p, err := schema(fd.Parameters)
				if err != nil {
					return chat, false, proxy.InvalidRequest("%s.parameters: %v", where, err)
				}
				fn.Parameters = p
			}
			chat.Tools = append(chat.Tools, proxy.ChatTool{Type: "function", Function: fn})
		}
	}

	if tc := gr.ToolConfig; tc != nil && tc.FunctionCallingConfig != nil {
		fc := tc.FunctionCallingConfig
		var choice any
		switch strings.ToUpper(fc.Mode) {
		case "", "MODE_UNSPECIFIED":
		case "AUTO", "VALIDATED":
			choice = "auto"
		case "NONE":
			choice = "none"
		case "ANY":
			choice = "required"
			if len(fc.AllowedFunctionNames) == 1 {
				choice = map[string]any{"type": "function", "function": map[string]string{"name": fc.AllowedFunctionNames[0]}}
			}
		default:
			return chat, false, proxy.InvalidRequest("%stoolConfig.functionCallingConfig.mode: %q is not AUTO, ANY, NONE or VALIDATED", at, fc.Mode)
		}
		if choice != nil && len(chat.Tools) > 0 {
			chat.ToolChoice, _ = json.Marshal(choice)
		}
	}

	include := false
	if g := gr.GenerationConfig; g != nil {
		if g.MaxOutputTokens != nil && *g.MaxOutputTokens >= 1 && *g.MaxOutputTokens < 1<<31 {
			n := int(*g.MaxOutputTokens)
			chat.MaxCompletionTokens = &n
		}
		chat.Temperature = g.Temperature
		chat.TopP = g.TopP
		if len(g.StopSequences) > 0 {
			chat.Stop = g.StopSequences
		}
		if g.CandidateCount != nil && *g.CandidateCount >= 1 && *g.CandidateCount < 1<<31 {
			n := int(*g.CandidateCount)
			chat.N = &n
		}
		if tc := g.ThinkingConfig; tc != nil {
			if tc.ThinkingBudget != nil && *tc.ThinkingBudget == 0 {
				chat.ChatTemplateKwargs = map[string]any{"enable_thinking": false}
			}
			include = tc.IncludeThoughts != nil && *tc.IncludeThoughts
		}
	}
	return chat, include, nil
}

// modelMessage turns a model turn into an assistant message and its function calls.
func modelMessage(c wireContent, turn int, where string) (proxy.ChatMessage, []pendingCall, *proxy.Error) {
	var text, thoughts strings.Builder
	var restored []string
	seen := map[string]bool{}
	var calls []pendingCall
	msg := proxy.ChatMessage{Role: "assistant"}
	for j, p := range c.Parts {
		if sig := p.ThoughtSignature; sig != "" && !seen[sig] {
			if r, ok := readSignature(sig); ok {
				seen[sig] = true
				restored = append(restored, r)
			}
		}
		if fc := p.FunctionCall; fc != nil {
			if fc.Name == "" {
				return msg, nil, proxy.InvalidRequest("%s.parts[%d].functionCall.name: required", where, j)
			}
			id := fc.ID
			if id == "" {
				id = fmt.Sprintf("call_%d_%d", turn, len(calls))
			}
			msg.ToolCalls = append(msg.ToolCalls, proxy.ChatToolCall{
				ID: id, Type: "function",
				Function: proxy.ChatFunctionCall{Name: fc.Name, Arguments: argsString(fc.Args)},
			})
			calls = append(calls, pendingCall{id: id, name: fc.Name})
		}
		if p.Text != nil {
			if p.Thought {
				thoughts.WriteString(*p.Text)
			} else {
				text.WriteString(*p.Text)
			}
		}
	}
	msg.Content = text.String()
	if len(restored) > 0 {
		msg.ReasoningContent = strings.Join(restored, "")
	} else {
		msg.ReasoningContent = thoughts.String()
	}
	return msg, calls, nil
}

// userMessages turns a user turn into tool messages (its function responses, first)
// and a user message (its other parts).
func userMessages(c wireContent, turn int, pending []pendingCall) []proxy.ChatMessage {
	var tools []proxy.ChatMessage
	var parts []proxy.ChatPart
	image := false
	addMedia := func(mime, url string, inline bool) {
		if strings.HasPrefix(strings.ToLower(mime), "image/") {
			if inline {
				url = "data:" + mime + ";base64," + url
			}
			parts = append(parts, proxy.ChatPart{Type: "image_url", ImageURL: &proxy.ChatImageURL{URL: url}})
			image = true
			return
		}
		if mime == "" {
			mime = "unknown"
		}
		parts = append(parts, proxy.ChatPart{Type: "text", Text: fmt.Sprintf("[%s content omitted: only text and images are forwarded]", mime)})
	}
	media := func(p part) {
		switch {
		case p.InlineData != nil:
			addMedia(p.InlineData.MimeType, p.InlineData.Data, true)
		case p.FileData != nil:
			addMedia(p.FileData.MimeType, p.FileData.FileURI, false)
		}
	}
	for j, p := range c.Parts {
		switch {
		case p.FunctionResponse != nil:
			fr := p.FunctionResponse
			id := matchCall(pending, fr)
			if id == "" {
				id = fmt.Sprintf("call_%d_%d", turn, j)
			}
			content := "{}"
			if isPresent(fr.Response) {
				content = canonString(fr.Response)
			}
			tools = append(tools, proxy.ChatMessage{Role: "tool", Content: content, ToolCallID: id})
			for _, fp := range fr.Parts {
				media(fp)
			}
		case p.InlineData != nil || p.FileData != nil:
			media(p)
		case p.Thought || p.FunctionCall != nil:
			// Not meaningful in a user turn.
		case p.Text != nil && *p.Text != "":
			parts = append(parts, proxy.ChatPart{Type: "text", Text: *p.Text})
		}
	}
	out := tools
	if len(parts) > 0 || len(tools) == 0 {
		msg := proxy.ChatMessage{Role: "user"}
		if image {
			msg.Content = parts
		} else {
			texts := make([]string, len(parts))
			for k, p := range parts {
				texts[k] = p.Text
			}
			msg.Content = strings.Join(texts, "\n")
		}
		out = append(out, msg)
	}
	return out
}

// matchCall finds the id of the call a function response answers ("" when none).
func matchCall(pending []pendingCall, fr *functionResponse) string {
	if fr.ID != "" {
		for k := range pending {
			if pending[k].id == fr.ID {
				pending[k].answered = true
			}
		}
		return fr.ID
	}
	for k := range pending {
		if !pending[k].answered && (fr.Name == "" || pending[k].name == fr.Name) {
			pending[k].answered = true
			return pending[k].id
		}
	}
	return ""
}

// joinText joins the non-thought text parts.
func joinText(parts []part, sep string) string {
	var texts []string
	for _, p := range parts {
		if p.Text != nil && !p.Thought && *p.Text != "" {
			texts = append(texts, *p.Text)
		}
	}
	return strings.Join(texts, sep)
}

func isPresent(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) > 0 && !bytes.Equal(t, []byte("null"))
}

func compact(raw json.RawMessage) json.RawMessage {
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		return raw
	}
	return b.Bytes()
}

// argsString is a functionCall's args as the Chat arguments string.
func argsString(args json.RawMessage) string {
	if !isPresent(args) {
		return "{}"
	}
	return canonString(args)
}

// argsJSON is a Chat arguments string as a Gemini args object: the JSON object
// itself (also when it was sent as a JSON string holding one), {} otherwise.
func argsJSON(arguments string) json.RawMessage {
	t := strings.TrimSpace(arguments)
	if strings.HasPrefix(t, `"`) {
		var s string
		if json.Unmarshal([]byte(t), &s) == nil {
			t = strings.TrimSpace(s)
		}
	}
	if strings.HasPrefix(t, "{") && json.Valid([]byte(t)) {
		return compact(json.RawMessage(t))
	}
	return json.RawMessage("{}")
}

// schema converts a Gemini Schema (OpenAPI subset, upper-case type names) to JSON
// Schema, keeping key order.
func schema(raw json.RawMessage) (json.RawMessage, error) {
	return rewriteObject(raw, func(k string, v json.RawMessage) (json.RawMessage, bool, error) {
		switch k {
		case "type":
			var s string
			if json.Unmarshal(v, &s) == nil {
				if s == "TYPE_UNSPECIFIED" {
					return nil, false, nil
				}
				v, _ = json.Marshal(strings.ToLower(s))
			}
		case "items", "additionalProperties", "not":
			s, err := schema(v)
			return s, true, err
		case "properties", "$defs", "definitions":
			s, err := rewriteObject(v, func(_ string, v json.RawMessage) (json.RawMessage, bool, error) {
				s, err := schema(v)
				return s, true, err
			})
			return s, true, err
		case "anyOf", "oneOf", "allOf", "prefixItems":
			var list []json.RawMessage
			if json.Unmarshal(v, &list) == nil {
				for i := range list {
					s, err := schema(list[i])
					if err != nil {
						return nil, false, err
					}
					list[i] = s
				}
				v, _ = json.Marshal(list)
			}
		}
		return compact(v), true, nil
	})
}

// rewriteObject rewrites each value of a JSON object with fn, keeping key order and
// dropping the keys fn does not keep; anything but an object is returned compacted.
func rewriteObject(raw json.RawMessage, fn func(k string, v json.RawMessage) (json.RawMessage, bool, error)) (json.RawMessage, error) {
	t := bytes.TrimSpace(raw)
	if len(t) == 0 || t[0] != '{' {
		return compact(t), nil
	}
	var b bytes.Buffer
	b.WriteByte('{')
	n := 0
	err := eachKey(t, func(k string, v json.RawMessage) error {
		v, keep, err := fn(k, v)
		if err != nil || !keep {
			return err
		}
		if n > 0 {
			b.WriteByte(',')
		}
		n++
		kb, _ := json.Marshal(k)
		b.Write(kb)
		b.WriteByte(':')
		b.Write(v)
		return nil
	})
	if err != nil {
		return nil, err
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// eachKey calls fn for each member of a JSON object, in order.
func eachKey(obj json.RawMessage, fn func(k string, v json.RawMessage) error) error {
	dec := json.NewDecoder(bytes.NewReader(obj))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return fmt.Errorf("expected a JSON object")
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		k, ok := tok.(string)
		if !ok {
			return fmt.Errorf("expected an object key")
		}
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return err
		}
		if err := fn(k, v); err != nil {
			return err
		}
	}
	return nil
}

// signature is floe's thoughtSignature for reasoning text.
func signature(reasoning string) string {
	return base64.StdEncoding.EncodeToString([]byte(proxy.SignaturePrefix + reasoning))
}

// readSignature restores reasoning from a floe signature; ok is false for others.
func readSignature(sig string) (string, bool) {
	// base64 of the 6-byte prefix is exactly these 8 characters.
	if !strings.HasPrefix(sig, "ZmxvZTEu") {
		return "", false
	}
	// floe writes standard base64; clients may re-encode the bytes they decoded in the
	// URL-safe alphabet (the Python SDK does) or without padding.
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.URLEncoding, base64.RawStdEncoding, base64.RawURLEncoding} {
		b, err := enc.DecodeString(sig)
		if err == nil && bytes.HasPrefix(b, []byte(proxy.SignaturePrefix)) {
			return string(b[len(proxy.SignaturePrefix):]), true
		}
	}
	return "", false
}

// ---- answers ----

func stateOf(req *proxy.Request) *state {
	if req != nil {
		if st, ok := req.State.(*state); ok && st != nil {
			return st
		}
	}
	return &state{Method: methodGenerate, IncludeThoughts: true}
}

func modelOf(req *proxy.Request) string {
	if req == nil {
		return ""
	}
	return req.Model
}

func textPtr(s string) *string { return &s }

// finishOf maps a normalized finish reason to Gemini's.
func finishOf(reason string) string {
	switch reason {
	case proxy.FinishStop, proxy.FinishToolCalls, "":
		return "STOP"
	case proxy.FinishLength:
		return "MAX_TOKENS"
	case proxy.FinishFilter:
		return "SAFETY"
	}
	return "OTHER"
}

func usageOf(u proxy.Usage) *wireUsage {
	total := u.TotalTokens
	if total == 0 {
		total = u.PromptTokens + u.CompletionTokens
	}
	return &wireUsage{PromptTokenCount: u.PromptTokens, CandidatesTokenCount: u.CompletionTokens, TotalTokenCount: total}
}

// answerParts renders one answer as parts: thoughts (when the caller wants them),
// text, function calls; floe's signature on the first non-thought part.
func answerParts(m proxy.ChatMessage, includeThoughts bool) []part {
	var parts []part
	if includeThoughts && m.ReasoningContent != "" {
		parts = append(parts, part{Text: textPtr(m.ReasoningContent), Thought: true})
	}
	host := -1
	if text := proxy.ContentText(m.Content); text != "" {
		// A blank text part is no home for the signature: harnesses drop such parts
		// (Pi skips whitespace-only text), and the reasoning would go with it.
		if strings.TrimSpace(text) != "" {
			host = len(parts)
		}
		parts = append(parts, part{Text: textPtr(text)})
	}
	if host < 0 && len(m.ToolCalls) > 0 {
		host = len(parts)
	}
	for _, tc := range m.ToolCalls {
		parts = append(parts, part{FunctionCall: &functionCall{
			ID: tc.ID, Name: tc.Function.Name, Args: argsJSON(tc.Function.Arguments),
		}})
	}
	if m.ReasoningContent != "" {
		if host >= 0 {
			parts[host].ThoughtSignature = signature(m.ReasoningContent)
		} else {
			parts = append(parts, part{ThoughtSignature: signature(m.ReasoningContent)})
		}
	}
	if len(parts) == 0 {
		parts = []part{{Text: textPtr("")}} // as Gemini sends an empty answer
	}
	return parts
}

// WriteResponse implements Dialect.
func (Dialect) WriteResponse(w http.ResponseWriter, req *proxy.Request, res *proxy.Response) error {
	st := stateOf(req)
	out := response{Candidates: []candidate{}, ModelVersion: modelOf(req)}
	if res != nil {
		out.ResponseID = res.ID
		out.UsageMetadata = usageOf(res.Usage)
		for _, ch := range res.Choices {
			out.Candidates = append(out.Candidates, candidate{
				Content:      wireContent{Role: "model", Parts: answerParts(ch.Message, st.IncludeThoughts)},
				FinishReason: finishOf(ch.FinishReason),
				Index:        ch.Index,
			})
		}
	}
	return proxy.WriteJSON(w, http.StatusOK, out)
}

// ---- streaming ----

// streamCall is a streamed function call whose arguments are still arriving.
type streamCall struct {
	index    int
	id, name string
	args     strings.Builder
}

type answerStream struct {
	sse             *proxy.SSEWriter
	model, id       string
	includeThoughts bool
	unsigned        strings.Builder // reasoning not yet covered by a signature
	open            []*streamCall   // calls not yet sent, by index
	sent            map[int]bool    // indexes of calls already sent
	done            bool
}

// NewStream implements Dialect.
func (Dialect) NewStream(w http.ResponseWriter, req *proxy.Request) proxy.Stream {
	return &answerStream{
		sse:             proxy.NewSSE(w),
		model:           modelOf(req),
		id:              newID(),
		includeThoughts: stateOf(req).IncludeThoughts,
		sent:            map[int]bool{},
	}
}

func newID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func (s *answerStream) send(parts []part, finish string, usage *wireUsage) error {
	if len(parts) == 0 {
		parts = []part{{Text: textPtr("")}}
	}
	return s.sse.Event("", response{
		Candidates:    []candidate{{Content: wireContent{Role: "model", Parts: parts}, FinishReason: finish}},
		UsageMetadata: usage,
		ModelVersion:  s.model,
		ResponseID:    s.id,
	})
}

// sign puts the signature of the reasoning so far on p, the first non-thought part
// after it.
func (s *answerStream) sign(p *part) {
	if s.unsigned.Len() > 0 {
		p.ThoughtSignature = signature(s.unsigned.String())
		s.unsigned.Reset()
	}
}

// take removes the open calls with index below limit and returns them as parts.
func (s *answerStream) take(limit int) []part {
	var parts []part
	keep := s.open[:0]
	for _, c := range s.open {
		if c.index >= limit {
			keep = append(keep, c)
			continue
		}
		id := c.id
		if id == "" {
			id = fmt.Sprintf("call_%s_%d", s.id, c.index)
		}
		p := part{FunctionCall: &functionCall{ID: id, Name: c.name, Args: argsJSON(c.args.String())}}
		if len(parts) == 0 {
			s.sign(&p)
		}
		parts = append(parts, p)
		s.sent[c.index] = true
	}
	s.open = keep
	return parts
}

// Delta implements Stream. Text and thoughts are sent as they come; a function call is
// sent whole when the next call starts or the stream ends.
func (s *answerStream) Delta(d proxy.Delta) error {
	if s.done {
		return errors.New("gemini stream: delta after the end")
	}
	if d.Reasoning != "" {
		s.unsigned.WriteString(d.Reasoning)
		if s.includeThoughts {
			if err := s.send([]part{{Text: textPtr(d.Reasoning), Thought: true}}, "", nil); err != nil {
				return err
			}
		}
	}
	if d.Content != "" {
		p := part{Text: textPtr(d.Content)}
		if strings.TrimSpace(d.Content) != "" { // blank parts get dropped by harnesses
			s.sign(&p)
		}
		if err := s.send([]part{p}, "", nil); err != nil {
			return err
		}
	}
	for _, tc := range d.ToolCalls {
		if s.sent[tc.Index] {
			return fmt.Errorf("gemini stream: fragment of tool call %d after it was sent", tc.Index)
		}
		var call *streamCall
		for _, c := range s.open {
			if c.index == tc.Index {
				call = c
			}
		}
		if call == nil {
			if done := s.take(tc.Index); len(done) > 0 {
				if err := s.send(done, "", nil); err != nil {
					return err
				}
			}
			call = &streamCall{index: tc.Index}
			s.open = append(s.open, call)
			sort.SliceStable(s.open, func(a, b int) bool { return s.open[a].index < s.open[b].index })
		}
		if call.id == "" {
			call.id = tc.ID
		}
		if call.name == "" {
			call.name = tc.Name
		}
		call.args.WriteString(tc.Arguments)
	}
	return nil
}

// End implements Stream: the remaining calls, finishReason and usage in one last event.
func (s *answerStream) End(finish proxy.Finish, usage proxy.Usage) error {
	if s.done {
		return errors.New("gemini stream: ended twice")
	}
	s.done = true
	parts := s.take(int(^uint(0) >> 1))
	if s.unsigned.Len() > 0 {
		p := part{}
		s.sign(&p)
		parts = append(parts, p)
	}
	return s.send(parts, finishOf(finish.Reason), usageOf(usage))
}

// Fail implements Stream.
func (s *answerStream) Fail(e *proxy.Error) error {
	if s.done {
		return errors.New("gemini stream: failed after the end")
	}
	s.done = true
	_, body := errorOf(e)
	return s.sse.Event("", body)
}

// ---- errors, models, counts ----

// errorOf renders err as Gemini's error body and its HTTP status.
func errorOf(e *proxy.Error) (int, errorBody) {
	if e == nil {
		e = &proxy.Error{Status: http.StatusInternalServerError, Kind: proxy.ErrInternal, Message: "internal error"}
	}
	code, status, msg := e.Status, "", e.Message
	switch e.Kind {
	case proxy.ErrInvalidRequest, proxy.ErrTooLarge:
		status = "INVALID_ARGUMENT"
	case proxy.ErrAuthentication:
		status = "UNAUTHENTICATED"
	case proxy.ErrNotFound:
		status = "NOT_FOUND"
	case proxy.ErrContextLength:
		// Gemini's own words, which harnesses look for.
		code, status = http.StatusBadRequest, "INVALID_ARGUMENT"
		switch {
		case e.CompletionTokens > e.MaxTokens && e.MaxTokens > 0:
			// maxOutputTokens alone is over the limit: Gemini's (Vertex's) own words.
			msg = fmt.Sprintf("Unable to submit request because it has a maxOutputTokens value of %d but the supported range is from 1 (inclusive) to %d (exclusive). Update the value and try again.",
				e.CompletionTokens, e.MaxTokens+1)
		case e.CompletionTokens > 0 && e.MaxTokens > 0 && e.PromptTokens < e.MaxTokens:
			msg = fmt.Sprintf("The input token count (%d) and maxOutputTokens (%d) exceed the maximum number of tokens allowed (%d).", e.PromptTokens, e.CompletionTokens, e.MaxTokens)
		case e.PromptTokens > 0 && e.MaxTokens > 0:
			msg = fmt.Sprintf("The input token count (%d) exceeds the maximum number of tokens allowed (%d).", e.PromptTokens, e.MaxTokens)
		case e.MaxTokens > 0:
			msg = fmt.Sprintf("The input token count exceeds the maximum number of tokens allowed (%d).", e.MaxTokens)
		default:
			msg = "The input token count exceeds the maximum number of tokens allowed."
		}
	case proxy.ErrUpstreamUnavailable:
		status = "UNAVAILABLE"
	case proxy.ErrOverloaded:
		status = "RESOURCE_EXHAUSTED"
		if code == http.StatusServiceUnavailable {
			status = "UNAVAILABLE"
		}
	case proxy.ErrCapacity:
		status = "RESOURCE_EXHAUSTED"
	case proxy.ErrTimeout:
		status = "DEADLINE_EXCEEDED"
	case proxy.ErrInternal:
		status = "INTERNAL"
	}
	if code == 0 {
		code = map[string]int{
			"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404,
			"RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
		}[status]
		if code == 0 {
			code = http.StatusInternalServerError
		}
	}
	if status == "" {
		status = statusFor(code)
	}
	return code, errorBody{Error: errorDetail{Code: code, Message: msg, Status: status}}
}

// statusFor is Google's canonical status for an HTTP code.
func statusFor(code int) string {
	switch code {
	case 400, 413:
		return "INVALID_ARGUMENT"
	case 401:
		return "UNAUTHENTICATED"
	case 403:
		return "PERMISSION_DENIED"
	case 404:
		return "NOT_FOUND"
	case 429:
		return "RESOURCE_EXHAUSTED"
	case 503:
		return "UNAVAILABLE"
	case 504:
		return "DEADLINE_EXCEEDED"
	}
	return "INTERNAL"
}

// WriteError implements Dialect.
func (Dialect) WriteError(w http.ResponseWriter, err *proxy.Error) {
	code, body := errorOf(err)
	_ = proxy.WriteJSON(w, code, body)
}

type modelInfo struct {
	Name                       string   `json:"name"`
	DisplayName                string   `json:"displayName"`
	SupportedGenerationMethods []string `json:"supportedGenerationMethods"`
}

// WriteModels implements Dialect.
func (Dialect) WriteModels(w http.ResponseWriter, models []string) {
	list := make([]modelInfo, 0, len(models))
	for _, m := range models {
		list = append(list, modelInfo{
			Name:                       "models/" + m,
			DisplayName:                m,
			SupportedGenerationMethods: []string{methodGenerate, methodStream, methodCount},
		})
	}
	_ = proxy.WriteJSON(w, http.StatusOK, map[string]any{"models": list})
}

// WriteCount implements TokenCounter.
func (Dialect) WriteCount(w http.ResponseWriter, req *proxy.Request, tokens int) {
	_ = proxy.WriteJSON(w, http.StatusOK, map[string]int{"totalTokens": tokens})
}
