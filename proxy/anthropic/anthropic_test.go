package anthropic

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/internal/ssetest"
)

func ptr[T any](v T) *T { return &v }

func mustJSON(t testing.TB, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

var decodeCases = []struct {
	name string
	body string
	want proxy.ChatRequest
}{
	{
		name: "system string, user string, sampling fields",
		body: `{"model":"claude-sonnet-4-5","max_tokens":1024,"system":"Be brief.",
			"messages":[{"role":"user","content":"hi"}],
			"temperature":0.5,"top_p":0.9,"top_k":40,"stop_sequences":["END","\n\nHuman:"],
			"stream":true,"metadata":{"user_id":"u1"}}`,
		want: proxy.ChatRequest{
			Model: "claude-sonnet-4-5",
			Messages: []proxy.ChatMessage{
				{Role: "system", Content: "Be brief."},
				{Role: "user", Content: "hi"},
			},
			MaxCompletionTokens: ptr(1024),
			Temperature:         ptr(0.5),
			TopP:                ptr(0.9),
			Stop:                []string{"END", "\n\nHuman:"},
			Stream:              true,
		},
	},
	{
		name: "system as text blocks with cache_control, user text blocks joined by newline",
		body: `{"model":"m","max_tokens":10,
			"system":[{"type":"text","text":"You are Claude Code."},{"type":"text","text":"Rules.","cache_control":{"type":"ephemeral"}}],
			"messages":[{"role":"user","content":[{"type":"text","text":"<system-reminder>x</system-reminder>"},{"type":"text","text":"fix the bug","cache_control":{"type":"ephemeral"}}]}]}`,
		want: proxy.ChatRequest{
			Model: "m",
			Messages: []proxy.ChatMessage{
				{Role: "system", Content: "You are Claude Code.\nRules."},
				{Role: "user", Content: "<system-reminder>x</system-reminder>\nfix the bug"},
			},
			MaxCompletionTokens: ptr(10),
		},
	},
	{
		name: "system role inside messages is tolerated",
		body: `{"model":"m","messages":[{"role":"system","content":[{"type":"text","text":"sys"}]},{"role":"user","content":"hi"}]}`,
		want: proxy.ChatRequest{
			Model:    "m",
			Messages: []proxy.ChatMessage{{Role: "system", Content: "sys"}, {Role: "user", Content: "hi"}},
		},
	},
	{
		name: "images: base64 becomes a data URI, url stays a url",
		body: `{"model":"m","messages":[{"role":"user","content":[
			{"type":"text","text":"what is this?"},
			{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBORw0KGgo="}},
			{"type":"image","source":{"type":"url","url":"https://example.com/a.jpg"}}]}]}`,
		want: proxy.ChatRequest{
			Model: "m",
			Messages: []proxy.ChatMessage{{Role: "user", Content: []proxy.ChatPart{
				{Type: "text", Text: "what is this?"},
				{Type: "image_url", ImageURL: &proxy.ChatImageURL{URL: "data:image/png;base64,iVBORw0KGgo="}},
				{Type: "image_url", ImageURL: &proxy.ChatImageURL{URL: "https://example.com/a.jpg"}},
			}}},
		},
	},
	{
		name: "tool_use then tool_result across two turns, text after the results",
		body: `{"model":"m","max_tokens":100,"messages":[
			{"role":"user","content":"list and read"},
			{"role":"assistant","content":[
				{"type":"text","text":"I'll look."},
				{"type":"tool_use","id":"toolu_1","name":"Bash","input":{"command":"ls", "timeout": 5}},
				{"type":"tool_use","id":"toolu_2","name":"Read","input":{"path":"a.go"}}]},
			{"role":"user","content":[
				{"type":"tool_result","tool_use_id":"toolu_1","content":"a.go\nb.go"},
				{"type":"tool_result","tool_use_id":"toolu_2","content":[{"type":"text","text":"package a"},{"type":"text","text":"func A() {}"}]},
				{"type":"text","text":"continue"}]}]}`,
		want: proxy.ChatRequest{
			Model: "m",
			Messages: []proxy.ChatMessage{
				{Role: "user", Content: "list and read"},
				{Role: "assistant", Content: "I'll look.", ToolCalls: []proxy.ChatToolCall{
					{ID: "toolu_1", Type: "function", Function: proxy.ChatFunctionCall{Name: "Bash", Arguments: `{"command":"ls","timeout":5}`}},
					{ID: "toolu_2", Type: "function", Function: proxy.ChatFunctionCall{Name: "Read", Arguments: `{"path":"a.go"}`}},
				}},
				{Role: "tool", ToolCallID: "toolu_1", Content: "a.go\nb.go"},
				{Role: "tool", ToolCallID: "toolu_2", Content: "package a\nfunc A() {}"},
				{Role: "user", Content: "continue"},
			},
			MaxCompletionTokens: ptr(100),
		},
	},
	{
		name: "tool_result: images read as [image], is_error is prefixed, empty content, order kept",
		body: `{"model":"m","messages":[
			{"role":"assistant","content":[
				{"type":"tool_use","id":"t1","name":"Shot","input":{}},
				{"type":"tool_use","id":"t2","name":"Bash","input":{}},
				{"type":"tool_use","id":"t3","name":"Bash","input":{}}]},
			{"role":"user","content":[
				{"type":"tool_result","tool_use_id":"t1","content":[{"type":"text","text":"screen:"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}}]},
				{"type":"text","text":"between"},
				{"type":"tool_result","tool_use_id":"t2","is_error":true,"content":"exit status 1"},
				{"type":"tool_result","tool_use_id":"t3","is_error":true}]}]}`,
		want: proxy.ChatRequest{
			Model: "m",
			Messages: []proxy.ChatMessage{
				{Role: "assistant", Content: "", ToolCalls: []proxy.ChatToolCall{
					{ID: "t1", Type: "function", Function: proxy.ChatFunctionCall{Name: "Shot", Arguments: `{}`}},
					{ID: "t2", Type: "function", Function: proxy.ChatFunctionCall{Name: "Bash", Arguments: `{}`}},
					{ID: "t3", Type: "function", Function: proxy.ChatFunctionCall{Name: "Bash", Arguments: `{}`}},
				}},
				{Role: "tool", ToolCallID: "t1", Content: "screen:\n[image]"},
				{Role: "user", Content: "between"},
				{Role: "tool", ToolCallID: "t2", Content: "Error: exit status 1"},
				{Role: "tool", ToolCallID: "t3", Content: "Error"},
			},
		},
	},
	{
		name: "thinking echoed with floe's signature restores the reasoning, even when the text was stripped",
		body: `{"model":"m","messages":[
			{"role":"user","content":"q"},
			{"role":"assistant","content":[
				{"type":"thinking","thinking":"","signature":"` + proxy.ReasoningSignature("Let me think.\n") + `"},
				{"type":"text","text":"Answer."}]},
			{"role":"user","content":"and?"}]}`,
		want: proxy.ChatRequest{
			Model: "m",
			Messages: []proxy.ChatMessage{
				{Role: "user", Content: "q"},
				{Role: "assistant", Content: "Answer.", ReasoningContent: "Let me think.\n"},
				{Role: "user", Content: "and?"},
			},
		},
	},
	{
		name: "thinking split by text is joined; foreign signatures keep the block text; redacted thinking",
		body: `{"model":"m","messages":[
			{"role":"assistant","content":[
				{"type":"thinking","thinking":"first ","signature":"` + proxy.ReasoningSignature("first ") + `"},
				{"type":"text","text":"a"},
				{"type":"thinking","thinking":"second","signature":"EqQBCkgIARABGAIiQL..."},
				{"type":"redacted_thinking","data":"` + proxy.ReasoningSignature(" third") + `"},
				{"type":"redacted_thinking","data":"EmwKAhgBEgy3va3pzix/LafPsn4a"},
				{"type":"text","text":"b"}]}]}`,
		want: proxy.ChatRequest{
			Model: "m",
			Messages: []proxy.ChatMessage{
				{Role: "assistant", Content: "ab", ReasoningContent: "first second third"},
			},
		},
	},
	{
		name: "server tools are skipped, custom tools forwarded, tool_choice any with parallel off",
		body: `{"model":"m","messages":[{"role":"user","content":"hi"}],
			"tools":[
				{"name":"Bash","description":"Run a command","input_schema":{"type":"object","properties":{"command":{"type":"string"}},"required":["command"]},"cache_control":{"type":"ephemeral"}},
				{"type":"web_search_20250305","name":"web_search","max_uses":5},
				{"type":"bash_20250124","name":"bash"},
				{"type":"text_editor_20250429","name":"str_replace_based_edit_tool"},
				{"type":"custom","name":"Noop","input_schema":{"type":"object"}}],
			"tool_choice":{"type":"any","disable_parallel_tool_use":true}}`,
		want: proxy.ChatRequest{
			Model:    "m",
			Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
			Tools: []proxy.ChatTool{
				{Type: "function", Function: proxy.ChatFunction{Name: "Bash", Description: "Run a command",
					Parameters: json.RawMessage(`{"type":"object","properties":{"command":{"type":"string"}},"required":["command"]}`)}},
				{Type: "function", Function: proxy.ChatFunction{Name: "Noop", Parameters: json.RawMessage(`{"type":"object"}`)}},
			},
			ToolChoice:        json.RawMessage(`"required"`),
			ParallelToolCalls: ptr(false),
		},
	},
	{
		name: "tool_choice auto",
		body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"name":"A","input_schema":{"type":"object"}}],"tool_choice":{"type":"auto"}}`,
		want: proxy.ChatRequest{Model: "m", Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
			Tools:      []proxy.ChatTool{{Type: "function", Function: proxy.ChatFunction{Name: "A", Parameters: json.RawMessage(`{"type":"object"}`)}}},
			ToolChoice: json.RawMessage(`"auto"`)},
	},
	{
		name: "tool_choice none",
		body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"name":"A","input_schema":{"type":"object"}}],"tool_choice":{"type":"none"}}`,
		want: proxy.ChatRequest{Model: "m", Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
			Tools:      []proxy.ChatTool{{Type: "function", Function: proxy.ChatFunction{Name: "A", Parameters: json.RawMessage(`{"type":"object"}`)}}},
			ToolChoice: json.RawMessage(`"none"`)},
	},
	{
		name: "tool_choice tool names a function",
		body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"name":"A","input_schema":{"type":"object"}}],"tool_choice":{"type":"tool","name":"A"}}`,
		want: proxy.ChatRequest{Model: "m", Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
			Tools:      []proxy.ChatTool{{Type: "function", Function: proxy.ChatFunction{Name: "A", Parameters: json.RawMessage(`{"type":"object"}`)}}},
			ToolChoice: json.RawMessage(`{"function":{"name":"A"},"type":"function"}`)},
	},
	{
		name: "tool_choice naming a skipped server tool, or with no tools, is dropped",
		body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"web_search_20250305","name":"web_search"}],"tool_choice":{"type":"tool","name":"web_search"}}`,
		want: proxy.ChatRequest{Model: "m", Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}}},
	},
	{
		name: "thinking enabled",
		body: `{"model":"m","max_tokens":2048,"thinking":{"type":"enabled","budget_tokens":1024},"messages":[{"role":"user","content":"hi"}]}`,
		want: proxy.ChatRequest{Model: "m", Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
			MaxCompletionTokens: ptr(2048), ChatTemplateKwargs: map[string]any{"enable_thinking": true}},
	},
	{
		name: "thinking disabled",
		body: `{"model":"m","thinking":{"type":"disabled"},"messages":[{"role":"user","content":"hi"}]}`,
		want: proxy.ChatRequest{Model: "m", Messages: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
			ChatTemplateKwargs: map[string]any{"enable_thinking": false}},
	},
	{
		name: "count_tokens body: no max_tokens, unknown blocks skipped, empty user content",
		body: `{"model":"m","messages":[
			{"role":"user","content":[{"type":"text","text":"hi"},{"type":"search_result","source":"x","content":[]}]},
			{"role":"assistant","content":[{"type":"server_tool_use","id":"srv_1","name":"web_search","input":{}},{"type":"text","text":"ok"}]},
			{"role":"user","content":[]}]}`,
		want: proxy.ChatRequest{Model: "m", Messages: []proxy.ChatMessage{
			{Role: "user", Content: "hi"},
			{Role: "assistant", Content: "ok"},
			{Role: "user", Content: ""},
		}},
	},
	{
		name: "tool input wrapped as _raw restores the raw arguments; absent input is {}",
		body: `{"model":"m","messages":[{"role":"assistant","content":[
			{"type":"tool_use","id":"a","name":"X","input":{"_raw":"{\"path\": \"a.go\""}},
			{"type":"tool_use","id":"b","name":"Y"}]}]}`,
		want: proxy.ChatRequest{Model: "m", Messages: []proxy.ChatMessage{{Role: "assistant", Content: "", ToolCalls: []proxy.ChatToolCall{
			{ID: "a", Type: "function", Function: proxy.ChatFunctionCall{Name: "X", Arguments: `{"path": "a.go"`}},
			{ID: "b", Type: "function", Function: proxy.ChatFunctionCall{Name: "Y", Arguments: `{}`}},
		}}}},
	},
	{
		name: "tool input is compacted and Go's HTML escapes are undone, other escapes kept",
		body: `{"model":"m","messages":[{"role":"assistant","content":[
			{"type":"tool_use","id":"a","name":"X","input":{ "q" : "a\u003cb\u0026c\u003E", "r": "\\u003c", "s": "\n\"\u00e9" }}]}]}`,
		want: proxy.ChatRequest{Model: "m", Messages: []proxy.ChatMessage{{Role: "assistant", Content: "", ToolCalls: []proxy.ChatToolCall{
			{ID: "a", Type: "function", Function: proxy.ChatFunctionCall{Name: "X", Arguments: `{"q":"a<b&c>","r":"\\u003c","s":"\n\"\u00e9"}`}},
		}}}},
	},
}

