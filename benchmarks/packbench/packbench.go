// Package packbench measures the batcher on a synthetic corpus: rows and attention cost
// per strategy against per_request, packing quality, and reconstruct/pack/encode
// throughput on one core. `floe-bench` prints its table; `make bench-report` commits it.
package packbench

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/trace"
)

// Options says what to measure.
type Options struct {
	Batcher       batcher.Config // strategy ignored: every strategy is run
	GroupsPerStep int            // groups per step; 0 puts the whole corpus in one step
	Repeats       int            // timed passes per phase; the fastest counts
	Progress      io.Writer      // progress lines, nil for none
}

// Result is one strategy's figures.
type Result struct {
	Strategy batcher.Strategy
	Stats    batcher.Stats // summed over steps; Fill and Imbalance are step means

	ReconstructSeconds float64 // fastest pass
	FullSeconds        float64 // reconstruct + pack + encode, fastest pass
	AllocBytes         uint64  // heap bytes allocated by one full pass
}

// Report is the whole comparison.
type Report struct {
	Options     Options
	InputTokens int64
	LowerBound  int64 // distinct rows of the group tries before any cut
	CutFloor    int64 // the fewest rows any cut of those tries to the budget can forward
	Results     []Result
}

// Run measures every strategy on groups. It sets GOMAXPROCS to 1 for its duration so the
// throughput figures are one core's.
func Run(ctx context.Context, groups []trace.Group, opt Options) (*Report, error) {
	if opt.Repeats < 1 {
		opt.Repeats = 1
	}
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	rep := &Report{Options: opt}
	for i := range groups {
		rep.InputTokens += groups[i].InputTokens()
	}
	steps := split(groups, opt.GroupsPerStep)
	for _, s := range batcher.Strategies {
		cfg := opt.Batcher
		cfg.Strategy = s
		res := Result{Strategy: s}
		for rep := 0; rep < opt.Repeats; rep++ {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			progress(opt.Progress, "%-14s pass %d/%d", s, rep+1, opt.Repeats)
			sec, err := timeReconstruct(groups, cfg)
			if err != nil {
				return nil, err
			}
			if rep == 0 || sec < res.ReconstructSeconds {
				res.ReconstructSeconds = sec
			}
			stats, sec, alloc, err := timeFull(ctx, steps, cfg)
			if err != nil {
				return nil, err
			}
			if rep == 0 || sec < res.FullSeconds {
				res.FullSeconds = sec
			}
			res.Stats, res.AllocBytes = stats, alloc
		}
		if s == batcher.Tree {
			rep.LowerBound = res.Stats.DistinctRows
			rep.CutFloor = res.Stats.CutFloor
		}
		rep.Results = append(rep.Results, res)
	}
	return rep, nil
}

func split(groups []trace.Group, per int) [][]trace.Group {
	if per <= 0 || per > len(groups) {
		per = len(groups)
	}
	var out [][]trace.Group
	for i := 0; i < len(groups); i += per {
		out = append(out, groups[i:min(i+per, len(groups))])
	}
	return out
}

func progress(w io.Writer, format string, args ...any) {
	if w != nil {
		_, _ = fmt.Fprintf(w, format+"\n", args...) // progress lines: a closed stderr must not stop a run
	}
}

func timeReconstruct(groups []trace.Group, cfg batcher.Config) (float64, error) {
	runtime.GC()
	start := time.Now()
	for i := range groups {
		if _, err := batcher.Reconstruct(&groups[i], cfg); err != nil {
			return 0, err
		}
	}
	return time.Since(start).Seconds(), nil
}

