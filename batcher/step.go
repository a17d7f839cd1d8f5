package batcher

import (
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/floe-rl/floe/trace"
)

// Sample is one session of the step: a row of the step's sample table. A loss row's
// sample_idx points here.
type Sample struct {
	Index         int32
	SessionID     string
	GroupID       string
	TaskID        string
	Reward        float64
	Advantage     float32
	PolicyVersion int64 // oldest policy version among its trainable calls
	NumCalls      int32 // calls recorded, trainable or not
	NumLossTokens int64
	// NumTruncatedCalls counts the session's trainable calls sampled with top_p < 1,
	// top_k > 0 or greedily: their processed log-probs are not log_softmax(logits / T), so
	// the trainer cannot reproduce them (trace.Sampling.Reproducible).
	NumTruncatedCalls int32
}

// MicroBatch is one rank's forward/backward pass: Rows real rows padded to PaddedRows.
type MicroBatch struct {
	Rank, Index int
	Rows        int64
	PaddedRows  int64
	LossRows    int64
	Cost        float64
	bin         bin
}

// Stats describes a formed step. Rows count what the trainer forwards: ancestor rows
// repeated by cuts included, padding separate.
type Stats struct {
	Groups         int
	Sessions       int
	Calls          int
	TrainableCalls int
	// TruncatedCalls are trainable calls sampled with top_p < 1, top_k > 0 or greedily,
	// whose processed log-probs the trainer cannot reproduce (Sample.NumTruncatedCalls).
	TruncatedCalls int
	InputTokens    int64   // Σ over calls of prompt+response tokens
	DistinctRows   int64   // rows of the forests before any cut
	CutFloor       int64   // the fewest rows any cut of the forests to the budget can forward
	Rows           int64   // rows placed in micro-batches, cut repeats included
	PaddedRows     int64   // Rows plus padding
	LossRows       int64   // sampled tokens trained
	AttnCost       float64 // Σ(depth+1) over forwarded rows, padding included
	Trees          int
	Pieces         int
	MicroBatches   int
	Fill           float64 // Rows / (MicroBatches × TokenBudget)
	Imbalance      float64 // heaviest rank cost / mean rank cost
	// LockstepImbalance is Σ_k max_r cost(rank r's micro-batch k) / Σ_k mean_r of the
	// same: how much longer ranks that run micro-batch k together take than even ones.
	LockstepImbalance float64
}

// Step is a formed training step: every rank's micro-batches and the sample table. It
// keeps references to the recorded calls' token arrays and encodes a micro-batch only when
// asked, so a step in the READY buffer costs its plan, not its Arrow bytes.
type Step struct {
	Number           int64
	Strategy         Strategy
	Samples          []Sample
	Ranks            [][]MicroBatch
	Stats            Stats
	PolicyVersionMin int64
	PolicyVersionMax int64

	pieces      []piece
	advantages  []float32 // per step sample index
	padMultiple int
}

// ErrNothingToTrain is returned by Pack and FormStep for a step whose groups hold no
// trainable call: there is no loss to normalise, so no step is formed.
var ErrNothingToTrain = errors.New("nothing to train")

// Reconstructed is one group turned into sequences under a strategy, with its samples
// and their advantages. floe serve reconstructs each group once, when it completes, and
// packs a step from several.
type Reconstructed struct {
	Group    *trace.Group
	Strategy Strategy
	Samples  []Sample // Index is the session's position in the group until Pack renumbers

	forest *forest
	lay    *layout
	stats  Stats // the per-group part: counts, input tokens, distinct rows
	vmin   int64
	vmax   int64
}

// Reconstruct validates g and builds its forest under cfg's strategy, with the
// sessions' advantages computed under cfg's advantage (SessionAdvantages).
func Reconstruct(g *trace.Group, cfg Config) (*Reconstructed, error) {
	return reconstructGroup(g, cfg, nil)
}

// ReconstructWith is Reconstruct with the sessions' advantages given, one per session of
// g in order, instead of computed from their rewards: floe serve decides a group's
// advantages once, records them with its step, and forms the step again from the record.
// cfg.Advantage is not used.
func ReconstructWith(g *trace.Group, cfg Config, advantages []float64) (*Reconstructed, error) {
	if len(advantages) != len(g.Sessions) {
		return nil, fmt.Errorf("group %q: %d advantages for %d sessions", g.ID, len(advantages), len(g.Sessions))
	}
	return reconstructGroup(g, cfg, advantages)
}

