// Package batcher is floe's pure core: it turns the recorded calls of finished GRPO groups
// into a formed training step — token forests, advantages, micro-batches balanced over
// data-parallel ranks — and encodes each micro-batch as an Arrow record batch.
//
// Nothing here does I/O, reads a clock or starts a goroutine; the same input always gives
// the same step, byte for byte. The sidecar owns time, storage and the READY buffer.
package batcher

import (
	"fmt"
)

// Strategy is how calls are turned into sequences. Every strategy yields exactly the same
// loss terms; they differ only in how many rows the trainer forwards.
type Strategy string

const (
	// PerRequest forwards each call alone: prompt rows without loss, response rows with loss.
	PerRequest Strategy = "per_request"
	// PrefixMerging chains the calls of a session while each prompt extends an earlier call's
	// prompt+response token for token; any mismatch starts a new sequence.
	PrefixMerging Strategy = "prefix_merging"
	// Tree inserts every call of a group into one token trie, so every shared prefix (system
	// prompt, task, earlier turns) is forwarded once and drift becomes a branch.
	Tree Strategy = "tree"
)

// Strategies lists the strategies in the order reports show them.
var Strategies = []Strategy{PerRequest, PrefixMerging, Tree}

// ParseStrategy returns the Strategy named s, or an error listing the valid names.
func ParseStrategy(s string) (Strategy, error) {
	for _, v := range Strategies {
		if string(v) == s {
			return v, nil
		}
	}
	return "", fmt.Errorf("unknown strategy %q (want per_request, prefix_merging or tree)", s)
}

// Advantage is how a session's reward becomes its advantage within its group.
type Advantage string

const (
	// GRPO is (r - mean) / (std + eps), std the unbiased sample deviation of the group.
	GRPO Advantage = "grpo"
	// DrGRPO is r - mean (no division by std, as in Dr. GRPO).
	DrGRPO Advantage = "dr_grpo"
	// RLOO is r minus the mean of the other sessions' rewards.
	RLOO Advantage = "rloo"
)

// ParseAdvantage returns the Advantage named s, or an error listing the valid names.
func ParseAdvantage(s string) (Advantage, error) {
	switch a := Advantage(s); a {
	case GRPO, DrGRPO, RLOO:
		return a, nil
	}
	return "", fmt.Errorf("unknown advantage %q (want grpo, dr_grpo or rloo)", s)
}

// Config says how a step is formed.
type Config struct {
	Strategy  Strategy
	Advantage Advantage
	// TokenBudget is B: the most rows one micro-batch may hold, padding included. It must be
	// a multiple of PadMultiple.
	TokenBudget int
	// PadMultiple rounds every micro-batch's row count up to a multiple of itself.
	PadMultiple int
	// DPSize is the number of data-parallel ranks; every rank gets the same number of
	// micro-batches.
	DPSize int
	// RowCost and AttnCost weigh a micro-batch for rank balancing:
	// cost = RowCost*rows + AttnCost*Σ(depth+1). Per row, the linear layers cost about
	// 2·params FLOPs and attention about 4·hidden·layers per visible key; AttnCost is
	// their ratio. The default 1/16384 lies between a 0.5B and a 7B dense model.
	RowCost  float64
	AttnCost float64
	// PassCost is c, the fixed cost of one forward+backward pass (one micro-batch) in
	// row-equivalents: kernel launches, and under FSDP/ZeRO-3 the parameter all-gather
	// and gradient reduce-scatter that every pass pays whatever its rows. The packer
	// minimises rows + c × micro-batches, and splits a tree that fits the budget when
	// that saves a pass. 0 never splits a tree that fits. The default 1024: a pass's
	// ~10–30 ms fixed cost over the 7–100 µs a row of a dense 0.5B–7B model costs on one
	// H100 gives ~100–4000 rows; 1024 is their middle on a log scale (docs/batcher.md).
	PassCost float64
}

// DefaultConfig returns floe's defaults (docs/design.md, "Defaults"): tree strategy,
// GRPO advantages, B = 65536, rows padded to 128, one rank.
func DefaultConfig() Config {
	return Config{
		Strategy:    Tree,
		Advantage:   GRPO,
		TokenBudget: 65536,
		PadMultiple: 128,
		DPSize:      1,
		RowCost:     1,
		AttnCost:    1.0 / 16384,
		PassCost:    1024,
	}
}

// Validate reports the first setting that cannot work.
func (c Config) Validate() error {
	if _, err := ParseStrategy(string(c.Strategy)); err != nil {
		return err
	}
	if _, err := ParseAdvantage(string(c.Advantage)); err != nil {
		return err
	}
	if c.PadMultiple < 1 {
		return fmt.Errorf("pad multiple %d must be at least 1", c.PadMultiple)
	}
	if c.TokenBudget < c.PadMultiple || c.TokenBudget%c.PadMultiple != 0 {
		return fmt.Errorf("token budget %d must be a positive multiple of the pad multiple %d",
			c.TokenBudget, c.PadMultiple)
	}
	if c.DPSize < 1 {
		return fmt.Errorf("data-parallel size %d must be at least 1", c.DPSize)
	}
	if c.RowCost < 0 || c.AttnCost < 0 || c.RowCost+c.AttnCost == 0 {
		return fmt.Errorf("rank cost weights (rows %v, attention %v) must be non-negative and not both zero",
			c.RowCost, c.AttnCost)
	}
	if c.PassCost < 0 || c.PassCost != c.PassCost {
		return fmt.Errorf("pass cost %v must be a non-negative number of rows", c.PassCost)
	}
	return nil
}
