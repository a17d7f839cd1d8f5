package openai

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	"github.com/floe-rl/floe/proxy"
)

// ---------------------------------------------------------------------------------------
// helpers

func respFloeEnc(text string) string {
	return "floe1." + base64.StdEncoding.EncodeToString([]byte(text))
}

func respDecode(t *testing.T, body string) *proxy.Request {
	t.Helper()
	req, err := Responses{}.Decode(httptest.NewRequest(http.MethodPost, "/v1/responses", nil), []byte(body))
	if err != nil {
		t.Fatalf("Decode(%s): %v", body, err)
	}
	return req
}

func respJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// respEvent is one parsed SSE event.
type respEvent struct {
	name string
	data map[string]any
}

func respParseSSE(t *testing.T, body string) []respEvent {
	t.Helper()
	var evs []respEvent
	var cur respEvent
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "event: "):
			cur.name = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &cur.data); err != nil {
				t.Fatalf("event %q: bad data: %v", cur.name, err)
			}
		case line == "":
			if cur.name != "" || cur.data != nil {
				evs = append(evs, cur)
			}
			cur = respEvent{}
		default:
			t.Fatalf("unexpected SSE line %q", line)
		}
	}
	if cur.name != "" || cur.data != nil {
		t.Fatalf("unterminated event %q", cur.name)
	}
	return evs
}

// respRun feeds deltas through a stream and returns the raw SSE body.
func respRun(t *testing.T, req *proxy.Request, deltas []proxy.Delta, end func(proxy.Stream) error) (*httptest.ResponseRecorder, []respEvent) {
	t.Helper()
	rec := httptest.NewRecorder()
	s := Responses{}.NewStream(rec, req)
	for _, d := range deltas {
		if err := s.Delta(d); err != nil {
			t.Fatalf("Delta: %v", err)
		}
	}
	if err := end(s); err != nil {
		t.Fatalf("end: %v", err)
	}
	return rec, respParseSSE(t, rec.Body.String())
}

func respStr(m map[string]any, key string) string {
	s, _ := m[key].(string)
	return s
}

func respMap(v any) map[string]any {
	m, _ := v.(map[string]any)
	return m
}

func respList(v any) []any {
	l, _ := v.([]any)
	return l
}

// ---------------------------------------------------------------------------------------
// Decode

