package gemini

import (
	"bufio"
	"bytes"
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

const pathGen = "/v1beta/models/gemini-2.5-pro:generateContent"

func decode(path, body string) (*proxy.Request, error) {
	r := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
	return Dialect{}.Decode(r, []byte(body))
}

// jSONEqual reports whether got, marshalled, is the same JSON value as want.
func jSONEqual(t *testing.T, what string, got any, want string) {
	t.Helper()
	gb, err := json.Marshal(got)
	if err != nil {
		t.Fatalf("%s: marshal: %v", what, err)
	}
	var g, w any
	if err := json.Unmarshal(gb, &g); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if err := json.Unmarshal([]byte(want), &w); err != nil {
		t.Fatalf("%s: bad want: %v", what, err)
	}
	if !reflect.DeepEqual(g, w) {
		t.Errorf("%s:\n got  %s\n want %s", what, gb, want)
	}
}

var decodeCases = []struct {
	name, path, body string
	want             string // JSON of Request.Chat
	stream           bool
	include          bool
	method           string
}{
	{
		name: "system instruction",
		path: pathGen,
		body: `{"systemInstruction":{"role":"user","parts":[{"text":"You are floe."},{"text":"Be brief."}]},
			"contents":[{"role":"user","parts":[{"text":"hi"}]}]}`,
		want: `{"model":"gemini-2.5-pro","messages":[
			{"role":"system","content":"You are floe.\nBe brief."},
			{"role":"user","content":"hi"}]}`,
	},
	{
		name: "function calls without ids, responses matched by name",
		path: pathGen,
		body: `{"contents":[
			{"role":"user","parts":[{"text":"look"}]},
			{"role":"model","parts":[{"text":"Let me look."},
				{"functionCall":{"name":"ls","args":{"path":".","all":true}}},
				{"functionCall":{"name":"read_file","args":{"file_path":"a.go"}}}]},
			{"role":"user","parts":[
				{"functionResponse":{"name":"read_file","response":{"output":"package a"}}},
				{"functionResponse":{"name":"ls","response":{"output":"a.go"}}}]},
			{"role":"model","parts":[{"text":"done"}]}]}`,
		want: `{"model":"gemini-2.5-pro","messages":[
			{"role":"user","content":"look"},
			{"role":"assistant","content":"Let me look.","tool_calls":[
				{"id":"call_1_0","type":"function","function":{"name":"ls","arguments":"{\"path\":\".\",\"all\":true}"}},
				{"id":"call_1_1","type":"function","function":{"name":"read_file","arguments":"{\"file_path\":\"a.go\"}"}}]},
			{"role":"tool","content":"{\"output\":\"package a\"}","tool_call_id":"call_1_1"},
			{"role":"tool","content":"{\"output\":\"a.go\"}","tool_call_id":"call_1_0"},
			{"role":"assistant","content":"done"}]}`,
	},
	{
		name: "function calls with ids, responses followed by user text",
		path: pathGen,
		body: `{"contents":[
			{"role":"user","parts":[{"text":"go"}]},
			{"role":"model","parts":[{"functionCall":{"id":"fc-a","name":"ls","args":{}}},{"functionCall":{"id":"fc-b","name":"ls"}}]},
			{"role":"user","parts":[{"text":"also this"},
				{"functionResponse":{"id":"fc-b","name":"ls","response":{"output":"b"}}},
				{"functionResponse":{"id":"fc-a","name":"ls","response":{"error":"denied"}}}]}]}`,
		want: `{"model":"gemini-2.5-pro","messages":[
			{"role":"user","content":"go"},
			{"role":"assistant","content":"","tool_calls":[
				{"id":"fc-a","type":"function","function":{"name":"ls","arguments":"{}"}},
				{"id":"fc-b","type":"function","function":{"name":"ls","arguments":"{}"}}]},
			{"role":"tool","content":"{\"output\":\"b\"}","tool_call_id":"fc-b"},
			{"role":"tool","content":"{\"error\":\"denied\"}","tool_call_id":"fc-a"},
			{"role":"user","content":"also this"}]}`,
	},
	{
		name: "arguments and responses re-encoded as UTF-8, order and numbers kept",
		path: pathGen,
		body: `{"contents":[{"role":"user","parts":[{"text":"q"}]},
			{"role":"model","parts":[{"functionCall":{"name":"w","args":{"z": "\u00fc\u003c", "a": [1.50, 2e3, null, true]}}}]},
			{"role":"user","parts":[{"functionResponse":{"name":"w","response":{"output": "line1\nl\u00eene2 \"q\" <b>&", "n": -0.0}}}]}]}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"user","content":"q"},
			{"role":"assistant","content":"","tool_calls":[{"id":"call_1_0","type":"function","function":{"name":"w","arguments":"{\"z\":\"ü<\",\"a\":[1.50,2e3,null,true]}"}}]},
			{"role":"tool","content":"{\"output\":\"line1\\nlîne2 \\\"q\\\" <b>&\",\"n\":-0.0}","tool_call_id":"call_1_0"}]}`,
	},
	{
		name: "unmatched function response gets its own id",
		path: pathGen,
		body: `{"contents":[{"role":"user","parts":[{"functionResponse":{"name":"x","response":null}}]}]}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"tool","content":"{}","tool_call_id":"call_0_0"}]}`,
	},
	{
		name: "thought parts become reasoning",
		path: pathGen,
		body: `{"contents":[{"role":"user","parts":[{"text":"q"}]},
			{"role":"model","parts":[{"text":"step 1. ","thought":true},{"text":"step 2.","thought":true},{"text":"ans"},{"text":"wer"}]}]}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"user","content":"q"},
			{"role":"assistant","content":"answer","reasoning_content":"step 1. step 2."}]}`,
	},
	{
		name: "floe signature restores dropped reasoning; foreign signatures ignored",
		path: pathGen,
		body: `{"contents":[{"role":"user","parts":[{"text":"q"}]},
			{"role":"model","parts":[{"text":"answer","thoughtSignature":"` + signature("exact\n reasoning ") + `"},
				{"functionCall":{"name":"f","args":{}},"thoughtSignature":"skip_thought_signature_validator"}]},
			{"role":"user","parts":[{"functionResponse":{"name":"f","response":{}}}]},
			{"role":"model","parts":[{"text":"summ","thought":true},{"text":"x","thoughtSignature":"` + signature("full") + `"}]}]}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"user","content":"q"},
			{"role":"assistant","content":"answer","reasoning_content":"exact\n reasoning ","tool_calls":[
				{"id":"call_1_0","type":"function","function":{"name":"f","arguments":"{}"}}]},
			{"role":"tool","content":"{}","tool_call_id":"call_1_0"},
			{"role":"assistant","content":"x","reasoning_content":"full"}]}`,
	},
	{
		name: "inline image, file image, other media placeholder",
		path: pathGen,
		body: `{"contents":[{"role":"user","parts":[{"text":"what is this"},
			{"inlineData":{"mimeType":"image/png","data":"iVBORw0KGgo="}},
			{"fileData":{"mimeType":"image/jpeg","fileUri":"https://x/y.jpg"}},
			{"inlineData":{"mimeType":"application/pdf","data":"JVBERi0="}}]}]}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"user","content":[
			{"type":"text","text":"what is this"},
			{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="}},
			{"type":"image_url","image_url":{"url":"https://x/y.jpg"}},
			{"type":"text","text":"[application/pdf content omitted: only text and images are forwarded]"}]}]}`,
	},
	{
		name: "function declarations kept, other tools dropped, Gemini schema lower-cased",
		path: pathGen,
		body: `{"contents":[{"role":"user","parts":[{"text":"hi"}]}],
			"tools":[{"googleSearch":{}},{"codeExecution":{}},{"urlContext":{}},
				{"functionDeclarations":[
					{"name":"read_file","description":"Reads a file.","parameters":{"type":"OBJECT","properties":{"path":{"type":"STRING"},"lines":{"type":"ARRAY","items":{"type":"INTEGER"}}},"required":["path"]}},
					{"name":"grep","parametersJsonSchema":{"type":"object","properties":{"pattern":{"type":"string"}},"additionalProperties":false}},
					{"name":"noargs"}]}]}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"user","content":"hi"}],"tools":[
			{"type":"function","function":{"name":"read_file","description":"Reads a file.","parameters":{"type":"object","properties":{"path":{"type":"string"},"lines":{"type":"array","items":{"type":"integer"}}},"required":["path"]}}},
			{"type":"function","function":{"name":"grep","parameters":{"type":"object","properties":{"pattern":{"type":"string"}},"additionalProperties":false}}},
			{"type":"function","function":{"name":"noargs"}}]}`,
	},
	{
		name: "mode AUTO",
		path: pathGen,
		body: `{"contents":[{"parts":[{"text":"hi"}]}],"tools":[{"functionDeclarations":[{"name":"f"}]}],
			"toolConfig":{"functionCallingConfig":{"mode":"AUTO"}}}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"user","content":"hi"}],
			"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"auto"}`,
	},
	{
		name: "mode ANY",
		path: pathGen,
		body: `{"contents":[{"parts":[{"text":"hi"}]}],"tools":[{"functionDeclarations":[{"name":"f"},{"name":"g"}]}],
			"toolConfig":{"functionCallingConfig":{"mode":"ANY","allowedFunctionNames":["f","g"]}}}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"user","content":"hi"}],
			"tools":[{"type":"function","function":{"name":"f"}},{"type":"function","function":{"name":"g"}}],"tool_choice":"required"}`,
	},
	{
		name: "mode ANY with one allowed name",
		path: pathGen,
		body: `{"contents":[{"parts":[{"text":"hi"}]}],"tools":[{"functionDeclarations":[{"name":"f"},{"name":"g"}]}],
			"toolConfig":{"functionCallingConfig":{"mode":"ANY","allowedFunctionNames":["g"]}}}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"user","content":"hi"}],
			"tools":[{"type":"function","function":{"name":"f"}},{"type":"function","function":{"name":"g"}}],
			"tool_choice":{"type":"function","function":{"name":"g"}}}`,
	},
	{
		name: "mode NONE",
		path: pathGen,
		body: `{"contents":[{"parts":[{"text":"hi"}]}],"tools":[{"functionDeclarations":[{"name":"f"}]}],
			"toolConfig":{"functionCallingConfig":{"mode":"NONE"}}}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"user","content":"hi"}],
			"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"none"}`,
	},
	{
		name: "mode without function tools is not forwarded",
		path: pathGen,
		body: `{"contents":[{"parts":[{"text":"hi"}]}],"tools":[{"googleSearch":{}}],
			"toolConfig":{"functionCallingConfig":{"mode":"ANY"}}}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"user","content":"hi"}]}`,
	},
	{
		name: "generation config and thinkingBudget 0",
		path: pathGen,
		body: `{"contents":[{"parts":[{"text":"hi"}]}],"generationConfig":{"maxOutputTokens":1024,"temperature":0.5,
			"topP":0.9,"topK":40,"stopSequences":["END"],"candidateCount":2,
			"thinkingConfig":{"thinkingBudget":0,"includeThoughts":true}}}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":1024,
			"temperature":0.5,"top_p":0.9,"stop":["END"],"n":2,"chat_template_kwargs":{"enable_thinking":false}}`,
		include: true,
	},
	{
		name: "dynamic thinking budget leaves thinking on",
		path: pathGen,
		body: `{"contents":[{"parts":[{"text":"hi"}]}],"generationConfig":{"thinkingConfig":{"thinkingBudget":-1,"includeThoughts":false}}}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"user","content":"hi"}]}`,
	},
	{
		name: "snake_case body",
		path: pathGen,
		body: `{"system_instruction":{"parts":[{"text":"sys"}]},"contents":[{"role":"user","parts":[{"text":"hi"},
			{"inline_data":{"mime_type":"image/png","data":"AA=="}}]},
			{"role":"model","parts":[{"function_call":{"name":"f","args":{"file_path":"x"}}}]},
			{"role":"user","parts":[{"function_response":{"name":"f","response":{"some_key":1}}}]}],
			"tools":[{"function_declarations":[{"name":"f","parameters":{"type":"OBJECT","properties":{"file_path":{"type":"STRING"}}}}]}],
			"tool_config":{"function_calling_config":{"mode":"ANY","allowed_function_names":["f"]}},
			"generation_config":{"max_output_tokens":5,"thinking_config":{"include_thoughts":true}}}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"system","content":"sys"},
			{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AA=="}}]},
			{"role":"assistant","content":"","tool_calls":[{"id":"call_1_0","type":"function","function":{"name":"f","arguments":"{\"file_path\":\"x\"}"}}]},
			{"role":"tool","content":"{\"some_key\":1}","tool_call_id":"call_1_0"}],
			"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"file_path":{"type":"string"}}}}}],
			"tool_choice":{"type":"function","function":{"name":"f"}},"max_completion_tokens":5}`,
		include: true,
	},
	{
		name:   "streamGenerateContent with alt=sse",
		path:   "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
		body:   `{"contents":[{"role":"user","parts":[{"text":"hi"}]}]}`,
		want:   `{"model":"gemini-2.5-flash","messages":[{"role":"user","content":"hi"}],"stream":true}`,
		stream: true,
		method: methodStream,
	},
	{
		name:   "streamGenerateContent without alt",
		path:   "/v1/models/m1:streamGenerateContent",
		body:   `{"contents":[{"role":"user","parts":[{"text":"hi"}]}]}`,
		want:   `{"model":"m1","messages":[{"role":"user","content":"hi"}],"stream":true}`,
		stream: true,
		method: methodStream,
	},
	{
		name: "tuned model",
		path: "/v1beta/tunedModels/my-tune:generateContent",
		body: `{"contents":[{"parts":[{"text":"hi"}]}]}`,
		want: `{"model":"my-tune","messages":[{"role":"user","content":"hi"}]}`,
	},
	{
		name: "vertex-style path",
		path: "/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.0:generateContent",
		body: `{"contents":[{"parts":[{"text":"hi"}]}]}`,
		want: `{"model":"gemini-2.0","messages":[{"role":"user","content":"hi"}]}`,
	},
	{
		name:   "countTokens with contents",
		path:   "/v1beta/models/gemini-2.5-pro:countTokens",
		body:   `{"contents":[{"role":"user","parts":[{"text":"count me"}]}]}`,
		want:   `{"model":"gemini-2.5-pro","messages":[{"role":"user","content":"count me"}]}`,
		method: methodCount,
	},
	{
		name: "countTokens with generateContentRequest",
		path: "/v1beta/models/gemini-2.5-pro:countTokens",
		body: `{"generateContentRequest":{"model":"models/gemini-2.5-pro","systemInstruction":{"parts":[{"text":"s"}]},
			"contents":[{"role":"user","parts":[{"text":"count me"}]}],"tools":[{"functionDeclarations":[{"name":"f"}]}]}}`,
		want: `{"model":"gemini-2.5-pro","messages":[{"role":"system","content":"s"},{"role":"user","content":"count me"}],
			"tools":[{"type":"function","function":{"name":"f"}}]}`,
		method: methodCount,
	},
}

func TestGeminiDecode(t *testing.T) {
	for _, tc := range decodeCases {
		t.Run(tc.name, func(t *testing.T) {
			req, err := decode(tc.path, tc.body)
			if err != nil {
				t.Fatalf("Decode: %v", err)
			}
			jSONEqual(t, "chat", req.Chat, tc.want)
			if req.Stream != tc.stream {
				t.Errorf("Stream = %v, want %v", req.Stream, tc.stream)
			}
			if req.Model != req.Chat.Model || req.Model == "" {
				t.Errorf("Model = %q, Chat.Model = %q", req.Model, req.Chat.Model)
			}
			st, ok := req.State.(*state)
			if !ok {
				t.Fatalf("State = %T", req.State)
			}
			method := tc.method
			if method == "" {
				method = methodGenerate
			}
			if st.Method != method || st.IncludeThoughts != tc.include {
				t.Errorf("State = %+v, want method %s include %v", *st, method, tc.include)
			}
		})
	}
}

func TestGeminiDecodeErrors(t *testing.T) {
	ok := `{"contents":[{"role":"user","parts":[{"text":"hi"}]}]}`
	cases := []struct{ name, path, body, want string }{
		{"malformed JSON", pathGen, `{"contents":[`, "request body: malformed JSON"},
		{"empty body", pathGen, ``, "request body: want object, got nothing"},
		{"missing contents", pathGen, `{"systemInstruction":{"parts":[{"text":"s"}]}}`, "contents: required"},
		{"empty contents", pathGen, `{"contents":[]}`, "contents: required"},
		{"count without contents", "/v1beta/models/m:countTokens", `{"generateContentRequest":{"model":"m"}}`, "generateContentRequest.contents: required"},
		{"contents not an array", pathGen, `{"contents":"hi"}`, "contents: want array, got string"},
		{"text not a string", pathGen, `{"contents":[{"parts":[{"text":5}]}]}`, "contents[0].parts[0].text: want string, got number"},
		{"body not an object", pathGen, `[1]`, "request body: want object, got array"},
		{"bad role", pathGen, `{"contents":[{"parts":[{"text":"a"}]},{"role":"bot","parts":[{"text":"a"}]}]}`, `contents[1].role: "bot"`},
		{"function call without name", pathGen, `{"contents":[{"parts":[{"text":"a"}]},{"role":"model","parts":[{"text":"a"},{"functionCall":{"args":{}}}]}]}`, "contents[1].parts[1].functionCall.name: required"},
		{"declaration without name", pathGen, `{"contents":[{"parts":[{"text":"a"}]}],"tools":[{"functionDeclarations":[{"name":"f"},{"description":"d"}]}]}`, "tools[0].functionDeclarations[1].name: required"},
		{"bad mode", pathGen, `{"contents":[{"parts":[{"text":"a"}]}],"toolConfig":{"functionCallingConfig":{"mode":"SOMETIMES"}}}`, "toolConfig.functionCallingConfig.mode"},
		{"bad generation config", pathGen, `{"contents":[{"parts":[{"text":"a"}]}],"generationConfig":{"maxOutputTokens":"many"}}`, "generationConfig.maxOutputTokens: want number, got string"},
		{"snake_case field named as sent", pathGen, `{"contents":[{"parts":[{"text":"a"}]}],"generation_config":{"max_output_tokens":true}}`, "generation_config.max_output_tokens: want number, got boolean"},
		{"no method", "/v1beta/models/gemini-2.5-pro", ok, "path"},
		{"empty model", "/v1beta/models/:generateContent", ok, "path"},
		{"no models segment", "/v1beta/gemini:generateContent", ok, "path"},
		{"unsupported method", "/v1beta/models/m:embedContent", ok, `unsupported method "embedContent"`},
		{"model with slash", "/v1beta/models/a/b:generateContent", ok, "path"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decode(tc.path, tc.body)
			var e *proxy.Error
			if !errors.As(err, &e) {
				t.Fatalf("err = %v (%T), want *Error", err, err)
			}
			if e.Status != http.StatusBadRequest || e.Kind != proxy.ErrInvalidRequest {
				t.Errorf("err = %+v, want 400 invalid_request", e)
			}
			if !strings.Contains(e.Message, tc.want) {
				t.Errorf("message %q does not contain %q", e.Message, tc.want)
			}
		})
	}
}

