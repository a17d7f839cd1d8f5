package batcher_test

import (
	"runtime"
	"sync"
	"testing"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/internal/corpus"
	"github.com/floe-rl/floe/trace"
)

var benchCorpus = sync.OnceValues(func() ([]trace.Group, int64) {
	cfg := corpus.Default()
	cfg.Groups = 8
	groups, err := corpus.Generate(cfg, 1)
	if err != nil {
		panic(err)
	}
	var tokens int64
	for i := range groups {
		tokens += groups[i].InputTokens()
	}
	return groups, tokens
})

func benchConfig(s batcher.Strategy) batcher.Config {
	cfg := batcher.DefaultConfig()
	cfg.Strategy = s
	cfg.DPSize = 8
	return cfg
}

// Run with -cpu 1 (make bench does) for one core's throughput. Input tokens are
// Σ over calls of prompt+response: what a per-request trainer would forward.

func BenchmarkReconstruct(b *testing.B) {
	groups, tokens := benchCorpus()
	for _, s := range batcher.Strategies {
		b.Run(string(s), func(b *testing.B) {
			cfg := benchConfig(s)
			for b.Loop() {
				for i := range groups {
					if _, err := batcher.Reconstruct(&groups[i], cfg); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(tokens)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
		})
	}
}

// BenchmarkFullPath forms the step and encodes every micro-batch, releasing each record
// as a Flight server would after sending it. B/row is heap bytes allocated per output row.
func BenchmarkFullPath(b *testing.B) {
	groups, tokens := benchCorpus()
	for _, s := range batcher.Strategies {
		b.Run(string(s), func(b *testing.B) {
			cfg := benchConfig(s)
			mem := memory.NewGoAllocator()
			var rows int64
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			for b.Loop() {
				st, err := batcher.FormStep(1, groups, cfg)
				if err != nil {
					b.Fatal(err)
				}
				for r := range st.Ranks {
					for i := range st.Ranks[r] {
						rec, err := st.Record(mem, r, i)
						if err != nil {
							b.Fatal(err)
						}
						rec.Release()
					}
				}
				rows += st.Stats.PaddedRows
			}
			runtime.ReadMemStats(&after)
			b.ReportMetric(float64(tokens)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
			b.ReportMetric(float64(after.TotalAlloc-before.TotalAlloc)/float64(rows), "B/row")
		})
	}
}
