package sidecar

import (
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/gpu"
	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/bolt"
	"github.com/floe-rl/floe/trace/mem"
)

// Metrics is floe serve's Prometheus registry (its own, never the global default) and
// the collectors the proxy, the step former, the Flight service and the step tracker
// feed. The metric names are listed in docs/control.md.
type Metrics struct {
	reg *prometheus.Registry

	calls                                *prometheus.CounterVec
	proxyErrors                          *prometheus.CounterVec
	samplingOverrides, samplingTruncated *prometheus.CounterVec
	upstream                             *prometheus.HistogramVec
	finished                             *prometheus.CounterVec
	timedOut                             prometheus.Counter
	dropped                              *prometheus.CounterVec
	stale                                prometheus.Counter

	stepsFormed    *prometheus.CounterVec
	stepFormation  prometheus.Histogram
	stepsCommitted prometheus.Counter

	archived        *prometheus.CounterVec
	archiveFailures *prometheus.CounterVec
	archiveTime     prometheus.Histogram
	flightBytes     prometheus.Counter
	flightBatches   prometheus.Counter
	flightRows      prometheus.Counter

	budget           prometheus.Gauge
	fill, imbalance  prometheus.Gauge
	rowsForwarded    prometheus.Counter
	perRequestTokens prometheus.Counter
	tokensSaved      prometheus.Counter
	lossTokens       prometheus.Counter

	trainerWait, trainerStep prometheus.Histogram
	trainerPeak              *prometheus.GaugeVec

	gpuBusy, gpuPeak prometheus.Gauge // the last step's window; registered only with a GPU

	// Per inference replica, labelled by its URL without credentials.
	replicaCalls, replicaErrors, replicaFailovers *prometheus.CounterVec
	replicaHealthy                                *prometheus.GaugeVec
	replicaLatency                                *prometheus.HistogramVec
}

var (
	_ proxy.Metrics        = (*Metrics)(nil)
	_ proxy.ReplicaMetrics = (*Metrics)(nil)
)

// State is what the metrics read at scrape time: the durable store's sessions and
// groups, the in-memory store's retention, the READY buffer and the GPU monitor; a nil
// field is not collected.
type State struct {
	Store   *bolt.Store
	Memory  *mem.Store
	Ready   *Ready
	Monitor *gpu.Monitor
}

// NewMetrics builds the registry with Go runtime and process collectors and floe's own.
func NewMetrics(st State) *Metrics { return newMetrics(st, true) }

