package openai

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
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
