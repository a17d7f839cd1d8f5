package sidecar

import (
	"log/slog"
	"math"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/floe-rl/floe/proxy"
)

// Descriptors floe keeps for itself whatever the proxy's connections: the store and its
// archive's files, the three listeners, the control API's and Flight's connections
// (the runner's and the trainer's: a handful), the log, NVML.
const reservedFDs = 128

// ProxyConnCap is how many connections the proxy may hold open under a descriptor limit
// of nofile: what is left after floe's own (reservedFDs) and one upstream connection per
// call in flight (maxInflight, at most half of the rest), so that harnesses' connections
// can never take the descriptors the control API, Flight, the store and the upstream
// calls need. At least 16; 0 (no cap) when nofile is unknown.
func ProxyConnCap(nofile uint64, maxInflight int) int {
	// 0 is unknown; a limit past 2^31 (RLIM_INFINITY on the BSDs) bounds nothing either,
	// and would wrap negative below.
	if nofile == 0 || nofile > math.MaxInt32 {
		return 0
	}
	avail := int64(nofile) - reservedFDs
	upstream := avail / 2
	if maxInflight > 0 && int64(maxInflight) < upstream {
		upstream = int64(maxInflight)
	}
	return int(max(avail-upstream, 16))
}

// proxyHTTPServer is the proxy listener's http.Server, its connections bounded by a
// proxy.ConnLimiter with cfg's cap (-max-conns, or one derived from the descriptor limit)
// and stranger deadline (-unauthenticated-timeout).
func proxyHTTPServer(cfg Config, handler http.Handler, log *slog.Logger) (*http.Server, *proxy.ConnLimiter) {
	lim := cfg.ProxyLimits
	maxInflight := lim.MaxInflight
	if maxInflight == 0 {
		maxInflight = proxy.DefaultLimits().MaxInflight
	}
	cl := &proxy.ConnLimiter{Max: lim.MaxConns, Unauthenticated: lim.UnauthenticatedTimeout, Log: log}
	if cl.Unauthenticated == 0 {
		cl.Unauthenticated = proxy.DefaultLimits().UnauthenticatedTimeout
	}
	nofile := nofileLimit()
	if cl.Max == 0 {
		cl.Max = ProxyConnCap(nofile, maxInflight)
	}
	log.Info("proxy connections", "max_conns", cl.Max, "nofile", nofile, "unauthenticated_timeout", cl.Unauthenticated)
	// An idle keep-alive connection from a harness is closed after IdleTimeout, so
	// connections left open cannot pile up.
	hs := &http.Server{Handler: handler, ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 5 * time.Minute,
		ConnContext: cl.ConnContext, ConnState: cl.ConnState}
	return hs, cl
}

// guardMetrics registers the gauges of the proxy's guards: the pause past -max-pause and
// the proxy's connections.
func guardMetrics(reg prometheus.Registerer, gate *proxy.Gate, conns *proxy.ConnLimiter) {
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "floe_pause_expired",
			Help: "1 while a pause has outlasted -max-pause (the trainer has not resumed) and calls are refused, else 0."},
			func() float64 {
				if gate.PauseExpired() {
					return 1
				}
				return 0
			}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "floe_paused_seconds",
			Help: "How long the current pause has lasted; 0 when not paused."},
			func() float64 { return gate.PausedFor().Seconds() }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "floe_proxy_connections",
			Help: "Connections open to the proxy listener."},
			func() float64 { return float64(conns.Open()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "floe_proxy_connections_evicted_total",
			Help: "Proxy connections closed to make room under the connection cap (a stranger's, or an idle one)."},
			func() float64 { return float64(conns.Evicted()) }),
	)
}

// pauseExpired is the gate's OnPauseExpired: floe says it loudly.
func pauseExpired(log *slog.Logger) func(time.Duration) {
	return func(d time.Duration) {
		log.Error("the trainer paused rollouts and has not resumed them within -max-pause: floe now refuses every model call with its provider's overloaded error until a resume (POST /floe/v1/resume or Flight resume); is the trainer alive?",
			"paused_for", d.Round(time.Second))
	}
}

// warnOpenListeners logs, for a control or Flight listener without a token, how to set
// one: on loopback it is open to every local process, a harness's sandbox included when
// it shares the host's network namespace.
func warnOpenListeners(cfg Config, log *slog.Logger) {
	warnOpenControl(cfg, log)
	if cfg.FlightToken == "" {
		log.Warn("Flight has no token: any process that reaches "+cfg.FlightAddr+" (a sandbox sharing the host's network namespace too) can commit steps and pause rollouts; set one with -flight-token-file FILE or $"+FlightTokenEnv,
			"flight_addr", cfg.FlightAddr)
	}
}

// warnOpenControl logs, when the control listener has no token, how to set one (floe
// serve and floe proxy).
func warnOpenControl(cfg Config, log *slog.Logger) {
	if cfg.ControlToken == "" {
		log.Warn("the control API has no token: any process that reaches "+cfg.ControlAddr+" (a sandbox sharing the host's network namespace too) can pause, resume and finish sessions; set one with -control-token-file FILE or $"+ControlTokenEnv,
			"control_addr", cfg.ControlAddr)
	}
}
