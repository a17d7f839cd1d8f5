// Package providers assembles the proxy's dialects and engines. It is its own package
// because it imports every dialect and engine package, and those import the core proxy
// package, which therefore cannot.
package providers

import (
	"fmt"
	"strings"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/anthropic"
	"github.com/floe-rl/floe/proxy/gemini"
	"github.com/floe-rl/floe/proxy/openai"
	"github.com/floe-rl/floe/proxy/sglang"
	"github.com/floe-rl/floe/proxy/vllm"
)

// Dialects serves all four provider APIs.
func Dialects() proxy.Dialects {
	return proxy.Dialects{
		openai.Chat{}, // first: the shape of an answer to what no dialect claims
		anthropic.Dialect{},
		openai.Responses{},
		gemini.Dialect{},
	}
}

// NewEngine returns the engine of kind ("vllm" or "sglang") for the inference server at
// baseURL serving model (empty: the first model the server lists), so that callers can
// choose the engine by a flag.
func NewEngine(kind, baseURL, model string) (proxy.Engine, error) {
	switch strings.ToLower(strings.TrimSpace(kind)) {
	case "vllm":
		return vllm.New(baseURL, model), nil
	case "sglang":
		return sglang.New(baseURL, model), nil
	default:
		return nil, fmt.Errorf("unknown inference engine %q: the supported engines are \"vllm\" and \"sglang\"", kind)
	}
}