// responsesDecodeCases are the request constructs floe must understand; they also seed
// FuzzResponsesDecode.
var responsesDecodeCases = []struct {
	name string
	body string
	want []proxy.ChatMessage
	// check inspects the rest of the request when set.
	check func(t *testing.T, r *proxy.Request)
}{
	{
		name: "string input is one user message, instructions the system message before it",
		body: `{"model":"gpt-5-codex","instructions":"You are Codex.","input":"hello"}`,
		want: []proxy.ChatMessage{{Role: "system", Content: "You are Codex."}, {Role: "user", Content: "hello"}},
		check: func(t *testing.T, r *proxy.Request) {
			if r.Model != "gpt-5-codex" || r.Chat.Model != "gpt-5-codex" || r.Stream {
				t.Errorf("model %q/%q stream %v", r.Model, r.Chat.Model, r.Stream)
			}
			if r.Chat.ChatTemplateKwargs != nil || r.Chat.Tools != nil || r.Chat.ToolChoice != nil {
				t.Errorf("unexpected settings: %+v", r.Chat)
			}
		},
	},
	{
		name: "developer becomes system; text parts of user and system messages join with newlines",
		body: `{"model":"m","input":[
			{"type":"message","role":"developer","content":[{"type":"input_text","text":"<permissions>"},{"type":"input_text","text":"sandbox"}]},
			{"type":"message","role":"system","content":"sys"},
			{"type":"message","role":"user","content":[{"type":"input_text","text":"<env>"},{"type":"input_text","text":"fix it"}]},
			{"role":"user","content":"easy message without type"}]}`,
		want: []proxy.ChatMessage{
			{Role: "system", Content: "<permissions>\nsandbox"},
			{Role: "system", Content: "sys"},
			{Role: "user", Content: "<env>\nfix it"},
			{Role: "user", Content: "easy message without type"},
		},
	},
	{
		name: "a user image keeps the parts",
		body: `{"model":"m","input":[{"type":"message","role":"user","content":[
			{"type":"input_text","text":"what is this?"},{"type":"input_image","image_url":"data:image/png;base64,AAAA","detail":"auto"}]}]}`,
		want: []proxy.ChatMessage{{Role: "user", Content: []proxy.ChatPart{
			{Type: "text", Text: "what is this?"},
			{Type: "image_url", ImageURL: &proxy.ChatImageURL{URL: "data:image/png;base64,AAAA"}},
		}}},
	},
	{
		name: "function calls and outputs across two turns: reasoning, text and calls of one call are one assistant message",
		body: `{"model":"m","store":false,"input":[
			{"type":"message","role":"user","content":[{"type":"input_text","text":"list and read"}]},
			{"type":"reasoning","summary":[{"type":"summary_text","text":"I should look."}],"encrypted_content":"` + respFloeEnc("I should look.") + `"},
			{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Looking."}]},
			{"type":"function_call","name":"shell","arguments":"{\"command\":[\"ls\"]}","call_id":"call_a"},
			{"type":"function_call","name":"shell","arguments":"{\"command\":[\"cat\",\"x\"]}","call_id":"call_b"},
			{"type":"function_call_output","call_id":"call_a","output":"x\ny"},
			{"type":"function_call_output","call_id":"call_b","output":"hello"},
			{"type":"reasoning","summary":[{"type":"summary_text","text":"Done."}],"encrypted_content":"` + respFloeEnc("Done.") + `"},
			{"type":"message","role":"assistant","content":[{"type":"output_text","text":"x has hello"}]},
			{"type":"message","role":"user","content":[{"type":"input_text","text":"thanks"}]}]}`,
		want: []proxy.ChatMessage{
			{Role: "user", Content: "list and read"},
			{Role: "assistant", Content: "Looking.", ReasoningContent: "I should look.", ToolCalls: []proxy.ChatToolCall{
				{ID: "call_a", Type: "function", Function: proxy.ChatFunctionCall{Name: "shell", Arguments: `{"command":["ls"]}`}},
				{ID: "call_b", Type: "function", Function: proxy.ChatFunctionCall{Name: "shell", Arguments: `{"command":["cat","x"]}`}},
			}},
			{Role: "tool", Content: "x\ny", ToolCallID: "call_a"},
			{Role: "tool", Content: "hello", ToolCallID: "call_b"},
			{Role: "assistant", Content: "x has hello", ReasoningContent: "Done."},
			{Role: "user", Content: "thanks"},
		},
	},
	{
		name: "reasoning with floe's encrypted_content restores the exact text, not the summary",
		body: `{"model":"m","input":[
			{"type":"message","role":"user","content":"q"},
			{"type":"reasoning","id":"rs_1","summary":[{"type":"summary_text","text":"(summary)"}],
			 "encrypted_content":"` + respFloeEnc("  exact\n\nreasoning, ünïcode \u2028 kept  ") + `"},
			{"type":"function_call","id":"fc_1","call_id":"c1","name":"f","arguments":"{}","status":"completed"}]}`,
		want: []proxy.ChatMessage{
			{Role: "user", Content: "q"},
			{Role: "assistant", Content: "", ReasoningContent: "  exact\n\nreasoning, ünïcode \u2028 kept  ", ToolCalls: []proxy.ChatToolCall{
				{ID: "c1", Type: "function", Function: proxy.ChatFunctionCall{Name: "f", Arguments: "{}"}},
			}},
		},
	},
	{
		name: "another provider's reasoning: content text first, else summaries joined by blank lines",
		body: `{"model":"m","input":[
			{"type":"message","role":"user","content":"q1"},
			{"type":"reasoning","summary":[{"type":"summary_text","text":"a"},{"type":"summary_text","text":"b"}],"encrypted_content":"gAAAAABopaque"},
			{"type":"message","role":"assistant","content":[{"type":"output_text","text":"A1"}]},
			{"type":"message","role":"user","content":"q2"},
			{"type":"reasoning","summary":[{"type":"summary_text","text":"short"}],"content":[{"type":"reasoning_text","text":"raw thoughts"}]},
			{"type":"message","role":"assistant","content":[{"type":"output_text","text":"A2"}]}]}`,
		want: []proxy.ChatMessage{
			{Role: "user", Content: "q1"},
			{Role: "assistant", Content: "A1", ReasoningContent: "a\n\nb"},
			{Role: "user", Content: "q2"},
			{Role: "assistant", Content: "A2", ReasoningContent: "raw thoughts"},
		},
	},
	{
		name: "reasoning alone is its own assistant message",
		body: `{"model":"m","input":[{"type":"message","role":"user","content":"q"},
			{"type":"reasoning","summary":[],"encrypted_content":"` + respFloeEnc("hmm") + `"},
			{"type":"message","role":"user","content":"and?"}]}`,
		want: []proxy.ChatMessage{{Role: "user", Content: "q"}, {Role: "assistant", Content: "", ReasoningContent: "hmm"}, {Role: "user", Content: "and?"}},
	},
	{
		name: "items of other types are dropped, not forwarded",
		body: `{"model":"m","input":[
			{"type":"message","role":"user","content":"search"},
			{"type":"web_search_call","id":"ws_1","status":"completed","action":{"type":"search","query":"go"}},
			{"type":"local_shell_call","call_id":"ls_1","status":"completed","action":{"type":"exec","command":["ls"]}},
			{"type":"local_shell_call_output","call_id":"ls_1","output":"x"},
			{"type":"custom_tool_call","call_id":"ct_1","name":"apply_patch","input":"*** Begin Patch"},
			{"type":"custom_tool_call_output","call_id":"ct_1","output":"ok"},
			{"type":"item_reference","id":"msg_old"},
			{"type":"compaction","encrypted_content":"zzz"},
			{"type":"message","role":"assistant","content":[{"type":"output_text","text":"found"}]}]}`,
		want: []proxy.ChatMessage{{Role: "user", Content: "search"}, {Role: "assistant", Content: "found"}},
	},
	{
		name: "function_call_output given as parts becomes the text parts joined",
		body: `{"model":"m","input":[
			{"type":"function_call","call_id":"c","name":"mcp__read","arguments":"{}"},
			{"type":"function_call_output","call_id":"c","output":[{"type":"input_text","text":"line 1"},{"type":"input_image","image_url":"data:image/png;base64,AA"},{"type":"input_text","text":"line 2"}]},
			{"type":"function_call","call_id":"d","name":"old","arguments":"{}"},
			{"type":"function_call_output","call_id":"d","output":{"content":"failed","success":false}}]}`,
		want: []proxy.ChatMessage{
			{Role: "assistant", Content: "", ToolCalls: []proxy.ChatToolCall{{ID: "c", Type: "function", Function: proxy.ChatFunctionCall{Name: "mcp__read", Arguments: "{}"}}}},
			{Role: "tool", Content: "line 1\nline 2", ToolCallID: "c"},
			{Role: "assistant", Content: "", ToolCalls: []proxy.ChatToolCall{{ID: "d", Type: "function", Function: proxy.ChatFunctionCall{Name: "old", Arguments: "{}"}}}},
			{Role: "tool", Content: "failed", ToolCallID: "d"},
		},
	},
	{
		name: "function tools are forwarded, other tool types are not; the settings follow",
		body: `{"model":"m","input":"hi","tool_choice":"auto","parallel_tool_calls":false,
			"tools":[
			{"type":"function","name":"shell","description":"Runs a command","strict":false,"parameters":{"type":"object","properties":{"command":{"type":"array","items":{"type":"string"}}},"required":["command"]}},
			{"type":"web_search"},{"type":"local_shell"},{"type":"image_generation"},{"type":"file_search","vector_store_ids":["v"]},
			{"type":"custom","name":"apply_patch","format":{"type":"grammar","syntax":"lark","definition":"start: x"}},
			{"type":"namespace","name":"mcp","tools":[]},
			{"type":"function","name":"noargs"}],
			"max_output_tokens":512,"temperature":0.6,"top_p":0.95,"stream":true,
			"store":false,"include":["reasoning.encrypted_content"],"prompt_cache_key":"k","metadata":{"a":"b"},"service_tier":"auto",
			"text":{"format":{"type":"text"},"verbosity":"low"},"truncation":"auto","user":"u"}`,
		want: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
		check: func(t *testing.T, r *proxy.Request) {
			want := []proxy.ChatTool{
				{Type: "function", Function: proxy.ChatFunction{Name: "shell", Description: "Runs a command",
					Parameters: json.RawMessage(`{"type":"object","properties":{"command":{"type":"array","items":{"type":"string"}}},"required":["command"]}`)}},
				{Type: "function", Function: proxy.ChatFunction{Name: "noargs"}},
			}
			if !reflect.DeepEqual(r.Chat.Tools, want) {
				t.Errorf("tools = %s", respJSON(t, r.Chat.Tools))
			}
			if string(r.Chat.ToolChoice) != `"auto"` || r.Chat.ParallelToolCalls == nil || *r.Chat.ParallelToolCalls {
				t.Errorf("tool_choice %s parallel %v", r.Chat.ToolChoice, r.Chat.ParallelToolCalls)
			}
			if r.Chat.MaxCompletionTokens == nil || *r.Chat.MaxCompletionTokens != 512 ||
				r.Chat.Temperature == nil || *r.Chat.Temperature != 0.6 || r.Chat.TopP == nil || *r.Chat.TopP != 0.95 {
				t.Errorf("sampling settings: %s", respJSON(t, r.Chat))
			}
			if !r.Stream || !r.Chat.Stream {
				t.Errorf("stream not set")
			}
		},
	},
	{
		name: "reasoning effort minimal turns thinking off",
		body: `{"model":"m","input":"hi","reasoning":{"effort":"minimal","summary":"auto"}}`,
		want: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
		check: func(t *testing.T, r *proxy.Request) {
			if !reflect.DeepEqual(r.Chat.ChatTemplateKwargs, map[string]any{"enable_thinking": false}) {
				t.Errorf("kwargs %v", r.Chat.ChatTemplateKwargs)
			}
		},
	},
	{
		name: "reasoning effort none turns thinking off",
		body: `{"model":"m","input":"hi","reasoning":{"effort":"none"}}`,
		want: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
		check: func(t *testing.T, r *proxy.Request) {
			if !reflect.DeepEqual(r.Chat.ChatTemplateKwargs, map[string]any{"enable_thinking": false}) {
				t.Errorf("kwargs %v", r.Chat.ChatTemplateKwargs)
			}
		},
	},
	{
		name: "reasoning effort high turns thinking on",
		body: `{"model":"m","input":"hi","reasoning":{"effort":"high","summary":"detailed"}}`,
		want: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
		check: func(t *testing.T, r *proxy.Request) {
			if !reflect.DeepEqual(r.Chat.ChatTemplateKwargs, map[string]any{"enable_thinking": true}) {
				t.Errorf("kwargs %v", r.Chat.ChatTemplateKwargs)
			}
		},
	},
	{
		name: "reasoning without an effort leaves the template alone",
		body: `{"model":"m","input":"hi","reasoning":{"summary":"auto"}}`,
		want: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
		check: func(t *testing.T, r *proxy.Request) {
			if r.Chat.ChatTemplateKwargs != nil {
				t.Errorf("kwargs %v", r.Chat.ChatTemplateKwargs)
			}
		},
	},
	{
		name: "tool_choice without forwarded tools is not forwarded (vLLM refuses it)",
		body: `{"model":"m","input":"hi","tools":[{"type":"web_search"}],"tool_choice":"required","parallel_tool_calls":true}`,
		want: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
		check: func(t *testing.T, r *proxy.Request) {
			if r.Chat.Tools != nil || r.Chat.ToolChoice != nil || r.Chat.ParallelToolCalls != nil {
				t.Errorf("forwarded %s", respJSON(t, r.Chat))
			}
		},
	},
	{
		name: "a function tool in Chat's nested shape is accepted too",
		body: `{"model":"m","input":"hi","tools":[{"type":"function","function":{"name":"f","description":"d","parameters":{"type":"object"}}}]}`,
		want: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
		check: func(t *testing.T, r *proxy.Request) {
			want := []proxy.ChatTool{{Type: "function", Function: proxy.ChatFunction{Name: "f", Description: "d", Parameters: json.RawMessage(`{"type":"object"}`)}}}
			if !reflect.DeepEqual(r.Chat.Tools, want) {
				t.Errorf("tools = %s", respJSON(t, r.Chat.Tools))
			}
		},
	},
	{
		name: "nulls are absent",
		body: `{"model":"m","input":"hi","instructions":null,"tools":null,"tool_choice":null,"reasoning":null,"temperature":null,"previous_response_id":null,"stream":null}`,
		want: []proxy.ChatMessage{{Role: "user", Content: "hi"}},
	},
}

