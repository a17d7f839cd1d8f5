package batcher

import (
	"flag"
	"fmt"
)

// Names of the flags RegisterFlags defines. Every command that takes one of these settings
// takes it under this name, so a setting reads the same in every command's help and in
// floe serve's YAML config (whose keys are the flag names).
const (
	FlagStrategy    = "strategy"
	FlagAdvantage   = "advantage"
	FlagTokenBudget = "token-budget"
	FlagPadMultiple = "pad-multiple"
	FlagDPSize      = "dp-size"
	FlagPassCost    = "pass-cost"
)

// FlagNames lists every flag RegisterFlags knows, in the order it defines them.
var FlagNames = []string{FlagStrategy, FlagAdvantage, FlagTokenBudget, FlagPadMultiple, FlagDPSize, FlagPassCost}

// RegisterFlags defines the named flags (every one of FlagNames when none is named) on fs,
// bound to c's fields, with c's current values as their defaults: a command sets its own
// defaults on c first. A strategy or advantage is checked as the flag is parsed, so a bad
// name fails naming the flag. Naming an unknown flag is a programming error and panics,
// as defining a flag twice does.
func (c *Config) RegisterFlags(fs *flag.FlagSet, names ...string) {
	if len(names) == 0 {
		names = FlagNames
	}
	for _, name := range names {
		switch name {
		case FlagStrategy:
			fs.Var((*strategyValue)(&c.Strategy), name, "per_request, prefix_merging or tree")
		case FlagAdvantage:
			fs.Var((*advantageValue)(&c.Advantage), name, "grpo, dr_grpo or rloo")
		case FlagTokenBudget:
			fs.IntVar(&c.TokenBudget, name, c.TokenBudget, "rows per micro-batch, padding included")
		case FlagPadMultiple:
			fs.IntVar(&c.PadMultiple, name, c.PadMultiple, "pad each micro-batch to a multiple of this many rows")
		case FlagDPSize:
			fs.IntVar(&c.DPSize, name, c.DPSize, "data-parallel ranks")
		case FlagPassCost:
			fs.Float64Var(&c.PassCost, name, c.PassCost, "fixed cost of one micro-batch pass in rows: the packer minimises rows + pass-cost × micro-batches, splitting a tree that fits when that saves a pass (0: never)")
		default:
			panic(fmt.Sprintf("batcher.RegisterFlags: no flag %q (want one of %v)", name, FlagNames))
		}
	}
}

// strategyValue is a Strategy as a flag.Value.
type strategyValue Strategy

func (v *strategyValue) String() string { return string(*v) }

func (v *strategyValue) Set(s string) error {
	st, err := ParseStrategy(s)
	if err != nil {
		return err
	}
	*v = strategyValue(st)
	return nil
}

// advantageValue is an Advantage as a flag.Value.
type advantageValue Advantage

func (v *advantageValue) String() string { return string(*v) }

func (v *advantageValue) Set(s string) error {
	a, err := ParseAdvantage(s)
	if err != nil {
		return err
	}
	*v = advantageValue(a)
	return nil
}
