package openai

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/floe-rl/floe/proxy"
)

// chatBody is a minimal chat request; %s adds fields.
const chatBody = `{"model":"claude-like","messages":[{"role":"user","content":"hi"}]%s}`

func FuzzChatDecode(f *testing.F) {
	f.Add([]byte(fmt.Sprintf(chatBody, "")))
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"data:x"}}]}],"stop":"x"}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		req, err := Chat{}.Decode(httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil), body)
		if err == nil && (req.Model == "" || len(req.Chat.Messages) == 0) {
			t.Fatalf("decoded a request without model or messages: %+v", req)
		}
	})
}

func TestChatDecode(t *testing.T) {
	body := `{"model":"m","max_tokens":5,"stop":"x","reasoning_effort":"none","stream":true,"stream_options":{"include_usage":true},
		"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],"tool_choice":"auto","unknown_field":[1],
		"messages":[{"role":"developer","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
		{"role":"user","content":[{"type":"text","text":"see"},{"type":"image_url","image_url":{"url":"data:x"}}]},
		{"role":"assistant","content":null,"reasoning":"r","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},
		{"role":"tool","tool_call_id":"c","content":"out"}]}`
	req, err := Chat{}.Decode(nil, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	c := req.Chat
	if req.Model != "m" || !req.Stream || *c.MaxCompletionTokens != 5 || len(c.Stop) != 1 || c.Stop[0] != "x" ||
		c.ChatTemplateKwargs["enable_thinking"] != false || string(c.ToolChoice) != `"auto"` || len(c.Tools) != 1 ||
		string(c.Tools[0].Function.Parameters) != `{"type":"object"}` || !req.State.(chatState).includeUsage {
		t.Errorf("decoded %+v", req)
	}
	m := c.Messages
	if len(m) != 4 || m[0].Role != "system" || m[0].Content != "ab" || m[2].ReasoningContent != "r" || m[2].Content != "" ||
		m[2].ToolCalls[0].Function.Name != "f" || m[3].ToolCallID != "c" {
		t.Errorf("messages %+v", m)
	}
	if parts, ok := m[1].Content.([]proxy.ChatPart); !ok || len(parts) != 2 || parts[1].ImageURL.URL != "data:x" {
		t.Errorf("user content %#v", m[1].Content)
	}
}

func TestChatDecodeErrors(t *testing.T) {
	tests := []struct{ name, body, want string }{
		{"malformed", `{"model":`, "request body: malformed JSON"},
		{"no model", `{"messages":[{"role":"user","content":"hi"}]}`, "model: required"},
		{"no messages", `{"model":"m"}`, "messages: required"},
		{"messages not an array", `{"model":"m","messages":{}}`, "messages: want array, got object"},
		{"bad role", `{"model":"m","messages":[{"role":"bot","content":"hi"}]}`, `messages[0].role: "bot" is not one of`},
		{"content a number", `{"model":"m","messages":[{"role":"user","content":1}]}`, "messages[0].content: want string or array of content parts, got number"},
		{"unknown part", `{"model":"m","messages":[{"role":"user","content":[{"type":"audio"}]}]}`, `messages[0].content[0].type: unknown content part type "audio"`},
		{"image without url", `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]}`, "messages[0].content[0].image_url: needs a url"},
		{"arguments not a string", `{"model":"m","messages":[{"role":"assistant","content":"","tool_calls":[{"id":"c","function":{"name":"f","arguments":{}}}]}]}`, "messages[0].tool_calls[0].function.arguments: want string, got object"},
		{"stop a number", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stop":1}`, "stop: want string or array of strings, got number"},
		{"max_tokens fractional", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1.5}`, "max_tokens: want integer, got 1.5"},
		{"stream a string", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":"yes"}`, "stream: want boolean, got string"},
	}
	for _, tt := range tests {
		_, err := Chat{}.Decode(nil, []byte(tt.body))
		var e *proxy.Error
		if !errors.As(err, &e) || e.Status != http.StatusBadRequest || !strings.Contains(e.Message, tt.want) {
			t.Errorf("%s: error %v, want a 400 saying %q", tt.name, err, tt.want)
		}
	}
}