func TestResponsesDecode(t *testing.T) {
	for _, tc := range responsesDecodeCases {
		t.Run(tc.name, func(t *testing.T) {
			r := respDecode(t, tc.body)
			if !reflect.DeepEqual(r.Chat.Messages, tc.want) {
				t.Errorf("messages\n got %s\nwant %s", respJSON(t, r.Chat.Messages), respJSON(t, tc.want))
			}
			if tc.check != nil {
				tc.check(t, r)
			}
		})
	}
}

func TestResponsesDecodeToolChoice(t *testing.T) {
	tools := `"tools":[{"type":"function","name":"f","parameters":{"type":"object"}}]`
	for _, tc := range []struct {
		choice string
		want   string // "" means not forwarded
	}{
		{`"auto"`, `"auto"`},
		{`"none"`, `"none"`},
		{`"required"`, `"required"`},
		{`{"type":"function","name":"f"}`, `{"function":{"name":"f"},"type":"function"}`},
		{`{"type":"allowed_tools","mode":"required","tools":[{"type":"function","name":"f"}]}`, `"required"`},
		{`{"type":"allowed_tools","mode":"auto","tools":[]}`, `"auto"`},
		{`{"type":"web_search_preview"}`, ``},
		{`{"type":"custom","name":"apply_patch"}`, ``},
	} {
		t.Run(tc.choice, func(t *testing.T) {
			r := respDecode(t, `{"model":"m","input":"x",`+tools+`,"tool_choice":`+tc.choice+`}`)
			if string(r.Chat.ToolChoice) != tc.want {
				t.Errorf("tool_choice = %s, want %s", r.Chat.ToolChoice, tc.want)
			}
		})
	}
}

