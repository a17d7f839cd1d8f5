package capacity

import (
	"bytes"
	"fmt"
	"image/color"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// Table is the per-point capacity tables, in Markdown: throughput and memory, latency,
// steps and Flight.
func (r *Report) Table() string {
	var b strings.Builder
	b.WriteString("| R sessions | T ranks | calls/s recorded | calls made (recorded) | errors | floe CPU cores | floe CPU µs/call | via floe p50 / p99 ms, saturated | RSS idle → loaded MiB | KiB/open session |\n")
	b.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, p := range r.Points {
		fmt.Fprintf(&b, "| %d | %d | %.0f | %d (%d) | %d | %.2f | %.0f | %.1f / %.1f | %.0f → %.0f | %.1f |\n",
			p.Sessions, p.Ranks, p.CallsPerSec, p.Calls, p.Recorded, p.Errors, p.FloeCPU/p.LoadSeconds, 1e6*p.CPUPerCall(),
			p.SaturatedP50, p.SaturatedP99, float64(p.IdleRSS)/(1<<20), float64(p.OpenRSS)/(1<<20), p.BytesPerSession()/1024)
	}
	b.WriteString("\nWhat the data dir keeps, after the drain: floe archives each committed step to Parquet and removes it from the store.\n\n")
	b.WriteString("| R sessions | T ranks | calls recorded | steps committed / archived | calls in committed steps / archived | calls left in the store | store file KiB (in use) | archive MiB | archive KiB/call |\n")
	b.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, p := range r.Points {
		fmt.Fprintf(&b, "| %d | %d | %d | %d / %d | %d / %d | %d | %.0f (%.0f) | %.1f | %.2f |\n",
			p.Sessions, p.Ranks, p.RecordedAll, p.StepsCommitted, p.ArchivedSteps, p.CommittedCalls, p.ArchivedCalls, p.StoreCalls,
			float64(p.StoreFileBytes)/1024, float64(p.StoreBytes)/1024, float64(p.ArchiveBytes)/(1<<20), p.ArchiveBytesPerCall()/1024)
	}
	fmt.Fprintf(&b, "\nLatency probe: the open sessions, paced to %.0f%% of the rate each point sustained, send each call straight to the fake and then through floe.\n\n", 100*r.ProbeLoad)
	b.WriteString("| R sessions | T ranks | probe calls/s via floe | probe calls | errors | direct p50 / p99 ms | via floe p50 / p99 ms | added p50 ms | added p99 ms | recorded after the probe |\n")
	b.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, p := range r.Points {
		fmt.Fprintf(&b, "| %d | %d | %.0f | %d | %d | %.2f / %.2f | %.2f / %.2f | %.2f | %.2f | %d |\n",
			p.Sessions, p.Ranks, p.ProbeCallsPerS, p.ProbeCalls, p.ProbeErrors, p.DirectP50, p.DirectP99, p.ProxyP50, p.ProxyP99,
			p.AddedP50, p.AddedP99, p.RecordedAll)
	}
	b.WriteString("\n| R sessions | T ranks | steps formed / committed | form ms/step (floe's metric) | rows/step | Flight MB fetched | fetch ms/step | Flight GB/s |\n")
	b.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, p := range r.Points {
		fmt.Fprintf(&b, "| %d | %d | %d / %d | %.1f | %.0f | %.1f | %.1f | %.3f |\n",
			p.Sessions, p.Ranks, p.StepsFormed, p.StepsCommitted, 1e3*p.FormSecondsMean, p.RowsPerStep,
			float64(p.FlightBytes())/1e6, 1e3*p.FlightSeconds()/float64(max(len(p.Fetched), 1)), p.FlightGBps())
	}
	return b.String()
}

// FormTable is the in-process step-forming cost against the step's size.
func (r *Report) FormTable() string {
	var b strings.Builder
	b.WriteString("| groups | calls | input tokens | rows forwarded | micro-batches | reconstruct ms | pack ms | encode ms | total ms | µs per 1k rows |\n")
	b.WriteString("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, f := range r.Forming {
		fmt.Fprintf(&b, "| %d | %d | %d | %d | %d | %.1f | %.1f | %.1f | %.1f | %.0f |\n",
			f.Groups, f.Calls, f.InputTokens, f.Rows, f.MicroBatches, 1e3*f.ReconstructS, 1e3*f.PackS, 1e3*f.EncodeS,
			1e3*f.TotalS(), 1e6*f.TotalS()/float64(max(f.Rows, 1))*1000)
	}
	return b.String()
}

// MarginalBytesPerSession is the slope of floe's open RSS over R, by least squares over
// the points: what one more open session costs, without the fixed cost of warming up.
func (r *Report) MarginalBytesPerSession() float64 {
	var xs, ys []float64
	for _, p := range r.Points {
		xs, ys = append(xs, float64(p.OpenSessions)), append(ys, float64(p.OpenRSS))
	}
	return slope(xs, ys)
}

func slope(xs, ys []float64) float64 {
	n := float64(len(xs))
	if n < 2 {
		return 0
	}
	var sx, sy, sxx, sxy float64
	for i := range xs {
		sx, sy, sxx, sxy = sx+xs[i], sy+ys[i], sxx+xs[i]*xs[i], sxy+xs[i]*ys[i]
	}
	d := n*sxx - sx*sx
	if d == 0 {
		return 0
	}
	return (n*sxy - sx*sy) / d
}

// Plots are the report's figures, by file name.
var Plots = []struct {
	File  string
	Build func(*Report) (*plot.Plot, error)
}{
	{"calls_per_sec.png", callsPlot},
	{"floe_cpu_per_call.png", cpuPlot},
	{"added_latency.png", latencyPlot},
	{"memory_per_session.png", memoryPlot},
	{"flight_gbps.png", flightPlot},
	{"step_forming.png", formingPlot},
}

// plotted is the file names of the plots r has data for: the forming plot needs forming
// costs (-form-groups empty measures none, and an empty log axis cannot be drawn).
func (r *Report) plotted() []string {
	var files []string
	for _, pl := range Plots {
		if pl.File == "step_forming.png" && len(r.Forming) == 0 {
			continue
		}
		files = append(files, pl.File)
	}
	return files
}

// WritePlots writes every figure r has data for as PNG into dir.
func (r *Report) WritePlots(dir string) error {
	for _, pl := range Plots {
		if !slices.Contains(r.plotted(), pl.File) {
			continue
		}
		p, err := pl.Build(r)
		if err != nil {
			return fmt.Errorf("%s: %w", pl.File, err)
		}
		// Headroom above the data, so the legend in the top right corner covers none of it.
		p.Y.Max *= 1.4
		// One x value (a one-point run): gonum widens the range by ±1, which a log axis at
		// x = 1 cannot draw; widen it by a factor instead.
		if _, isLog := p.X.Scale.(plot.LogScale); isLog && p.X.Min == p.X.Max && p.X.Min > 0 {
			p.X.Min, p.X.Max = p.X.Min/2, p.X.Max*2
		}
		c := vgimg.NewWith(vgimg.UseWH(8*vg.Inch, 4*vg.Inch), vgimg.UseDPI(150))
		p.Draw(draw.New(c))
		var buf bytes.Buffer
		if _, err := (vgimg.PngCanvas{Canvas: c}).WriteTo(&buf); err != nil {
			return fmt.Errorf("%s: %w", pl.File, err)
		}
		if err := os.WriteFile(filepath.Join(dir, pl.File), buf.Bytes(), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func newPlot(title, x, y string, logX bool) *plot.Plot {
	p := plot.New()
	p.Title.Text, p.X.Label.Text, p.Y.Label.Text = title, x, y
	p.Add(plotter.NewGrid())
	p.Legend.Top = true
	if logX {
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	}
	p.Y.Min = 0
	return p
}

func (r *Report) values(f func(Point) int) []int {
	var vs []int
	for _, p := range r.Points {
		if !slices.Contains(vs, f(p)) {
			vs = append(vs, f(p))
		}
	}
	slices.Sort(vs)
	return vs
}

// series draws one line per value of the grouping key, over x.
func (r *Report) series(p *plot.Plot, key func(Point) int, label string, x, y func(Point) float64) error {
	for i, k := range r.values(key) {
		var xys plotter.XYs
		for _, pt := range r.Points {
			if key(pt) == k {
				xys = append(xys, plotter.XY{X: x(pt), Y: y(pt)})
			}
		}
		if err := addLine(p, i, fmt.Sprintf("%s = %d", label, k), xys); err != nil {
			return err
		}
	}
	return nil
}

func addLine(p *plot.Plot, i int, name string, xys plotter.XYs) error {
	if len(xys) == 0 {
		return nil
	}
	slices.SortFunc(xys, func(a, b plotter.XY) int {
		switch {
		case a.X < b.X:
			return -1
		case a.X > b.X:
			return 1
		}
		return 0
	})
	l, pts, err := plotter.NewLinePoints(xys)
	if err != nil {
		return err
	}
	l.Color, pts.Color = plotutil.Color(i), plotutil.Color(i)
	l.Dashes, pts.Shape = plotutil.Dashes(i), plotutil.Shape(i)
	l.Width = vg.Points(1.5)
	p.Add(l, pts)
	p.Legend.Add(name, l, pts)
	return nil
}

func byRanks(p Point) int    { return p.Ranks }
func bySessions(p Point) int { return p.Sessions }
func sessionsX(p Point) float64 {
	return float64(p.Sessions)
}

func callsPlot(r *Report) (*plot.Plot, error) {
	p := newPlot("Durable calls recorded per second by one floe serve", "concurrent streaming sessions R", "calls recorded / s", true)
	return p, r.series(p, byRanks, "T", sessionsX, func(pt Point) float64 { return pt.CallsPerSec })
}

func cpuPlot(r *Report) (*plot.Plot, error) {
	p := newPlot("floe serve's CPU per durable call recorded (all of floe: proxy, store, steps, Flight)", "concurrent streaming sessions R", "CPU µs per call", true)
	return p, r.series(p, byRanks, "T", sessionsX, func(pt Point) float64 { return 1e6 * pt.CPUPerCall() })
}

func latencyPlot(r *Report) (*plot.Plot, error) {
	p := newPlot("Latency floe adds to a streaming call (paired: via floe − direct), median over T", "concurrent streaming sessions R", "added latency (ms)", true)
	// T does not change the proxy path: the median over the T points of each R is the
	// steadiest reading on a shared machine.
	var p50, p99 plotter.XYs
	for _, rr := range r.values(bySessions) {
		var a, b []float64
		for _, pt := range r.Points {
			if pt.Sessions == rr {
				a, b = append(a, pt.AddedP50), append(b, pt.AddedP99)
			}
		}
		p50 = append(p50, plotter.XY{X: float64(rr), Y: median(a)})
		p99 = append(p99, plotter.XY{X: float64(rr), Y: median(b)})
	}
	if err := addLine(p, 0, "added p50", p50); err != nil {
		return nil, err
	}
	return p, addLine(p, 1, "added p99", p99)
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func memoryPlot(r *Report) (*plot.Plot, error) {
	p := newPlot("floe serve's memory per open session ((RSS open − RSS idle) / R)", "concurrent streaming sessions R", "KiB per open session", true)
	return p, r.series(p, byRanks, "T", sessionsX, func(pt Point) float64 { return pt.BytesPerSession() / 1024 })
}

func flightPlot(r *Report) (*plot.Plot, error) {
	p := newPlot("Flight delivery to T trainer-rank processes (bytes fetched / fetch time)", "trainer ranks T", "aggregate GB/s", true)
	return p, r.series(p, bySessions, "R", func(pt Point) float64 { return float64(pt.Ranks) }, func(pt Point) float64 { return pt.FlightGBps() })
}

func formingPlot(r *Report) (*plot.Plot, error) {
	p := newPlot("Cost of forming one step against its size (one core)", "rows forwarded per step", "ms per step", true)
	var rec, pack, enc, total plotter.XYs
	for _, f := range r.Forming {
		x := float64(f.Rows)
		rec = append(rec, plotter.XY{X: x, Y: 1e3 * f.ReconstructS})
		pack = append(pack, plotter.XY{X: x, Y: 1e3 * f.PackS})
		enc = append(enc, plotter.XY{X: x, Y: 1e3 * f.EncodeS})
		total = append(total, plotter.XY{X: x, Y: 1e3 * f.TotalS()})
	}
	for i, s := range []struct {
		name string
		xys  plotter.XYs
	}{{"total", total}, {"reconstruct", rec}, {"pack", pack}, {"encode (all micro-batches)", enc}} {
		if err := addLine(p, i, s.name, s.xys); err != nil {
			return nil, err
		}
	}
	// floe's own step_formation_seconds (pack and save) per point, as a cross-check.
	var served plotter.XYs
	for _, pt := range r.Points {
		if pt.RowsPerStep > 0 {
			served = append(served, plotter.XY{X: pt.RowsPerStep, Y: 1e3 * pt.FormSecondsMean})
		}
	}
	if len(served) > 0 {
		s, err := plotter.NewScatter(served)
		if err != nil {
			return nil, err
		}
		s.Color = color.Black
		s.Shape = plotutil.Shape(5)
		p.Add(s)
		p.Legend.Add("floe serve: floe_step_formation_seconds (under load)", s)
	}
	return p, nil
}

// Markdown is REPORT.md: the command, the machine, the tables and the plots.
func (r *Report) Markdown() string {
	var b strings.Builder
	w := r.Workload
	b.WriteString("# Capacity of one floe serve\n\n")
	fmt.Fprintf(&b, "Command (`make bench-capacity` runs it and regenerates this folder):\n\n```\n%s\n```\n\n", r.Command)
	fmt.Fprintf(&b, "Machine: %s. Whole sweep: %.0f s wall.\n\n", r.Machine, r.WallSeconds)
	b.WriteString("**Noise.** floe, the fake vLLM, the R agents and the T rank processes all share the machine's cores " +
		"(above; a load average near or above the core count means other jobs shared them too): floe's own CPU " +
		"(from /proc) is the steadier figure, the rates and latencies are lower bounds for a machine floe has to itself.\n\n")
	b.WriteString("## What runs\n\n")
	fmt.Fprintf(&b, "- **floe serve**: the real binary as a child process (so its RSS and CPU are its own), default durable store "+
		"(bbolt, every call fsynced before its answer) and its default archiving (`-archive`: each committed step's calls, "+
		"sessions and record written as Parquet under `<data-dir>/archive/`, then removed from the store, which is compacted "+
		"when that pays; docs/archive.md), `-groups-per-step %d -token-budget %d -dp-size T -max-inflight max(2R, 1024)`, "+
		"a fresh data dir per point.\n", r.GroupsPer, r.TokenBudget)
	fmt.Fprintf(&b, "- **Upstream**: floe's zero-latency fake vLLM (internal/fakevllm: token ids are the messages' bytes), streaming "+
		"%d tokens per answer, one per chunk, in the benchmark process.\n", w.AnswerTokens)
	fmt.Fprintf(&b, "- **R agent sessions** in groups of %d (created with the control API, one API key each): %d turns each, every turn a "+
		"streaming OpenAI Chat call carrying the whole history (a %d-byte system prompt shared by all, a %d-byte task shared by the "+
		"group, then per turn the answer and a %d-byte tool result), finished with rewards that differ within the group. A group "+
		"whose sessions are done starts again under a new group id. No think time: this measures saturation.\n",
		w.GroupSize, w.Turns, w.SystemBytes, w.TaskBytes, w.ToolBytes)
	b.WriteString("- **T trainer ranks**: separate processes (`floe-bench capacity-rank`, arrow-go's Flight client) that fetch their " +
		"rank's micro-batches of every step, decoding them into Arrow records; the driver commits the step once all T have it.\n")
	fmt.Fprintf(&b, "- **Per point**: start floe and read its idle RSS; %s of load through floe (longer, up to %s, until the agents made %.1f calls per session), closed loop, the ranks taking steps as "+
		"they form; at its end the agents stop, their sessions still open, and floe's RSS and CPU are read; then %s of latency probe "+
		"on those open sessions (below); then the sessions finish and the ranks fetch and commit every step their groups form "+
		"(the drain), and floe archives each step once committed. The point fails unless, after the drain, every committed step is "+
		"archived, the archive holds exactly the calls the agents got answered in those steps' groups, and the store none of them.\n\n", r.LoadFor, r.LoadMax, r.MinCallsPerSession, r.ProbeFor)
	b.WriteString("## Results\n\n")
	b.WriteString(r.Table())
	b.WriteString("\n- **calls/s recorded**: calls answered (whole stream, 200) in the load phase over its wall time; every one is in floe's " +
		"store, fsynced before its last event was sent (`floe_calls_recorded_total` is the number in brackets).\n" +
		"- **calls in committed steps / archived**: the calls the agents got answered through floe (load and probe) in the groups " +
		"the committed steps' sample tables name (read over Flight before each commit), against the status' `store.archived_calls`; **calls left in the store**: `store.calls`, " +
		"the groups no step took yet (fewer complete groups than a step takes). The point fails unless the first two are equal " +
		"and the third is the rest of the calls recorded.\n" +
		"- **store file KiB (in use)**: the bbolt file `<data-dir>/floe.db` after the drain (in brackets, its pages in use to the " +
		"high-water mark): what the store holds at once (steps in flight, complete groups, open sessions), which does not grow " +
		"with the run's length.\n" +
		"- **archive KiB/call**: every file under `<data-dir>/archive/` (calls, sessions and step rows, zstd Parquet) over the " +
		"calls archived: what the data dir grows by per call. The archive keeps each call's prompt in full, where the store kept " +
		"it by reference to the session's earlier calls.\n" +
		"- **floe CPU**: floe serve's user+system CPU over the load phase (/proc/<pid>/stat), as cores busy and per call recorded. It includes archiving the steps committed during the load (Parquet encoding, " +
		"zstd, fsyncs) and compacting the store when that pays.\n" +
		"- **saturated p50/p99**: each load call timed at the agent. Closed loop with no think time, so this is R / rate: " +
		"queueing on the shared cores, not floe's cost.\n" +
		"- **added p50/p99**: in the probe each open session sends its next call straight to the fake and at once the same call " +
		"through floe, one pair every think time (random start, ±50%), the think time set so that floe gets the probe's share " +
		"of the rate the point sustained; the percentiles of each pair's difference (via floe − direct). On a shared machine the " +
		"p99 is mostly the scheduler's.\n" +
		"- **KiB/open session**: (VmRSS at the end of the load, the R sessions open − VmRSS idle) / R. Each session had a call in " +
		"flight until just before, so it holds that call's buffers at Go's heap high-water mark too, and at small R floe's " +
		"warm-up (steps READY, the store's mapped pages) dominates; the marginal figure below is the slope over R.\n" +
		"- **form ms/step**: floe's `floe_step_formation_seconds` mean (packing and saving the step record; reconstruction is done " +
		"earlier, per group), with floe's `floe_rows_forwarded_total` per step.\n" +
		"- **Flight GB/s**: bytes of the Flight messages the T ranks received over the time from asking them for a step to the last " +
		"one's end, summed over the steps.\n\n")
	fmt.Fprintf(&b, "Marginal memory per open session (least-squares slope of open RSS over the sessions open, all points): **%.1f KiB**.\n\n",
		r.MarginalBytesPerSession()/1024)
	if len(r.Forming) > 0 {
		b.WriteString("## Forming a step against its size\n\n")
		fmt.Fprintf(&b, "In-process, one goroutine, the same workload's groups (every session at its last turn), token budget %d, "+
			"balanced over %d ranks; the fastest of 3. Reconstruct is `batcher.Reconstruct` per group (floe does it as each group "+
			"completes), pack is `batcher.Pack`, encode is every rank's micro-batches to Arrow (`sidecar.FlightStep` + `MicroBatch`, "+
			"which Flight does when the ranks fetch).\n\n", r.TokenBudget, r.FormDPSize)
		b.WriteString(r.FormTable())
		b.WriteString("\n")
	}
	b.WriteString("## Plots\n\n")
	for _, f := range r.plotted() {
		fmt.Fprintf(&b, "![%s](%s)\n\n", strings.TrimSuffix(f, ".png"), f)
	}
	b.WriteString("Raw figures: [results.json](results.json). docs/scale.md reads these numbers.\n")
	return b.String()
}
