package gemini

import (
	"bytes"
	"encoding/json"
	"io"
	"math/rand/v2"
	"testing"
)

// canonJSONByTokens is the token-by-token canonJSON it replaced, kept as the oracle: it
// re-encodes a JSON value compactly with its key order and number literals
// kept and strings written as UTF-8 rather than \u escapes, so that what the model reads
// does not depend on how a client's JSON encoder escapes (Python's ensure_ascii, Go's
// HTML escaping). Invalid input is returned compacted as is.
func canonJSONByTokens(raw json.RawMessage) json.RawMessage {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var b, sb bytes.Buffer
	enc := json.NewEncoder(&sb)
	enc.SetEscapeHTML(false)
	type frame struct {
		obj bool
		n   int
	}
	var stack []frame
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			return compact(raw)
		}
		if d, ok := tok.(json.Delim); ok && (d == '}' || d == ']') {
			stack = stack[:len(stack)-1]
			b.WriteByte(byte(d))
			continue
		}
		if len(stack) > 0 {
			f := &stack[len(stack)-1]
			switch {
			case f.obj && f.n%2 == 1:
				b.WriteByte(':')
			case f.n > 0:
				b.WriteByte(',')
			}
			f.n++
		}
		switch v := tok.(type) {
		case json.Delim:
			stack = append(stack, frame{obj: v == '{'})
			b.WriteByte(byte(v))
		case string:
			sb.Reset()
			_ = enc.Encode(v)
			b.Write(bytes.TrimSuffix(sb.Bytes(), []byte("\n")))
		case json.Number:
			b.WriteString(string(v))
		case bool:
			if v {
				b.WriteString("true")
			} else {
				b.WriteString("false")
			}
		case nil:
			b.WriteString("null")
		}
	}
	return b.Bytes()
}

// TestCanonJSONMatchesTheDecoderRoundTrip: the one-pass canonJSON writes exactly what
// decoding each token and encoding it again did, for escapes of every kind, surrogates
// (paired and lone), invalid UTF-8, U+2028, HTML characters, numbers and nesting.
func TestCanonJSONMatchesTheDecoderRoundTrip(t *testing.T) {
	cases := []string{
		`{}`, `[]`, `null`, `true`, `-1.50e+10`, `"plain"`, `""`,
		`{"a" : 1 , "b":[ true,false,null , {"c":"d"} ], "e":{}}`,
		`{"out":"line\nnext\ttab \"quoted\" back\\slash \/ \b\f\r"}`,
		`{"u":"\u0041\u00e9\u4e2d\ud83d\ude00 \u0001\u001f \u007f"}`,
		`{"lone":"\ud800 x \udc00 \ud800\u0041 \ud83d"}`,
		`{"html":"<a href=\"x\">&amp;</a> \u003c\u003e\u0026"}`,
		`{"sep":"\u2028\u2029 ` + "\u2028\u2029" + `"}`,
		"{\"bad\":\"\xff\xfe ok \xe2\x82 \xef\xbf\xbd\"}",
		`{"num":[0,1e5,1E-5,123456789012345678901234567890,-0.0]}`,
		"{\n  \"pretty\": [\n    1,\n    2\n  ]\n}",
		`{"unicode":"ünïcødé 日本 🎉"}`,
		`{"a":1`,     // invalid: returned compacted as is
		`{"a":"\x"}`, // invalid escape
	}
	alphabet := []string{`\n`, `\t`, `\"`, `\\`, `\/`, `\b`, `\f`, `\u00e9`, `\ud83d\ude00`, `\ud800`, `\u2028`, "\u2028", "é", "\xff", "<", "&", "a", " ", `\u0000`, `\u001F`, "\x7f"}
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 2000; i++ {
		var s bytes.Buffer
		s.WriteString(`{"k":"`)
		for j := r.IntN(20); j > 0; j-- {
			s.WriteString(alphabet[r.IntN(len(alphabet))])
		}
		s.WriteString(`", "n": [1, "`)
		s.WriteString(alphabet[r.IntN(len(alphabet))])
		s.WriteString(`"]}`)
		cases = append(cases, s.String())
	}
	for _, c := range cases {
		if got, want := canonJSON(json.RawMessage(c)), canonJSONByTokens(json.RawMessage(c)); !bytes.Equal(got, want) {
			t.Errorf("canonJSON(%q) = %q, want %q", c, got, want)
		}
		if got, want := canonString(json.RawMessage(c)), string(canonJSONByTokens(json.RawMessage(c))); got != want {
			t.Errorf("canonString(%q) = %q, want %q", c, got, want)
		}
	}
}

// BenchmarkCanonJSON canonicalizes a tool result of a source file's size.
func BenchmarkCanonJSON(b *testing.B) {
	raw, _ := json.Marshal(map[string]string{"output": string(bytes.Repeat([]byte("\tif err := f(\"x\"); err != nil {\n\t\treturn err\n\t}\n"), 300))})
	for _, bc := range []struct {
		name string
		f    func(json.RawMessage) json.RawMessage
	}{{"one-pass", canonJSON}, {"by-tokens", canonJSONByTokens}} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetBytes(int64(len(raw)))
			for b.Loop() {
				bc.f(raw)
			}
		})
	}
}