func testRequest(include bool) *proxy.Request {
	return &proxy.Request{Model: "gemini-2.5-pro", State: &state{Method: methodGenerate, IncludeThoughts: include}}
}

func TestGeminiWriteResponse(t *testing.T) {
	usage := proxy.Usage{PromptTokens: 10, CompletionTokens: 5, TotalTokens: 15}
	usageJSON := `"usageMetadata":{"promptTokenCount":10,"candidatesTokenCount":5,"totalTokenCount":15},"modelVersion":"gemini-2.5-pro","responseId":"r1"`
	cases := []struct {
		name    string
		include bool
		choice  proxy.Choice
		want    string
	}{
		{
			name:   "text",
			choice: proxy.Choice{Message: proxy.ChatMessage{Role: "assistant", Content: "Hello."}, FinishReason: proxy.FinishStop},
			want:   `{"candidates":[{"content":{"role":"model","parts":[{"text":"Hello."}]},"finishReason":"STOP","index":0}],` + usageJSON + `}`,
		},
		{
			name:    "thought and text",
			include: true,
			choice:  proxy.Choice{Message: proxy.ChatMessage{Role: "assistant", Content: "42", ReasoningContent: "think"}, FinishReason: proxy.FinishStop},
			want: `{"candidates":[{"content":{"role":"model","parts":[{"text":"think","thought":true},
				{"text":"42","thoughtSignature":"` + signature("think") + `"}]},"finishReason":"STOP","index":0}],` + usageJSON + `}`,
		},
		{
			name:   "thoughts not included: signature only",
			choice: proxy.Choice{Message: proxy.ChatMessage{Role: "assistant", Content: "42", ReasoningContent: "think"}, FinishReason: proxy.FinishStop},
			want: `{"candidates":[{"content":{"role":"model","parts":[
				{"text":"42","thoughtSignature":"` + signature("think") + `"}]},"finishReason":"STOP","index":0}],` + usageJSON + `}`,
		},
		{
			name:    "parallel function calls",
			include: true,
			choice: proxy.Choice{Message: proxy.ChatMessage{Role: "assistant", Content: "", ReasoningContent: "r", ToolCalls: []proxy.ChatToolCall{
				{ID: "c1", Type: "function", Function: proxy.ChatFunctionCall{Name: "ls", Arguments: `{"path": "."}`}},
				{ID: "c2", Type: "function", Function: proxy.ChatFunctionCall{Name: "read_file", Arguments: `{"file_path":"a.go","n":[1,2]}`}},
				{ID: "c3", Type: "function", Function: proxy.ChatFunctionCall{Name: "noargs", Arguments: ``}},
			}}, FinishReason: proxy.FinishToolCalls},
			want: `{"candidates":[{"content":{"role":"model","parts":[{"text":"r","thought":true},
				{"functionCall":{"id":"c1","name":"ls","args":{"path":"."}},"thoughtSignature":"` + signature("r") + `"},
				{"functionCall":{"id":"c2","name":"read_file","args":{"file_path":"a.go","n":[1,2]}}},
				{"functionCall":{"id":"c3","name":"noargs","args":{}}}]},"finishReason":"STOP","index":0}],` + usageJSON + `}`,
		},
		{
			name:   "max tokens inside reasoning",
			choice: proxy.Choice{Message: proxy.ChatMessage{Role: "assistant", Content: "", ReasoningContent: "long"}, FinishReason: proxy.FinishLength},
			want: `{"candidates":[{"content":{"role":"model","parts":[{"thoughtSignature":"` + signature("long") + `"}]},
				"finishReason":"MAX_TOKENS","index":0}],` + usageJSON + `}`,
		},
		{
			name:   "empty",
			choice: proxy.Choice{Message: proxy.ChatMessage{Role: "assistant", Content: ""}, FinishReason: "abort"},
			want:   `{"candidates":[{"content":{"role":"model","parts":[{"text":""}]},"finishReason":"OTHER","index":0}],` + usageJSON + `}`,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			err := Dialect{}.WriteResponse(rec, testRequest(tc.include), &proxy.Response{ID: "r1", Choices: []proxy.Choice{tc.choice}, Usage: usage})
			if err != nil {
				t.Fatal(err)
			}
			if rec.Code != 200 || rec.Header().Get("Content-Type") != "application/json" {
				t.Errorf("status %d, content type %q", rec.Code, rec.Header().Get("Content-Type"))
			}
			jSONEqual(t, "body", json.RawMessage(rec.Body.Bytes()), tc.want)
		})
	}
}

