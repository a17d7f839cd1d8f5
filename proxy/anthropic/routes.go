package anthropic

import (
	"encoding/json"
	"net/http"

	"github.com/floe-rl/floe/proxy"
)

// Routes: Messages, its token counting, and GET …/models when the caller speaks
// Anthropic's headers (every provider lists models under that suffix).
func (Dialect) Routes() []proxy.Route {
	return []proxy.Route{
		{Suffix: "/messages/count_tokens", Op: proxy.OpCount},
		{Suffix: "/messages", Op: proxy.OpGenerate},
		{Suffix: "/models", Op: proxy.OpModels, When: func(r *http.Request) bool {
			return r.Header.Get("anthropic-version") != "" || r.Header.Get("x-api-key") != ""
		}},
	}
}

// Claims: the anthropic-version header every Anthropic SDK sends, or a body with
// messages, max_tokens and system (which Messages requires and Chat does not name so).
func (Dialect) Claims(r *http.Request, body map[string]json.RawMessage) proxy.Claim {
	switch {
	case r.Header.Get("anthropic-version") != "":
		return proxy.ClaimByHeader
	case body["messages"] != nil && body["max_tokens"] != nil && body["system"] != nil:
		return proxy.ClaimByBody
	}
	return proxy.ClaimNone
}

// Key is proxy.APIKey.
func (Dialect) Key(r *http.Request) string { return proxy.APIKey(r) }

// Client: Anthropic SDKs take the proxy's root as their base URL.
func (Dialect) Client() proxy.Client { return proxy.Client{Name: "anthropic"} }
