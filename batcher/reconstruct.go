package batcher

import (
	"bytes"

	"github.com/floe-rl/floe/trace"
)

// reconstruct builds the forest of one group under a strategy. A node's sample is its
// session's position in the group. Untrainable
// calls produce nothing: their token data cannot be trusted, and the calls after them
// carry the history in their own prompts.
func reconstruct(g *trace.Group, strategy Strategy) *forest {
	calls := 0
	for si := range g.Sessions {
		calls += len(g.Sessions[si].Calls)
	}
	f := newForest(3 * calls)
	for si := range g.Sessions {
		s := &g.Sessions[si]
		sample := int32(si)
		switch strategy {
		case PerRequest:
			for ci := range s.Calls {
				if c := &s.Calls[ci]; c.Trainable {
					root := f.addChild(0, c.PromptIDs, nil, 0, none, sample)
					f.addChild(root, c.ResponseIDs, c.Logprobs, temperature(c), sample, sample)
				}
			}
		case PrefixMerging:
			mergeChains(f, s, sample)
		default: // Tree
			for ci := range s.Calls {
				if c := &s.Calls[ci]; c.Trainable {
					end := f.insert(f.top(), c.PromptIDs, nil, 0, none, sample)
					f.insert(end, c.ResponseIDs, c.Logprobs, temperature(c), sample, sample)
				}
			}
		}
	}
	return f
}

// temperature is the temperature the trainer scores call c's sampled tokens at: the one it
// was sampled with, 1 when unknown or greedy (a greedy call's log-probs are flagged as not
// reproducible: trace.Sampling.Reproducible).
func temperature(c *trace.Call) float32 {
	t := c.Sampling.EffectiveTemperature()
	if t <= 1e-5 {
		return 1
	}
	return float32(t)
}

// chain is one sequence of prefix_merging: a path from root to tip holding length rows.
type chain struct {
	root, tip int32
	length    int
}

// mergeChains appends each call to the session's most recent chain that its prompt
// extends token for token, or starts a new chain. Several chains stay open, so a main
// conversation interrupted by a sub-agent, a retry or a second choice resumes its own
// chain instead of starting over; nothing is ever merged that the tokens don't prove equal.
func mergeChains(f *forest, s *trace.Session, sample int32) {
	var chains []chain
	for ci := range s.Calls {
		c := &s.Calls[ci]
		if !c.Trainable {
			continue
		}
		k := len(chains) - 1
		for ; k >= 0; k-- {
			if extends(f, chains[k], c.PromptIDs) {
				break
			}
		}
		if k < 0 {
			root := f.addChild(0, c.PromptIDs, nil, 0, none, sample)
			tip := f.addChild(root, c.ResponseIDs, c.Logprobs, temperature(c), sample, sample)
			chains = append(chains, chain{root: root, tip: tip, length: len(c.PromptIDs) + len(c.ResponseIDs)})
			continue
		}
		ch := chains[k]
		if rest := c.PromptIDs[ch.length:]; len(rest) > 0 {
			ch.tip = f.addChild(ch.tip, rest, nil, 0, none, sample)
		}
		ch.tip = f.addChild(ch.tip, c.ResponseIDs, c.Logprobs, temperature(c), sample, sample)
		ch.length = len(c.PromptIDs) + len(c.ResponseIDs)
		// The extended chain becomes the most recent one.
		copy(chains[k:], chains[k+1:])
		chains[len(chains)-1] = ch
	}
}

// extends reports whether prompt starts with every token of the chain.
func extends(f *forest, ch chain, prompt []int32) bool {
	if len(prompt) < ch.length {
		return false
	}
	pos := 0
	for n := ch.root; ; n = f.nodes[n].first {
		t := f.nodes[n].tokens
		if !bytes.Equal(int32Bytes(t), int32Bytes(prompt[pos:pos+len(t)])) {
			return false
		}
		pos += len(t)
		if n == ch.tip {
			return true
		}
	}
}
