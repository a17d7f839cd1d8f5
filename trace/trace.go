// Package trace holds the nouns shared by the proxy and the batcher: a model Call as the
// proxy recorded it, the Session (one harness run) that made it, and the GRPO Group of
// sessions that solved the same task. It has no behaviour beyond validation.
package trace

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"time"
)

// Status is how a session ended.
type Status string

const (
	StatusRunning   Status = "running"
	StatusCompleted Status = "completed"
	StatusFailed    Status = "failed"
	StatusTimeout   Status = "timeout"
)

// Call is one recorded model call: the tokens the inference server conditioned on, the
// tokens it sampled and their log-probabilities. A request with n > 1 choices is recorded
// as n Calls with the same Index and PromptIDs and Choice 0..n-1. Its JSON form (the
// field tags, docs/trace.md) is the recorded-call wire format: floe proxy -record lines,
// the control API's session calls.
type Call struct {
	SessionID     string    `json:"session_id"`
	Index         int       `json:"index"`  // position of the call in its session, from 0
	Choice        int       `json:"choice"` // choice index for n > 1 requests, 0 otherwise
	PromptIDs     []int32   `json:"prompt_ids"`
	ResponseIDs   []int32   `json:"response_ids"`
	Logprobs      []float32 `json:"logprobs"` // one per response id: rollout log-probability of that sampled token
	FinishReason  string    `json:"finish_reason"`
	PolicyVersion int64     `json:"policy_version"`
	// Sampling is what the call was sampled with, as sent upstream; nil when unknown
	// (recorded before floe kept it). The trainer scores the call at its temperature.
	Sampling *Sampling `json:"sampling,omitempty"`

	// Trainable is false when the call is kept for the record but must not produce loss
	// terms (token data missing or inconsistent upstream); UntrainableReason says why.
	Trainable         bool   `json:"trainable"`
	UntrainableReason string `json:"untrainable_reason,omitempty"`

	// What the proxy saw, for the record; the batcher never reads these.
	API             string          `json:"api"`                        // the caller's API: anthropic, openai_chat, openai_responses, gemini
	Started         time.Time       `json:"started"`                    // request received
	Finished        time.Time       `json:"finished"`                   // answer complete
	UpstreamLatency time.Duration   `json:"upstream_latency_ns"`        // from sending upstream to the last token (JSON: integer nanoseconds)
	Request         json.RawMessage `json:"request,omitempty"`          // the caller's request body as received
	UpstreamRequest json.RawMessage `json:"upstream_request,omitempty"` // the normalized request sent to the engine
	Response        json.RawMessage `json:"response,omitempty"`         // the assistant message, normalized (OpenAI Chat)
}

// Sampling holds the sampling parameters of a call as sent to the inference server. A nil
// field was not sent: the engine used its default (floe expects T = 1, top_p = 1, no
// top_k: run vLLM with --generation-config vllm so a model's generation_config.json does
// not change them behind floe's back).
type Sampling struct {
	Temperature *float64 `json:"temperature,omitempty"`
	TopP        *float64 `json:"top_p,omitempty"`
	TopK        *int     `json:"top_k,omitempty"` // sent only by -sampling force, as -1 (off): no dialect forwards a caller's top_k
}

// EffectiveTemperature is the temperature the call was sampled at: 1 when not sent or
// unknown. A temperature <= 1e-5 is greedy decoding.
func (s *Sampling) EffectiveTemperature() float64 {
	if s == nil || s.Temperature == nil {
		return 1
	}
	return *s.Temperature
}

// Reproducible reports whether the trainer can recompute the call's processed
// log-probs from log_softmax(logits / T): false with top_p < 1, top_k > 0 or greedy
// decoding (T <= 1e-5), whose behaviour policy is truncated.
func (s *Sampling) Reproducible() bool {
	if s == nil {
		return true
	}
	if s.TopP != nil && *s.TopP < 1 {
		return false
	}
	if s.TopK != nil && *s.TopK > 0 {
		return false
	}
	return s.EffectiveTemperature() > 1e-5
}

// ErrInvalidCall is wrapped by every error Validate returns.
var ErrInvalidCall = errors.New("invalid call")

