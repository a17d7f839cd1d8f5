package proxy

import (
	"encoding/json"
	"net/http"
	"strings"
)

// Dialects are the provider APIs the server speaks, in order: the first is the shape of
// an answer to a request no dialect claims. Adding a dialect is a package implementing
// Dialect and one line in proxy/providers.
type Dialects []Dialect

// Op is what a route does.
type Op int

// The operations a route serves.
const (
	OpGenerate Op = iota // a model call, recorded
	OpCount              // token counting
	OpModels             // list models (GET)
	opUnknown            // no route: a 404 in the claimed dialect's shape
)

// Route is one path a dialect serves: a request whose path ends in Suffix (and, when When
// is set, for which When holds) is that dialect's Op.
type Route struct {
	Suffix string
	Op     Op
	// When tells apart dialects that share a path suffix (GET …/models is every
	// provider's): a route with When is tried before any route without one.
	When func(r *http.Request) bool
}

// Claim is how strongly a dialect recognizes a request floe does not route (for the
// shape of its 404): by a header only that provider's clients send, or by the body's
// shape. Every header claim is weighed before any body claim.
type Claim int

// The strengths of a claim.
const (
	ClaimNone Claim = iota
	ClaimByBody
	ClaimByHeader
)

// Client names a dialect's provider for a session's base_urls (docs/control.md): Name is
// the key ("openai"), Path what follows the proxy's root ("/v1"). Dialects of one
// provider share it.
type Client struct {
	Name, Path string
}

// BaseURLs are the base URLs a harness of each provider is given: the proxy's root
// followed by each dialect's client path.
func (ds Dialects) BaseURLs(root string) map[string]string {
	out := map[string]string{}
	for _, d := range ds {
		if d == nil {
			continue
		}
		c := d.Client()
		out[c.Name] = root + c.Path
	}
	return out
}

// APIKey returns the credential a harness sent, in the order docs/proxy.md ("Sessions")
// lists them: x-api-key, Authorization: Bearer, x-goog-api-key, ?key=. Only a
// session's api_key is a credential: a session id is never one, and no floe-specific
// header carries one. Every built-in dialect's Key is APIKey, so a harness may send its
// key in any of these whichever API it speaks.
func APIKey(r *http.Request) string {
	if v := r.Header.Get("x-api-key"); v != "" {
		return v
	}
	if v, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok && v != "" {
		return strings.TrimSpace(v)
	}
	if v := r.Header.Get("x-goog-api-key"); v != "" {
		return v
	}
	return r.URL.Query().Get("key")
}

// route picks the dialect and the operation: by path first (conditional routes before
// plain ones), then, for a path no dialect serves, by the dialects' claims (headers,
// then the body's shape); the first dialect answers what nothing claims.
func (s *Server) route(r *http.Request, body []byte) (Dialect, Op) {
	p := r.URL.Path
	for _, conditional := range []bool{true, false} {
		for _, d := range s.Dialects {
			if d == nil {
				continue
			}
			for _, rt := range d.Routes() {
				if (rt.When != nil) != conditional || !strings.HasSuffix(p, rt.Suffix) {
					continue
				}
				if rt.Op == OpModels && r.Method != http.MethodGet {
					continue
				}
				if rt.When == nil || rt.When(r) {
					return d, rt.Op
				}
			}
		}
	}
	var shape map[string]json.RawMessage
	if body != nil {
		_ = json.Unmarshal(body, &shape)
	}
	for _, strength := range []Claim{ClaimByHeader, ClaimByBody} {
		for _, d := range s.Dialects {
			if d != nil && d.Claims(r, shape) == strength {
				return d, opUnknown
			}
		}
	}
	return s.fallbackDialect(), opUnknown
}

// fallbackDialect is the first dialect: the shape of answers to what none claims.
func (s *Server) fallbackDialect() Dialect {
	for _, d := range s.Dialects {
		if d != nil {
			return d
		}
	}
	return nil
}