var responsesDecodeErrors = []struct {
	name, body, want string
}{
	{"malformed JSON", `{"model":"m","input":`, "malformed JSON"},
	{"not an object", `["model"]`, "request body: want object, got array"},
	{"empty body", ``, "request body: want object, got nothing"},
	{"missing model", `{"input":"hi"}`, "model: required"},
	{"empty model", `{"model":"","input":"hi"}`, "model: must not be empty"},
	{"model of the wrong type", `{"model":7,"input":"hi"}`, "model: want string, got number"},
	{"missing input", `{"model":"m"}`, "input: required"},
	{"input of the wrong type", `{"model":"m","input":42}`, "input: want string or array of items, got number"},
	{"no messages", `{"model":"m","input":[]}`, "input: has no messages"},
	{"item not an object", `{"model":"m","input":["hi"]}`, "input[0]: want object, got string"},
	{"item without type or role", `{"model":"m","input":[{"content":"x"}]}`, "input[0].type: required"},
	{"unknown role", `{"model":"m","input":[{"type":"message","role":"tool","content":"x"}]}`, "input[0].role: must be user, assistant, system or developer"},
	{"message without content", `{"model":"m","input":[{"type":"message","role":"user"}]}`, "input[0].content: required"},
	{"content of the wrong type", `{"model":"m","input":[{"type":"message","role":"user","content":5}]}`, "input[0].content: want string or array of content parts, got number"},
	{"text of the wrong type", `{"model":"m","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":1}]}]}`, "input[0].content[0].text: want string, got number"},
	{"image without url", `{"model":"m","input":[{"type":"message","role":"user","content":[{"type":"input_image","file_id":"f"}]}]}`, "input[0].content[0].image_url: required (file_id is not supported)"},
	{"function_call without call_id", `{"model":"m","input":[{"type":"function_call","name":"f","arguments":"{}"}]}`, "input[0].call_id: required"},
	{"function_call without name", `{"model":"m","input":[{"type":"function_call","call_id":"c","arguments":"{}"}]}`, "input[0].name: required"},
	{"output without call_id", `{"model":"m","input":"x","tools":[],"x":1,"input":[{"type":"function_call_output","output":"o"}]}`, "input[0].call_id: required"},
	{"reasoning summary of the wrong type", `{"model":"m","input":[{"type":"reasoning","summary":"s"}]}`, "input[0].summary: want array, got string"},
	{"instructions of the wrong type", `{"model":"m","input":"x","instructions":["a"]}`, "instructions: want string, got array"},
	{"tools not an array", `{"model":"m","input":"x","tools":{"type":"function"}}`, "tools: want array, got object"},
	{"function tool without a name", `{"model":"m","input":"x","tools":[{"type":"function","parameters":{}}]}`, "tools[0].name: required"},
	{"tool without a type", `{"model":"m","input":"x","tools":[{"name":"f"}]}`, "tools[0].type: required"},
	{"parameters not an object", `{"model":"m","input":"x","tools":[{"type":"function","name":"f","parameters":"{}"}]}`, "tools[0].parameters: want object, got string"},
	{"unknown tool_choice", `{"model":"m","input":"x","tool_choice":"sometimes"}`, "tool_choice: must be auto, none, required or an object"},
	{"named tool_choice without a name", `{"model":"m","input":"x","tool_choice":{"type":"function"}}`, "tool_choice.name: required"},
	{"max_output_tokens of the wrong type", `{"model":"m","input":"x","max_output_tokens":"ten"}`, "max_output_tokens: want number, got string"},
	{"max_output_tokens zero", `{"model":"m","input":"x","max_output_tokens":0}`, "max_output_tokens: must be at least 1"},
	{"temperature of the wrong type", `{"model":"m","input":"x","temperature":"hot"}`, "temperature: want number, got string"},
	{"reasoning effort of the wrong type", `{"model":"m","input":"x","reasoning":{"effort":1}}`, "reasoning.effort: want string, got number"},
	{"stream of the wrong type", `{"model":"m","input":"x","stream":"yes"}`, "stream: want boolean, got string"},
	{"parallel_tool_calls of the wrong type", `{"model":"m","input":"x","parallel_tool_calls":1}`, "parallel_tool_calls: want boolean, got number"},
	{"previous_response_id", `{"model":"m","input":"x","previous_response_id":"resp_1"}`, "previous_response_id: not supported"},
}

func TestResponsesDecodeErrors(t *testing.T) {
	for _, tc := range responsesDecodeErrors {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Responses{}.Decode(nil, []byte(tc.body))
			var e *proxy.Error
			if !errors.As(err, &e) {
				t.Fatalf("err = %v, want *Error", err)
			}
			if e.Status != http.StatusBadRequest || e.Kind != proxy.ErrInvalidRequest || !strings.Contains(e.Message, tc.want) {
				t.Errorf("got %d %s %q, want 400 invalid_request containing %q", e.Status, e.Kind, e.Message, tc.want)
			}
		})
	}
}

// ---------------------------------------------------------------------------------------
// WriteResponse

func respWrite(t *testing.T, req *proxy.Request, res *proxy.Response) map[string]any {
	t.Helper()
	rec := httptest.NewRecorder()
	if err := (Responses{}).WriteResponse(rec, req, res); err != nil {
		t.Fatal(err)
	}
	if rec.Code != 200 || rec.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("status %d, content type %q", rec.Code, rec.Header().Get("Content-Type"))
	}
	var obj map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &obj); err != nil {
		t.Fatal(err)
	}
	return obj
}

// respCheckObject checks the fields every Response object carries.
func respCheckObject(t *testing.T, obj map[string]any, status string) {
	t.Helper()
	if !strings.HasPrefix(respStr(obj, "id"), "resp_") || obj["object"] != "response" || obj["status"] != status {
		t.Errorf("id %v object %v status %v, want status %s", obj["id"], obj["object"], obj["status"], status)
	}
	if _, ok := obj["created_at"].(float64); !ok {
		t.Errorf("created_at = %v", obj["created_at"])
	}
	for _, k := range []string{"error", "incomplete_details", "instructions", "max_output_tokens", "previous_response_id",
		"temperature", "top_p", "user", "reasoning", "text", "tool_choice", "tools", "parallel_tool_calls", "metadata", "usage", "output"} {
		if _, ok := obj[k]; !ok {
			t.Errorf("missing field %q", k)
		}
	}
	if obj["output"] == nil {
		t.Errorf("output is null")
	}
	if respMap(obj["metadata"]) == nil {
		t.Errorf("metadata = %v, want an object", obj["metadata"])
	}
}

func respCheckUsage(t *testing.T, u map[string]any, in, out, total float64) {
	t.Helper()
	if u["input_tokens"] != in || u["output_tokens"] != out || u["total_tokens"] != total ||
		respMap(u["input_tokens_details"])["cached_tokens"] != 0.0 ||
		respMap(u["output_tokens_details"])["reasoning_tokens"] != 0.0 {
		t.Errorf("usage = %v", u)
	}
}

func respTypes(output []any) []string {
	var ts []string
	for _, it := range output {
		ts = append(ts, respStr(respMap(it), "type"))
	}
	return ts
}

