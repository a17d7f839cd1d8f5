package packbench_test

import (
	"context"
	"strings"
	"testing"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/benchmarks/packbench"
	"github.com/floe-rl/floe/internal/corpus"
)

func TestRunMatchesFormStep(t *testing.T) {
	cc := corpus.Small()
	cc.Groups = 6
	groups, err := corpus.Generate(cc, 5)
	if err != nil {
		t.Fatal(err)
	}
	cfg := batcher.DefaultConfig()
	cfg.TokenBudget, cfg.PadMultiple, cfg.DPSize = 1024, 16, 2
	var progress strings.Builder
	rep, err := packbench.Run(context.Background(), groups, packbench.Options{Batcher: cfg, GroupsPerStep: 3, Repeats: 2, Progress: &progress})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Results) != len(batcher.Strategies) {
		t.Fatalf("%d results, want one per strategy", len(rep.Results))
	}
	for _, s := range batcher.Strategies {
		res, ok := rep.Find(s)
		if !ok {
			t.Fatalf("no result for %s", s)
		}
		// The report sums two steps of three groups: recompute them directly.
		var rows, padded int64
		for _, part := range [][]int{{0, 3}, {3, 6}} {
			c := cfg
			c.Strategy = s
			st, err := batcher.FormStep(0, groups[part[0]:part[1]], c)
			if err != nil {
				t.Fatal(err)
			}
			rows += st.Stats.Rows
			padded += st.Stats.PaddedRows
		}
		if res.Stats.Rows != rows || res.Stats.PaddedRows != padded {
			t.Errorf("%s: report has %d rows (%d padded), FormStep gives %d (%d)", s, res.Stats.Rows, res.Stats.PaddedRows, rows, padded)
		}
		if res.ReconstructSeconds <= 0 || res.FullSeconds <= 0 || res.AllocBytes == 0 {
			t.Errorf("%s: timings %v/%v s and %d bytes allocated", s, res.ReconstructSeconds, res.FullSeconds, res.AllocBytes)
		}
		if !strings.Contains(progress.String(), string(s)+" ") {
			t.Errorf("no progress line for %s in %q", s, progress.String())
		}
	}
	tree, _ := rep.Find(batcher.Tree)
	if rep.LowerBound != tree.Stats.DistinctRows || rep.CutFloor < rep.LowerBound {
		t.Errorf("lower bound %d, cut floor %d, tree distinct rows %d", rep.LowerBound, rep.CutFloor, tree.Stats.DistinctRows)
	}
	table := rep.Table()
	for _, s := range batcher.Strategies {
		if !strings.Contains(table, "| "+string(s)+" |") {
			t.Errorf("table lacks a row for %s:\n%s", s, table)
		}
	}
}

func TestRunStopsWhenCancelled(t *testing.T) {
	groups, err := corpus.Generate(corpus.Small(), 1)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := packbench.Run(ctx, groups, packbench.Options{Batcher: batcher.DefaultConfig()}); err == nil {
		t.Fatal("Run on a cancelled context returned no error")
	}
}
