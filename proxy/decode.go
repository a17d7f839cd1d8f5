package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
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
