package proxy

import (
	"encoding/base64"
	"strings"
	"unicode/utf8"
)

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
