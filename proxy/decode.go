package proxy

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"unicode/utf8"
)

// Helpers the dialects share to decode loosely typed request bodies and name what is
// wrong in them.

// invalidRequest is a 400 naming what is wrong with the caller's request.
func invalidRequest(format string, args ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Kind: ErrInvalidRequest, Message: fmt.Sprintf(format, args...)}
}

// jsonIsNull reports whether raw is absent or null.
func jsonIsNull(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) == 0 || string(t) == "null"
}

// jsonKind is the first byte of a JSON value: '"', '[', '{', 't', 'f', 'n' or a digit; 0
// when absent.
func jsonKind(raw json.RawMessage) byte {
	t := bytes.TrimSpace(raw)
	if len(t) == 0 {
		return 0
	}
	return t[0]
}

// contentText is a message's content as text: a string as it is, parts' text joined.
func contentText(c any) string {
	switch v := c.(type) {
	case string:
		return v
	case []ChatPart:
		var b strings.Builder
		for _, p := range v {
			b.WriteString(p.Text)
		}
		return b.String()
	}
	return ""
}

// floeSignaturePrefix starts the opaque state floe keeps in the fields harnesses echo
// back (Anthropic signatures, Responses encrypted_content, Gemini thoughtSignature), so
// that the reasoning of an earlier turn is restored exactly.
const floeSignaturePrefix = "floe1."

// reasoningSignature is "floe1." + base64 of the reasoning text.
func reasoningSignature(reasoning string) string {
	return floeSignaturePrefix + base64.StdEncoding.EncodeToString([]byte(reasoning))
}

// reasoningFromSignature returns the reasoning a floe signature carries; ok is false for
// anything else (another provider's signature, a damaged one).
func reasoningFromSignature(sig string) (string, bool) {
	rest, ok := strings.CutPrefix(sig, floeSignaturePrefix)
	if !ok {
		return "", false
	}
	b, err := base64.StdEncoding.DecodeString(rest)
	if err != nil || !utf8.Valid(b) {
		return "", false
	}
	return string(b), true
}
