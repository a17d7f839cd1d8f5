package gemini

import (
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
)

// BenchmarkDecodeLongHistory decodes a 180-message agent history with tool calls.
func BenchmarkDecodeLongHistory(b *testing.B) {
	var cs []string
	for i := 0; i < 60; i++ {
		cs = append(cs, fmt.Sprintf(`{"role":"user","parts":[{"text":%q}]},{"role":"model","parts":[{"functionCall":{"name":"read_file","args":{"path":"a_%d.go"}}}]},{"role":"user","parts":[{"functionResponse":{"name":"read_file","response":{"output":%q}}}]}`, strings.Repeat("hello world ", 20), i, strings.Repeat("func main() {}\n", 40)))
	}
	body := []byte(`{"systemInstruction":{"parts":[{"text":"sys"}]},"tools":[{"functionDeclarations":[{"name":"read_file","description":"read","parametersJsonSchema":{"type":"object","properties":{"path":{"type":"string"}}}}]}],"generationConfig":{"temperature":0,"thinkingConfig":{"includeThoughts":true}},"contents":[` + strings.Join(cs, ",") + `]}`)
	r := httptest.NewRequest("POST", "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", nil)
	b.SetBytes(int64(len(body)))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := (Dialect{}).Decode(r, body); err != nil {
			b.Fatal(err)
		}
	}
}
