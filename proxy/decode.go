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

// InvalidRequest is a 400 naming what is wrong with the caller's request.
func InvalidRequest(format string, args ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Kind: ErrInvalidRequest, Message: fmt.Sprintf(format, args...)}
}

// JSONIsNull reports whether raw is absent or null.
func JSONIsNull(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) == 0 || string(t) == "null"
}

// JSONKind is the first byte of a JSON value: '"', '[', '{', 't', 'f', 'n' or a digit; 0
// when absent.
func JSONKind(raw json.RawMessage) byte {
	t := bytes.TrimSpace(raw)
	if len(t) == 0 {
		return 0
	}
	return t[0]
}

// ContentText is a message's content as text: a string as it is, parts' text joined.
func ContentText(c any) string {
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

// SignaturePrefix starts the opaque state floe keeps in the fields harnesses echo
// back (Anthropic signatures, Responses encrypted_content, Gemini thoughtSignature), so
// that the reasoning of an earlier turn is restored exactly.
const SignaturePrefix = "floe1."

// ReasoningSignature is "floe1." + base64 of the reasoning text.
func ReasoningSignature(reasoning string) string {
	return SignaturePrefix + base64.StdEncoding.EncodeToString([]byte(reasoning))
}

// ReasoningFromSignature returns the reasoning a floe signature carries; ok is false for
// anything else (another provider's signature, a damaged one).
func ReasoningFromSignature(sig string) (string, bool) {
	rest, ok := strings.CutPrefix(sig, SignaturePrefix)
	if !ok {
		return "", false
	}
	b, err := base64.StdEncoding.DecodeString(rest)
	if err != nil || !utf8.Valid(b) {
		return "", false
	}
	return string(b), true
}
