package proxy

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

// TestKeySources: the session key is read from each header a harness may send it in;
// x-floe-session is no credential (a session id is never a key).
func TestKeySources(t *testing.T) {
	tests := []struct {
		set  func(*http.Request)
		want string
	}{
		{func(r *http.Request) { r.Header.Set("x-api-key", "a") }, "a"},
		{func(r *http.Request) { r.Header.Set("x-goog-api-key", "b") }, "b"},
		{func(r *http.Request) { r.URL.RawQuery = "key=c&alt=sse" }, "c"},
		{func(r *http.Request) { r.Header.Set("x-api-key", "a"); r.Header.Set("x-floe-session", "s") }, "a"},
		{func(r *http.Request) { r.Header.Set("x-floe-session", "s") }, ""},
	}
	for _, tt := range tests {
		r := httptest.NewRequest(http.MethodPost, "/v1/messages", nil)
		tt.set(r)
		if got := APIKey(r); got != tt.want {
			t.Errorf("APIKey() = %q, want %q", got, tt.want)
		}
	}
}
