package proxybench

import (
	"fmt"
	"strings"
)

// Targets of issue 15: at 64 KiB, every dialect adds at most 1 ms at p50 and 5 ms at
// p99; at every size, it costs at most twice the chat path's CPU per request.
const (
	TargetP50      = 1.0 // ms
	TargetP99      = 5.0 // ms
	TargetCPURatio = 2.0
)

func (r *Report) latency(proxy string, d Dialect, size int, stream bool) *Latency {
	for i := range r.Latencies {
		l := &r.Latencies[i]
		if l.Proxy == proxy && l.Dialect == d && l.Size == size && l.Stream == stream {
			return l
		}
	}
	return nil
}

func (r *Report) throughput(proxy string, d Dialect, size int) *Throughput {
	for i := range r.Throughputs {
		t := &r.Throughputs[i]
		if t.Proxy == proxy && t.Dialect == d && t.Size == size {
			return t
		}
	}
	return nil
}

// CPURatio is d's CPU per request over the chat path's, for proxy at size (0: unknown).
func (r *Report) CPURatio(proxy string, d Dialect, size int) float64 {
	t, chat := r.throughput(proxy, d, size), r.throughput(proxy, Chat, size)
	if t == nil || chat == nil || chat.CPUPerCall <= 0 || t.Err != "" {
		return 0
	}
	return t.CPUPerCall / chat.CPUPerCall
}

// Met says whether floe's dialect d at size meets the targets that apply there.
func (r *Report) Met(d Dialect, size int) bool {
	if ratio := r.CPURatio("floe", d, size); ratio == 0 || ratio > TargetCPURatio {
		return false
	}
	if size != 64<<10 {
		return true
	}
	for _, stream := range []bool{false, true} {
		l := r.latency("floe", d, size, stream)
		if l == nil || l.Err != "" || l.ProxyP50-l.DirectP50 > TargetP50 || l.ProxyP99-l.DirectP99 > TargetP99 {
			return false
		}
	}
	return true
}

func (r *Report) proxies() []string {
	var ps []string
	if r.Options.BeforeName != "" {
		ps = append(ps, r.Options.BeforeName)
	}
	ps = append(ps, "floe")
	if r.LiteLLM != "" {
		ps = append(ps, "LiteLLM")
	}
	return ps
}

// SideBySide compares the earlier build (Options.BeforeName) with this one, measured in
// the same run: added latency and CPU per request, and this build's over the earlier
// one's. Empty when no earlier build was measured.
func (r *Report) SideBySide() string {
	before := r.Options.BeforeName
	if before == "" {
		return ""
	}
	var b strings.Builder
	fmt.Fprintf(&b, "| dialect | request | mode | added p50 ms, %s / now | now / %s | added p99 ms, %s / now | CPU ms per request, %s / now |\n|---|---:|---|---:|---:|---:|---:|\n",
		before, before, before, before)
	for _, d := range r.Options.Dialects {
		for _, size := range r.Options.Sizes {
			for _, stream := range []bool{false, true} {
				was, now := r.latency(before, d, size, stream), r.latency("floe", d, size, stream)
				if was == nil || now == nil || was.Err != "" || now.Err != "" {
					continue
				}
				mode := "non-streaming"
				cpu := ""
				if stream {
					mode = "streaming"
					if tw, tn := r.throughput(before, d, size), r.throughput("floe", d, size); tw != nil && tn != nil {
						cpu = fmt.Sprintf("%.3f / %.3f", tw.CPUPerCall, tn.CPUPerCall)
					}
				}
				wasAdded, nowAdded := was.ProxyP50-was.DirectP50, now.ProxyP50-now.DirectP50
				ratio := ""
				if wasAdded > 0 {
					ratio = fmt.Sprintf("%.2f", nowAdded/wasAdded)
				}
				fmt.Fprintf(&b, "| %s | %d KiB | %s | %.3f / %.3f | %s | %.3f / %.3f | %s |\n", d.Label(), size>>10, mode,
					wasAdded, nowAdded, ratio, was.ProxyP99-was.DirectP99, now.ProxyP99-now.DirectP99, cpu)
			}
		}
	}
	return b.String()
}

// Summary is the cost per dialect: one row per proxy, dialect and size.
func (r *Report) Summary() string {
	var b strings.Builder
	b.WriteString("| proxy | dialect | request | added p50 ms, non-streaming / streaming | added p99 ms, non-streaming / streaming | req/s, " +
		fmt.Sprint(r.Options.Concurrency) + " streaming clients, 1 core | CPU ms per request | CPU vs chat | targets |\n|---|---|---:|---:|---:|---:|---:|---:|---|\n")
	for _, p := range r.proxies() {
		for _, d := range r.Options.Dialects {
			for _, size := range r.Options.Sizes {
				ns, st, t := r.latency(p, d, size, false), r.latency(p, d, size, true), r.throughput(p, d, size)
				if ns == nil || st == nil || t == nil {
					continue
				}
				name := p
				if p == "LiteLLM" {
					name += " " + r.LiteLLM
				}
				if ns.Err != "" && st.Err != "" {
					// The whole answer is in the table of every latency below.
					short, _, _ := strings.Cut(ns.Err, ":")
					fmt.Fprintf(&b, "| %s | %s | %d KiB | cannot serve it (%s) | | | | | |\n", name, d.Label(), size>>10, cell(short))
					continue
				}
				added := func(l *Latency, p99 bool) string {
					if l.Err != "" {
						return "fails"
					}
					if p99 {
						return fmt.Sprintf("%.2f", l.ProxyP99-l.DirectP99)
					}
					return fmt.Sprintf("%.2f", l.ProxyP50-l.DirectP50)
				}
				ratio, met := "", ""
				if x := r.CPURatio(p, d, size); x > 0 {
					ratio = fmt.Sprintf("%.2fx", x)
				}
				if p == "floe" {
					met = "met"
					if !r.Met(d, size) {
						met = "**missed**"
					}
				}
				fmt.Fprintf(&b, "| %s | %s | %d KiB | %s / %s | %s / %s | %.0f | %.3f | %s | %s |\n", name, d.Label(), size>>10,
					added(ns, false), added(st, false), added(ns, true), added(st, true), t.PerSecond, t.CPUPerCall, ratio, met)
			}
		}
	}
	return b.String()
}

