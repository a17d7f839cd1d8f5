package replay

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/trace"
)

// Setting is one packing configuration: the token budget B and the data-parallel size.
type Setting struct {
	Budget int `json:"budget"`
	DP     int `json:"dp"`
}

// DefaultSettings are the grid: B = 16k, 64k, 128k at dp 1, 8 and 16.
var DefaultSettings = []Setting{{16384, 1}, {16384, 8}, {16384, 16}, {65536, 1}, {65536, 8}, {65536, 16},
	{131072, 1}, {131072, 8}, {131072, 16}}

// Headline is the setting the summary line and the docs quote.
var Headline = Setting{65536, 8}

// Cell is one strategy under one setting.
type Cell struct {
	Setting
	Strategy batcher.Strategy `json:"strategy"`
	// Skipped says why the strategy could not form the step: a path longer than B.
	Skipped      string  `json:"skipped,omitempty"`
	Rows         int64   `json:"rows"`        // rows placed, cut repeats included
	PaddedRows   int64   `json:"padded_rows"` // what the trainer forwards
	MicroBatches int     `json:"micro_batches"`
	Passes       int     `json:"passes"` // micro-batches per rank: lockstep forward/backward passes
	CutFloor     int64   `json:"cut_floor"`
	DistinctRows int64   `json:"distinct_rows"`
	Fill         float64 `json:"fill"`
	// Imbalance is the heaviest rank's cost over the mean; LockstepImbalance Σ_k max_r
	// cost(rank r's micro-batch k) over Σ_k mean_r (batcher.Stats).
	Imbalance         float64 `json:"imbalance"`
	LockstepImbalance float64 `json:"lockstep_imbalance"`
	PackSeconds       float64 `json:"pack_seconds"` // cut, pack and balance; fastest of the repeats
	LossTerms         int64   `json:"loss_terms"`
	// LossTermsEqual: the Arrow micro-batches decode to exactly per_request's multiset.
	LossTermsEqual bool   `json:"loss_terms_equal"`
	LossTermsDiff  string `json:"loss_terms_diff,omitempty"`
}

// Measurement is every strategy under every setting on one recorded file.
type Measurement struct {
	Groups, Sessions, Calls, TrainableCalls int
	InputTokens                             int64 // Σ prompt + response over the trainable calls: per_request's rows
	LongestPath                             int   // the longest call, prompt + response
	PerRequestTerms                         int64
	ReconstructSeconds                      map[batcher.Strategy]float64
	Cells                                   []Cell
}

// Cell returns the cell of a strategy under a setting.
func (m *Measurement) Cell(s batcher.Strategy, set Setting) (Cell, bool) {
	for _, c := range m.Cells {
		if c.Strategy == s && c.Setting == set {
			return c, true
		}
	}
	return Cell{}, false
}

// LossTermsEqual reports whether every cell that formed a step trained per_request's terms.
func (m *Measurement) LossTermsEqual() bool {
	for _, c := range m.Cells {
		if c.Skipped == "" && !c.LossTermsEqual {
			return false
		}
	}
	return true
}

// Measure forms one step of all groups with every strategy under every setting (the
// default pass cost and padding), times the packing, and checks each step's loss terms,
// decoded from its Arrow micro-batches, against the recorded calls'.
func Measure(ctx context.Context, groups []trace.Group, settings []Setting, repeats int) (*Measurement, error) {
	repeats = max(repeats, 1)
	m := &Measurement{Groups: len(groups), ReconstructSeconds: map[batcher.Strategy]float64{}}
	for gi := range groups {
		m.Sessions += len(groups[gi].Sessions)
		for _, s := range groups[gi].Sessions {
			for _, c := range s.Calls {
				m.Calls++
				if c.Trainable {
					m.TrainableCalls++
					m.InputTokens += int64(len(c.PromptIDs) + len(c.ResponseIDs))
					m.LongestPath = max(m.LongestPath, len(c.PromptIDs)+len(c.ResponseIDs))
				}
			}
		}
	}
	want := PerRequestTerms(groups, batcher.DefaultConfig().Advantage)
	m.PerRequestTerms = want.Len()
	for _, s := range batcher.Strategies {
		cfg := batcher.DefaultConfig()
		cfg.Strategy = s
		recs := make([]*batcher.Reconstructed, len(groups))
		began := time.Now()
		for i := range groups {
			r, err := batcher.Reconstruct(&groups[i], cfg)
			if err != nil {
				return nil, fmt.Errorf("%s: reconstructing group %s: %w", s, groups[i].ID, err)
			}
			recs[i] = r
		}
		m.ReconstructSeconds[s] = time.Since(began).Seconds()
		for _, set := range settings {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			cell, err := measureCell(recs, want, cfg, set, repeats)
			if err != nil {
				return nil, fmt.Errorf("%s at B %d dp %d: %w", s, set.Budget, set.DP, err)
			}
			m.Cells = append(m.Cells, cell)
		}
	}
	return m, nil
}

func measureCell(recs []*batcher.Reconstructed, want Terms, cfg batcher.Config, set Setting, repeats int) (Cell, error) {
	cfg.TokenBudget, cfg.DPSize = set.Budget, set.DP
	c := Cell{Setting: set, Strategy: cfg.Strategy}
	var st *batcher.Step
	for i := 0; i < repeats; i++ {
		began := time.Now()
		s, err := batcher.Pack(0, recs, cfg)
		sec := time.Since(began).Seconds()
		if err != nil {
			if errors.Is(err, batcher.ErrNothingToTrain) {
				return c, err
			}
			if strings.Contains(err.Error(), "longer than the token budget") {
				c.Skipped = "a call is longer than B"
				return c, nil
			}
			return c, err
		}
		if i == 0 || sec < c.PackSeconds {
			c.PackSeconds = sec
		}
		st = s
	}
	ss := st.Stats
	c.Rows, c.PaddedRows, c.MicroBatches, c.Passes = ss.Rows, ss.PaddedRows, ss.MicroBatches, ss.MicroBatches/set.DP
	c.CutFloor, c.DistinctRows, c.Fill = ss.CutFloor, ss.DistinctRows, ss.Fill
	c.Imbalance, c.LockstepImbalance = ss.Imbalance, ss.LockstepImbalance
	got, err := StepTerms(st)
	if err != nil {
		return c, err
	}
	c.LossTerms = got.Len()
	missing, extra := got.Diff(want)
	c.LossTermsEqual = missing == 0 && extra == 0
	if !c.LossTermsEqual {
		c.LossTermsDiff = fmt.Sprintf("%d terms missing, %d extra of per_request's %d", missing, extra, want.Len())
	}
	return c, nil
}