// timeFull forms every step and encodes every micro-batch, releasing each record at
// once as a Flight server would after sending it.
func timeFull(ctx context.Context, steps [][]trace.Group, cfg batcher.Config) (batcher.Stats, float64, uint64, error) {
	var total batcher.Stats
	mem := memory.NewGoAllocator()
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	start := time.Now()
	for n, groups := range steps {
		if err := ctx.Err(); err != nil {
			return total, 0, 0, err
		}
		st, err := batcher.FormStep(int64(n), groups, cfg)
		if err != nil {
			return total, 0, 0, err
		}
		for r := range st.Ranks {
			for i := range st.Ranks[r] {
				rec, err := st.Record(mem, r, i)
				if err != nil {
					return total, 0, 0, err
				}
				rec.Release()
			}
		}
		accumulate(&total, &st.Stats, len(steps))
	}
	sec := time.Since(start).Seconds()
	runtime.ReadMemStats(&after)
	return total, sec, after.TotalAlloc - before.TotalAlloc, nil
}

func accumulate(t, s *batcher.Stats, steps int) {
	t.Groups += s.Groups
	t.Sessions += s.Sessions
	t.Calls += s.Calls
	t.TrainableCalls += s.TrainableCalls
	t.InputTokens += s.InputTokens
	t.DistinctRows += s.DistinctRows
	t.CutFloor += s.CutFloor
	t.Rows += s.Rows
	t.PaddedRows += s.PaddedRows
	t.LossRows += s.LossRows
	t.AttnCost += s.AttnCost
	t.Trees += s.Trees
	t.Pieces += s.Pieces
	t.MicroBatches += s.MicroBatches
	t.Fill += s.Fill / float64(steps)
	t.Imbalance = max(t.Imbalance, s.Imbalance)
}

// Table renders the report as a Markdown table with one row per strategy.
func (r *Report) Table() string {
	var b strings.Builder
	base := r.Results[0].Stats
	fmt.Fprintf(&b, "input tokens %s · lower bound (distinct rows of the group tries) %s · cut floor (fewest rows any cut to B can forward) %s (%.3f x bound) · B = %d · dp = %d · groups/step %d\n\n",
		human(r.InputTokens), human(r.LowerBound), human(r.CutFloor), float64(r.CutFloor)/float64(r.LowerBound),
		r.Options.Batcher.TokenBudget, r.Options.Batcher.DPSize, r.groupsPerStep())
	b.WriteString("| strategy | rows forwarded | vs per_request | / lower bound | / cut floor | attention Σ(depth+1) | vs per_request | micro-batches | fill | imbalance | reconstruct tok/s | full path tok/s | alloc B/row |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, res := range r.Results {
		s := res.Stats
		fmt.Fprintf(&b, "| %s | %s | %.2fx | %.3f | %.3f | %s | %.1fx | %d | %.1f%% | %.3f | %s | %s | %.1f |\n",
			res.Strategy, human(s.PaddedRows), float64(base.PaddedRows)/float64(s.PaddedRows),
			float64(s.PaddedRows)/float64(r.LowerBound), float64(s.PaddedRows)/float64(r.CutFloor),
			human(int64(s.AttnCost)), base.AttnCost/s.AttnCost,
			s.MicroBatches, 100*s.Fill, s.Imbalance,
			human(int64(float64(r.InputTokens)/res.ReconstructSeconds)), human(int64(float64(r.InputTokens)/res.FullSeconds)),
			float64(res.AllocBytes)/float64(s.PaddedRows))
	}
	return b.String()
}

func (r *Report) groupsPerStep() int {
	if n := r.Options.GroupsPerStep; n > 0 {
		return n
	}
	return r.Results[0].Stats.Groups
}

// Find returns the result of strategy s.
func (r *Report) Find(s batcher.Strategy) (Result, bool) {
	i := slices.IndexFunc(r.Results, func(x Result) bool { return x.Strategy == s })
	if i < 0 {
		return Result{}, false
	}
	return r.Results[i], true
}

// human prints n with a k/M/G suffix and three significant digits.
func human(n int64) string {
	f := float64(n)
	for _, u := range []struct {
		div float64
		sfx string
	}{{1e12, "T"}, {1e9, "G"}, {1e6, "M"}, {1e3, "k"}} {
		if f >= u.div {
			return fmt.Sprintf("%.3g%s", f/u.div, u.sfx)
		}
	}
	return fmt.Sprintf("%d", n)
}