func TestResponsesWriteResponse(t *testing.T) {
	req := respDecode(t, `{"model":"gpt-5-codex","instructions":"be good","input":"hi","store":false,"tools":[{"type":"function","name":"shell"}],"temperature":0.5}`)
	calls := []proxy.ChatToolCall{
		{ID: "call_1", Type: "function", Function: proxy.ChatFunctionCall{Name: "shell", Arguments: `{"command":["ls"]}`}},
		{ID: "call_2", Type: "function", Function: proxy.ChatFunctionCall{Name: "shell", Arguments: `{"command":["pwd"]}`}},
	}
	for _, tc := range []struct {
		name      string
		msg       proxy.ChatMessage
		finish    string
		status    string
		types     []string
		incomplet string
		check     func(t *testing.T, output []any)
	}{
		{
			name: "text", msg: proxy.ChatMessage{Role: "assistant", Content: "Hello!"}, finish: proxy.FinishStop,
			status: "completed", types: []string{"message"},
			check: func(t *testing.T, out []any) {
				m := respMap(out[0])
				part := respMap(respList(m["content"])[0])
				if !strings.HasPrefix(respStr(m, "id"), "msg_") || m["role"] != "assistant" || m["status"] != "completed" ||
					part["type"] != "output_text" || part["text"] != "Hello!" || part["annotations"] == nil || len(respList(part["annotations"])) != 0 {
					t.Errorf("message item %v", m)
				}
			},
		},
		{
			name: "reasoning and text", msg: proxy.ChatMessage{Role: "assistant", Content: "42", ReasoningContent: "Let me think.\n6*7"}, finish: proxy.FinishStop,
			status: "completed", types: []string{"reasoning", "message"},
			check: func(t *testing.T, out []any) {
				r := respMap(out[0])
				sum := respList(r["summary"])
				if !strings.HasPrefix(respStr(r, "id"), "rs_") || len(sum) != 1 ||
					respMap(sum[0])["type"] != "summary_text" || respMap(sum[0])["text"] != "Let me think.\n6*7" ||
					r["encrypted_content"] != respFloeEnc("Let me think.\n6*7") {
					t.Errorf("reasoning item %v", r)
				}
			},
		},
		{
			name: "parallel function calls", msg: proxy.ChatMessage{Role: "assistant", Content: "", ToolCalls: calls}, finish: proxy.FinishToolCalls,
			status: "completed", types: []string{"function_call", "function_call"},
			check: func(t *testing.T, out []any) {
				for i, it := range out {
					f := respMap(it)
					if !strings.HasPrefix(respStr(f, "id"), "fc_") || f["call_id"] != calls[i].ID || f["name"] != "shell" ||
						f["arguments"] != calls[i].Function.Arguments || f["status"] != "completed" {
						t.Errorf("call %d: %v", i, f)
					}
				}
			},
		},
		{
			name: "length cuts the answer: incomplete", msg: proxy.ChatMessage{Role: "assistant", Content: "The answer is", ReasoningContent: "r"}, finish: proxy.FinishLength,
			status: "incomplete", types: []string{"reasoning", "message"}, incomplet: "max_output_tokens",
			check: func(t *testing.T, out []any) {
				if respMap(out[1])["status"] != "incomplete" {
					t.Errorf("message %v", out[1])
				}
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			obj := respWrite(t, req, &proxy.Response{ID: "chatcmpl-1", Choices: []proxy.Choice{{Message: tc.msg, FinishReason: tc.finish}},
				Usage: proxy.Usage{PromptTokens: 10, CompletionTokens: 5, TotalTokens: 15}})
			respCheckObject(t, obj, tc.status)
			if obj["model"] != "gpt-5-codex" || obj["instructions"] != "be good" || obj["temperature"] != 0.5 || obj["store"] != false {
				t.Errorf("echo: model %v instructions %v temperature %v store %v", obj["model"], obj["instructions"], obj["temperature"], obj["store"])
			}
			if len(respList(obj["tools"])) != 1 {
				t.Errorf("tools %v", obj["tools"])
			}
			out := respList(obj["output"])
			if got := respTypes(out); !reflect.DeepEqual(got, tc.types) {
				t.Fatalf("output types %v, want %v", got, tc.types)
			}
			respCheckUsage(t, respMap(obj["usage"]), 10, 5, 15)
			if tc.incomplet != "" {
				if respMap(obj["incomplete_details"])["reason"] != tc.incomplet {
					t.Errorf("incomplete_details %v", obj["incomplete_details"])
				}
			} else if obj["incomplete_details"] != nil || obj["error"] != nil {
				t.Errorf("incomplete_details %v error %v", obj["incomplete_details"], obj["error"])
			}
			tc.check(t, out)
		})
	}
}

// ---------------------------------------------------------------------------------------
// Streaming

