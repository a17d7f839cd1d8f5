package upstream

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strconv"
	"unicode/utf8"

	"github.com/floe-rl/floe/proxy"
	gojson "github.com/goccy/go-json"
)

// spliceMin is the size of message text above which EncodeRequest writes it straight
// into the final body instead of through the JSON encoder.
const spliceMin = 256 << 10

// nonce makes EncodeRequest's placeholders impossible for a caller to forge.
var nonce = func() string {
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}()

// EncodeRequest encodes the upstream request r with encode (which wraps it with the
// engine's flags). Large strings of its messages (text, reasoning, image URLs, tool-call
// arguments over spliceMin) are written straight into a body allocated once at its final
// size: a JSON encoder would build the body in a buffer grown by doubling and then copy
// it, holding two or three copies of a maximum-size request's text at once where this
// holds one besides the text itself. Small requests go through encode unchanged.
func EncodeRequest(r *proxy.ChatRequest, encode func(*proxy.ChatRequest) ([]byte, error)) ([]byte, error) {
	total := 0
	eachString(r.Messages, func(s *string) {
		if len(*s) > spliceMin {
			total += len(*s)
		}
	})
	if total == 0 {
		return encode(r)
	}
	small := *r
	small.Messages = make([]proxy.ChatMessage, len(r.Messages))
	copy(small.Messages, r.Messages)
	for i := range small.Messages {
		m := &small.Messages[i]
		if parts, ok := m.Content.([]proxy.ChatPart); ok {
			cp := make([]proxy.ChatPart, len(parts))
			copy(cp, parts)
			for j := range cp {
				if cp[j].ImageURL != nil {
					u := *cp[j].ImageURL
					cp[j].ImageURL = &u
				}
			}
			m.Content = cp
		}
		if len(m.ToolCalls) > 0 {
			m.ToolCalls = append([]proxy.ChatToolCall(nil), m.ToolCalls...)
		}
	}
	var big []string
	eachString(small.Messages, func(s *string) {
		if len(*s) > spliceMin {
			big = append(big, *s)
			*s = placeholder(len(big) - 1)
		}
	})
	head, err := encode(&small)
	if err != nil {
		return nil, err
	}
	size := len(head)
	for i, s := range big {
		size += quotedLen(s) - len(placeholder(i)) - 2
	}
	out := make([]byte, 0, size)
	rest := head
	for i, s := range big {
		ph := `"` + placeholder(i) + `"`
		k := bytes.Index(rest, []byte(ph))
		if k < 0 {
			return nil, fmt.Errorf("encoding the upstream request: placeholder %d not found", i)
		}
		out = append(out, rest[:k]...)
		out = appendQuoted(out, s)
		rest = rest[k+len(ph):]
	}
	return append(out, rest...), nil
}

func placeholder(i int) string { return "floe-splice-" + nonce + "-" + strconv.Itoa(i) }

// eachString calls fn with each string of msgs that can be large, in the order a JSON
// encoder writes them.
func eachString(msgs []proxy.ChatMessage, fn func(*string)) {
	for i := range msgs {
		m := &msgs[i]
		switch c := m.Content.(type) {
		case string:
			s := c
			if fn(&s); s != c {
				m.Content = s
			}
		case []proxy.ChatPart:
			for j := range c {
				fn(&c[j].Text)
				if c[j].ImageURL != nil {
					fn(&c[j].ImageURL.URL)
				}
			}
		}
		for j := range m.ToolCalls {
			fn(&m.ToolCalls[j].Function.Arguments)
		}
		fn(&m.ReasoningContent)
	}
}

const hexDigits = "0123456789abcdef"

// quotedLen is len(appendQuoted(nil, s)).
func quotedLen(s string) int {
	n := 2
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\' || c == '\n' || c == '\r' || c == '\t':
				n += 2
			case c < 0x20:
				n += 6
			default:
				n++
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			n += 6
		case r == '\u2028' || r == '\u2029':
			n += 6
		default:
			n += size
		}
		i += size
	}
	return n
}

// appendQuoted appends s as a JSON string, escaped as Encode's encoder escapes it (HTML
// characters as they are; U+2028 and U+2029 escaped; invalid UTF-8 as U+FFFD).
func appendQuoted(dst []byte, s string) []byte {
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if (r == utf8.RuneError && size == 1) || r == '\u2028' || r == '\u2029' {
			dst = append(dst, s[start:i]...)
			switch r {
			case utf8.RuneError:
				dst = append(dst, `\ufffd`...)
			default:
				dst = append(dst, '\\', 'u', '2', '0', '2', hexDigits[r&0xf])
			}
			i += size
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}

// Marshal encodes an upstream request body. HTML characters are written as they are:
// the inference server parses the JSON, to which "\u003c" and "<" are the same string,
// and escaping them costs a tenth of a call's CPU on an agent's history of source code.
func Marshal(v any) ([]byte, error) {
	return gojson.MarshalWithOption(v, gojson.DisableHTMLEscape())
}
