package main

// floe-bench trl: floe's half of the comparison with TRL's tree packing
// (benchmarks/trl_bench.py, make bench-trl). It generates a corpus, writes its trainable
// calls for TRL's planner (tokens as little-endian int32, an index as JSON), and packs the
// same calls with floe under every setting, timing reconstruction, packing and encoding
// on one core. It uses only batcher's public API, so the same file builds against an
// earlier commit for the before/after table (the pass cost is set only where Config has it).

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/internal/cli"
	"github.com/floe-rl/floe/internal/corpus"
	"github.com/floe-rl/floe/trace"
)

const trlUsage = `usage: floe-bench trl [flags]

Writes a corpus's trainable calls for benchmarks/trl_bench.py and packs them with floe
under every token budget, data-parallel size and pass cost given.

`

type trlCall struct {
	Group     int     `json:"group"`
	Offset    int64   `json:"offset"` // into the token file, in tokens
	Prompt    int     `json:"prompt"`
	Response  int     `json:"response"`
	Advantage float32 `json:"advantage"`
}

type trlFloeResult struct {
	Budget            int     `json:"budget"`
	DP                int     `json:"dp"`
	PassCost          float64 `json:"pass_cost"`
	Error             string  `json:"error,omitempty"`
	Rows              int64   `json:"rows"`
	PaddedRows        int64   `json:"padded_rows"`
	MicroBatches      int     `json:"micro_batches"`
	PassesPerRank     int     `json:"passes_per_rank"`
	Fill              float64 `json:"fill"`
	Imbalance         float64 `json:"imbalance"`
	LockstepImbalance float64 `json:"lockstep_imbalance"`
	DepthSum          float64 `json:"depth_sum"` // Σ(depth+1) over forwarded rows, padding excluded
	LossTerms         int64   `json:"loss_terms"`
	Seconds           float64 `json:"seconds"` // reconstruct + pack + encode every micro-batch, fastest of the repeats
}

func runTRL(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := cli.NewFlagSet("floe-bench trl", trlUsage, stderr)
	name := fs.String("corpus", "cpu", "corpus config: small, cpu, medium, default or longtool")
	groups := fs.Int("groups", 0, "GRPO groups (0: the config's)")
	seed := fs.Int64("seed", 1, "corpus seed")
	budgets := fs.String("budgets", "16384,65536", "token budgets B, comma-separated")
	dps := fs.String("dp", "1,8", "data-parallel sizes, comma-separated")
	costs := fs.String("pass-costs", "0,1/64,1/32,1/16,1/8", "pass costs c: rows, or a fraction a/b of B")
	calls := fs.String("calls", "", "write the trainable calls to PREFIX.tokens and PREFIX.json")
	out := fs.String("out", "", "write floe's results (JSON) here")
	repeats := fs.Int("repeats", 1, "timed passes per setting; the fastest counts")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	runtime.GOMAXPROCS(1)
	cc, err := corpus.Preset(*name, *groups)
	if err != nil {
		return err
	}
	data, err := corpus.Generate(cc, *seed)
	if err != nil {
		return err
	}
	if *calls != "" {
		if err := writeTRLCalls(*calls, data); err != nil {
			return err
		}
	}
	var results []trlFloeResult
	for _, bs := range strings.Split(*budgets, ",") {
		b, err := strconv.Atoi(bs)
		if err != nil {
			return fmt.Errorf("budget %q: %w", bs, err)
		}
		for _, ds := range strings.Split(*dps, ",") {
			dp, err := strconv.Atoi(ds)
			if err != nil {
				return fmt.Errorf("dp %q: %w", ds, err)
			}
			for _, cs := range strings.Split(*costs, ",") {
				c, err := parseCost(cs, b)
				if err != nil {
					return err
				}
				if ctx.Err() != nil {
					return ctx.Err()
				}
				res := packTRLSetting(data, b, dp, c, *repeats)
				// A progress line: a closed stderr must not stop a run.
				_, _ = fmt.Fprintf(stderr, "floe %s B=%d dp=%d c=%g: %d rows, %d passes/rank, lockstep %.3f, %.3fs %s\n",
					*name, b, dp, c, res.Rows, res.PassesPerRank, res.LockstepImbalance, res.Seconds, res.Error)
				results = append(results, res)
			}
		}
	}
	enc, err := json.MarshalIndent(results, "", " ")
	if err != nil {
		return err
	}
	if *out != "" {
		return os.WriteFile(*out, enc, 0o644)
	}
	_, err = stdout.Write(enc)
	return err
}