// reconstructGroup is Reconstruct with advantages given, or computed when nil.
func reconstructGroup(g *trace.Group, cfg Config, advantages []float64) (*Reconstructed, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := g.Validate(); err != nil {
		return nil, err
	}
	if advantages == nil {
		var err error
		if advantages, err = SessionAdvantages(cfg.Advantage, g.Sessions); err != nil {
			return nil, fmt.Errorf("group %q: %w", g.ID, err)
		}
	}
	r := &Reconstructed{Group: g, Strategy: cfg.Strategy, vmin: math.MaxInt64, vmax: math.MinInt64}
	r.addSamples(advantages)
	r.forest = reconstruct(g, cfg.Strategy)
	for i := 1; i < len(r.forest.nodes); i++ {
		if nd := &r.forest.nodes[i]; nd.sample != none {
			r.Samples[nd.sample].NumLossTokens += int64(len(nd.tokens))
		}
	}
	r.lay = newLayout(r.forest)
	r.stats.Groups = 1
	r.stats.Sessions = len(g.Sessions)
	r.stats.DistinctRows = r.forest.rows()
	r.stats.Trees = len(r.lay.trees)
	return r, nil
}

// DistinctRows is the number of rows the group's forest holds before any cut.
func (r *Reconstructed) DistinctRows() int64 { return r.stats.DistinctRows }

// OldestTrainable is the oldest policy version among the group's trainable calls; ok is
// false when it has none.
func (r *Reconstructed) OldestTrainable() (version int64, ok bool) {
	return r.vmin, r.stats.TrainableCalls > 0
}

// LongestPath is the group's longest root-to-leaf path in rows and the session whose
// call made it: Pack fails on a token budget below it.
func (r *Reconstructed) LongestPath() (rows int64, session string) {
	for _, lf := range r.lay.leaves {
		if lf.length > rows {
			rows, session = lf.length, r.Samples[r.forest.nodes[lf.node].creator].SessionID
		}
	}
	return rows, session
}

// addSamples sets one sample per session of the group with its advantage, adv[i].
func (r *Reconstructed) addSamples(adv []float64) {
	g := r.Group
	for i := range g.Sessions {
		s := &g.Sessions[i]
		version := int64(math.MaxInt64)
		var truncated int32
		for ci := range s.Calls {
			c := &s.Calls[ci]
			r.stats.Calls++
			r.stats.InputTokens += int64(len(c.PromptIDs) + len(c.ResponseIDs))
			if !c.Trainable {
				continue
			}
			r.stats.TrainableCalls++
			if !c.Sampling.Reproducible() {
				r.stats.TruncatedCalls++
				truncated++
			}
			version = min(version, c.PolicyVersion)
			r.vmin, r.vmax = min(r.vmin, c.PolicyVersion), max(r.vmax, c.PolicyVersion)
		}
		if version == math.MaxInt64 {
			version = 0
		}
		r.Samples = append(r.Samples, Sample{
			Index: int32(i), SessionID: s.ID, GroupID: g.ID, TaskID: taskOf(g, s),
			Reward: s.Reward, Advantage: float32(adv[i]), PolicyVersion: version, NumCalls: int32(len(s.Calls)),
			NumTruncatedCalls: truncated,
		})
	}
}

// FormStep reconstructs, scores and packs the groups into step number n.
func FormStep(n int64, groups []trace.Group, cfg Config) (*Step, error) {
	recs := make([]*Reconstructed, len(groups))
	for i := range groups {
		r, err := Reconstruct(&groups[i], cfg)
		if err != nil {
			return nil, fmt.Errorf("step %d: %w", n, err)
		}
		recs[i] = r
	}
	return Pack(n, recs, cfg)
}