func cell(s string) string {
	s = strings.NewReplacer("|", "/", "\n", " ").Replace(s)
	if len(s) > 120 {
		s = s[:120] + "…"
	}
	return s
}

// Table renders the report: the summary, every latency measured, and the memory phases.
func (r *Report) Table() string {
	var b strings.Builder
	fmt.Fprintf(&b, "Requests: an agent's multi-turn history with tool calls and tool results, in each dialect; streamed answers of %d chunks; %d requests each way per row (LiteLLM: %d); throughput phases of %s.\n\n",
		r.Options.StreamChunks, r.Options.Requests, r.Options.LiteLLMRequests, r.Options.Duration)
	fmt.Fprintf(&b, "Targets (floe): at 64 KiB added p50 ≤ %.0f ms and p99 ≤ %.0f ms, both modes; CPU per request ≤ %.0fx the chat path's at every size.\n\n", TargetP50, TargetP99, TargetCPURatio)
	if sbs := r.SideBySide(); sbs != "" {
		fmt.Fprintf(&b, "%s (an earlier build of floe's proxy) and this one (floe), in one run: each sample goes direct, through %s and through floe, the two in turn first; CPU per request from the throughput phases (streaming, 1 core):\n\n",
			r.Options.BeforeName, r.Options.BeforeName)
		b.WriteString(sbs)
		b.WriteString("\n")
	}
	b.WriteString(r.Summary())
	b.WriteString("\nEvery latency, in ms (direct: the same request straight to the fake upstream; alternately, in one run):\n\n")
	b.WriteString("| proxy | dialect | request | mode | direct p50 | via proxy p50 | added p50 | direct p99 | via proxy p99 | added p99 |\n|---|---|---:|---|---:|---:|---:|---:|---:|---:|\n")
	for _, l := range r.Latencies {
		mode := "non-streaming"
		if l.Stream {
			mode = "streaming"
		}
		if l.Err != "" {
			fmt.Fprintf(&b, "| %s | %s | %d KiB | %s | fails: %s | | | | | |\n", l.Proxy, l.Dialect.Label(), l.Size>>10, mode, cell(l.Err))
			continue
		}
		fmt.Fprintf(&b, "| %s | %s | %d KiB | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", l.Proxy, l.Dialect.Label(), l.Size>>10, mode,
			l.DirectP50, l.ProxyP50, l.ProxyP50-l.DirectP50, l.DirectP99, l.ProxyP99, l.ProxyP99-l.DirectP99)
	}
	b.WriteString("\nThroughput phases:\n\n| proxy | dialect | request | requests | errors | req/s | CPU ms per request |\n|---|---|---:|---:|---:|---:|---:|\n")
	for _, t := range r.Throughputs {
		if t.Err != "" {
			fmt.Fprintf(&b, "| %s | %s | %d KiB | %s | | | |\n", t.Proxy, t.Dialect.Label(), t.Size>>10, t.Err)
			continue
		}
		fmt.Fprintf(&b, "| %s | %s | %d KiB | %d | %d | %.0f | %.3f |\n", t.Proxy, t.Dialect.Label(), t.Size>>10, t.Requests, t.Errors, t.PerSecond, t.CPUPerCall)
	}
	if len(r.Memory) > 0 {
		fmt.Fprintf(&b, "\nMemory of floe's proxy recording every call in memory (as floe proxy does), %d streaming clients sending 64 KiB chat requests for %s; RSS in MiB each second:\n\n",
			r.Options.Concurrency, r.Options.Memory)
		b.WriteString("| stored calls | requests | peak RSS MiB | RSS over time |\n|---|---:|---:|---|\n")
		for _, m := range r.Memory {
			limit := "unbounded (before)"
			if m.MaxStoredBytes > 0 {
				limit = fmt.Sprintf("-max-stored-bytes %d MiB", m.MaxStoredBytes>>20)
			}
			var series []string
			for _, s := range m.Samples {
				series = append(series, fmt.Sprint(s.RSS>>20))
			}
			fmt.Fprintf(&b, "| %s | %d | %d | %s |\n", limit, m.Requests, m.Peak>>20, strings.Join(series, " "))
		}
	}
	return b.String()
}