func TestResponsesStream(t *testing.T) {
	req := respDecode(t, `{"model":"gpt-5-codex","input":"hi","stream":true}`)
	for _, tc := range []struct {
		name   string
		deltas []proxy.Delta
		finish string
		events []string
		// final texts by output item: reasoning/message text or call arguments
		texts []string
	}{
		{
			name:   "text",
			deltas: []proxy.Delta{{Content: "Hel"}, {Content: "lo"}, {Content: "!"}},
			finish: proxy.FinishStop,
			events: []string{"response.created", "response.in_progress",
				"response.output_item.added", "response.content_part.added",
				"response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
				"response.output_text.done", "response.content_part.done", "response.output_item.done",
				"response.completed"},
			texts: []string{"Hello!"},
		},
		{
			name:   "reasoning then text",
			deltas: []proxy.Delta{{Reasoning: "Think"}, {Reasoning: "ing."}, {Reasoning: " ok", Content: "Ans"}, {Content: "wer"}},
			finish: proxy.FinishStop,
			events: []string{"response.created", "response.in_progress",
				"response.output_item.added", "response.reasoning_summary_part.added",
				"response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
				"response.reasoning_summary_text.done", "response.reasoning_summary_part.done", "response.output_item.done",
				"response.output_item.added", "response.content_part.added",
				"response.output_text.delta", "response.output_text.delta",
				"response.output_text.done", "response.content_part.done", "response.output_item.done",
				"response.completed"},
			texts: []string{"Thinking. ok", "Answer"},
		},
		{
			name: "reasoning, text and parallel tool calls",
			deltas: []proxy.Delta{
				{Reasoning: "need ls and pwd"},
				{Content: "Running."},
				{ToolCalls: []proxy.ToolCallDelta{{Index: 0, ID: "call_a", Name: "shell", Arguments: ""}}},
				{ToolCalls: []proxy.ToolCallDelta{{Index: 0, Arguments: `{"command":`}}},
				{ToolCalls: []proxy.ToolCallDelta{{Index: 0, Arguments: `["ls"]}`}}},
				{ToolCalls: []proxy.ToolCallDelta{{Index: 1, ID: "call_b", Name: "shell", Arguments: `{"command":["pwd"]}`}}},
			},
			finish: proxy.FinishToolCalls,
			events: []string{"response.created", "response.in_progress",
				"response.output_item.added", "response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
				"response.reasoning_summary_text.done", "response.reasoning_summary_part.done", "response.output_item.done",
				"response.output_item.added", "response.content_part.added", "response.output_text.delta",
				"response.output_text.done", "response.content_part.done", "response.output_item.done",
				"response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.delta",
				"response.function_call_arguments.done", "response.output_item.done",
				"response.output_item.added", "response.function_call_arguments.delta",
				"response.function_call_arguments.done", "response.output_item.done",
				"response.completed"},
			texts: []string{"need ls and pwd", "Running.", `{"command":["ls"]}`, `{"command":["pwd"]}`},
		},
		{
			name:   "length: response.incomplete",
			deltas: []proxy.Delta{{Content: "The answer is"}},
			finish: proxy.FinishLength,
			events: []string{"response.created", "response.in_progress",
				"response.output_item.added", "response.content_part.added", "response.output_text.delta",
				"response.output_text.done", "response.content_part.done", "response.output_item.done",
				"response.incomplete"},
			texts: []string{"The answer is"},
		},
		{
			name:   "nothing at all",
			finish: proxy.FinishStop,
			events: []string{"response.created", "response.in_progress", "response.completed"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec, evs := respRun(t, req, tc.deltas, func(s proxy.Stream) error {
				return s.End(proxy.Finish{Reason: tc.finish}, proxy.Usage{PromptTokens: 7, CompletionTokens: 3, TotalTokens: 10})
			})
			if ct := rec.Header().Get("Content-Type"); ct != "text/event-stream" {
				t.Errorf("content type %q", ct)
			}
			var names []string
			for i, e := range evs {
				names = append(names, e.name)
				if e.data["type"] != e.name {
					t.Errorf("event %d: data type %v under event %q", i, e.data["type"], e.name)
				}
				if e.data["sequence_number"] != float64(i) {
					t.Errorf("event %d (%s): sequence_number %v", i, e.name, e.data["sequence_number"])
				}
			}
			if !reflect.DeepEqual(names, tc.events) {
				t.Fatalf("events\n got %v\nwant %v", names, tc.events)
			}
			respCheckStream(t, evs, tc.texts)

			// The first two carry the response in progress; the last one everything.
			for _, e := range evs[:2] {
				r := respMap(e.data["response"])
				respCheckObject(t, r, "in_progress")
				if len(respList(r["output"])) != 0 || r["usage"] != nil || r["model"] != "gpt-5-codex" {
					t.Errorf("%s: %v", e.name, r)
				}
			}
			final := respMap(evs[len(evs)-1].data["response"])
			status := "completed"
			if tc.finish == proxy.FinishLength {
				status = "incomplete"
				if respMap(final["incomplete_details"])["reason"] != "max_output_tokens" {
					t.Errorf("incomplete_details %v", final["incomplete_details"])
				}
			}
			respCheckObject(t, final, status)
			if final["id"] != respMap(evs[0].data["response"])["id"] {
				t.Errorf("response id changed: %v vs %v", final["id"], respMap(evs[0].data["response"])["id"])
			}
			respCheckUsage(t, respMap(final["usage"]), 7, 3, 10)
			out := respList(final["output"])
			if len(out) != len(tc.texts) {
				t.Fatalf("final output has %d items, want %d", len(out), len(tc.texts))
			}
			for i, it := range out {
				if got := respItemText(respMap(it)); got != tc.texts[i] {
					t.Errorf("final output[%d] text %q, want %q", i, got, tc.texts[i])
				}
			}
		})
	}
}

// respItemText is an output item's text: reasoning summary, message text or arguments.
func respItemText(it map[string]any) string {
	switch it["type"] {
	case "reasoning":
		s := ""
		for _, p := range respList(it["summary"]) {
			s += respStr(respMap(p), "text")
		}
		return s
	case "message":
		s := ""
		for _, p := range respList(it["content"]) {
			s += respStr(respMap(p), "text")
		}
		return s
	case "function_call":
		return respStr(it, "arguments")
	}
	return ""
}

// respCheckStream checks that each item's deltas concatenate to its done events and its
// output_item.done, that indexes and ids agree, and that items are added and done in order.
func respCheckStream(t *testing.T, evs []respEvent, texts []string) {
	t.Helper()
	type itemState struct {
		id, typ string
		deltas  string
		done    bool
	}
	var items []*itemState
	cur := func(e respEvent) *itemState {
		idx := int(e.data["output_index"].(float64))
		if idx != len(items)-1 {
			t.Fatalf("%s for output_index %d while item %d is open", e.name, idx, len(items)-1)
		}
		it := items[idx]
		if id, ok := e.data["item_id"]; ok && id != it.id {
			t.Errorf("%s: item_id %v, want %v", e.name, id, it.id)
		}
		if it.done {
			t.Errorf("%s after output_item.done", e.name)
		}
		return it
	}
	for _, e := range evs {
		switch e.name {
		case "response.output_item.added":
			if len(items) > 0 && !items[len(items)-1].done {
				t.Errorf("item %d added while item %d is open", len(items), len(items)-1)
			}
			item := respMap(e.data["item"])
			items = append(items, &itemState{id: respStr(item, "id"), typ: respStr(item, "type")})
			cur(e)
			if item["type"] == "function_call" && (item["arguments"] != "" || item["status"] != "in_progress") {
				t.Errorf("added call %v", item)
			}
			if item["type"] == "message" && (len(respList(item["content"])) != 0 || item["status"] != "in_progress") {
				t.Errorf("added message %v", item)
			}
		case "response.reasoning_summary_text.delta", "response.output_text.delta", "response.function_call_arguments.delta":
			it := cur(e)
			it.deltas += respStr(e.data, "delta")
		case "response.reasoning_summary_text.done", "response.output_text.done":
			if it := cur(e); respStr(e.data, "text") != it.deltas {
				t.Errorf("%s text %q, deltas %q", e.name, e.data["text"], it.deltas)
			}
		case "response.function_call_arguments.done":
			if it := cur(e); respStr(e.data, "arguments") != it.deltas {
				t.Errorf("%s arguments %q, deltas %q", e.name, e.data["arguments"], it.deltas)
			}
		case "response.reasoning_summary_part.done", "response.content_part.done":
			if it := cur(e); respStr(respMap(e.data["part"]), "text") != it.deltas {
				t.Errorf("%s part %v, deltas %q", e.name, e.data["part"], it.deltas)
			}
		case "response.reasoning_summary_part.added", "response.content_part.added":
			if cur(e); respStr(respMap(e.data["part"]), "text") != "" {
				t.Errorf("%s part not empty", e.name)
			}
		case "response.output_item.done":
			it := cur(e)
			item := respMap(e.data["item"])
			if respStr(item, "id") != it.id || respItemText(item) != it.deltas {
				t.Errorf("output_item.done %v, deltas %q", item, it.deltas)
			}
			if it.typ == "reasoning" && item["encrypted_content"] != respFloeEnc(it.deltas) {
				t.Errorf("reasoning encrypted_content %v", item["encrypted_content"])
			}
			it.done = true
		}
	}
	if len(items) != len(texts) {
		t.Fatalf("%d items streamed, want %d", len(items), len(texts))
	}
	for i, it := range items {
		if !it.done || it.deltas != texts[i] {
			t.Errorf("item %d: done %v deltas %q, want %q", i, it.done, it.deltas, texts[i])
		}
	}
}