func TestAnthropicDecode(t *testing.T) {
	for _, tc := range decodeCases {
		t.Run(tc.name, func(t *testing.T) {
			req, err := Dialect{}.Decode(nil, []byte(tc.body))
			if err != nil {
				t.Fatalf("Decode: %v", err)
			}
			if !reflect.DeepEqual(req.Chat, tc.want) {
				t.Errorf("Decode chat request\n got: %s\nwant: %s", mustJSON(t, req.Chat), mustJSON(t, tc.want))
			}
			if req.Model != tc.want.Model || req.Stream != tc.want.Stream {
				t.Errorf("Model, Stream = %q, %v; want %q, %v", req.Model, req.Stream, tc.want.Model, tc.want.Stream)
			}
		})
	}
}

var decodeErrorCases = []struct {
	name, body, wantField string
}{
	{"malformed JSON", `{"model":"m",`, "malformed JSON"},
	{"not an object", `[1,2]`, "request body"},
	{"missing model", `{"messages":[{"role":"user","content":"hi"}]}`, "model: required"},
	{"model not a string", `{"model":7,"messages":[]}`, "model: want string, got number"},
	{"missing messages", `{"model":"m"}`, "messages: required"},
	{"empty messages", `{"model":"m","messages":[]}`, "messages: at least one"},
	{"messages not an array", `{"model":"m","messages":{}}`, "messages: want array, got object"},
	{"message not an object", `{"model":"m","messages":["hi"]}`, "messages[0]: want object, got string"},
	{"bad role", `{"model":"m","messages":[{"role":"bot","content":"hi"}]}`, "messages[0].role"},
	{"missing content", `{"model":"m","messages":[{"role":"user"}]}`, "messages[0].content: required"},
	{"content a number", `{"model":"m","messages":[{"role":"user","content":3}]}`, "messages[0].content: want string or array of content blocks, got number"},
	{"block without type", `{"model":"m","messages":[{"role":"user","content":[{"text":"x"}]}]}`, "messages[0].content[0].type: required"},
	{"text not a string", `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":1}]}]}`, "messages[0].content[0].text: want string, got number"},
	{"tool_result without id", `{"model":"m","messages":[{"role":"user","content":[{"type":"tool_result","content":"x"}]}]}`, "messages[0].content[0].tool_use_id"},
	{"tool_use without name", `{"model":"m","messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t","input":{}}]}]}`, "messages[0].content[0].name"},
	{"image with bad source", `{"model":"m","messages":[{"role":"user","content":[{"type":"image","source":{"type":"file","file_id":"f"}}]}]}`, "messages[0].content[0].source.type"},
	{"max_tokens a string", `{"model":"m","max_tokens":"10","messages":[{"role":"user","content":"hi"}]}`, "max_tokens: want number, got string"},
	{"max_tokens zero", `{"model":"m","max_tokens":0,"messages":[{"role":"user","content":"hi"}]}`, "max_tokens: must be at least 1"},
	{"temperature a string", `{"model":"m","temperature":"hot","messages":[{"role":"user","content":"hi"}]}`, "temperature"},
	{"stop_sequences not strings", `{"model":"m","stop_sequences":[1],"messages":[{"role":"user","content":"hi"}]}`, "stop_sequences[0]"},
	{"stream not a bool", `{"model":"m","stream":"yes","messages":[{"role":"user","content":"hi"}]}`, "stream: want boolean, got string"},
	{"tools not an array", `{"model":"m","tools":{},"messages":[{"role":"user","content":"hi"}]}`, "tools: want array, got object"},
	{"tool without name", `{"model":"m","tools":[{"input_schema":{}}],"messages":[{"role":"user","content":"hi"}]}`, "tools[0].name"},
	{"tool schema not an object", `{"model":"m","tools":[{"name":"a","input_schema":"x"}],"messages":[{"role":"user","content":"hi"}]}`, "tools[0].input_schema"},
	{"tool_choice bad type", `{"model":"m","tool_choice":{"type":"some"},"messages":[{"role":"user","content":"hi"}]}`, "tool_choice.type"},
	{"tool_choice tool without name", `{"model":"m","tool_choice":{"type":"tool"},"messages":[{"role":"user","content":"hi"}]}`, "tool_choice.name"},
	{"thinking not an object", `{"model":"m","thinking":true,"messages":[{"role":"user","content":"hi"}]}`, "thinking: want object, got boolean"},
}

