package sidecar

import (
	"flag"
	"fmt"
	"strconv"
	"strings"
)

// defineGuardFlag defines one of the guards' flags (serveFlags names them).
func defineGuardFlag(c *Config, fs *flag.FlagSet, n string) {
	l := &c.ProxyLimits
	switch n {
	case "client-body-timeout":
		fs.DurationVar(&l.BodyTimeout, n, l.BodyTimeout,
			"drop a request whose body has not arrived whole this long after its headers, however steadily it trickles; a body being read holds no -max-inflight slot (negative: no limit)")
	case "unauthenticated-timeout":
		fs.DurationVar(&l.UnauthenticatedTimeout, n, l.UnauthenticatedTimeout,
			"close a proxy connection that has not sent a request with a live session's key this long after it was accepted (negative: no limit)")
	case "max-conns":
		fs.IntVar(&l.MaxConns, n, l.MaxConns,
			"most connections the proxy holds open; past it the oldest one serving no call is closed (0: derived from the descriptor limit, keeping room for the control and Flight listeners, the store and one upstream connection per call; negative: no cap)")
	case "max-n":
		fs.IntVar(&l.MaxN, n, l.MaxN, "most choices (n, candidateCount) one call may ask for; past it: 400 (negative: no limit)")
	case "media-hosts":
		fs.Func(n, "comma-separated hosts (host or host:port) whose http(s) image URLs are forwarded for the inference server to fetch (default: none, only data: URLs; any other URL gets 400)",
			func(v string) error {
				l.MediaHosts = splitList(v)
				return nil
			})
	case "chat-template-kwargs":
		fs.Func(n, "comma-separated chat_template_kwargs keys a request may set; any other gets 400 (default "+strings.Join(DefaultTemplateKwargs(), ",")+"; empty: none)",
			func(v string) error {
				l.TemplateKwargs = splitList(v)
				if l.TemplateKwargs == nil {
					l.TemplateKwargs = []string{}
				}
				for _, k := range l.TemplateKwargs {
					if k == "chat_template" {
						return fmt.Errorf("chat_template replaces the template the model is trained under; floe does not forward it")
					}
				}
				return nil
			})
	case "max-session-bytes":
		fs.Func(n, fmt.Sprintf("most bytes of calls (requests, answers, tokens) one session may store; its calls past it are refused (default %d; negative: no limit)", l.MaxSessionBytes),
			func(v string) error {
				b, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					return fmt.Errorf("want a number of bytes: %w", err)
				}
				l.MaxSessionBytes = b
				return nil
			})
	case "min-free-disk":
		fs.Func(n, fmt.Sprintf("refuse every call, with its provider's overloaded error and before any upstream call, while the data dir's disk has fewer free bytes than this (default %d; 0: off)", l.MinFreeDisk),
			func(v string) error {
				b, err := strconv.ParseInt(v, 10, 64)
				if err != nil || b < 0 {
					return fmt.Errorf("want a number of bytes, 0 or more")
				}
				l.MinFreeDisk = b
				return nil
			})
	case "max-pause":
		fs.DurationVar(&c.MaxPause, n, c.MaxPause,
			"a pause the trainer does not resume within this long is logged as an error, and calls are refused with their provider's overloaded error until it does (0: hold calls for ever)")
	default:
		panic("sidecar: no guard flag " + n)
	}
}

// splitList splits a comma-separated flag value, dropping empty items; nil when none.
func splitList(v string) []string {
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}