// newMetrics is NewMetrics for what floe builds: without steps (floe proxy) the step
// former's, Flight's, the trainer's and the archive's metrics are not registered, so that
// /metrics shows nothing that cannot move.
func newMetrics(st State, steps bool) *Metrics {
	m := &Metrics{reg: prometheus.NewRegistry()}
	f := promauto{m.reg}
	// The step side's collectors exist either way (the code that feeds them needs no
	// check); without steps they go to a registry nobody serves.
	stepReg := m.reg
	if !steps {
		stepReg = prometheus.NewRegistry()
	}
	s := promauto{stepReg}
	m.calls = f.counterVec("floe_calls_recorded_total", "Model calls recorded, by API kind and whether they are trainable.", "api", "trainable")
	m.samplingOverrides = f.counterVec("floe_sampling_overrides_total", "Sampling parameters the proxy overrode under --sampling force, by API kind and parameter (temperature, top_p).", "api", "param")
	m.samplingTruncated = f.counterVec("floe_calls_truncated_sampling_total", "Calls recorded with top_p < 1, top_k > 0, min_p > 0 or greedy decoding, whose processed log-probs the trainer cannot reproduce (untrainable unless -train-truncated), by API kind.", "api")
	m.proxyErrors = f.counterVec("floe_proxy_errors_total", "Errors the proxy answered, by API kind and error kind.", "api", "kind")
	m.upstream = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "floe_upstream_latency_seconds",
		Help: "Latency of upstream inference calls that answered, by API kind.", Buckets: prometheus.ExponentialBuckets(0.01, 2, 14)}, []string{"api"})
	m.finished = f.counterVec("floe_sessions_finished_total", "Sessions finished, by status; timeout includes sessions ended by the group timeout.", "status")
	m.timedOut = s.counter("floe_groups_timed_out_total", "Groups ended by the group timeout (their running sessions finished as timeout).")
	m.dropped = s.counterVec("floe_groups_dropped_total", "Complete groups set aside without training, by reason: too_few_sessions, invalid, nothing_to_train, path_too_long.", "reason")
	m.stale = s.counter("floe_calls_stale_total", "Trainable calls not trained on because their policy version lagged the current one by more than max_staleness.")
	m.stepsFormed = s.counterVec("floe_steps_formed_total", "Steps formed and made READY; recovered=true for uncommitted steps formed again after a restart.", "recovered")
	m.stepFormation = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "floe_step_formation_seconds",
		Help: "Time to form a step: reconstruction, advantages, packing and encoding each rank's first micro-batch.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)})
	m.stepsCommitted = s.counter("floe_steps_committed_total", "Steps committed by the trainer.")
	m.archived = s.counterVec("floe_archive_steps_total", "Committed steps (kind=step) and dropped groups (kind=dropped_group) moved from the store into the Parquet archive.", "kind")
	m.archiveFailures = s.counterVec("floe_archive_failures_total", "Failed attempts to archive a committed step (kind=step) or a dropped group (kind=dropped_group); each stays in the store and is tried again.", "kind")
	m.archiveTime = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "floe_archive_seconds",
		Help: "Time to archive one committed step or dropped group: writing its Parquet files and removing it from the store.", Buckets: prometheus.ExponentialBuckets(0.01, 2, 16)})
	stepReg.MustRegister(m.archiveTime)
	m.flightBytes = s.counter("floe_flight_bytes_sent_total", "Bytes of micro-batch FlightData messages sent over Flight.")
	m.flightBatches = s.counter("floe_flight_micro_batches_served_total", "Micro-batches sent over Flight.")
	m.flightRows = s.counter("floe_flight_rows_sent_total", "Rows (tokens, padding included) of the micro-batches sent over Flight.")
	m.budget = s.gauge("floe_token_budget_rows", "Token budget B (rows per micro-batch) new steps are formed with.")
	m.fill = s.gauge("floe_step_fill", "Fill of the last formed step: rows / (micro-batches x budget).")
	m.imbalance = s.gauge("floe_step_imbalance", "Rank imbalance of the last formed step: heaviest rank cost / mean rank cost.")
	m.rowsForwarded = s.counter("floe_rows_forwarded_total", "Rows the trainer forwards in formed steps (cut repeats included, padding excluded).")
	m.perRequestTokens = s.counter("floe_per_request_tokens_total", "Rows the per_request strategy would forward for the same steps (prompt + response tokens of every call).")
	m.tokensSaved = s.counter("floe_tokens_saved_total", "Rows saved against per_request: floe_per_request_tokens_total - floe_rows_forwarded_total.")
	m.lossTokens = s.counter("floe_loss_tokens_total", "Sampled tokens trained in formed steps.")
	m.trainerWait = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "floe_trainer_wait_seconds",
		Help: "Seconds a trainer rank waited for data in a step, from its reports.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 20)})
	m.trainerStep = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "floe_trainer_step_seconds",
		Help: "Seconds a trainer rank spent on a step, from its reports.", Buckets: prometheus.ExponentialBuckets(0.01, 2, 18)})
	m.trainerPeak = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "floe_trainer_peak_memory_bytes",
		Help: "Peak memory a trainer rank reported for its last step."}, []string{"rank"})
	m.replicaCalls = f.counterVec("floe_replica_calls_total", "Upstream calls sent to each inference replica (a call that failed over counts on each replica it tried).", "upstream")
	m.replicaErrors = f.counterVec("floe_replica_errors_total", "Upstream calls a replica failed: unreachable, a 5xx, a timeout or a broken stream.", "upstream")
	m.replicaFailovers = f.counterVec("floe_replica_failovers_total", "Calls that left this replica for the next one of their session's order, before any of the answer reached the caller.", "upstream")
	m.replicaHealthy = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "floe_replica_healthy",
		Help: "1 while the replica passes its health checks and answers, 0 while it is down."}, []string{"upstream"})
	m.replicaLatency = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "floe_replica_latency_seconds",
		Help: "Latency of the upstream calls each replica answered.", Buckets: prometheus.ExponentialBuckets(0.01, 2, 14)}, []string{"upstream"})
	m.reg.MustRegister(m.replicaHealthy, m.replicaLatency)
	stepReg.MustRegister(m.stepFormation, m.trainerWait, m.trainerStep, m.trainerPeak)
	m.reg.MustRegister(m.upstream, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		&stateCollector{st: st})
	if st.Memory != nil {
		memoryMetrics(m.reg, st.Memory)
	}
	if st.Monitor != nil && st.Monitor.DeviceCount() > 0 {
		m.gpuBusy = s.gauge("floe_gpu_step_busy_fraction", "GPU busy fraction (mean utilization, 0..1) over the last step, from its first micro-batch served to its commit.")
		m.gpuPeak = s.gauge("floe_gpu_step_peak_memory_bytes", "Peak device memory used over the last step's window.")
	}
	return m
}