// sSEEvents parses a recorded SSE body into its data payloads.
func sSEEvents(t *testing.T, body string) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	var data []string
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			if data != nil {
				out = append(out, strings.Join(data, "\n"))
				data = nil
			}
		case strings.HasPrefix(line, "data: "):
			data = append(data, strings.TrimPrefix(line, "data: "))
		default:
			t.Errorf("unexpected SSE line %q", line)
		}
	}
	if data != nil {
		t.Errorf("unterminated event %q", data)
	}
	return out
}

// decodeStrict decodes a GenerateContentResponse, refusing unknown fields.
func decodeStrict(t *testing.T, data string) response {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(data))
	dec.DisallowUnknownFields()
	var r response
	if err := dec.Decode(&r); err != nil {
		t.Fatalf("event %s: %v", data, err)
	}
	if len(r.Candidates) != 1 || r.Candidates[0].Content.Role != "model" || len(r.Candidates[0].Content.Parts) == 0 {
		t.Fatalf("event %s: want one model candidate with parts", data)
	}
	return r
}

func TestGeminiStream(t *testing.T) {
	for _, include := range []bool{true, false} {
		rec := httptest.NewRecorder()
		s := Dialect{}.NewStream(rec, testRequest(include))
		deltas := []proxy.Delta{
			{Reasoning: "Let me "},
			{Reasoning: "think."},
			{Content: "I'll look."},
			{Content: " Now."},
			{ToolCalls: []proxy.ToolCallDelta{{Index: 0, ID: "c0", Name: "ls", Arguments: `{"pa`}}},
			{ToolCalls: []proxy.ToolCallDelta{{Index: 0, Arguments: `th": "."}`}}},
			{ToolCalls: []proxy.ToolCallDelta{{Index: 1, ID: "c1", Name: "read_file"}}},
			{ToolCalls: []proxy.ToolCallDelta{{Index: 1, Arguments: `{"file_path":`}}},
			{ToolCalls: []proxy.ToolCallDelta{{Index: 1, Arguments: ` "a.go"}`}}},
		}
		for _, d := range deltas {
			if err := s.Delta(d); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.End(proxy.Finish{Reason: proxy.FinishToolCalls}, proxy.Usage{PromptTokens: 7, CompletionTokens: 9, TotalTokens: 16}); err != nil {
			t.Fatal(err)
		}
		if err := s.Delta(proxy.Delta{Content: "late"}); err == nil {
			t.Error("Delta after End: want an error")
		}
		if ct := rec.Header().Get("Content-Type"); ct != "text/event-stream" {
			t.Errorf("content type %q", ct)
		}

		events := sSEEvents(t, rec.Body.String())
		var thoughts, text strings.Builder
		var calls []functionCall
		var history []part // what Gemini CLI keeps: non-thought parts
		var last response
		for i, ev := range events {
			r := decodeStrict(t, ev)
			c := r.Candidates[0]
			if r.ModelVersion != "gemini-2.5-pro" || r.ResponseID == "" {
				t.Errorf("event %d: modelVersion %q responseId %q", i, r.ModelVersion, r.ResponseID)
			}
			if (c.FinishReason != "") != (i == len(events)-1) || (r.UsageMetadata != nil) != (i == len(events)-1) {
				t.Errorf("event %d of %d: finishReason %q usage %v", i, len(events), c.FinishReason, r.UsageMetadata)
			}
			for _, p := range c.Content.Parts {
				switch {
				case p.Thought:
					thoughts.WriteString(*p.Text)
				case p.FunctionCall != nil:
					calls = append(calls, *p.FunctionCall)
				case p.Text != nil:
					text.WriteString(*p.Text)
				}
				if !p.Thought {
					history = append(history, p)
				}
			}
			last = r
		}
		wantThoughts := ""
		if include {
			wantThoughts = "Let me think."
		}
		if thoughts.String() != wantThoughts || text.String() != "I'll look. Now." {
			t.Errorf("include=%v: thoughts %q text %q", include, thoughts.String(), text.String())
		}
		jSONEqual(t, "calls", calls, `[{"id":"c0","name":"ls","args":{"path":"."}},{"id":"c1","name":"read_file","args":{"file_path":"a.go"}}]`)
		if c := last.Candidates[0]; c.FinishReason != "STOP" || *last.UsageMetadata != (wireUsage{7, 9, 16}) {
			t.Errorf("last event: %+v %+v", c, last.UsageMetadata)
		}
		// The harness sends the non-thought parts back: floe's signature restores the reasoning.
		next, _ := json.Marshal(request{Contents: []wireContent{
			{Role: "user", Parts: []part{{Text: textPtr("q")}}},
			{Role: "model", Parts: history},
		}})
		req, err := decode(pathGen, string(next))
		if err != nil {
			t.Fatal(err)
		}
		jSONEqual(t, "replayed turn", req.Chat.Messages[1], `{"role":"assistant","content":"I'll look. Now.","reasoning_content":"Let me think.",
			"tool_calls":[{"id":"c0","type":"function","function":{"name":"ls","arguments":"{\"path\":\".\"}"}},
				{"id":"c1","type":"function","function":{"name":"read_file","arguments":"{\"file_path\":\"a.go\"}"}}]}`)
	}
}

func TestGeminiStreamCallsWhole(t *testing.T) {
	rec := httptest.NewRecorder()
	s := Dialect{}.NewStream(rec, testRequest(false))
	steps := []proxy.Delta{
		{Reasoning: "plan"},
		{ToolCalls: []proxy.ToolCallDelta{{Index: 0, ID: "a", Name: "f", Arguments: `{"x":`}}},
		{ToolCalls: []proxy.ToolCallDelta{{Index: 0, Arguments: `1}`}}},
		{ToolCalls: []proxy.ToolCallDelta{{Index: 1, ID: "b", Name: "g", Arguments: `{}`}}},
	}
	var counts []int
	for _, d := range steps {
		if err := s.Delta(d); err != nil {
			t.Fatal(err)
		}
		counts = append(counts, len(sSEEvents(t, rec.Body.String())))
	}
	// Nothing is sent while call 0 is incomplete (thoughts are not included); it goes out
	// whole, with the reasoning's signature, when call 1 starts.
	if !reflect.DeepEqual(counts, []int{0, 0, 0, 1}) {
		t.Errorf("events after each delta: %v", counts)
	}
	if err := s.Delta(proxy.Delta{ToolCalls: []proxy.ToolCallDelta{{Index: 0, Arguments: "x"}}}); err == nil {
		t.Error("fragment of a sent call: want an error")
	}
	if err := s.End(proxy.Finish{Reason: proxy.FinishToolCalls}, proxy.Usage{}); err != nil {
		t.Fatal(err)
	}
	events := sSEEvents(t, rec.Body.String())
	if len(events) != 2 {
		t.Fatalf("events: %q", events)
	}
	first, last := decodeStrict(t, events[0]), decodeStrict(t, events[1])
	jSONEqual(t, "first", first.Candidates[0].Content.Parts, `[{"functionCall":{"id":"a","name":"f","args":{"x":1}},"thoughtSignature":"`+signature("plan")+`"}]`)
	jSONEqual(t, "last", last.Candidates[0].Content.Parts, `[{"functionCall":{"id":"b","name":"g","args":{}}}]`)

	// Reasoning and nothing else: the signature rides alone on the last event.
	rec = httptest.NewRecorder()
	s = Dialect{}.NewStream(rec, testRequest(true))
	_ = s.Delta(proxy.Delta{Reasoning: "hmm"})
	_ = s.End(proxy.Finish{Reason: proxy.FinishLength}, proxy.Usage{PromptTokens: 1, CompletionTokens: 2})
	events = sSEEvents(t, rec.Body.String())
	last = decodeStrict(t, events[len(events)-1])
	jSONEqual(t, "reasoning only", last.Candidates[0], `{"content":{"role":"model","parts":[{"thoughtSignature":"`+signature("hmm")+`"}]},"finishReason":"MAX_TOKENS","index":0}`)
	if *last.UsageMetadata != (wireUsage{1, 2, 3}) {
		t.Errorf("usage %+v", last.UsageMetadata)
	}
}

func TestGeminiStreamFail(t *testing.T) {
	rec := httptest.NewRecorder()
	s := Dialect{}.NewStream(rec, testRequest(true))
	_ = s.Delta(proxy.Delta{Content: "par"})
	if err := s.Fail(&proxy.Error{Status: 503, Kind: proxy.ErrUpstreamUnavailable, Message: "engine down"}); err != nil {
		t.Fatal(err)
	}
	events := sSEEvents(t, rec.Body.String())
	if len(events) != 2 {
		t.Fatalf("events %q", events)
	}
	jSONEqual(t, "error event", json.RawMessage(events[1]), `{"error":{"code":503,"message":"engine down","status":"UNAVAILABLE"}}`)
	if s.End(proxy.Finish{Reason: proxy.FinishStop}, proxy.Usage{}) == nil {
		t.Error("End after Fail: want an error")
	}
}

// TestGeminiRoundTrip: an answer written as Gemini JSON and sent back as the model turn
// of the next request decodes to the same assistant message.
func TestGeminiRoundTrip(t *testing.T) {
	msgs := []proxy.ChatMessage{
		{Role: "assistant", Content: "plain"},
		{Role: "assistant", Content: "with reasoning", ReasoningContent: "because\n\n it is "},
		{Role: "assistant", Content: "", ReasoningContent: "call two", ToolCalls: []proxy.ChatToolCall{
			{ID: "x1", Type: "function", Function: proxy.ChatFunctionCall{Name: "ls", Arguments: `{"path":".","deep":{"a":[1,"b"]}}`}},
			{ID: "x2", Type: "function", Function: proxy.ChatFunctionCall{Name: "run_shell_command", Arguments: `{"command":"go test ./...","description":"ünïcode"}`}},
		}},
		{Role: "assistant", Content: "text then call", ToolCalls: []proxy.ChatToolCall{
			{ID: "y", Type: "function", Function: proxy.ChatFunctionCall{Name: "f", Arguments: `{}`}}}},
	}
	for _, include := range []bool{true, false} {
		for i, m := range msgs {
			rec := httptest.NewRecorder()
			res := &proxy.Response{ID: "r", Choices: []proxy.Choice{{Message: m, FinishReason: proxy.FinishStop}}}
			if err := (Dialect{}).WriteResponse(rec, testRequest(include), res); err != nil {
				t.Fatal(err)
			}
			var out response
			if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil {
				t.Fatal(err)
			}
			turn := out.Candidates[0].Content
			if !include {
				for _, p := range turn.Parts {
					if p.Thought {
						t.Errorf("thought part sent without includeThoughts: %+v", p)
					}
				}
			}
			body, _ := json.Marshal(map[string]any{"contents": []any{
				map[string]any{"role": "user", "parts": []any{map[string]any{"text": "go"}}},
				turn,
			}})
			req, err := decode(pathGen, string(body))
			if err != nil {
				t.Fatal(err)
			}
			if got := req.Chat.Messages[1]; !reflect.DeepEqual(got, m) {
				t.Errorf("include=%v msg %d:\n got  %+v\n want %+v", include, i, got, m)
			}
		}
	}
}

func TestGeminiWriteError(t *testing.T) {
	cases := []struct {
		err  *proxy.Error
		code int
		want string
	}{
		{&proxy.Error{Status: 400, Kind: proxy.ErrInvalidRequest, Message: "contents: required"}, 400,
			`{"error":{"code":400,"message":"contents: required","status":"INVALID_ARGUMENT"}}`},
		{&proxy.Error{Status: 401, Kind: proxy.ErrAuthentication, Message: "bad key"}, 401,
			`{"error":{"code":401,"message":"bad key","status":"UNAUTHENTICATED"}}`},
		{&proxy.Error{Status: 404, Kind: proxy.ErrNotFound, Message: "no model"}, 404,
			`{"error":{"code":404,"message":"no model","status":"NOT_FOUND"}}`},
		{&proxy.Error{Status: 429, Kind: proxy.ErrOverloaded, Message: "busy"}, 429,
			`{"error":{"code":429,"message":"busy","status":"RESOURCE_EXHAUSTED"}}`},
		{&proxy.Error{Status: 503, Kind: proxy.ErrOverloaded, Message: "busy"}, 503,
			`{"error":{"code":503,"message":"busy","status":"UNAVAILABLE"}}`},
		{&proxy.Error{Status: 502, Kind: proxy.ErrUpstreamUnavailable, Message: "down"}, 502,
			`{"error":{"code":502,"message":"down","status":"UNAVAILABLE"}}`},
		{&proxy.Error{Kind: proxy.ErrInternal, Message: "oops"}, 500,
			`{"error":{"code":500,"message":"oops","status":"INTERNAL"}}`},
		{&proxy.Error{Status: 413, Kind: proxy.ErrTooLarge, Message: "big"}, 413,
			`{"error":{"code":413,"message":"big","status":"INVALID_ARGUMENT"}}`},
		{&proxy.Error{Status: 400, Kind: proxy.ErrContextLength, Message: "vllm words", PromptTokens: 40000, MaxTokens: 32768}, 400,
			`{"error":{"code":400,"message":"The input token count (40000) exceeds the maximum number of tokens allowed (32768).","status":"INVALID_ARGUMENT"}}`},
		{&proxy.Error{Status: 413, Kind: proxy.ErrContextLength, Message: "vllm words", MaxTokens: 32768}, 400,
			`{"error":{"code":400,"message":"The input token count exceeds the maximum number of tokens allowed (32768).","status":"INVALID_ARGUMENT"}}`},
		{&proxy.Error{Status: 403, Kind: "other", Message: "no"}, 403,
			`{"error":{"code":403,"message":"no","status":"PERMISSION_DENIED"}}`},
	}
	for _, tc := range cases {
		rec := httptest.NewRecorder()
		Dialect{}.WriteError(rec, tc.err)
		if rec.Code != tc.code {
			t.Errorf("%v: status %d, want %d", tc.err, rec.Code, tc.code)
		}
		jSONEqual(t, tc.err.Error(), json.RawMessage(rec.Body.Bytes()), tc.want)
	}
}

func TestGeminiModelsAndCount(t *testing.T) {
	rec := httptest.NewRecorder()
	Dialect{}.WriteModels(rec, []string{"qwen3-8b", "gemini-2.5-pro"})
	jSONEqual(t, "models", json.RawMessage(rec.Body.Bytes()), `{"models":[
		{"name":"models/qwen3-8b","displayName":"qwen3-8b","supportedGenerationMethods":["generateContent","streamGenerateContent","countTokens"]},
		{"name":"models/gemini-2.5-pro","displayName":"gemini-2.5-pro","supportedGenerationMethods":["generateContent","streamGenerateContent","countTokens"]}]}`)
	rec = httptest.NewRecorder()
	Dialect{}.WriteModels(rec, nil)
	jSONEqual(t, "no models", json.RawMessage(rec.Body.Bytes()), `{"models":[]}`)

	req, err := decode("/v1beta/models/m:countTokens", `{"contents":[{"parts":[{"text":"x"}]}]}`)
	if err != nil {
		t.Fatal(err)
	}
	rec = httptest.NewRecorder()
	Dialect{}.WriteCount(rec, req, 123)
	jSONEqual(t, "count", json.RawMessage(rec.Body.Bytes()), `{"totalTokens":123}`)
	if Dialect.Name(Dialect{}) != "gemini" {
		t.Error("Name")
	}
}

func TestGeminiSignature(t *testing.T) {
	for _, r := range []string{"", "a", "multi\nline ünïcode 🙂 ??>>", "\xff\xfe\xfd", strings.Repeat("x", 10000)} {
		sig := signature(r)
		raw := []byte(proxy.SignaturePrefix + r)
		for _, s := range []string{sig, base64.URLEncoding.EncodeToString(raw), base64.RawURLEncoding.EncodeToString(raw), base64.RawStdEncoding.EncodeToString(raw)} {
			got, ok := readSignature(s)
			if !ok || got != r {
				t.Errorf("signature %q of %q restored %q %v", s, r, got, ok)
			}
		}
	}
	for _, s := range []string{"", "skip_thought_signature_validator", "ZmxvZTEu!!!", "CiQB0e2Kb3k="} {
		if _, ok := readSignature(s); ok {
			t.Errorf("%q read as floe's", s)
		}
	}
}

func FuzzGeminiDecode(f *testing.F) {
	for _, tc := range decodeCases {
		f.Add(uint8(0), []byte(tc.body))
	}
	f.Add(uint8(1), []byte(`{"contents":[{"role":"model","parts":[{"functionCall":{"name":"f","args":[1]}}]}]}`))
	f.Add(uint8(2), []byte(`{"generateContentRequest":{"contents":[{"parts":[{"text":"a","thoughtSignature":"ZmxvZTEuYQ=="}]}]}}`))
	f.Add(uint8(0), []byte(`{"contents":[{"parts":[{"text":"a"}]}],"tools":[{"functionDeclarations":[{"name":"f","parameters":{"type":"OBJECT","properties":{"a":{"anyOf":[{"type":"STRING"}]}},"items":3}}]}]}`))
	paths := []string{pathGen, "/v1beta/models/m:streamGenerateContent?alt=sse", "/v1beta/models/m:countTokens"}
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		r := httptest.NewRequest(http.MethodPost, paths[int(which)%len(paths)], bytes.NewReader(body))
		req, err := Dialect{}.Decode(r, body)
		if err != nil {
			var e *proxy.Error
			if !errors.As(err, &e) || e.Status != 400 || e.Kind != proxy.ErrInvalidRequest {
				t.Fatalf("error %v is not a 400 *Error", err)
			}
			return
		}
		if _, err := json.Marshal(req.Chat); err != nil {
			t.Fatalf("normalized request does not marshal: %v", err)
		}
		// Answer with what was asked, to exercise the writers too.
		var res proxy.Response
		for _, m := range req.Chat.Messages {
			if m.Role == "assistant" {
				res.Choices = append(res.Choices, proxy.Choice{Message: m})
			}
		}
		if err := (Dialect{}).WriteResponse(httptest.NewRecorder(), req, &res); err != nil {
			t.Fatalf("WriteResponse: %v", err)
		}
	})
}