func parseCost(s string, budget int) (float64, error) {
	if a, b, ok := strings.Cut(s, "/"); ok {
		x, err1 := strconv.ParseFloat(a, 64)
		y, err2 := strconv.ParseFloat(b, 64)
		if err1 != nil || err2 != nil || y == 0 {
			return 0, fmt.Errorf("pass cost %q: want rows or a/b", s)
		}
		return x / y * float64(budget), nil
	}
	x, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return 0, fmt.Errorf("pass cost %q: %w", s, err)
	}
	return x, nil
}

// setPassCost sets Config.PassCost where this build's batcher has it.
func setPassCost(cfg *batcher.Config, c float64) bool {
	f := reflect.ValueOf(cfg).Elem().FieldByName("PassCost")
	if !f.IsValid() {
		return false
	}
	f.SetFloat(c)
	return true
}

func packTRLSetting(data []trace.Group, budget, dp int, c float64, repeats int) trlFloeResult {
	res := trlFloeResult{Budget: budget, DP: dp, PassCost: c}
	cfg := batcher.DefaultConfig()
	cfg.TokenBudget, cfg.DPSize = budget, dp
	if !setPassCost(&cfg, c) && c != 0 {
		res.Error = "this build has no pass cost"
		return res
	}
	var st *batcher.Step
	best := -1.0
	for range max(repeats, 1) {
		runtime.GC()
		start := time.Now()
		s, err := batcher.FormStep(1, data, cfg)
		if err != nil {
			res.Error = err.Error()
			return res
		}
		for r := range s.Ranks {
			for i := range s.Ranks[r] {
				rec, err := s.Record(memory.DefaultAllocator, r, i)
				if err != nil {
					res.Error = err.Error()
					return res
				}
				rec.Release()
			}
		}
		if d := time.Since(start).Seconds(); best < 0 || d < best {
			best = d
		}
		st = s
	}
	res.Seconds = best
	res.Rows, res.PaddedRows = st.Stats.Rows, st.Stats.PaddedRows
	res.MicroBatches, res.PassesPerRank = st.Stats.MicroBatches, len(st.Ranks[0])
	res.Fill = st.Stats.Fill
	res.DepthSum = st.Stats.AttnCost - float64(st.Stats.PaddedRows-st.Stats.Rows)
	res.LossTerms = st.Stats.LossRows
	rankCost := make([]float64, dp)
	var slowest, total float64
	for k := range st.Ranks[0] {
		var m float64
		for r := range st.Ranks {
			m = max(m, st.Ranks[r][k].Cost)
			rankCost[r] += st.Ranks[r][k].Cost
			total += st.Ranks[r][k].Cost
		}
		slowest += m
	}
	if total > 0 {
		res.Imbalance = slices.Max(rankCost) / (total / float64(dp))
		res.LockstepImbalance = slowest / (total / float64(dp))
	}
	return res
}

// writeTRLCalls writes every trainable call as TRL's planner takes it: prompt then
// response tokens, the response trained, under the session's advantage, in group,
// session, call order (as a rollout buffer fed group by group yields them).
func writeTRLCalls(prefix string, data []trace.Group) error {
	f, err := os.Create(prefix + ".tokens")
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }() // on an error return; the Close that counts is below
	var index []trlCall
	var offset int64
	var buf []byte
	for gi := range data {
		g := &data[gi]
		rewards := make([]float64, len(g.Sessions))
		for i, s := range g.Sessions {
			rewards[i] = s.Reward
		}
		advs := batcher.Advantages(batcher.GRPO, rewards)
		for si, s := range g.Sessions {
			for _, c := range s.Calls {
				if !c.Trainable {
					continue
				}
				buf = buf[:0]
				for _, t := range c.PromptIDs {
					buf = binary.LittleEndian.AppendUint32(buf, uint32(t))
				}
				for _, t := range c.ResponseIDs {
					buf = binary.LittleEndian.AppendUint32(buf, uint32(t))
				}
				if _, err := f.Write(buf); err != nil {
					return err
				}
				index = append(index, trlCall{Group: gi, Offset: offset, Prompt: len(c.PromptIDs), Response: len(c.ResponseIDs), Advantage: float32(advs[si])})
				offset += int64(len(c.PromptIDs) + len(c.ResponseIDs))
			}
		}
	}
	if err := f.Close(); err != nil {
		return err
	}
	enc, err := json.Marshal(index)
	if err != nil {
		return err
	}
	return os.WriteFile(prefix+".json", enc, 0o644)
}
