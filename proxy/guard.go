package proxy

import (
	"fmt"
	"math"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
)

// decode decodes the caller's request and checks the normalized result (checkRequest):
// every dialect's request is bounded the same way, after its own decoding.
func (s *Server) decode(d Dialect, r *http.Request, body []byte, lim Limits) (*Request, error) {
	req, err := d.Decode(r, body)
	if err != nil {
		return nil, err
	}
	if e := checkRequest(d.Name(), &req.Chat, lim); e != nil {
		return nil, e
	}
	return req, nil
}

// checkRequest refuses, with a 400 naming the field, a normalized request that would
// multiply upstream work (n past Limits.MaxN), train on a value the trainer cannot use (a
// sampling parameter that is not finite or out of its range: a temperature of 1e308 is
// +Inf in the float32 column the trainer divides by), make the inference server fetch a
// URL (an image by http: URL, request forgery from the inference host, unless its host is
// in Limits.MediaHosts), or change the chat template (a chat_template_kwargs key not in
// Limits.TemplateKwargs, chat_template above all).
func checkRequest(api string, c *ChatRequest, lim Limits) *Error {
	name := func(f string) string { return callerField(api, f) }
	if c.N != nil {
		switch n := *c.N; {
		case n < 1:
			return InvalidRequest("%s: %d must be at least 1", name("n"), n)
		case lim.MaxN > 0 && n > lim.MaxN:
			return InvalidRequest("%s: %d is more than floe's maximum of %d choices per call (-max-n)", name("n"), n, lim.MaxN)
		}
	}
	for _, p := range []struct {
		field   string
		v       *float64
		lo, hi  float64
		openLow bool // lo itself is refused
		allowed string
	}{
		{"temperature", c.Temperature, 0, 2, false, "from 0 to 2"},
		{"top_p", c.TopP, 0, 1, true, "greater than 0 and at most 1"},
		{"min_p", c.MinP, 0, 1, false, "from 0 to 1"},
	} {
		if p.v == nil {
			continue
		}
		v := *p.v
		if math.IsNaN(v) || math.IsInf(v, 0) || v < p.lo || v > p.hi || (p.openLow && v == p.lo) {
			return InvalidRequest("%s: %g is out of range (want a number %s)", name(p.field), v, p.allowed)
		}
	}
	if c.TopK != nil && *c.TopK < -1 {
		return InvalidRequest("%s: %d is out of range (want -1 for none, or a count)", name("top_k"), *c.TopK)
	}
	for i, m := range c.Messages {
		parts, _ := m.Content.([]ChatPart)
		for j, p := range parts {
			if p.ImageURL == nil {
				continue
			}
			if e := checkMediaURL(p.ImageURL.URL, lim.MediaHosts); e != "" {
				return InvalidRequest("%s (message %d, part %d): %s", name("image_url"), i, j, e)
			}
		}
	}
	allowed := lim.TemplateKwargs
	if allowed == nil {
		allowed = DefaultTemplateKwargs
	}
	keys := make([]string, 0, len(c.ChatTemplateKwargs))
	for k := range c.ChatTemplateKwargs {
		if !slices.Contains(allowed, k) {
			keys = append(keys, k)
		}
	}
	if len(keys) > 0 {
		slices.Sort(keys)
		return InvalidRequest("chat_template_kwargs.%s: floe does not forward this key (it allows %s; -chat-template-kwargs)",
			keys[0], orNone(allowed))
	}
	return nil
}

func orNone(l []string) string {
	if len(l) == 0 {
		return "none"
	}
	return strings.Join(l, ", ")
}

// checkMediaURL says what is wrong with an image URL ("" when nothing is): a data: URL
// always passes; an http(s) URL only when its host (or host:port) is in hosts.
func checkMediaURL(raw string, hosts []string) string {
	if len(raw) >= 5 && strings.EqualFold(raw[:5], "data:") {
		return ""
	}
	shown := raw
	if len(shown) > 200 {
		shown = shown[:200] + "…"
	}
	refuse := fmt.Sprintf("floe forwards images only as data: URLs, since the inference server would fetch %q itself", shown)
	if len(hosts) == 0 {
		return refuse
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil {
		return refuse + " (and it is no http or https URL)"
	}
	host := strings.ToLower(u.Hostname())
	hostPort := host
	if port := u.Port(); port != "" {
		hostPort = net.JoinHostPort(host, port)
	}
	for _, h := range hosts {
		if h = strings.ToLower(strings.TrimSpace(h)); h == host || h == hostPort {
			return ""
		}
	}
	return refuse + fmt.Sprintf(" (host %s is not in -media-hosts)", host)
}

// callerField is the caller's name of a normalized request's field in its own API.
func callerField(api, field string) string {
	switch api {
	case "gemini":
		switch field {
		case "n":
			return "generationConfig.candidateCount"
		case "temperature":
			return "generationConfig.temperature"
		case "top_p":
			return "generationConfig.topP"
		case "top_k":
			return "generationConfig.topK"
		case "image_url":
			return "fileData.fileUri"
		}
	case "anthropic":
		if field == "image_url" {
			return "image.source.url"
		}
	case "openai_responses":
		if field == "image_url" {
			return "input_image.image_url"
		}
	}
	return field
}