// TestGeminiSignatureSkipsBlankText: the model's "\n\n" between reasoning and a tool
// call must not carry floe's signature, because harnesses drop blank text parts (Pi does)
// and the reasoning would be lost from the next request's history.
func TestGeminiSignatureSkipsBlankText(t *testing.T) {
	msg := proxy.ChatMessage{Role: "assistant", Content: "\n\n", ReasoningContent: "think",
		ToolCalls: []proxy.ChatToolCall{{ID: "c1", Type: "function", Function: proxy.ChatFunctionCall{Name: "read", Arguments: `{"path":"a"}`}}}}
	parts := answerParts(msg, false)
	for _, p := range parts {
		if p.Text != nil && strings.TrimSpace(*p.Text) == "" && p.ThoughtSignature != "" {
			t.Fatalf("the blank text part carries the signature: %+v", parts)
		}
	}
	if parts[len(parts)-1].FunctionCall == nil || parts[len(parts)-1].ThoughtSignature == "" {
		t.Fatalf("the function call should carry the signature: %+v", parts)
	}

	rec := httptest.NewRecorder()
	st := Dialect{}.NewStream(rec, &proxy.Request{Model: "m", State: nil})
	_ = st.Delta(proxy.Delta{Reasoning: "think"})
	_ = st.Delta(proxy.Delta{Content: "\n\n"})
	_ = st.Delta(proxy.Delta{ToolCalls: []proxy.ToolCallDelta{{Index: 0, ID: "c1", Name: "read", Arguments: `{"path":"a"}`}}})
	_ = st.End(proxy.Finish{Reason: proxy.FinishToolCalls}, proxy.Usage{})
	body := rec.Body.String()
	if !strings.Contains(body, `"functionCall"`) {
		t.Fatalf("no function call streamed: %s", body)
	}
	for _, line := range strings.Split(body, "\n") {
		if strings.Contains(line, `"text":"\n\n"`) && strings.Contains(line, "thoughtSignature") {
			t.Fatalf("the blank text event carries the signature: %s", line)
		}
		if strings.Contains(line, `"functionCall"`) && !strings.Contains(line, "thoughtSignature") {
			t.Fatalf("the function call event lacks the signature: %s", line)
		}
	}
}