func TestResponsesStreamFail(t *testing.T) {
	req := respDecode(t, `{"model":"m","input":"hi","stream":true}`)
	for _, tc := range []struct {
		err      *proxy.Error
		code     string
		contains string
	}{
		{&proxy.Error{Status: 400, Kind: proxy.ErrContextLength, Message: "too long", PromptTokens: 40000, MaxTokens: 32768},
			"context_length_exceeded", "Your input exceeds the context window of this model. Please adjust your input and try again."},
		{&proxy.Error{Status: 503, Kind: proxy.ErrUpstreamUnavailable, Message: "engine down"}, "server_error", "engine down"},
		{&proxy.Error{Status: 529, Kind: proxy.ErrOverloaded, Message: "busy"}, "server_is_overloaded", "busy"},
	} {
		t.Run(string(tc.err.Kind), func(t *testing.T) {
			_, evs := respRun(t, req, []proxy.Delta{{Content: "par"}}, func(s proxy.Stream) error { return s.Fail(tc.err) })
			last := evs[len(evs)-1]
			if last.name != "response.failed" {
				t.Fatalf("last event %q", last.name)
			}
			r := respMap(last.data["response"])
			e := respMap(r["error"])
			if r["status"] != "failed" || e["code"] != tc.code || !strings.Contains(respStr(e, "message"), tc.contains) {
				t.Errorf("failed response %v", r)
			}
			for i, ev := range evs {
				if ev.data["sequence_number"] != float64(i) {
					t.Errorf("sequence_number %v at %d", ev.data["sequence_number"], i)
				}
			}
		})
	}
}

func TestResponsesStreamToolCallFragments(t *testing.T) {
	req := respDecode(t, `{"model":"m","input":"hi"}`)
	_, evs := respRun(t, req, []proxy.Delta{
		{ToolCalls: []proxy.ToolCallDelta{{Index: 0, Arguments: `{"a":`}}}, // no id, no name yet
		{ToolCalls: []proxy.ToolCallDelta{{Index: 0, Name: "f", Arguments: `1}`}}},
		{ToolCalls: []proxy.ToolCallDelta{{Index: 1, ID: "call_b", Name: "g", Arguments: `{"b":`}}},
		{ToolCalls: []proxy.ToolCallDelta{{Index: 0, Arguments: ` `}}}, // late: call 0 is already done
		{ToolCalls: []proxy.ToolCallDelta{{Index: 1, Arguments: `2}`}}},
	}, func(s proxy.Stream) error { return s.End(proxy.Finish{Reason: proxy.FinishToolCalls}, proxy.Usage{}) })
	out := respList(respMap(evs[len(evs)-1].data["response"])["output"])
	if len(out) != 2 {
		t.Fatalf("output %v", out)
	}
	a, b := respMap(out[0]), respMap(out[1])
	if !strings.HasPrefix(respStr(a, "call_id"), "call_") || a["name"] != "f" || a["arguments"] != `{"a":1} ` {
		t.Errorf("first call %v", a)
	}
	if b["call_id"] != "call_b" || b["name"] != "g" || b["arguments"] != `{"b":2}` {
		t.Errorf("second call %v", b)
	}
}

func TestResponsesWritersWithoutDecodedState(t *testing.T) {
	// A request the core built itself (no dialect state) still gets a complete object.
	req := &proxy.Request{Model: "m"}
	obj := respWrite(t, req, &proxy.Response{Choices: []proxy.Choice{{Message: proxy.ChatMessage{Role: "assistant", Content: "x"}, FinishReason: proxy.FinishFilter}}})
	respCheckObject(t, obj, "incomplete")
	if respMap(obj["incomplete_details"])["reason"] != "content_filter" || obj["tool_choice"] != "auto" || len(respList(obj["tools"])) != 0 {
		t.Errorf("object %v", obj)
	}
	obj = respWrite(t, nil, &proxy.Response{})
	respCheckObject(t, obj, "completed")
}

func TestResponsesStreamCallsOrder(t *testing.T) {
	// Calls are misuse-proof: nothing after the end.
	req := respDecode(t, `{"model":"m","input":"hi"}`)
	rec := httptest.NewRecorder()
	s := Responses{}.NewStream(rec, req)
	if err := s.End(proxy.Finish{Reason: proxy.FinishStop}, proxy.Usage{}); err != nil {
		t.Fatal(err)
	}
	if s.Delta(proxy.Delta{Content: "x"}) == nil || s.End(proxy.Finish{Reason: proxy.FinishStop}, proxy.Usage{}) == nil || s.Fail(&proxy.Error{Kind: proxy.ErrInternal}) == nil {
		t.Errorf("calls after End must fail")
	}
}

// ---------------------------------------------------------------------------------------
// Round trip: what floe answers, fed back as the next request's input, is the same message.

