package main

import (
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"time"

	"github.com/grafana/pyroscope-go"
)

// pyroscopeEnv names the server when -pyroscope is not given.
const pyroscopeEnv = "FLOE_PYROSCOPE_SERVER"

// Bounds that keep an unreachable profiling server from ever holding floe up: each upload
// gives up after uploadTimeout, and shutdown waits at most stopWait for the last one.
const (
	uploadTimeout = 5 * time.Second
	stopWait      = 2 * time.Second
)

// startProfiling starts continuous profiling to a Pyroscope server at addr (opt-in) and
// returns the function that stops it. Start-up does not contact the server; uploads run
// in the background, and a server that is down costs a logged error per upload, nothing
// more.
func startProfiling(addr string, log *slog.Logger) (stop func(), err error) {
	if addr == "" {
		return func() {}, nil
	}
	if u, err := url.Parse(addr); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("-pyroscope %q: want an http(s) URL such as http://pyroscope:4040", addr)
	}
	p, err := pyroscope.Start(pyroscope.Config{
		ApplicationName: "floe",
		ServerAddress:   addr,
		Logger:          pyroscopeLogger{log.With("component", "pyroscope")},
		HTTPClient:      &http.Client{Timeout: uploadTimeout},
		ProfileTypes: []pyroscope.ProfileType{pyroscope.ProfileCPU, pyroscope.ProfileAllocSpace,
			pyroscope.ProfileInuseSpace, pyroscope.ProfileGoroutines},
	})
	if err != nil {
		return nil, fmt.Errorf("starting pyroscope profiling to %s: %w", addr, err)
	}
	log.Info("profiling to pyroscope", "server", addr)
	return func() {
		done := make(chan struct{})
		// Stop uploads what is left; the process is exiting, so past stopWait the upload
		// is abandoned with it.
		go func() {
			defer close(done)
			if err := p.Stop(); err != nil {
				log.Warn("pyroscope: final upload", "err", err)
			}
		}()
		select {
		case <-done:
		case <-time.After(stopWait):
			log.Warn("pyroscope: final upload abandoned", "server", addr, "after", stopWait)
		}
	}, nil
}

// pyroscopeLogger routes the profiler's messages to slog; its info chatter goes to debug.
type pyroscopeLogger struct{ log *slog.Logger }

func (l pyroscopeLogger) Infof(f string, a ...any)  { l.log.Debug(fmt.Sprintf(f, a...)) }
func (l pyroscopeLogger) Debugf(f string, a ...any) { l.log.Debug(fmt.Sprintf(f, a...)) }
func (l pyroscopeLogger) Errorf(f string, a ...any) { l.log.Warn(fmt.Sprintf(f, a...)) }
