package gemini

import (
	"encoding/json"
	"net/http"
	"strings"

	"github.com/floe-rl/floe/proxy"
)

// Routes: the model methods generateContent, streamGenerateContent and countTokens, and
// GET …/models under v1beta or with Gemini's key header.
func (Dialect) Routes() []proxy.Route {
	return []proxy.Route{
		{Suffix: ":" + methodGenerate, Op: proxy.OpGenerate},
		{Suffix: ":" + methodStream, Op: proxy.OpGenerate},
		{Suffix: ":" + methodCount, Op: proxy.OpCount},
		{Suffix: "/models", Op: proxy.OpModels, When: func(r *http.Request) bool {
			return strings.Contains(r.URL.Path, "v1beta") || r.Header.Get("x-goog-api-key") != ""
		}},
	}
}

// Claims: Gemini's key header or ?key=, or a body with contents.
func (Dialect) Claims(r *http.Request, body map[string]json.RawMessage) proxy.Claim {
	switch {
	case r.Header.Get("x-goog-api-key") != "" || r.URL.Query().Get("key") != "":
		return proxy.ClaimByHeader
	case body["contents"] != nil:
		return proxy.ClaimByBody
	}
	return proxy.ClaimNone
}

// Key is proxy.APIKey.
func (Dialect) Key(r *http.Request) string { return proxy.APIKey(r) }

// Client: the Gemini SDKs take the proxy's root as their base URL.
func (Dialect) Client() proxy.Client { return proxy.Client{Name: "gemini"} }
