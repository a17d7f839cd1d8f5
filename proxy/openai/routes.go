package openai

import (
	"encoding/json"
	"net/http"

	"github.com/floe-rl/floe/proxy"
)

// Routes: Chat Completions, and GET …/models for any caller no other dialect's
// conditional route took.
func (Chat) Routes() []proxy.Route {
	return []proxy.Route{
		{Suffix: "/chat/completions", Op: proxy.OpGenerate},
		{Suffix: "/models", Op: proxy.OpModels},
	}
}

// Claims nothing: Chat is the first dialect, the shape of what no dialect claims.
func (Chat) Claims(*http.Request, map[string]json.RawMessage) proxy.Claim { return proxy.ClaimNone }

// Key is proxy.APIKey.
func (Chat) Key(r *http.Request) string { return proxy.APIKey(r) }

// Client: OpenAI SDKs take the proxy's root with /v1.
func (Chat) Client() proxy.Client { return proxy.Client{Name: "openai", Path: "/v1"} }

// Routes: Responses.
func (Responses) Routes() []proxy.Route {
	return []proxy.Route{{Suffix: "/responses", Op: proxy.OpGenerate}}
}

// Claims a body with input.
func (Responses) Claims(_ *http.Request, body map[string]json.RawMessage) proxy.Claim {
	if body["input"] != nil {
		return proxy.ClaimByBody
	}
	return proxy.ClaimNone
}

// Key is proxy.APIKey.
func (Responses) Key(r *http.Request) string { return proxy.APIKey(r) }

// Client: OpenAI SDKs take the proxy's root with /v1.
func (Responses) Client() proxy.Client { return proxy.Client{Name: "openai", Path: "/v1"} }
