package gemini

import (
	"encoding/json"
	"unicode/utf8"
	"unsafe"

	"github.com/floe-rl/floe/proxy/reqjson"
)

// canonJSON re-encodes a JSON value compactly with its key order and number literals
// kept and strings written as UTF-8 rather than \u escapes, so that what the model reads
// does not depend on how a client's JSON encoder escapes (Python's ensure_ascii, Go's
// HTML escaping). Invalid input is returned compacted as is.
//
// It writes what decoding each string and encoding it again with encoding/json (HTML
// escaping off) would, in one pass over the bytes: tool results are most of an agent's
// request, and a token-by-token decoder made this a third of Gemini's decoding time.
func canonJSON(raw json.RawMessage) json.RawMessage {
	if !reqjson.Valid(raw) {
		return compact(raw)
	}
	return canonValid(raw)
}

// canonValid is canonJSON of valid JSON, in a buffer of its own.
func canonValid(raw []byte) []byte {
	out := make([]byte, 0, len(raw))
	for i := 0; i < len(raw); {
		c := raw[i]
		switch c {
		case ' ', '\t', '\n', '\r':
			i++
		case '"':
			var n int
			out, n = appendCanonString(out, raw[i:])
			i += n
		default:
			out = append(out, c)
			i++
		}
	}
	return out
}

// canonString is canonJSON(raw) as a string, without copying the canonical bytes (a
// function response is most of an agent's request): they are canonJSON's own buffer, and
// nothing else refers to them.
func canonString(raw json.RawMessage) string {
	if !reqjson.Valid(raw) {
		return string(compact(raw))
	}
	out := canonValid(raw)
	if len(out) == 0 {
		return ""
	}
	return unsafe.String(&out[0], len(out))
}

// appendCanonString appends the canonical form of the JSON string at the start of s
// (valid JSON) and returns how many bytes of s it took.
func appendCanonString(out, s []byte) ([]byte, int) {
	out = append(out, '"')
	i := 1
	for {
		// The run of bytes that stay as they are: printable ASCII other than the quote
		// and backslash, which is most of any text.
		j := i
		for j < len(s) && plainByte[s[j]] {
			j++
		}
		out = append(out, s[i:j]...)
		i = j
		switch c := s[i]; c {
		case '"':
			return append(out, '"'), i + 1
		case '\\':
			r, n := unescape(s[i:])
			i += n
			out = appendCanonRune(out, r)
		default: // c >= utf8.RuneSelf: invalid UTF-8 becomes U+FFFD, as the decoder makes it
			r, n := utf8.DecodeRune(s[i:])
			i += n
			out = appendCanonRune(out, r)
		}
	}
}

// plainByte marks the bytes a string's canonical form keeps as they are: printable ASCII
// other than the quote and the backslash.
var plainByte = func() (t [256]bool) {
	for c := 0x20; c < utf8.RuneSelf; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

// unescape decodes the escape at the start of s (valid JSON), joining a surrogate pair,
// and returns the rune and its length; a lone surrogate is U+FFFD, as encoding/json
// decodes it.
func unescape(s []byte) (rune, int) {
	switch s[1] {
	case 'b':
		return '\b', 2
	case 'f':
		return '\f', 2
	case 'n':
		return '\n', 2
	case 'r':
		return '\r', 2
	case 't':
		return '\t', 2
	case 'u':
		r := hex4(s[2:6])
		if r >= 0xD800 && r < 0xDC00 {
			if len(s) >= 12 && s[6] == '\\' && s[7] == 'u' {
				if lo := hex4(s[8:12]); lo >= 0xDC00 && lo < 0xE000 {
					return (r-0xD800)<<10 + (lo - 0xDC00) + 0x10000, 12
				}
			}
			return utf8.RuneError, 6
		}
		if r >= 0xDC00 && r < 0xE000 {
			return utf8.RuneError, 6
		}
		return r, 6
	}
	return rune(s[1]), 2 // \" \\ \/
}

func hex4(h []byte) rune {
	var r rune
	for _, c := range h {
		switch {
		case c >= '0' && c <= '9':
			c -= '0'
		case c >= 'a' && c <= 'f':
			c = c - 'a' + 10
		default:
			c = c - 'A' + 10
		}
		r = r<<4 | rune(c)
	}
	return r
}

// appendCanonRune appends r as encoding/json writes it in a string with HTML escaping off.
func appendCanonRune(out []byte, r rune) []byte {
	switch r {
	case '"', '\\':
		return append(out, '\\', byte(r))
	case '\b':
		return append(out, '\\', 'b')
	case '\f':
		return append(out, '\\', 'f')
	case '\n':
		return append(out, '\\', 'n')
	case '\r':
		return append(out, '\\', 'r')
	case '\t':
		return append(out, '\\', 't')
	case '\u2028', '\u2029':
		return append(out, '\\', 'u', '2', '0', '2', "89"[r-'\u2028'])
	}
	if r < 0x20 {
		const hex = "0123456789abcdef"
		return append(out, '\\', 'u', '0', '0', hex[r>>4], hex[r&0xF])
	}
	return utf8.AppendRune(out, r)
}
