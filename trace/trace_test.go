package trace_test

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/floe-rl/floe/trace"
)

func good() trace.Call {
	return trace.Call{SessionID: "s", Index: 2, PromptIDs: []int32{1, 2}, ResponseIDs: []int32{3, 4},
		Logprobs: []float32{-0.5, 0}, Trainable: true}
}

func TestCallValidate(t *testing.T) {
	tests := []struct {
		name   string
		change func(*trace.Call)
		want   string // "" for valid
	}{
		{"valid, logprob exactly 0", func(*trace.Call) {}, ""},
		{"empty prompt", func(c *trace.Call) { c.PromptIDs = nil }, "empty prompt_ids"},
		{"empty response", func(c *trace.Call) { c.ResponseIDs, c.Logprobs = nil, nil }, "empty response_ids"},
		{"lengths differ", func(c *trace.Call) { c.Logprobs = c.Logprobs[:1] }, "1 logprobs for 2 response_ids"},
		{"negative prompt id", func(c *trace.Call) { c.PromptIDs = []int32{1, -7} }, "prompt_ids[1] = -7 is negative"},
		{"negative response id", func(c *trace.Call) { c.ResponseIDs = []int32{-1, 4} }, "response_ids[0] = -1 is negative"},
		{"NaN logprob", func(c *trace.Call) { c.Logprobs = []float32{float32(math.NaN()), -1} }, "logprobs[0] = NaN is not finite"},
		{"infinite logprob", func(c *trace.Call) { c.Logprobs = []float32{-1, float32(math.Inf(-1))} }, "logprobs[1] = -Inf is not finite"},
		{"positive logprob", func(c *trace.Call) { c.Logprobs = []float32{-1, 0.01} }, "logprobs[1] = 0.01 is positive"},
		{"vLLM's -inf sentinel", func(c *trace.Call) { c.Logprobs = []float32{-1, -9999} }, "logprobs[1] = -9999 is below the floor -100"},
		{"just below the floor", func(c *trace.Call) { c.Logprobs = []float32{-100.01, -1} }, "logprobs[0] = -100.01 is below the floor"},
		{"at the floor", func(c *trace.Call) { c.Logprobs = []float32{trace.MinLogprob, -1} }, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := good()
			tt.change(&c)
			err := c.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate() = %v, want an error containing %q", err, tt.want)
			}
			if !errors.Is(err, trace.ErrInvalidCall) {
				t.Errorf("error %v does not wrap ErrInvalidCall", err)
			}
			if !strings.Contains(err.Error(), `session "s" call 2`) {
				t.Errorf("error %q does not name the call", err)
			}
		})
	}
}

func TestGroupValidate(t *testing.T) {
	bad := good()
	bad.Logprobs = nil
	untrainable := bad
	untrainable.MarkUntrainable("logprobs missing upstream")
	foreign := good()
	foreign.SessionID = "other"
	tests := []struct {
		name string
		g    trace.Group
		want string
	}{
		{"valid", trace.Group{ID: "g", Sessions: []trace.Session{{ID: "s", Calls: []trace.Call{good()}}}}, ""},
		{"untrainable broken call is kept", trace.Group{ID: "g", Sessions: []trace.Session{{ID: "s", Calls: []trace.Call{untrainable, good()}}}}, ""},
		{"trainable broken call", trace.Group{ID: "g", Sessions: []trace.Session{{ID: "s", Calls: []trace.Call{bad}}}}, "0 logprobs for 2 response_ids"},
		{"no sessions", trace.Group{ID: "g"}, `group "g" has no sessions`},
		{"call of another session", trace.Group{ID: "g", Sessions: []trace.Session{{ID: "s", Calls: []trace.Call{foreign}}}}, `holds a call of session "other"`},
		{"NaN reward", trace.Group{ID: "g", Sessions: []trace.Session{{ID: "s", Reward: math.NaN()}}}, "reward NaN is not finite"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.g.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate() = %v, want an error containing %q", err, tt.want)
			}
		})
	}
	if untrainable.Trainable || untrainable.UntrainableReason != "logprobs missing upstream" {
		t.Errorf("MarkUntrainable left %+v", untrainable)
	}
}

func TestInputTokens(t *testing.T) {
	u := good()
	u.MarkUntrainable("x")
	g := trace.Group{Sessions: []trace.Session{{Calls: []trace.Call{good(), u}}, {Calls: []trace.Call{good()}}}}
	if got := g.InputTokens(); got != 12 {
		t.Fatalf("InputTokens() = %d, want 12 (three calls of 2+2, untrainable included)", got)
	}
}
