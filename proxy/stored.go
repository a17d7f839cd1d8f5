package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"
)

// validUTF8 returns b with every invalid UTF-8 sequence replaced by U+FFFD, as
// encoding/json does when it decodes a string: every JSON document floe stores is valid
// UTF-8, so that any reader (Python's json among them) can load it. Valid input is
// returned as it is, without a copy. Invalid bytes can only stand inside JSON strings
// (the dialect's decoder accepted the document), so the result is still valid JSON.
func validUTF8(b []byte) []byte {
	if utf8.Valid(b) {
		return b
	}
	return bytes.ToValidUTF8(b, []byte("\uFFFD"))
}

// truncated is the "floe_truncated" marker of a stored request cut down to its limit.
type truncated struct {
	Reason        string         `json:"reason"`
	OriginalBytes int            `json:"original_bytes"`
	Dropped       []droppedField `json:"dropped"`
}

type droppedField struct {
	Field string `json:"field"`
	Bytes int    `json:"bytes"`
}

// storedRequest is the caller's request body as stored with its calls: whole (valid
// UTF-8) when it is at most max bytes; otherwise its top-level fields of at most
// StoredFieldBytes, in order, while they fit in max, and a "floe_truncated" field naming
// those dropped. Nothing reconstruction needs is lost: training reads the token ids, and
// the normalized upstream request, stored whole, holds everything the model saw. max 0:
// no limit.
func storedRequest(body []byte, max int) []byte {
	if max <= 0 || len(body) <= max {
		return validUTF8(body)
	}
	mark := truncated{
		Reason:        fmt.Sprintf("the request (%d bytes) is over floe's stored-request limit of %d bytes; fields over %d bytes are dropped; upstream_request holds what the model saw", len(body), max, StoredFieldBytes),
		OriginalBytes: len(body),
		Dropped:       []droppedField{},
	}
	var out bytes.Buffer
	out.WriteByte('{')
	err := topLevelFields(body, func(key, value []byte) {
		size := len(key) + 1 + len(value)
		if len(value) > StoredFieldBytes || out.Len()+size+1 > max {
			mark.Dropped = append(mark.Dropped, droppedField{Field: fieldName(key), Bytes: len(value)})
			return
		}
		out.Write(key)
		out.WriteByte(':')
		out.Write(value)
		out.WriteByte(',')
	})
	if err != nil {
		out.Reset()
		out.WriteByte('{')
		mark.Reason = "the request could not be split into fields (" + err.Error() + "); none is stored"
	}
	m, _ := json.Marshal(mark)
	out.WriteString(`"floe_truncated":`)
	out.Write(m)
	out.WriteByte('}')
	return validUTF8(out.Bytes())
}

// fieldName is a field's name for the marker, at most 256 bytes of it.
func fieldName(key []byte) string {
	var name string
	if len(key) > 1024 || json.Unmarshal(key, &name) != nil {
		name = string(bytes.Trim(key[:min(len(key), 256)], `"`))
	}
	if len(name) > 256 {
		name = name[:256] + "…"
	}
	return name
}

// topLevelFields calls fn with the raw key (quoted) and raw value of each member of the
// JSON object doc, without copying them.
func topLevelFields(doc []byte, fn func(key, value []byte)) error {
	i := skipSpace(doc, 0)
	if i >= len(doc) || doc[i] != '{' {
		return errors.New("not an object")
	}
	i = skipSpace(doc, i+1)
	if i < len(doc) && doc[i] == '}' {
		return nil
	}
	for {
		if i >= len(doc) || doc[i] != '"' {
			return errors.New("want a key")
		}
		kEnd, err := skipValue(doc, i)
		if err != nil {
			return err
		}
		key := doc[i:kEnd]
		i = skipSpace(doc, kEnd)
		if i >= len(doc) || doc[i] != ':' {
			return errors.New("want a colon")
		}
		i = skipSpace(doc, i+1)
		vEnd, err := skipValue(doc, i)
		if err != nil {
			return err
		}
		fn(key, doc[i:vEnd])
		i = skipSpace(doc, vEnd)
		if i >= len(doc) {
			return errors.New("unterminated object")
		}
		switch doc[i] {
		case ',':
			i = skipSpace(doc, i+1)
		case '}':
			return nil
		default:
			return errors.New("want a comma")
		}
	}
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipValue returns the end of the JSON value starting at b[i].
func skipValue(b []byte, i int) (int, error) {
	if i >= len(b) {
		return 0, errors.New("want a value")
	}
	switch b[i] {
	case '"':
		for j := i + 1; j < len(b); j++ {
			switch b[j] {
			case '\\':
				j++
			case '"':
				return j + 1, nil
			}
		}
		return 0, errors.New("unterminated string")
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				end, err := skipValue(b, j)
				if err != nil {
					return 0, err
				}
				j = end - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, errors.New("unterminated " + string(b[i]))
	default:
		j := i
		for j < len(b) && !bytes.ContainsRune([]byte(",}] \t\r\n"), rune(b[j])) {
			j++
		}
		if j == i {
			return 0, errors.New("want a value")
		}
		return j, nil
	}
}

// abortReason says why a call whose context ended did not finish: a weight sync drained
// it (e is then the error to show the caller, who is still there), its caller stopped
// reading for the client idle limit, or its caller left.
func abortReason(ctx context.Context, dw *deadlineWriter, lim Limits) (reason string, e *Error) {
	switch {
	case errors.Is(context.Cause(ctx), ErrDrained):
		return "aborted: " + ErrDrained.Error(), drainedError()
	case dw != nil && dw.timedOut.Load():
		return fmt.Sprintf("aborted: the caller did not read its answer for %s (-client-idle-timeout)", lim.ClientIdle), nil
	}
	return "aborted: the caller disconnected mid-stream", nil
}
