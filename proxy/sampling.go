package proxy

import (
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/floe-rl/floe/trace"
)

// SamplingPolicy is what the proxy does with a caller's sampling parameters (floe serve
// --sampling).
type SamplingPolicy string

const (
	// SamplingRecord passes temperature and top_p through as the caller sent them and
	// records them with the call; the trainer scores each call at its temperature.
	SamplingRecord SamplingPolicy = "record"
	// SamplingForce samples every call at T = 1, top_p = 1, top_k = -1 and min_p = 0
	// (no truncation: the last two so that a model's generation config cannot truncate
	// behind floe's back), whatever the caller asked, and counts each override.
	SamplingForce SamplingPolicy = "force"
)

// ParseSamplingPolicy accepts "record", "force" and "" (record).
func ParseSamplingPolicy(s string) (SamplingPolicy, error) {
	switch SamplingPolicy(s) {
	case "", SamplingRecord:
		return SamplingRecord, nil
	case SamplingForce:
		return SamplingForce, nil
	}
	return "", fmt.Errorf("unknown sampling policy %q (record or force)", s)
}

// SamplingMetrics is implemented by a Metrics that counts --sampling force overrides.
type SamplingMetrics interface {
	// SamplingOverridden is called once per parameter the proxy overrode: "temperature"
	// or "top_p".
	SamplingOverridden(api, param string)
	// SampledTruncated is called once per call recorded with top_p < 1, top_k > 0,
	// min_p > 0 or greedy decoding: the trainer cannot reproduce its processed log-probs
	// (such a call is recorded untrainable unless -train-truncated keeps it).
	SampledTruncated(api string)
}

// applySampling enforces the policy on the normalized request before it goes upstream.
// Under either policy top_k -1 and min_p 0 are sent (no dialect forwards a caller's), so
// that a model's generation_config.json cannot truncate the distribution behind floe's
// back when vLLM runs without --generation-config vllm.
func (s *Server) applySampling(d Dialect, req *Request) {
	noTopK, noMinP := -1, 0.0
	req.Chat.TopK, req.Chat.MinP = &noTopK, &noMinP
	if s.Sampling != SamplingForce {
		return
	}
	m, _ := s.Metrics.(SamplingMetrics)
	one := func(p **float64, name string) {
		if *p != nil && **p != 1 && m != nil {
			m.SamplingOverridden(d.Name(), name)
		}
		v := 1.0
		*p = &v
	}
	one(&req.Chat.Temperature, "temperature")
	one(&req.Chat.TopP, "top_p")
}

// untrainableSampling says why a call sampled as c asks cannot be trained on, or "" when
// it can. vLLM's processed log-probs are those of the distribution it sampled from, and
// the trainer scores log_softmax(logits / T), the full distribution at the temperature:
//
//   - Constrained decoding (tool_choice "required" or naming a function: vLLM masks the
//     logits with a grammar) gives log-probs of the masked distribution, off by 10 nats
//     and more on the tokens the grammar forces. Always untrainable.
//   - Truncated sampling (top_p < 1, top_k > 0, min_p > 0, or greedy T <= 1e-5) gives
//     log-probs renormalised over the tokens kept: top_p 0.9 puts every token's ratio
//     about 0.1 nats off. Untrainable unless trainTruncated, for users who accept the bias.
//
// No dialect forwards response_format, text.format or responseSchema (structured
// outputs are dropped), so tool_choice is the only grammar floe can ask for.
func untrainableSampling(c *ChatRequest, trainTruncated bool) string {
	if why := constrained(c.ToolChoice); why != "" {
		return "constrained decoding: " + why + " (vLLM's log-probs are of the grammar-masked distribution, which the trainer cannot reproduce)"
	}
	if trainTruncated {
		return ""
	}
	if why := truncation(c); why != "" {
		return "truncated sampling: " + why + " (the log-probs are of the truncated distribution, which the trainer cannot reproduce; -train-truncated trains such calls)"
	}
	return ""
}

// constrained names the grammar a tool_choice makes the engine apply, or "" for none
// ("auto", "none", absent).
func constrained(toolChoice json.RawMessage) string {
	if len(toolChoice) == 0 {
		return ""
	}
	var mode string
	if json.Unmarshal(toolChoice, &mode) == nil {
		if mode == "required" {
			return `tool_choice "required"`
		}
		return ""
	}
	var named struct {
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	if json.Unmarshal(toolChoice, &named) == nil && named.Function.Name != "" {
		return fmt.Sprintf("tool_choice names the function %q", named.Function.Name)
	}
	return "tool_choice " + string(toolChoice)
}

// truncation names the parameter that truncates the sampled distribution, or "" when
// the call sampled from the full softmax at its temperature (trace.Sampling.Reproducible,
// and min_p, which floe sends only as 0).
func truncation(c *ChatRequest) string {
	num := func(v float64) string { return strconv.FormatFloat(v, 'g', -1, 64) }
	switch {
	case c.Temperature != nil && *c.Temperature <= 1e-5:
		return "greedy decoding (temperature " + num(*c.Temperature) + ")"
	case c.TopP != nil && *c.TopP < 1:
		return "top_p " + num(*c.TopP)
	case c.TopK != nil && *c.TopK > 0:
		return "top_k " + strconv.Itoa(*c.TopK)
	case c.MinP != nil && *c.MinP > 0:
		return "min_p " + num(*c.MinP)
	}
	return ""
}

// samplingOf is the sampling parameters of the normalized request, as sent upstream.
func samplingOf(c *ChatRequest) *trace.Sampling {
	s := &trace.Sampling{}
	if c.Temperature != nil {
		t := *c.Temperature
		s.Temperature = &t
	}
	if c.TopP != nil {
		p := *c.TopP
		s.TopP = &p
	}
	if c.TopK != nil {
		k := *c.TopK
		s.TopK = &k
	}
	return s
}
