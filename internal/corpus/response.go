package corpus

import "math/rand/v2"

const (
	finishStop  = "stop"
	finishTool  = "tool_calls"
	finishLimit = "length"
)

// minResponseTokens is the shortest response that still fits every part of the layout
// below: a think block, a tool call and the closing <|im_end|>.
const minResponseTokens = 14

// response is one sampled completion and where its parts lie. Layout (Qwen3):
//
//	[<think> \n reasoning \n </think> \n\n] content [<tool_call> \n args \n </tool_call>] [<|im_end|>]
//
// A response cut by max_tokens ("length") has no tool call and no <|im_end|>.
type response struct {
	ids    []int32
	lps    []float32
	finish string

	think      bool
	thinkEnd   int // index after the think block; 0 without one
	lead       int // start of the first free-text run: reasoning, or content without think
	leadLen    int
	contentLen int // free text after the think block; content starts at thinkEnd
}

func (r *response) endsWithImEnd() bool {
	return len(r.ids) > 0 && r.ids[len(r.ids)-1] == tokImEnd
}

// content is the answer text, what a sub-agent hands back to its caller.
func (r *response) content() []int32 {
	return r.ids[r.thinkEnd : r.thinkEnd+r.contentLen]
}

// sampler draws responses for one group.
type sampler struct {
	cfg *Config
	rng *rand.Rand
	voc vocab
}

// response samples a completion. wantTool asks for a tool call (else a text answer);
// think forces a reasoning block, otherwise it appears with ThinkProb.
func (s *sampler) response(wantTool, think bool) *response {
	rng := s.rng
	n, cut := s.cfg.ResponseTokens.sample(rng)
	if !think {
		think = rng.Float64() < s.cfg.ThinkProb
	}
	r := &response{think: think, ids: make([]int32, 0, n), lps: make([]float32, 0, n)}

	avail := n
	minContent := 1
	args := 0
	switch {
	case cut:
		r.finish = finishLimit
	case wantTool:
		r.finish = finishTool
		minContent = 0
		avail--
		thinkMin := 0
		if think {
			thinkMin = 6
		}
		frac := 0.2 + 0.3*rng.Float64()
		args = max(1, min(int(frac*float64(avail)), avail-4-thinkMin))
		avail -= 4 + args
	default:
		r.finish = finishStop
		avail--
	}

	if think {
		room := avail - 5 - minContent
		reasoning := max(1, min(room, int(float64(room)*(0.3+0.5*rng.Float64()))))
		r.ids = append(r.ids, tokThink, tokNewline)
		r.lead, r.leadLen = len(r.ids), reasoning
		r.ids = s.voc.appendText(r.ids, reasoning)
		r.ids = append(r.ids, tokNewline, tokThinkEnd, tokDoubleNewline)
		r.thinkEnd = len(r.ids)
		avail -= 5 + reasoning
	}
	r.contentLen = avail
	if !think {
		r.lead, r.leadLen = 0, avail
	}
	r.ids = s.voc.appendText(r.ids, avail)
	if args > 0 {
		r.ids = append(r.ids, tokToolCall, tokNewline)
		r.ids = s.voc.appendText(r.ids, args)
		r.ids = append(r.ids, tokNewline, tokToolCallEnd)
	}
	if !cut {
		r.ids = append(r.ids, tokImEnd)
	}
	for range r.ids {
		r.lps = append(r.lps, logprob(rng))
	}
	return r
}

// sibling samples another completion of the same request (a retry or another choice).
// With SharedLeadProb it starts with the same sampled tokens as first, as two samples
// from one context do until they diverge.
func (s *sampler) sibling(first *response, wantTool bool) *response {
	r := s.response(wantTool, first.think)
	if r.think != first.think || s.rng.Float64() >= s.cfg.SharedLeadProb {
		return r
	}
	m := min(s.cfg.SharedLeadTokens.sample(s.rng), first.leadLen, r.leadLen)
	copy(r.ids[r.lead:r.lead+m], first.ids[first.lead:first.lead+m])
	copy(r.lps[r.lead:r.lead+m], first.lps[first.lead:first.lead+m])
	return r
}

// drifted returns the response as a harness re-tokenizes it for the next prompt: one or
// two content tokens become two other ids (a different split of the same text).
func (s *sampler) drifted(r *response) []int32 {
	var p int
	for {
		p = s.rng.IntN(len(r.ids))
		if !isTemplate(r.ids[p]) {
			break
		}
	}
	k := 1
	if p+1 < len(r.ids) && !isTemplate(r.ids[p+1]) && s.rng.IntN(2) == 0 {
		k = 2
	}
	a := s.voc.token()
	for a == r.ids[p] {
		a = s.voc.token()
	}
	out := make([]int32, 0, len(r.ids)+1)
	out = append(out, r.ids[:p]...)
	out = append(out, a, s.voc.token())
	return append(out, r.ids[p+k:]...)
}

// stripped returns the response without its reasoning block, as harnesses and Qwen3's
// template render earlier assistant turns.
func stripped(r *response) []int32 {
	return r.ids[r.thinkEnd:]
}
