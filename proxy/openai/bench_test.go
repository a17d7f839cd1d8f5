package openai

import (
	"fmt"
	"strings"
	"testing"
)

// BenchmarkChatDecodeLongHistory decodes a 180-message agent history with tool calls.
func BenchmarkChatDecodeLongHistory(b *testing.B) {
	var msgs []string
	for i := 0; i < 60; i++ {
		msgs = append(msgs, fmt.Sprintf(`{"role":"user","content":%q},{"role":"assistant","content":"","tool_calls":[{"id":"c%d","type":"function","function":{"name":"Read","arguments":"{\"path\":\"a.go\"}"}}]},{"role":"tool","tool_call_id":"c%d","content":%q}`, strings.Repeat("hello world ", 20), i, i, strings.Repeat("func main() {}\n", 40)))
	}
	body := []byte(`{"model":"m","stream":true,"tools":[{"type":"function","function":{"name":"Read","description":"read","parameters":{"type":"object","properties":{"path":{"type":"string"}}}}}],"messages":[` + strings.Join(msgs, ",") + `]}`)
	b.SetBytes(int64(len(body)))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := (Chat{}).Decode(nil, body); err != nil {
			b.Fatal(err)
		}
	}
}