func TestAnthropicDecodeErrors(t *testing.T) {
	for _, tc := range decodeErrorCases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Dialect{}.Decode(nil, []byte(tc.body))
			var e *proxy.Error
			if !errors.As(err, &e) {
				t.Fatalf("Decode error = %v, want *Error", err)
			}
			if e.Status != http.StatusBadRequest || e.Kind != proxy.ErrInvalidRequest {
				t.Errorf("Status, Kind = %d, %s; want 400, %s", e.Status, e.Kind, proxy.ErrInvalidRequest)
			}
			if !strings.Contains(e.Message, tc.wantField) {
				t.Errorf("Message = %q, want it to name %q", e.Message, tc.wantField)
			}
		})
	}
}

// jSONEqual compares two JSON documents by value.
func jSONEqual(t *testing.T, got []byte, want string) {
	t.Helper()
	var g, w any
	if err := json.Unmarshal(got, &g); err != nil {
		t.Fatalf("response is not JSON: %v\n%s", err, got)
	}
	if err := json.Unmarshal([]byte(want), &w); err != nil {
		t.Fatalf("bad want JSON: %v", err)
	}
	if !reflect.DeepEqual(g, w) {
		t.Errorf("JSON differs\n got: %s\nwant: %s", got, want)
	}
}

func TestAnthropicWriteResponse(t *testing.T) {
	req := &proxy.Request{Model: "claude-opus-4"}
	cases := []struct {
		name string
		res  proxy.Response
		want string
	}{
		{
			name: "text",
			res: proxy.Response{ID: "chatcmpl-1", Usage: proxy.Usage{PromptTokens: 12, CompletionTokens: 3},
				Choices: []proxy.Choice{{Message: proxy.ChatMessage{Role: "assistant", Content: "Hello!"}, FinishReason: proxy.FinishStop}}},
			want: `{"id":"msg_chatcmpl-1","type":"message","role":"assistant","model":"claude-opus-4",
				"content":[{"type":"text","text":"Hello!"}],
				"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":12,"output_tokens":3}}`,
		},
		{
			name: "thinking and text, cut by max_tokens",
			res: proxy.Response{ID: "c2", Usage: proxy.Usage{PromptTokens: 5, CompletionTokens: 9},
				Choices: []proxy.Choice{{Message: proxy.ChatMessage{Role: "assistant", Content: "42", ReasoningContent: "6*7"}, FinishReason: proxy.FinishLength}}},
			want: `{"id":"msg_c2","type":"message","role":"assistant","model":"claude-opus-4",
				"content":[{"type":"thinking","thinking":"6*7","signature":"` + proxy.ReasoningSignature("6*7") + `"},{"type":"text","text":"42"}],
				"stop_reason":"max_tokens","stop_sequence":null,"usage":{"input_tokens":5,"output_tokens":9}}`,
		},
		{
			name: "two parallel tool calls, one with invalid arguments",
			res: proxy.Response{ID: "c3", Usage: proxy.Usage{PromptTokens: 100, CompletionTokens: 20},
				Choices: []proxy.Choice{{Message: proxy.ChatMessage{Role: "assistant", Content: "", ToolCalls: []proxy.ChatToolCall{
					{ID: "call_a", Type: "function", Function: proxy.ChatFunctionCall{Name: "Read", Arguments: `{"path":"a<b>.go"}`}},
					{ID: "call_b", Type: "function", Function: proxy.ChatFunctionCall{Name: "Bash", Arguments: `{"command": "ls`}},
				}}, FinishReason: proxy.FinishToolCalls}}},
			want: `{"id":"msg_c3","type":"message","role":"assistant","model":"claude-opus-4",
				"content":[{"type":"tool_use","id":"call_a","name":"Read","input":{"path":"a<b>.go"}},
					{"type":"tool_use","id":"call_b","name":"Bash","input":{"_raw":"{\"command\": \"ls"}}],
				"stop_reason":"tool_use","stop_sequence":null,"usage":{"input_tokens":100,"output_tokens":20}}`,
		},
		{
			name: "tool calls reported with finish stop are tool_use",
			res: proxy.Response{ID: "c4", Choices: []proxy.Choice{{Message: proxy.ChatMessage{Role: "assistant", Content: "ok", ToolCalls: []proxy.ChatToolCall{
				{ID: "x", Type: "function", Function: proxy.ChatFunctionCall{Name: "A", Arguments: ``}},
			}}, FinishReason: proxy.FinishStop}}},
			want: `{"id":"msg_c4","type":"message","role":"assistant","model":"claude-opus-4",
				"content":[{"type":"text","text":"ok"},{"type":"tool_use","id":"x","name":"A","input":{}}],
				"stop_reason":"tool_use","stop_sequence":null,"usage":{"input_tokens":0,"output_tokens":0}}`,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			if err := (Dialect{}).WriteResponse(rec, req, &tc.res); err != nil {
				t.Fatal(err)
			}
			if rec.Code != 200 || rec.Header().Get("Content-Type") != "application/json" {
				t.Errorf("status %d, content type %q", rec.Code, rec.Header().Get("Content-Type"))
			}
			jSONEqual(t, rec.Body.Bytes(), tc.want)
		})
	}
}

