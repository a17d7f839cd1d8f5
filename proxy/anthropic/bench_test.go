package anthropic

import (
	"fmt"
	"strings"
	"testing"
)

// BenchmarkDecodeLongHistory decodes a 180-message agent history with tool calls.
func BenchmarkDecodeLongHistory(b *testing.B) {
	var msgs []string
	for i := 0; i < 60; i++ {
		msgs = append(msgs, fmt.Sprintf(`{"role":"user","content":[{"type":"text","text":%q}]},{"role":"assistant","content":[{"type":"thinking","thinking":"hmm","signature":"x"},{"type":"tool_use","id":"t%d","name":"Read","input":{"path":"a.go"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t%d","content":%q}]}`, strings.Repeat("hello world ", 20), i, i, strings.Repeat("func main() {}\n", 40)))
	}
	body := []byte(`{"model":"m","max_tokens":1000,"stream":true,"system":[{"type":"text","text":"sys"}],"tools":[{"name":"Read","description":"read","input_schema":{"type":"object","properties":{"path":{"type":"string"}}}}],"messages":[` + strings.Join(msgs, ",") + `]}`)
	b.SetBytes(int64(len(body)))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := (Dialect{}).Decode(nil, body); err != nil {
			b.Fatal(err)
		}
	}
}
