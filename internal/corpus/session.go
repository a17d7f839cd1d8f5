package corpus

import (
	"fmt"

	"github.com/floe-rl/floe/trace"
)

// groupPrompts are the token blocks every session of a group starts from.
type groupPrompts struct {
	system   []int32 // rendered system turn: system prompt + tool definitions
	task     []int32 // rendered user turn with the task
	subAgent []int32 // rendered system turn of the sub-agent
}

// historyEvent is what happens to a response on its way into the next prompt.
type historyEvent int

const (
	plain historyEvent = iota
	drift
	strip
	subAgent
)

// sessionGen plays one harness run. ctx is the scratch history: the current prompt,
// ending with the assistant header; every call gets its own copy of it.
type sessionGen struct {
	*sampler
	g       *groupPrompts
	ev      *events
	id      string
	version int64
	calls   []trace.Call
	next    int // Index of the next request

	ctx, spare, sub []int32
}

func (s *sessionGen) run(requests int, timedOut bool) error {
	s.ctx = append(append(append(s.ctx[:0], s.g.system...), s.g.task...), tokImStart, tokAssistant, tokNewline)
	for s.next < requests {
		retry, multi := false, false
		switch u := s.rng.Float64(); {
		case u < s.cfg.RetryProb:
			retry = requests-s.next >= 2
		case u < s.cfg.RetryProb+s.cfg.MultiChoiceProb:
			multi = true
		}
		used := 1
		if retry {
			used = 2
		}
		left := requests - s.next - used // requests after this one
		last := left == 0

		event := plain
		subCalls := 0
		if !last {
			switch u := s.rng.Float64(); {
			case u < s.cfg.DriftProb:
				event = drift
			case u < s.cfg.DriftProb+s.cfg.StripReasoningProb:
				event = strip
			case u < s.cfg.DriftProb+s.cfg.StripReasoningProb+s.cfg.SubAgentProb:
				// The main chain must get the last word, so the run fits in what is left.
				if subCalls = min(s.cfg.SubAgentCalls.sample(s.rng), left-1); subCalls >= 1 {
					event = subAgent
				}
			}
		}
		wantTool := event == subAgent || (!last && s.rng.Float64() >= s.cfg.StopProb) || (last && timedOut)

		r, err := s.request(wantTool, event == strip, retry, multi)
		if err != nil {
			return err
		}
		if last {
			return nil
		}
		if event == subAgent && r.finish != finishTool {
			event = plain // cut by max_tokens before it could call the sub-agent tool
		}
		if err := s.advance(r, event, subCalls); err != nil {
			return err
		}
	}
	return nil
}

// request makes one model request on the current prompt and records its calls; it returns
// the response the harness goes on with.
func (s *sessionGen) request(wantTool, think, retry, multi bool) (*response, error) {
	r := s.response(wantTool, think)
	if retry {
		// The first attempt was discarded by the harness (timeout, unparsable tool call).
		if err := s.record(s.ctx, 0, r); err != nil {
			return nil, err
		}
		s.next++
		s.ev.Retries++
		r = s.sibling(r, wantTool)
	}
	if err := s.record(s.ctx, 0, r); err != nil {
		return nil, err
	}
	if multi {
		s.ev.MultiChoiceRequests++
		n := s.cfg.Choices.sample(s.rng)
		for c := 1; c < n; c++ {
			if err := s.record(s.ctx, c, s.sibling(r, wantTool)); err != nil {
				return nil, err
			}
		}
	}
	s.next++
	return r, nil
}

// record stores one call with its own copies of the token data. The response's slices
// were freshly allocated for it and are handed over.
func (s *sessionGen) record(prompt []int32, choice int, r *response) error {
	if ctx := len(prompt) + len(r.ids); ctx > s.cfg.MaxContext {
		return fmt.Errorf("session %s call %d: context of %d tokens exceeds MaxContext %d", s.id, s.next, ctx, s.cfg.MaxContext)
	}
	c := trace.Call{
		SessionID:     s.id,
		Index:         s.next,
		Choice:        choice,
		PromptIDs:     clone(prompt),
		ResponseIDs:   clone(r.ids),
		Logprobs:      clone(r.lps),
		FinishReason:  r.finish,
		PolicyVersion: s.version,
		Trainable:     true,
	}
	if s.rng.Float64() < s.cfg.UntrainableProb {
		s.breakTokens(&c)
		s.ev.Untrainable++
	}
	s.calls = append(s.calls, c)
	return nil
}