// Pack cuts the reconstructed groups' trees to the token budget, packs them into
// micro-batches and balances those over the ranks, forming step n. The groups must have
// been reconstructed with cfg's strategy.
func Pack(n int64, groups []*Reconstructed, cfg Config) (*Step, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("step %d: %w", n, err)
	}
	st := &Step{Number: n, Strategy: cfg.Strategy, padMultiple: cfg.PadMultiple}
	st.PolicyVersionMin, st.PolicyVersionMax = math.MaxInt64, math.MinInt64
	var units []unit
	for _, r := range groups {
		if r.Strategy != cfg.Strategy {
			return nil, fmt.Errorf("step %d: group %q was reconstructed with %s, the step packs %s", n, r.Group.ID, r.Strategy, cfg.Strategy)
		}
		base := int32(len(st.Samples))
		for _, s := range r.Samples {
			s.Index += base
			st.Samples = append(st.Samples, s)
			st.advantages = append(st.advantages, s.Advantage)
		}
		st.Stats.add(&r.stats)
		st.PolicyVersionMin, st.PolicyVersionMax = min(st.PolicyVersionMin, r.vmin), max(st.PolicyVersionMax, r.vmax)
		us, err := r.lay.units(int64(cfg.TokenBudget), base, func(s int32) string { return fmt.Sprintf("%q", r.Samples[s].SessionID) })
		if err != nil {
			return nil, fmt.Errorf("step %d, group %q: %w", n, r.Group.ID, err)
		}
		units = append(units, us...)
		st.Stats.CutFloor += r.lay.cutFloor(int64(cfg.TokenBudget))
	}
	if len(units) == 0 {
		return nil, fmt.Errorf("step %d: %w: its %d groups hold no trainable call", n, ErrNothingToTrain, len(groups))
	}
	pieces, bins, err := pack(units, int64(cfg.TokenBudget), cfg.DPSize, cfg.PassCost, weight{cfg.RowCost, cfg.AttnCost})
	if err != nil {
		return nil, fmt.Errorf("step %d: %w", n, err)
	}
	costs := make([]float64, len(bins))
	for i := range bins {
		costs[i] = cfg.cost(&bins[i])
	}
	st.pieces = pieces
	st.Ranks = make([][]MicroBatch, cfg.DPSize)
	rankCost := make([]float64, cfg.DPSize)
	for r, idx := range balance(costs, cfg.DPSize) {
		for i, b := range idx {
			bn := bins[b]
			mb := MicroBatch{Rank: r, Index: i, Rows: bn.rows, PaddedRows: paddedRows(bn.rows, cfg.PadMultiple),
				LossRows: bn.loss, Cost: costs[b], bin: bn}
			st.Ranks[r] = append(st.Ranks[r], mb)
			rankCost[r] += mb.Cost
			st.Stats.Rows += mb.Rows
			st.Stats.PaddedRows += mb.PaddedRows
			st.Stats.LossRows += mb.LossRows
			st.Stats.AttnCost += bn.attn + float64(mb.PaddedRows-mb.Rows)
		}
	}
	st.Stats.Pieces = len(pieces)
	st.Stats.MicroBatches = len(bins)
	st.Stats.Fill = float64(st.Stats.Rows) / float64(int64(len(bins))*int64(cfg.TokenBudget))
	var total float64
	for _, c := range rankCost {
		total += c
	}
	if total > 0 {
		st.Stats.Imbalance = slices.Max(rankCost) / (total / float64(len(rankCost)))
		var slowest float64
		for k := range st.Ranks[0] {
			var m float64
			for r := range st.Ranks {
				m = max(m, st.Ranks[r][k].Cost)
			}
			slowest += m
		}
		st.Stats.LockstepImbalance = slowest / (total / float64(len(rankCost)))
	}
	var loss int64
	for i := range st.Samples {
		loss += st.Samples[i].NumLossTokens
	}
	if loss != st.Stats.LossRows {
		return nil, fmt.Errorf("internal error: step %d places %d loss rows for %d sampled tokens", n, st.Stats.LossRows, loss)
	}
	return st, nil
}

// add accumulates the per-group counts of o.
func (s *Stats) add(o *Stats) {
	s.Groups += o.Groups
	s.Sessions += o.Sessions
	s.Calls += o.Calls
	s.TrainableCalls += o.TrainableCalls
	s.TruncatedCalls += o.TruncatedCalls
	s.InputTokens += o.InputTokens
	s.DistinctRows += o.DistinctRows
	s.CutFloor += o.CutFloor
	s.Trees += o.Trees
}

func taskOf(g *trace.Group, s *trace.Session) string {
	if s.TaskID != "" {
		return s.TaskID
	}
	return g.TaskID
}
