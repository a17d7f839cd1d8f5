package replay

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"unicode/utf8"
)

// pythonJSON re-serializes a JSON text the way Python's json.dumps(ensure_ascii=False)
// writes it: ", " and ": " separators, keys in their order, non-ASCII characters as
// themselves. Servers hand the arguments of earlier tool calls to the chat template as a
// parsed object, and the template writes them back with that json.dumps; a tool call
// whose arguments are scripted in this form renders in the history exactly as it was
// sampled, so the replay does not add drift that the recording does not hold. ok is false
// when raw is not one JSON value.
func pythonJSON(raw string) (out string, ok bool) {
	dec := json.NewDecoder(strings.NewReader(raw))
	dec.UseNumber()
	var b strings.Builder
	if err := writePy(&b, dec); err != nil {
		return "", false
	}
	if _, err := dec.Token(); err != io.EOF {
		return "", false // trailing data
	}
	return b.String(), true
}

func writePy(b *strings.Builder, dec *json.Decoder) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	switch t := tok.(type) {
	case json.Delim:
		closing := map[json.Delim]json.Delim{'{': '}', '[': ']'}[t]
		if closing == 0 {
			return fmt.Errorf("unexpected %v", t)
		}
		b.WriteRune(rune(t))
		for i := 0; dec.More(); i++ {
			if i > 0 {
				b.WriteString(", ")
			}
			if t == '{' {
				key, err := dec.Token()
				if err != nil {
					return err
				}
				s, isStr := key.(string)
				if !isStr {
					return fmt.Errorf("object key %v", key)
				}
				writePyString(b, s)
				b.WriteString(": ")
			}
			if err := writePy(b, dec); err != nil {
				return err
			}
		}
		end, err := dec.Token()
		if err != nil {
			return err
		}
		if end != closing {
			return fmt.Errorf("unexpected %v", end)
		}
		b.WriteRune(rune(closing))
	case string:
		writePyString(b, t)
	case json.Number:
		// Integers print as Python prints them; other literals are kept as written (a
		// float's Python repr may differ, which only costs that call its shared history).
		b.WriteString(t.String())
	case bool:
		if t {
			b.WriteString("true")
		} else {
			b.WriteString("false")
		}
	case nil:
		b.WriteString("null")
	}
	return nil
}

// writePyString quotes s as json.dumps(ensure_ascii=False) does: only '"', '\\' and the
// control characters below 0x20 are escaped.
func writePyString(b *strings.Builder, s string) {
	var buf bytes.Buffer
	buf.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			buf.WriteString(`\"`)
		case '\\':
			buf.WriteString(`\\`)
		case '\n':
			buf.WriteString(`\n`)
		case '\r':
			buf.WriteString(`\r`)
		case '\t':
			buf.WriteString(`\t`)
		case '\b':
			buf.WriteString(`\b`)
		case '\f':
			buf.WriteString(`\f`)
		default:
			if r < 0x20 {
				fmt.Fprintf(&buf, `\u%04x`, r)
			} else {
				var enc [utf8.UTFMax]byte
				buf.Write(enc[:utf8.EncodeRune(enc[:], r)])
			}
		}
	}
	buf.WriteByte('"')
	b.Write(buf.Bytes())
}