// breakTokens damages the call's token data the ways upstream servers do, and marks it.
func (s *sessionGen) breakTokens(c *trace.Call) {
	switch s.rng.IntN(3) {
	case 0:
		c.Logprobs = c.Logprobs[:s.rng.IntN(len(c.Logprobs))]
		c.MarkUntrainable(fmt.Sprintf("logprobs length %d != response_ids length %d", len(c.Logprobs), len(c.ResponseIDs)))
	case 1:
		c.Logprobs = nil
		c.MarkUntrainable("upstream returned no logprobs")
	default:
		c.ResponseIDs, c.Logprobs = nil, nil
		c.MarkUntrainable("upstream returned no token ids")
	}
}

// advance appends the response and the harness's reply to the history, compacting it
// when it grows past CompactAt.
func (s *sessionGen) advance(r *response, event historyEvent, subCalls int) error {
	hist := r.ids
	switch event {
	case drift:
		hist = s.drifted(r)
		s.ev.Drifts++
	case strip:
		hist = stripped(r)
		s.ev.StrippedReasoning++
	}
	turnStart := len(s.ctx) - assistantHeaderLen
	s.ctx = append(s.ctx, hist...)
	if !r.endsWithImEnd() {
		s.ctx = append(s.ctx, tokImEnd)
	}
	s.ctx = append(s.ctx, tokNewline)

	switch {
	case event == subAgent:
		answer, err := s.runSubAgent(subCalls)
		if err != nil {
			return err
		}
		s.ctx = appendToolResult(s.ctx, answer)
	case r.finish == finishTool:
		n, _ := s.cfg.ToolOutputTokens.sample(s.rng)
		s.ev.ToolOutputTokens = append(s.ev.ToolOutputTokens, n)
		s.ctx = appendToolResult(s.ctx, s.voc.appendText(s.spare[:0], n))
	default:
		// No tool call: the harness nudges the model on.
		s.ctx = appendTurn(s.ctx, tokUser, s.voc.appendText(s.spare[:0], s.cfg.NudgeTokens.sample(s.rng)))
	}
	s.ctx = appendAssistantHeader(s.ctx)

	if len(s.ctx) > s.cfg.CompactAt {
		s.compact(turnStart)
	}
	return nil
}

// compact rewrites the history as harnesses do near the context limit: system prompt,
// task, a freshly written summary, then the most recent turn (from turnStart) verbatim.
func (s *sessionGen) compact(turnStart int) {
	summary := s.voc.appendText(nil, s.cfg.SummaryTokens.sample(s.rng))
	out := append(s.spare[:0], s.g.system...)
	out = append(out, s.g.task...)
	out = appendTurn(out, tokUser, summary)
	out = append(out, s.ctx[turnStart:]...)
	s.ctx, s.spare = out, s.ctx
	s.ev.Compactions++
}

// runSubAgent makes the calls of one sub-agent run on its own system prompt and returns
// its final answer, which becomes the main agent's tool result.
func (s *sessionGen) runSubAgent(calls int) ([]int32, error) {
	sub := append(s.sub[:0], s.g.subAgent...)
	sub = appendTurn(sub, tokUser, s.voc.appendText(nil, s.cfg.SubAgentTaskTokens.sample(s.rng)))
	sub = appendAssistantHeader(sub)
	s.ev.SubAgentRuns++
	var answer []int32
	for i := range calls {
		final := i == calls-1
		r := s.response(!final && s.rng.Float64() >= s.cfg.StopProb, false)
		if err := s.record(sub, 0, r); err != nil {
			return nil, err
		}
		s.next++
		s.ev.SubAgentCalls++
		if final {
			answer = clone(r.content())
			break
		}
		sub = append(sub, r.ids...)
		if !r.endsWithImEnd() {
			sub = append(sub, tokImEnd)
		}
		sub = append(sub, tokNewline)
		if r.finish == finishTool {
			n, _ := s.cfg.ToolOutputTokens.sample(s.rng)
			s.ev.ToolOutputTokens = append(s.ev.ToolOutputTokens, n)
			sub = appendToolResult(sub, s.voc.appendText(nil, n))
		} else {
			sub = appendTurn(sub, tokUser, s.voc.appendText(nil, s.cfg.NudgeTokens.sample(s.rng)))
		}
		sub = appendAssistantHeader(sub)
	}
	s.sub = sub
	return answer, nil
}