func TestResponsesRoundTrip(t *testing.T) {
	msg := proxy.ChatMessage{
		Role: "assistant", Content: "I'll look at both.", ReasoningContent: "The user wants\n\n  both files.  ",
		ToolCalls: []proxy.ChatToolCall{
			{ID: "call_x1", Type: "function", Function: proxy.ChatFunctionCall{Name: "shell", Arguments: `{"command":["cat","a"]}`}},
			{ID: "call_x2", Type: "function", Function: proxy.ChatFunctionCall{Name: "shell", Arguments: `{"command":["cat","b"]}`}},
		},
	}
	req := respDecode(t, `{"model":"m","input":"read a and b"}`)

	nonStream := respList(respWrite(t, req, &proxy.Response{Choices: []proxy.Choice{{Message: msg, FinishReason: proxy.FinishToolCalls}}})["output"])
	deltas := []proxy.Delta{{Reasoning: "The user wants\n\n"}, {Reasoning: "  both files.  "}, {Content: "I'll look"}, {Content: " at both."}}
	for i, tc := range msg.ToolCalls {
		deltas = append(deltas, proxy.Delta{ToolCalls: []proxy.ToolCallDelta{{Index: i, ID: tc.ID, Name: tc.Function.Name}}},
			proxy.Delta{ToolCalls: []proxy.ToolCallDelta{{Index: i, Arguments: tc.Function.Arguments[:5]}}},
			proxy.Delta{ToolCalls: []proxy.ToolCallDelta{{Index: i, Arguments: tc.Function.Arguments[5:]}}})
	}
	_, evs := respRun(t, req, deltas, func(s proxy.Stream) error { return s.End(proxy.Finish{Reason: proxy.FinishToolCalls}, proxy.Usage{}) })
	streamed := respList(respMap(evs[len(evs)-1].data["response"])["output"])

	// Codex keeps each output_item.done item and sends it back without id or status.
	var doneItems []any
	for _, e := range evs {
		if e.name == "response.output_item.done" {
			it := respMap(e.data["item"])
			delete(it, "id")
			delete(it, "status")
			doneItems = append(doneItems, it)
		}
	}

	for _, tc := range []struct {
		name  string
		items []any
	}{{"non-streamed", nonStream}, {"streamed", streamed}, {"as Codex replays the streamed items", doneItems}} {
		t.Run(tc.name, func(t *testing.T) {
			input := []any{map[string]any{"type": "message", "role": "user", "content": []any{map[string]any{"type": "input_text", "text": "read a and b"}}}}
			input = append(input, tc.items...)
			for _, c := range msg.ToolCalls {
				input = append(input, map[string]any{"type": "function_call_output", "call_id": c.ID, "output": "contents of " + c.ID})
			}
			next := respDecode(t, respJSON(t, map[string]any{"model": "m", "store": false, "input": input}))
			want := []proxy.ChatMessage{
				{Role: "user", Content: "read a and b"},
				msg,
				{Role: "tool", Content: "contents of call_x1", ToolCallID: "call_x1"},
				{Role: "tool", Content: "contents of call_x2", ToolCallID: "call_x2"},
			}
			if !reflect.DeepEqual(next.Chat.Messages, want) {
				t.Errorf("messages\n got %s\nwant %s", respJSON(t, next.Chat.Messages), respJSON(t, want))
			}
		})
	}
}

// ---------------------------------------------------------------------------------------
// Errors and models

func TestResponsesWriteError(t *testing.T) {
	for _, tc := range []struct {
		err    *proxy.Error
		status int
		typ    string
		code   any
		msg    string
	}{
		{&proxy.Error{Status: 400, Kind: proxy.ErrContextLength, Message: "upstream words", PromptTokens: 40000, MaxTokens: 32768}, 400, "invalid_request_error", "context_length_exceeded",
			"Your input exceeds the context window of this model. Please adjust your input and try again. Your input is 40000 tokens; the context window is 32768 tokens."},
		{&proxy.Error{Kind: proxy.ErrContextLength}, 400, "invalid_request_error", "context_length_exceeded",
			"Your input exceeds the context window of this model. Please adjust your input and try again."},
		{&proxy.Error{Status: 400, Kind: proxy.ErrInvalidRequest, Message: "input: required"}, 400, "invalid_request_error", nil, "input: required"},
		{&proxy.Error{Status: 401, Kind: proxy.ErrAuthentication, Message: "unknown key"}, 401, "invalid_request_error", "invalid_api_key", "unknown key"},
		{&proxy.Error{Status: 404, Kind: proxy.ErrNotFound, Message: "no such path"}, 404, "invalid_request_error", nil, "no such path"},
		{&proxy.Error{Status: 503, Kind: proxy.ErrUpstreamUnavailable, Message: "engine down"}, 503, "server_error", "server_error", "engine down"},
		{&proxy.Error{Status: 500, Kind: proxy.ErrInternal, Message: "bug"}, 500, "server_error", "server_error", "bug"},
	} {
		t.Run(string(tc.err.Kind), func(t *testing.T) {
			rec := httptest.NewRecorder()
			Responses{}.WriteError(rec, tc.err)
			var body struct {
				Error map[string]any `json:"error"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
				t.Fatal(err)
			}
			e := body.Error
			if rec.Code != tc.status || e["type"] != tc.typ || e["code"] != tc.code || e["message"] != tc.msg {
				t.Errorf("got %d %v", rec.Code, e)
			}
			if v, ok := e["param"]; !ok || v != nil {
				t.Errorf("param %v present %v, want null", v, ok)
			}
		})
	}
}

func TestResponsesWriteModels(t *testing.T) {
	rec := httptest.NewRecorder()
	Responses{}.WriteModels(rec, []string{"qwen3-8b", "gpt-5-codex"})
	want := `{"data":[{"created":0,"id":"qwen3-8b","object":"model","owned_by":"floe"},{"created":0,"id":"gpt-5-codex","object":"model","owned_by":"floe"}],"object":"list"}`
	if rec.Code != 200 || rec.Body.String() != want {
		t.Errorf("got %d %s", rec.Code, rec.Body.String())
	}
	rec = httptest.NewRecorder()
	Responses{}.WriteModels(rec, nil)
	if rec.Body.String() != `{"data":[],"object":"list"}` {
		t.Errorf("no models: %s", rec.Body.String())
	}
	if (Responses{}).Name() != "openai_responses" {
		t.Errorf("name")
	}
}

// ---------------------------------------------------------------------------------------
// Fuzz

func FuzzResponsesDecode(f *testing.F) {
	for _, tc := range responsesDecodeCases {
		f.Add([]byte(tc.body))
	}
	for _, tc := range responsesDecodeErrors {
		f.Add([]byte(tc.body))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, err := Responses{}.Decode(nil, body)
		if err != nil {
			var e *proxy.Error
			if !errors.As(err, &e) || e.Status != http.StatusBadRequest || e.Kind != proxy.ErrInvalidRequest || e.Message == "" {
				t.Fatalf("error %#v", err)
			}
			return
		}
		if req.Model == "" || len(req.Chat.Messages) == 0 {
			t.Fatalf("accepted without model or messages: %s", body)
		}
		if _, err := json.Marshal(req.Chat); err != nil {
			t.Fatalf("normalized request does not encode: %v", err)
		}
		// The writers cope with whatever was decoded: they do not panic (an error is an
		// answer too).
		_ = Responses{}.WriteResponse(httptest.NewRecorder(), req, &proxy.Response{Choices: []proxy.Choice{{Message: proxy.ChatMessage{Role: "assistant", Content: "x"}, FinishReason: proxy.FinishStop}}})
		s := Responses{}.NewStream(httptest.NewRecorder(), req)
		_ = s.Delta(proxy.Delta{Content: "x"})
		_ = s.End(proxy.Finish{Reason: proxy.FinishStop}, proxy.Usage{})
	})
}