// MinLogprob is the lowest rollout log-probability a trainable call may carry. A sampled
// token whose probability was below e^-100 (about 3.7e-44) was not drawn from the
// distribution the log-prob describes: the value is a sentinel (vLLM writes -inf as
// -9999) or garbage, and its importance ratio would be e^(logp+9999). Such a call is
// recorded untrainable, with the reason.
const MinLogprob = -100

// Validate checks that the call's token data can be trained on: a non-empty prompt, a
// non-empty response, one finite log-probability in [MinLogprob, 0] per response token,
// and no negative token ids. It returns an error wrapping ErrInvalidCall that names the
// call and the first problem found.
func (c *Call) Validate() error {
	fail := func(format string, args ...any) error {
		return fmt.Errorf("%w: session %q call %d choice %d: %s",
			ErrInvalidCall, c.SessionID, c.Index, c.Choice, fmt.Sprintf(format, args...))
	}
	if len(c.PromptIDs) == 0 {
		return fail("empty prompt_ids")
	}
	if len(c.ResponseIDs) == 0 {
		return fail("empty response_ids")
	}
	if len(c.Logprobs) != len(c.ResponseIDs) {
		return fail("%d logprobs for %d response_ids", len(c.Logprobs), len(c.ResponseIDs))
	}
	for i, id := range c.PromptIDs {
		if id < 0 {
			return fail("prompt_ids[%d] = %d is negative", i, id)
		}
	}
	for i, id := range c.ResponseIDs {
		if id < 0 {
			return fail("response_ids[%d] = %d is negative", i, id)
		}
	}
	for i, lp := range c.Logprobs {
		if math.IsNaN(float64(lp)) || math.IsInf(float64(lp), 0) {
			return fail("logprobs[%d] = %v is not finite", i, lp)
		}
		if lp > 0 {
			return fail("logprobs[%d] = %v is positive", i, lp)
		}
		if lp < MinLogprob {
			return fail("logprobs[%d] = %v is below the floor %d (vLLM writes -inf as -9999)", i, lp, MinLogprob)
		}
	}
	return nil
}

// MarkUntrainable clears Trainable and records why. Recorders call it instead of dropping
// a call, so that nothing the harness saw is lost and nothing broken is trained.
func (c *Call) MarkUntrainable(reason string) {
	c.Trainable = false
	c.UntrainableReason = reason
}

// Session is one harness run on one task: its calls in the order they were made.
type Session struct {
	ID      string  `json:"id"`
	TaskID  string  `json:"task_id"`
	GroupID string  `json:"group_id"`
	Calls   []Call  `json:"calls"`
	Reward  float64 `json:"reward"`
	Status  Status  `json:"status"`
}

// Running reports whether the session still takes calls: it was not finished (completed,
// failed or timed out).
func (s Session) Running() bool { return s.Status == StatusRunning }

// Group is the GRPO group: sessions that solved the same task, whose rewards are
// compared with each other to form advantages.
type Group struct {
	ID       string    `json:"id"`
	TaskID   string    `json:"task_id"`
	Sessions []Session `json:"sessions"`
}

// Validate checks every trainable call of the group, and that each call belongs to the
// session that holds it.
func (g *Group) Validate() error {
	if len(g.Sessions) == 0 {
		return fmt.Errorf("group %q has no sessions", g.ID)
	}
	for si := range g.Sessions {
		s := &g.Sessions[si]
		if math.IsNaN(s.Reward) || math.IsInf(s.Reward, 0) {
			return fmt.Errorf("group %q session %q: reward %v is not finite", g.ID, s.ID, s.Reward)
		}
		for ci := range s.Calls {
			c := &s.Calls[ci]
			if c.SessionID != s.ID {
				return fmt.Errorf("group %q session %q holds a call of session %q", g.ID, s.ID, c.SessionID)
			}
			if !c.Trainable {
				continue
			}
			if err := c.Validate(); err != nil {
				return fmt.Errorf("group %q: %w", g.ID, err)
			}
		}
	}
	return nil
}

// InputTokens is the number of tokens the group's calls carry, prompt and response, over
// all calls trainable or not: the work a per-request trainer would forward.
func (g *Group) InputTokens() int64 {
	var n int64
	for si := range g.Sessions {
		for ci := range g.Sessions[si].Calls {
			c := &g.Sessions[si].Calls[ci]
			n += int64(len(c.PromptIDs) + len(c.ResponseIDs))
		}
	}
	return n
}