// Handler serves the registry in the Prometheus exposition format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// Registry is the sidecar's registry.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Recorded implements proxy.Metrics.
func (m *Metrics) Recorded(api string, trainable bool) {
	m.calls.WithLabelValues(api, strconv.FormatBool(trainable)).Inc()
}

// Upstream implements proxy.Metrics.
func (m *Metrics) Upstream(api string, latency time.Duration) {
	m.upstream.WithLabelValues(api).Observe(latency.Seconds())
}

// ReplicaCalled implements proxy.ReplicaMetrics.
func (m *Metrics) ReplicaCalled(upstream string, latency time.Duration, failed bool) {
	m.replicaCalls.WithLabelValues(upstream).Inc()
	if failed {
		m.replicaErrors.WithLabelValues(upstream).Inc()
	}
	if latency > 0 {
		m.replicaLatency.WithLabelValues(upstream).Observe(latency.Seconds())
	}
}

// ReplicaFailover implements proxy.ReplicaMetrics.
func (m *Metrics) ReplicaFailover(upstream string) {
	m.replicaFailovers.WithLabelValues(upstream).Inc()
}

// ReplicaHealth implements proxy.ReplicaMetrics.
func (m *Metrics) ReplicaHealth(upstream string, healthy bool) {
	v := 0.0
	if healthy {
		v = 1
	}
	m.replicaHealthy.WithLabelValues(upstream).Set(v)
	// A replica's counters show from the start, at 0, so that a rate over them is defined.
	m.replicaCalls.WithLabelValues(upstream)
	m.replicaErrors.WithLabelValues(upstream)
	m.replicaFailovers.WithLabelValues(upstream)
}

// SamplingOverridden implements proxy.SamplingMetrics.
func (m *Metrics) SamplingOverridden(api, param string) {
	m.samplingOverrides.WithLabelValues(api, param).Inc()
}

// SampledTruncated implements proxy.SamplingMetrics.
func (m *Metrics) SampledTruncated(api string) {
	m.samplingTruncated.WithLabelValues(api).Inc()
}

// Failed implements proxy.Metrics.
func (m *Metrics) Failed(api string, kind proxy.ErrorKind) {
	m.proxyErrors.WithLabelValues(api, string(kind)).Inc()
}

func (m *Metrics) sessionFinished(status trace.Status) {
	m.finished.WithLabelValues(string(status)).Inc()
}

func archiveKind(step bool) string {
	if step {
		return "step"
	}
	return "dropped_group"
}

// StepArchived counts a step or dropped group archived (ArchiveMetrics).
func (m *Metrics) StepArchived(step bool, took time.Duration) {
	m.archived.WithLabelValues(archiveKind(step)).Inc()
	m.archiveTime.Observe(took.Seconds())
}

// ArchiveFailed counts a failed attempt to archive (ArchiveMetrics).
func (m *Metrics) ArchiveFailed(step bool) {
	m.archiveFailures.WithLabelValues(archiveKind(step)).Inc()
}

func (m *Metrics) groupTimedOut()           { m.timedOut.Inc() }
func (m *Metrics) groupDropped(kind string) { m.dropped.WithLabelValues(kind).Inc() }
func (m *Metrics) staleCalls(n int)         { m.stale.Add(float64(n)) }

func (m *Metrics) stepFormed(st *batcher.Step, took time.Duration, recovered bool) {
	m.stepsFormed.WithLabelValues(strconv.FormatBool(recovered)).Inc()
	m.stepFormation.Observe(took.Seconds())
	m.fill.Set(st.Stats.Fill)
	m.imbalance.Set(st.Stats.Imbalance)
	m.rowsForwarded.Add(float64(st.Stats.Rows))
	m.perRequestTokens.Add(float64(st.Stats.InputTokens))
	m.tokensSaved.Add(float64(st.Stats.InputTokens - st.Stats.Rows))
	m.lossTokens.Add(float64(st.Stats.LossRows))
}

func (m *Metrics) served(rows, bytes int) {
	m.flightBatches.Inc()
	m.flightRows.Add(float64(rows))
	m.flightBytes.Add(float64(bytes))
}

func (m *Metrics) report(rank int, wait, step float64, peak int64) {
	m.trainerWait.Observe(wait)
	m.trainerStep.Observe(step)
	m.trainerPeak.WithLabelValues(strconv.Itoa(rank)).Set(float64(peak))
}