// assistantBody wraps assistant content blocks as the history of a next request.
func assistantBody(content string) string {
	return `{"model":"m","max_tokens":100,"messages":[{"role":"user","content":"go"},{"role":"assistant","content":` +
		content + `},{"role":"user","content":"next"}]}`
}

func TestAnthropicRoundTrip(t *testing.T) {
	cases := []struct {
		name string
		msg  proxy.ChatMessage
	}{
		{"text", proxy.ChatMessage{Role: "assistant", Content: "Just text <b> & more."}},
		{"reasoning and text", proxy.ChatMessage{Role: "assistant", Content: "Done.", ReasoningContent: "\nStep 1: read.\nStep 2: ✓\n"}},
		{"reasoning and parallel tool calls", proxy.ChatMessage{Role: "assistant", Content: "Reading both.", ReasoningContent: "Need both files.",
			ToolCalls: []proxy.ChatToolCall{
				{ID: "chatcmpl-tool-1", Type: "function", Function: proxy.ChatFunctionCall{Name: "Read", Arguments: `{"path":"a.go","limit":10}`}},
				{ID: "chatcmpl-tool-2", Type: "function", Function: proxy.ChatFunctionCall{Name: "Grep", Arguments: `{"pattern":"x<y && z>0","opts":{"i":true,"n":[1,2]}}`}},
			}}},
		{"invalid arguments come back raw", proxy.ChatMessage{Role: "assistant", Content: "", ToolCalls: []proxy.ChatToolCall{
			{ID: "t", Type: "function", Function: proxy.ChatFunctionCall{Name: "Bash", Arguments: `{"command": "ls`}},
			{ID: "u", Type: "function", Function: proxy.ChatFunctionCall{Name: "Bash", Arguments: `["not","an","object"]`}},
		}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			res := &proxy.Response{ID: "r", Choices: []proxy.Choice{{Message: tc.msg, FinishReason: proxy.FinishStop}}}
			if err := (Dialect{}).WriteResponse(rec, &proxy.Request{Model: "m"}, res); err != nil {
				t.Fatal(err)
			}
			var answer struct {
				Content json.RawMessage `json:"content"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &answer); err != nil {
				t.Fatal(err)
			}
			req, err := Dialect{}.Decode(nil, []byte(assistantBody(string(answer.Content))))
			if err != nil {
				t.Fatalf("Decode: %v", err)
			}
			if got := req.Chat.Messages[1]; !reflect.DeepEqual(got, tc.msg) {
				t.Errorf("assistant message after a round trip\n got: %s\nwant: %s", mustJSON(t, got), mustJSON(t, tc.msg))
			}
		})
	}
}

// assemble rebuilds the message content blocks from stream events, as a client does.
func assemble(t *testing.T, events []ssetest.Event) []map[string]any {
	t.Helper()
	var blocks []map[string]any
	partial := map[int]string{}
	for _, ev := range events {
		switch ev.Name {
		case "content_block_start":
			idx := int(ev.Data["index"].(float64))
			if idx != len(blocks) {
				t.Fatalf("block %d started, want index %d", idx, len(blocks))
			}
			blocks = append(blocks, ev.Data["content_block"].(map[string]any))
		case "content_block_delta":
			idx := int(ev.Data["index"].(float64))
			b, d := blocks[idx], ev.Data["delta"].(map[string]any)
			switch d["type"] {
			case "text_delta":
				b["text"] = b["text"].(string) + d["text"].(string)
			case "thinking_delta":
				b["thinking"] = b["thinking"].(string) + d["thinking"].(string)
			case "signature_delta":
				b["signature"] = b["signature"].(string) + d["signature"].(string)
			case "input_json_delta":
				partial[idx] += d["partial_json"].(string)
			}
		case "content_block_stop":
			idx := int(ev.Data["index"].(float64))
			if s, ok := partial[idx]; ok {
				var in any
				if err := json.Unmarshal([]byte(s), &in); err != nil {
					t.Fatalf("block %d input %q: %v", idx, s, err)
				}
				blocks[idx]["input"] = in
			}
		}
	}
	return blocks
}

func TestAnthropicStream(t *testing.T) {
	rec := httptest.NewRecorder()
	st := Dialect{}.NewStream(rec, &proxy.Request{Model: "claude-haiku", Stream: true})
	deltas := []proxy.Delta{
		{Reasoning: "The user wants "},
		{Reasoning: "two files."},
		{Content: "Reading "},
		{Content: "both."},
		{ToolCalls: []proxy.ToolCallDelta{{Index: 0, ID: "call_1", Name: "Read", Arguments: ""}}},
		{ToolCalls: []proxy.ToolCallDelta{{Index: 0, Arguments: `{"path":`}}},
		{ToolCalls: []proxy.ToolCallDelta{{Index: 0, Arguments: `"a.go"}`}}},
		{ToolCalls: []proxy.ToolCallDelta{{Index: 1, ID: "call_2", Name: "Read", Arguments: `{"path"`}, {Index: 1, Arguments: `:"b<c>.go"}`}}},
		{},
	}
	for _, d := range deltas {
		if err := st.Delta(d); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.End(proxy.Finish{Reason: proxy.FinishToolCalls}, proxy.Usage{PromptTokens: 321, CompletionTokens: 45}); err != nil {
		t.Fatal(err)
	}
	if err := st.Delta(proxy.Delta{Content: "late"}); err == nil {
		t.Error("Delta after End succeeded")
	}
	if ct := rec.Header().Get("Content-Type"); ct != "text/event-stream" {
		t.Errorf("Content-Type %q", ct)
	}

	events := ssetest.Events(t, rec.Body.String())
	var got []string
	for _, ev := range events {
		got = append(got, ssetest.Summary(ev))
	}
	want := []string{
		"message_start",
		"ping",
		"content_block_start 0 thinking",
		"content_block_delta 0 thinking_delta",
		"content_block_delta 0 thinking_delta",
		"content_block_delta 0 signature_delta",
		"content_block_stop 0",
		"content_block_start 1 text",
		"content_block_delta 1 text_delta",
		"content_block_delta 1 text_delta",
		"content_block_stop 1",
		"content_block_start 2 tool_use",
		"content_block_delta 2 input_json_delta",
		"content_block_delta 2 input_json_delta",
		"content_block_stop 2",
		"content_block_start 3 tool_use",
		"content_block_delta 3 input_json_delta",
		"content_block_delta 3 input_json_delta",
		"content_block_stop 3",
		"message_delta",
		"message_stop",
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("event sequence\n got: %q\nwant: %q", got, want)
	}

	start := events[0].Data["message"].(map[string]any)
	wantStart := `{"id":` + mustJSON(t, start["id"]) + `,"type":"message","role":"assistant","model":"claude-haiku",
		"content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":0,"output_tokens":0}}`
	jSONEqual(t, []byte(mustJSON(t, start)), wantStart)
	if id, _ := start["id"].(string); !strings.HasPrefix(id, "msg_") {
		t.Errorf("message id %q", id)
	}
	jSONEqual(t, []byte(mustJSON(t, events[len(events)-2].Data)),
		`{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"input_tokens":321,"output_tokens":45}}`)
	jSONEqual(t, []byte(mustJSON(t, events[2].Data)),
		`{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}`)
	jSONEqual(t, []byte(mustJSON(t, events[11].Data)),
		`{"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"call_1","name":"Read","input":{}}}`)

	blocks := assemble(t, events)
	wantBlocks := `[
		{"type":"thinking","thinking":"The user wants two files.","signature":"` + proxy.ReasoningSignature("The user wants two files.") + `"},
		{"type":"text","text":"Reading both."},
		{"type":"tool_use","id":"call_1","name":"Read","input":{"path":"a.go"}},
		{"type":"tool_use","id":"call_2","name":"Read","input":{"path":"b<c>.go"}}]`
	jSONEqual(t, []byte(mustJSON(t, blocks)), wantBlocks)

	// The harness echoes the assembled blocks: the next request holds exactly what the model produced.
	req, err := Dialect{}.Decode(nil, []byte(assistantBody(mustJSON(t, blocks))))
	if err != nil {
		t.Fatal(err)
	}
	wantMsg := proxy.ChatMessage{Role: "assistant", Content: "Reading both.", ReasoningContent: "The user wants two files.",
		ToolCalls: []proxy.ChatToolCall{
			{ID: "call_1", Type: "function", Function: proxy.ChatFunctionCall{Name: "Read", Arguments: `{"path":"a.go"}`}},
			{ID: "call_2", Type: "function", Function: proxy.ChatFunctionCall{Name: "Read", Arguments: `{"path":"b<c>.go"}`}},
		}}
	if got := req.Chat.Messages[1]; !reflect.DeepEqual(got, wantMsg) {
		t.Errorf("echoed assistant message\n got: %s\nwant: %s", mustJSON(t, got), mustJSON(t, wantMsg))
	}
}

func TestAnthropicStreamShapes(t *testing.T) {
	cases := []struct {
		name   string
		deltas []proxy.Delta
		finish string
		want   []string
		stop   string
	}{
		{
			name:   "no content at all",
			finish: proxy.FinishStop,
			want:   []string{"message_start", "ping", "message_delta", "message_stop"},
			stop:   "end_turn",
		},
		{
			name:   "reasoning resumes after text: a new thinking block, each signed",
			deltas: []proxy.Delta{{Reasoning: "a", Content: "b"}, {Reasoning: "c"}},
			finish: proxy.FinishLength,
			want: []string{"message_start", "ping",
				"content_block_start 0 thinking", "content_block_delta 0 thinking_delta", "content_block_delta 0 signature_delta", "content_block_stop 0",
				"content_block_start 1 text", "content_block_delta 1 text_delta", "content_block_stop 1",
				"content_block_start 2 thinking", "content_block_delta 2 thinking_delta", "content_block_delta 2 signature_delta", "content_block_stop 2",
				"message_delta", "message_stop"},
			stop: "max_tokens",
		},
		{
			name: "interleaved tool-call fragments reopen the call under its id",
			deltas: []proxy.Delta{
				{ToolCalls: []proxy.ToolCallDelta{{Index: 0, ID: "a", Name: "A", Arguments: `{"x":`}}},
				{ToolCalls: []proxy.ToolCallDelta{{Index: 1, ID: "b", Name: "B", Arguments: `{}`}}},
				{ToolCalls: []proxy.ToolCallDelta{{Index: 0, Arguments: `1}`}}},
			},
			finish: proxy.FinishStop,
			want: []string{"message_start", "ping",
				"content_block_start 0 tool_use", "content_block_delta 0 input_json_delta", "content_block_stop 0",
				"content_block_start 1 tool_use", "content_block_delta 1 input_json_delta", "content_block_stop 1",
				"content_block_start 2 tool_use", "content_block_delta 2 input_json_delta", "content_block_stop 2",
				"message_delta", "message_stop"},
			stop: "tool_use",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			st := Dialect{}.NewStream(rec, &proxy.Request{Model: "m"})
			for _, d := range tc.deltas {
				if err := st.Delta(d); err != nil {
					t.Fatal(err)
				}
			}
			if err := st.End(proxy.Finish{Reason: tc.finish}, proxy.Usage{}); err != nil {
				t.Fatal(err)
			}
			events := ssetest.Events(t, rec.Body.String())
			var got []string
			for _, ev := range events {
				got = append(got, ssetest.Summary(ev))
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("event sequence\n got: %q\nwant: %q", got, tc.want)
			}
			md := events[len(events)-2].Data["delta"].(map[string]any)
			if md["stop_reason"] != tc.stop {
				t.Errorf("stop_reason %v, want %s", md["stop_reason"], tc.stop)
			}
		})
	}
}

func TestAnthropicStreamFail(t *testing.T) {
	rec := httptest.NewRecorder()
	st := Dialect{}.NewStream(rec, &proxy.Request{Model: "m"})
	if err := st.Delta(proxy.Delta{Content: "partial"}); err != nil {
		t.Fatal(err)
	}
	if err := st.Fail(&proxy.Error{Status: 502, Kind: proxy.ErrUpstreamUnavailable, Message: "engine went away"}); err != nil {
		t.Fatal(err)
	}
	if err := st.End(proxy.Finish{Reason: proxy.FinishStop}, proxy.Usage{}); err == nil {
		t.Error("End after Fail succeeded")
	}
	events := ssetest.Events(t, rec.Body.String())
	last := events[len(events)-1]
	if last.Name != "error" {
		t.Fatalf("last event %s, want error", last.Name)
	}
	jSONEqual(t, []byte(mustJSON(t, last.Data)), `{"type":"error","error":{"type":"api_error","message":"engine went away"}}`)
}

func TestAnthropicWriteError(t *testing.T) {
	cases := []struct {
		name       string
		err        *proxy.Error
		wantStatus int
		wantType   string
		wantMsg    string
	}{
		{"invalid request", &proxy.Error{Status: 400, Kind: proxy.ErrInvalidRequest, Message: "model: required"}, 400, "invalid_request_error", "model: required"},
		{"authentication", &proxy.Error{Status: 401, Kind: proxy.ErrAuthentication, Message: "invalid x-api-key"}, 401, "authentication_error", "invalid x-api-key"},
		{"not found", &proxy.Error{Status: 404, Kind: proxy.ErrNotFound, Message: "no such model"}, 404, "not_found_error", "no such model"},
		{"too large", &proxy.Error{Status: 413, Kind: proxy.ErrTooLarge, Message: "body too large"}, 413, "request_too_large", "body too large"},
		{"context length with numbers, as Claude Code expects", &proxy.Error{Status: 400, Kind: proxy.ErrContextLength, Message: "This model's maximum context length is 32768 tokens", PromptTokens: 40000, MaxTokens: 32768},
			400, "invalid_request_error", "prompt is too long: 40000 tokens > 32768 maximum"},
		{"context length without numbers", &proxy.Error{Status: 400, Kind: proxy.ErrContextLength, Message: "input too long"}, 400, "invalid_request_error", "prompt is too long: input too long"},
		// The prompt fits, prompt + max_tokens does not: Claude Code's default max_tokens alone
		// overflows a 32k window, and it lowers max_tokens and retries only on this wording.
		{"max_tokens overflow, older vLLM wording", &proxy.Error{Status: 400, Kind: proxy.ErrContextLength,
			Message:      "This model's maximum context length is 32768 tokens. However, you requested 49177 tokens (17177 in the messages, 32000 in the completion). Please reduce the length of the messages or completion.",
			PromptTokens: 17177, MaxTokens: 32768},
			400, "invalid_request_error", "input length and `max_tokens` exceed context limit: 17177 + 32000 > 32768, decrease input length or `max_tokens` and try again"},
		{"max_tokens overflow, newer vLLM wording", &proxy.Error{Status: 400, Kind: proxy.ErrContextLength,
			Message:   "'max_tokens' or 'max_completion_tokens' is too large: 32000. This model's maximum context length is 32768 tokens and your request has 17177 input tokens (32000 > 32768 - 17177).",
			MaxTokens: 32768},
			400, "invalid_request_error", "input length and `max_tokens` exceed context limit: 17177 + 32000 > 32768, decrease input length or `max_tokens` and try again"},
		{"prompt over the limit with a budget: still prompt is too long", &proxy.Error{Status: 400, Kind: proxy.ErrContextLength,
			Message:      "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4900 in the messages, 100 in the completion). Please reduce the length of the messages or completion.",
			PromptTokens: 4900, MaxTokens: 4096},
			400, "invalid_request_error", "prompt is too long: 4900 tokens > 4096 maximum"},
		{"prompt over the limit, newer vLLM wording", &proxy.Error{Status: 400, Kind: proxy.ErrContextLength,
			Message:   "This model's maximum context length is 32768 tokens. However, your request has 40000 input tokens. Please reduce the length of the input messages.",
			MaxTokens: 32768},
			400, "invalid_request_error", "prompt is too long: 40000 tokens > 32768 maximum"},
		{"upstream down (502)", &proxy.Error{Status: 502, Kind: proxy.ErrUpstreamUnavailable, Message: "connection refused"}, 502, "api_error", "connection refused"},
		{"upstream unavailable (503)", &proxy.Error{Status: 503, Kind: proxy.ErrUpstreamUnavailable, Message: "paused"}, 503, "overloaded_error", "paused"},
		{"overloaded", &proxy.Error{Status: 529, Kind: proxy.ErrOverloaded, Message: "busy"}, 529, "overloaded_error", "busy"},
		{"internal", &proxy.Error{Status: 500, Kind: proxy.ErrInternal, Message: "boom"}, 500, "api_error", "boom"},
		{"rate limited by status", &proxy.Error{Status: 429, Kind: "rate", Message: "slow down"}, 429, "rate_limit_error", "slow down"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			Dialect{}.WriteError(rec, tc.err)
			if rec.Code != tc.wantStatus {
				t.Errorf("status %d, want %d", rec.Code, tc.wantStatus)
			}
			want := mustJSON(t, map[string]any{"type": "error", "error": map[string]string{"type": tc.wantType, "message": tc.wantMsg}})
			jSONEqual(t, rec.Body.Bytes(), want)
		})
	}
}

func TestAnthropicModelsAndCount(t *testing.T) {
	rec := httptest.NewRecorder()
	Dialect{}.WriteModels(rec, []string{"claude-sonnet-4-5", "qwen3-8b"})
	jSONEqual(t, rec.Body.Bytes(), `{"data":[
		{"type":"model","id":"claude-sonnet-4-5","display_name":"claude-sonnet-4-5","created_at":"2025-01-01T00:00:00Z"},
		{"type":"model","id":"qwen3-8b","display_name":"qwen3-8b","created_at":"2025-01-01T00:00:00Z"}],
		"has_more":false,"first_id":"claude-sonnet-4-5","last_id":"qwen3-8b"}`)

	rec = httptest.NewRecorder()
	Dialect{}.WriteModels(rec, nil)
	jSONEqual(t, rec.Body.Bytes(), `{"data":[],"has_more":false,"first_id":null,"last_id":null}`)

	rec = httptest.NewRecorder()
	Dialect{}.WriteCount(rec, &proxy.Request{Model: "m"}, 1234)
	jSONEqual(t, rec.Body.Bytes(), `{"input_tokens":1234}`)
	if rec.Code != 200 {
		t.Errorf("count status %d", rec.Code)
	}
}

func TestAnthropicSignature(t *testing.T) {
	for _, s := range []string{"", "plain", "multi\nline ✓ <tags> & \"quotes\""} {
		got, ok := proxy.ReasoningFromSignature(proxy.ReasoningSignature(s))
		if !ok || got != s {
			t.Errorf("signature of %q reads back as %q, %v", s, got, ok)
		}
	}
	for _, foreign := range []string{"EqQBCkgIARABGAIiQL", "floe1.!!!", ""} {
		if _, ok := proxy.ReasoningFromSignature(foreign); ok {
			t.Errorf("foreign signature %q read as floe's", foreign)
		}
	}
}

func FuzzAnthropicDecode(f *testing.F) {
	for _, tc := range decodeCases {
		f.Add([]byte(tc.body))
	}
	for _, tc := range decodeErrorCases {
		f.Add([]byte(tc.body))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, err := Dialect{}.Decode(nil, body)
		if err != nil {
			var e *proxy.Error
			if !errors.As(err, &e) || e.Status != http.StatusBadRequest || e.Kind != proxy.ErrInvalidRequest || e.Message == "" {
				t.Fatalf("error %#v is not a 400 invalid request", err)
			}
			return
		}
		if req.Model == "" || len(req.Chat.Messages) == 0 {
			t.Fatalf("accepted request without model or messages: %s", body)
		}
		if _, err := json.Marshal(req.Chat); err != nil {
			t.Fatalf("normalized request does not encode: %v", err)
		}
		for _, m := range req.Chat.Messages {
			for _, tc := range m.ToolCalls {
				if tc.ID == "" || tc.Function.Name == "" {
					t.Fatalf("tool call without id or name: %+v", tc)
				}
			}
		}
	})
}
