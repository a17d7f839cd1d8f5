package batcher_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"testing"

	"github.com/apache/arrow-go/v18/arrow/ipc"
	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/trace"
)

// TestDumpAdversarialSteps writes the hand-built adversarial groups (and a deep chain) and
// the steps they form at dp 3 under a budget that forces cuts, for the trainer bridge's
// equivalence test (trainer-bridge/tests/test_equivalence.py, issue 13 item 6). It runs
// only with FLOE_DUMP_ADVERSARIAL=<dir>: groups.json (the groups, trace JSON), and per
// strategy <strategy>/meta.json and <strategy>/rank<r>.arrows (the rank's micro-batches as
// one Arrow IPC stream).
func TestDumpAdversarialSteps(t *testing.T) {
	dir := os.Getenv("FLOE_DUMP_ADVERSARIAL")
	if dir == "" {
		t.Skip("set FLOE_DUMP_ADVERSARIAL to a directory")
	}
	gs := adversarialGroups()
	names := make([]string, 0, len(gs))
	for n := range gs {
		names = append(names, n)
	}
	sort.Strings(names)
	var groups []trace.Group
	for _, n := range names {
		groups = append(groups, gs[n])
	}
	groups = append(groups, deepGroup(30))
	for gi := range groups {
		for si := range groups[gi].Sessions {
			groups[gi].Sessions[si].GroupID = groups[gi].ID
			groups[gi].Sessions[si].Status = trace.StatusCompleted
		}
	}
	b, err := json.Marshal(groups)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "groups.json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	longest := longestSequence(groups)
	for _, s := range []batcher.Strategy{batcher.Tree, batcher.PrefixMerging, batcher.PerRequest} {
		cfg := batcher.DefaultConfig()
		cfg.Strategy, cfg.Advantage, cfg.DPSize, cfg.PadMultiple = s, batcher.GRPO, 3, 8
		cfg.TokenBudget = roundUp(longest, 8) // the longest path alone: every group is cut
		st := formChecked(t, groups, cfg)
		sd := filepath.Join(dir, string(s))
		if err := os.MkdirAll(sd, 0o755); err != nil {
			t.Fatal(err)
		}
		meta := map[string]any{"loss_tokens_global": st.Stats.LossRows, "ranks": len(st.Ranks),
			"micro_batches": len(st.Ranks[0]), "token_budget": cfg.TokenBudget}
		mb, _ := json.Marshal(meta)
		if err := os.WriteFile(filepath.Join(sd, "meta.json"), mb, 0o644); err != nil {
			t.Fatal(err)
		}
		for r := range st.Ranks {
			f, err := os.Create(filepath.Join(sd, fmt.Sprintf("rank%d.arrows", r)))
			if err != nil {
				t.Fatal(err)
			}
			w := ipc.NewWriter(f, ipc.WithSchema(batcher.MicroBatchSchema()))
			for i := range st.Ranks[r] {
				rec, err := st.Record(memory.DefaultAllocator, r, i)
				if err != nil {
					t.Fatal(err)
				}
				if err := w.Write(rec); err != nil {
					t.Fatal(err)
				}
				rec.Release()
			}
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("%s: %d micro-batches per rank, budget %d, %d loss rows", s, len(st.Ranks[0]), cfg.TokenBudget, st.Stats.LossRows)
	}
}
