package reqjson

import (
	"bytes"
	"errors"
	"unicode/utf16"
	"unicode/utf8"
	"unsafe"
)

// A hand-written scanner finds the extent of each value: decoding an object or an array
// only walks its own bytes once, skipping nested values, so reading a long agent history
// level by level stays cheap (encoding/json would re-validate every level it is given).
// Parse has checked the whole body with a full JSON parser first; the scanner still
// bounds-checks every step and reports malformed input instead of trusting it.

var errMalformed = errors.New("malformed JSON")

// field is one member of an object, its value still encoded.
type field struct {
	key string
	raw []byte
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func skipSpace(b []byte, i int) int {
	for i < len(b) && isSpace(b[i]) {
		i++
	}
	return i
}

// skipString returns the index after the string starting at b[i] == '"'.
func skipString(b []byte, i int) (int, error) {
	for i++; i < len(b); {
		j := bytes.IndexByte(b[i:], '"')
		if j < 0 {
			break
		}
		end := i + j
		// The quote ends the string unless an odd number of backslashes escapes it.
		k := end
		for k > i && b[k-1] == '\\' {
			k--
		}
		if (end-k)%2 == 0 {
			return end + 1, nil
		}
		i = end + 1
	}
	return 0, errMalformed
}

// skipValue returns the index after the value starting at b[i], looked up in ix when it
// holds it.
func skipValue(b []byte, i int, ix *index) (int, error) {
	if i >= len(b) {
		return 0, errMalformed
	}
	switch b[i] {
	case '"':
		// A short string (most keys' values) ends within the few bytes the index does
		// not note; only a longer one is looked up.
		if end, err := skipString(b[i:min(len(b), i+indexMinString)], 0); err == nil {
			return i + end, nil
		}
		if end, ok := ix.end(b, i); ok {
			return end, nil
		}
	case '{', '[':
		if end, ok := ix.end(b, i); ok {
			return end, nil
		}
	}
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for ; i < len(b); i++ {
			switch b[i] {
			case '"':
				end, err := skipString(b, i)
				if err != nil {
					return 0, err
				}
				i = end - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1, nil
				}
			}
		}
		return 0, errMalformed
	}
	start := i
	for i < len(b) && !isSpace(b[i]) && b[i] != ',' && b[i] != '}' && b[i] != ']' {
		i++
	}
	if i == start {
		return 0, errMalformed
	}
	return i, nil
}

// decodeString decodes the JSON string s (quotes included) as encoding/json does,
// invalid UTF-8 and lone surrogates becoming U+FFFD.
func decodeString(s []byte) (string, error) {
	if len(s) < 2 || s[0] != '"' || s[len(s)-1] != '"' {
		return "", errMalformed
	}
	in := s[1 : len(s)-1]
	if asciiPrefix(in) == len(in) {
		return string(in), nil
	}
	out := make([]byte, 0, len(in))
	for i := 0; i < len(in); {
		// Copy the run up to the next escape whole when it is valid UTF-8, rune by rune
		// (invalid bytes becoming U+FFFD) when it is not.
		if n, ascii := plainRun(in[i:]); n > 0 {
			run := in[i : i+n]
			if ascii || utf8.Valid(run) {
				out = append(out, run...)
			} else {
				for len(run) > 0 {
					r, size := utf8.DecodeRune(run)
					out = utf8.AppendRune(out, r) // RuneError for invalid bytes
					run = run[size:]
				}
			}
			i += n
			continue
		}
		c := in[i]
		switch {
		case c < 0x20 || c == '"':
			return "", errMalformed
		case c >= utf8.RuneSelf:
			r, size := utf8.DecodeRune(in[i:])
			out = utf8.AppendRune(out, r) // RuneError for invalid bytes
			i += size
		case c != '\\':
			out = append(out, c)
			i++
		default:
			if i+1 >= len(in) {
				return "", errMalformed
			}
			switch e := in[i+1]; e {
			case '"', '\\', '/':
				out = append(out, e)
			case 'b':
				out = append(out, '\b')
			case 'f':
				out = append(out, '\f')
			case 'n':
				out = append(out, '\n')
			case 'r':
				out = append(out, '\r')
			case 't':
				out = append(out, '\t')
			case 'u':
				r, ok := hex4(in, i+2)
				if !ok {
					return "", errMalformed
				}
				i += 6
				if utf16.IsSurrogate(r) {
					if r2, ok := hex4(in, i+2); ok && i+1 < len(in) && in[i] == '\\' && in[i+1] == 'u' {
						if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
							out = utf8.AppendRune(out, dec)
							i += 6
							continue
						}
					}
					r = utf8.RuneError
				}
				out = utf8.AppendRune(out, r)
				continue
			default:
				return "", errMalformed
			}
			i += 2
		}
	}
	if len(out) == 0 {
		return "", nil
	}
	// out is the string's own buffer and nothing else refers to it: no copy (a tool
	// result's text is most of a request).
	return unsafe.String(&out[0], len(out)), nil
}

// hex4 reads the four hex digits at b[i:i+4].
func hex4(b []byte, i int) (rune, bool) {
	if i < 0 || i+4 > len(b) {
		return 0, false
	}
	var r rune
	for _, c := range b[i : i+4] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			c = c - 'A' + 10
		default:
			return 0, false
		}
		r = r*16 + rune(c)
	}
	return r, true
}

// scanObject splits the object b into its fields, in order.
func scanObject(b []byte, ix *index) ([]field, error) {
	i := skipSpace(b, 1)
	out := make([]field, 0, 8)
	if i < len(b) && b[i] == '}' {
		return out, nil
	}
	for {
		if i >= len(b) || b[i] != '"' {
			return nil, errMalformed
		}
		end, err := skipString(b, i)
		if err != nil {
			return nil, err
		}
		key, err := decodeString(b[i:end])
		if err != nil {
			return nil, err
		}
		i = skipSpace(b, end)
		if i >= len(b) || b[i] != ':' {
			return nil, errMalformed
		}
		i = skipSpace(b, i+1)
		vend, err := skipValue(b, i, ix)
		if err != nil {
			return nil, err
		}
		out = append(out, field{key: key, raw: b[i:vend]})
		i = skipSpace(b, vend)
		if i >= len(b) {
			return nil, errMalformed
		}
		switch b[i] {
		case ',':
			i = skipSpace(b, i+1)
		case '}':
			return out, nil
		default:
			return nil, errMalformed
		}
	}
}

// scanArray splits the array b into its elements.
func scanArray(b []byte, ix *index) ([][]byte, error) {
	i := skipSpace(b, 1)
	var out [][]byte
	if i < len(b) && b[i] == ']' {
		return out, nil
	}
	for {
		end, err := skipValue(b, i, ix)
		if err != nil {
			return nil, err
		}
		out = append(out, b[i:end])
		i = skipSpace(b, end)
		if i >= len(b) {
			return nil, errMalformed
		}
		switch b[i] {
		case ',':
			i = skipSpace(b, i+1)
		case ']':
			return out, nil
		default:
			return nil, errMalformed
		}
	}
}