func (m *Metrics) gpuStep(s gpu.Summary) {
	if m.gpuBusy != nil {
		m.gpuBusy.Set(s.BusyFraction)
		m.gpuPeak.Set(float64(s.PeakMemoryUsed))
	}
}

// promauto registers as it builds.
type promauto struct{ reg *prometheus.Registry }

func (p promauto) counter(name, help string) prometheus.Counter {
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	p.reg.MustRegister(c)
	return c
}

func (p promauto) counterVec(name, help string, labels ...string) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
	p.reg.MustRegister(c)
	return c
}

func (p promauto) gauge(name, help string) prometheus.Gauge {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
	p.reg.MustRegister(g)
	return g
}

var (
	descSessions = prometheus.NewDesc("floe_sessions", "Sessions in the store, by state (running, finished).", []string{"state"}, nil)
	descGroups   = prometheus.NewDesc("floe_groups", "Groups in the store, by state: open (sessions running or missing), complete (waiting for a step), in_step, dropped.", []string{"state"}, nil)
	descReady    = prometheus.NewDesc("floe_ready_steps", "Steps READY in the buffer, formed and not committed.", nil, nil)
	descGPUUtil  = prometheus.NewDesc("floe_gpu_utilization", "GPU utilization at the latest sample, 0..1, by device.", []string{"device"}, nil)
	descGPUMem   = prometheus.NewDesc("floe_gpu_memory_used_bytes", "Device memory used at the latest sample, by device.", []string{"device"}, nil)
	descGPUTotal = prometheus.NewDesc("floe_gpu_memory_total_bytes", "Device memory, by device.", []string{"device"}, nil)
)

// stateCollector reads the store, the READY buffer and the GPU at scrape time.
type stateCollector struct{ st State }

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descSessions, descGroups, descReady, descGPUUtil, descGPUMem, descGPUTotal} {
		ch <- d
	}
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	if c.st.Store != nil {
		if gs, err := c.st.Store.Groups(); err == nil {
			var running, finished int
			groups := map[string]int{"open": 0, "complete": 0, "in_step": 0, "dropped": 0}
			for _, g := range gs {
				running += g.Sessions - g.Finished
				finished += g.Finished
				switch {
				case g.Dropped:
					groups["dropped"]++
				case g.Step >= 0:
					groups["in_step"]++
				case g.Complete():
					groups["complete"]++
				default:
					groups["open"]++
				}
			}
			ch <- prometheus.MustNewConstMetric(descSessions, prometheus.GaugeValue, float64(running), "running")
			ch <- prometheus.MustNewConstMetric(descSessions, prometheus.GaugeValue, float64(finished), "finished")
			for state, n := range groups {
				ch <- prometheus.MustNewConstMetric(descGroups, prometheus.GaugeValue, float64(n), state)
			}
		}
	}
	if c.st.Ready != nil {
		ch <- prometheus.MustNewConstMetric(descReady, prometheus.GaugeValue, float64(c.st.Ready.Depth()))
	}
	if c.st.Monitor != nil {
		if s, ok := c.st.Monitor.Latest(); ok {
			for _, d := range s.Devices {
				dev := strconv.Itoa(d.Index)
				ch <- prometheus.MustNewConstMetric(descGPUUtil, prometheus.GaugeValue, float64(d.Util)/100, dev)
				ch <- prometheus.MustNewConstMetric(descGPUMem, prometheus.GaugeValue, float64(d.MemoryUsed), dev)
				ch <- prometheus.MustNewConstMetric(descGPUTotal, prometheus.GaugeValue, float64(d.MemoryTotal), dev)
			}
		}
	}
}

// memoryMetrics registers the in-memory store's retention (floe proxy's
// -max-stored-bytes), read from the store at each scrape so that nothing is counted
// twice.
func memoryMetrics(reg prometheus.Registerer, store *mem.Store) {
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "floe_proxy_stored_bytes",
			Help: "Bytes of the recorded calls kept in memory (counted under -max-stored-bytes)."},
			func() float64 { stored, _ := store.Retained(); return float64(stored) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "floe_proxy_dropped_calls_total",
			Help: "Recorded calls dropped from memory by -max-stored-bytes."},
			func() float64 { _, dropped := store.Retained(); return float64(dropped.Calls) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "floe_proxy_dropped_bytes_total",
			Help: "Bytes of the recorded calls dropped from memory by -max-stored-bytes."},
			func() float64 { _, dropped := store.Retained(); return float64(dropped.Bytes) }),
	)
}
