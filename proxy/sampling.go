package proxy

import (
	"fmt"

	"github.com/floe-rl/floe/trace"
)

// SamplingPolicy is what the proxy does with a caller's sampling parameters (floe serve
// --sampling).
type SamplingPolicy string

const (
	// SamplingRecord passes temperature and top_p through as the caller sent them and
	// records them with the call; the trainer scores each call at its temperature.
	SamplingRecord SamplingPolicy = "record"
	// SamplingForce samples every call at T = 1, top_p = 1 (no top_k is ever forwarded),
	// whatever the caller asked, and counts each override.
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
	// SampledTruncated is called once per call recorded with top_p < 1, top_k > 0 or
	// greedy decoding: the trainer cannot reproduce its processed log-probs.
	SampledTruncated(api string)
}

// applySampling enforces the policy on the normalized request before it goes upstream.
func (s *Server) applySampling(d Dialect, req *Request) {
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
	return s
}
