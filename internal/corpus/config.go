// Package corpus generates seeded synthetic traces of SWE-style coding-agent GRPO runs,
// token-faithful to what the floe proxy records from vLLM serving a Qwen-style chat
// template: every prompt is the chat history rendered to token ids, so the prefix
// structure (group-shared system prompt and task, per-session growing history, and the
// events that break a plain chain) is the structure the batcher has to exploit.
//
// It is internal, not under benchmarks/, because floe corpus-serve serves its steps: the
// product links the generator and no benchmark code. Its statistics are in
// benchmarks/corpus/STATS.md.
package corpus

import (
	"errors"
	"fmt"
)

// Range is an inclusive range of token or call counts, sampled uniformly.
type Range struct{ Min, Max int }

// Skewed is a clipped log-normal length distribution, in tokens. Real tool outputs and
// responses are mostly short with a long tail, so the median sits well below the mean;
// a sample below Min is raised to Min and one above Max is cut to Max (as a harness
// truncates long tool output, or max_tokens cuts a response).
type Skewed struct {
	Min, Max int     // tokens, inclusive
	Median   float64 // median of the underlying log-normal, tokens
	Sigma    float64 // standard deviation of the log length; larger = heavier tail
}

// Config holds every knob of the generator. Lengths are in tokens; probabilities are per
// model request (or per transition between requests) and in [0, 1].
type Config struct {
	Groups    int // GRPO groups to generate
	GroupSize int // sessions per group
	VocabSize int // content ids are drawn uniformly from [0, VocabSize), minus template ids

	SystemPrefixTokens Range  // system prompt + tool definitions, one random prefix per group
	TaskPromptTokens   Range  // the task's user turn, shared by the group
	CallsPerSession    Range  // model requests per session (distinct Index; n>1 choices count once)
	ToolOutputTokens   Skewed // output of one tool execution
	ResponseTokens     Skewed // sampled tokens of one response, template tokens included; a sample above Max finishes with "length"
	NudgeTokens        Range  // user turn a harness sends after a response without a tool call
	ThinkProb          float64
	StopProb           float64 // an intermediate response ends with text ("stop") instead of a tool call

	CompactAt     int   // a prompt longer than this is compacted: history replaced by a summary
	SummaryTokens Range // the summary turn a compaction writes
	MaxContext    int   // hard cap on prompt+response of any call; Validate proves it holds

	DriftProb          float64 // the next prompt re-tokenizes the response differently
	StripReasoningProb float64 // the response has a <think> block the next prompt's history omits
	SubAgentProb       float64 // the response spawns a sub-agent whose answer is the tool result

	SubAgentPrefixTokens Range // sub-agent system prompt, one per group
	SubAgentTaskTokens   Range // the instruction the main agent gives a sub-agent
	SubAgentCalls        Range // requests one sub-agent run makes

	RetryProb        float64 // the request is made twice with the same prompt; the chain continues from the second
	MultiChoiceProb  float64 // the request asks for n > 1 choices; the chain continues from choice 0
	Choices          Range   // n of an n > 1 request
	SharedLeadProb   float64 // a retry or extra choice starts with the same sampled tokens as the first
	SharedLeadTokens Range   // how many leading tokens it shares

	UntrainableProb float64 // a call record has broken token data and is marked untrainable

	PolicyVersions int     // a session's policy version is drawn from [0, PolicyVersions)
	FailedProb     float64 // session status "failed" (reward 0)
	TimeoutProb    float64 // session status "timeout" (reward 0, cut off after a tool call)
}

// Default is the benchmark corpus: 32 groups of 8 sessions of a SWE-style coding agent.
func Default() Config {
	return Config{
		Groups:    32,
		GroupSize: 8,
		VocabSize: 151_000,

		SystemPrefixTokens: Range{4_000, 12_000},
		TaskPromptTokens:   Range{200, 2_000},
		CallsPerSession:    Range{10, 60},
		// Median 350, sigma 1.0: mean ≈ 540 after clipping; ~2.6% at the floor, ~1.6% truncated at 3,000.
		ToolOutputTokens: Skewed{Min: 50, Max: 3_000, Median: 350, Sigma: 1.0},
		// Median 110, sigma 0.9: mean ≈ 160; ~1.4% of responses hit 800 and finish with "length".
		ResponseTokens: Skewed{Min: 20, Max: 800, Median: 110, Sigma: 0.9},
		NudgeTokens:    Range{5, 40},
		ThinkProb:      0.3,
		StopProb:       0.03,

		CompactAt:     48_000,
		SummaryTokens: Range{1_000, 3_000},
		MaxContext:    60_000,

		DriftProb:          0.03,
		StripReasoningProb: 0.03,
		SubAgentProb:       0.03,

		SubAgentPrefixTokens: Range{1_000, 3_000},
		SubAgentTaskTokens:   Range{50, 400},
		SubAgentCalls:        Range{1, 4},

		RetryProb:        0.01,
		MultiChoiceProb:  0,
		Choices:          Range{2, 3},
		SharedLeadProb:   0.5,
		SharedLeadTokens: Range{2, 8},

		UntrainableProb: 0.005,

		PolicyVersions: 3,
		FailedProb:     0.05,
		TimeoutProb:    0.03,
	}
}

// Medium is Default's agent at a sixth of its context: system prompts of 1–3k tokens,
// compaction at 10k, contexts up to 14k. Sized for end-to-end runs where every call is
// replayed through the reference inference server and trained on a real model (floe
// bench e2e on a GPU), where Default's 60k-token contexts would take the server minutes.
func Medium() Config {
	c := Default()
	c.Groups = 16
	c.SystemPrefixTokens = Range{1_000, 3_000}
	c.TaskPromptTokens = Range{100, 800}
	c.CallsPerSession = Range{8, 40}
	c.ToolOutputTokens = Skewed{Min: 30, Max: 1_500, Median: 250, Sigma: 1.0}
	c.CompactAt = 10_000
	c.SummaryTokens = Range{300, 1_000}
	c.MaxContext = 14_000
	c.SubAgentPrefixTokens = Range{300, 1_000}
	c.SubAgentTaskTokens = Range{30, 200}
	return c
}

// LongTool is Default's agent where tools return long outputs: whole files, test logs,
// search results of several thousand tokens (median 3,000, up to 12,000, as a harness
// that truncates at 12k would pass them on). Contexts reach the compaction threshold in a
// dozen calls, so sessions are short chains of few, heavy calls: fewer, larger units for
// the packer, and micro-batches whose cost is mostly attention. 8 groups; the TRL
// comparison runs 2 (its Python planner takes minutes a setting here).
func LongTool() Config {
	c := Default()
	c.Groups = 8
	// Median 3,000, sigma 0.6: mean ≈ 3,560 after clipping; ~1.0% truncated at 12,000, ~0.1% at the floor.
	c.ToolOutputTokens = Skewed{Min: 500, Max: 12_000, Median: 3_000, Sigma: 0.6}
	return c
}

// CPU is Default's agent (its event rates, its shape of sessions) at about a twentieth of
// its context: system prompts of 200–600 tokens, compaction at 2,400, contexts up to
// 3,000. Sized for end-to-end runs whose trainer is on a CPU (floe-bench e2e), where
// Small's frequent events would understate what merging prefixes buys.
func CPU() Config {
	c := Default()
	c.Groups = 8
	c.SystemPrefixTokens = Range{200, 600}
	c.TaskPromptTokens = Range{20, 100}
	c.CallsPerSession = Range{8, 30}
	c.ToolOutputTokens = Skewed{Min: 5, Max: 150, Median: 20, Sigma: 1.0}
	c.ResponseTokens = Skewed{Min: minResponseTokens, Max: 60, Median: 18, Sigma: 0.7}
	c.NudgeTokens = Range{2, 8}
	c.CompactAt = 2_400
	c.SummaryTokens = Range{50, 150}
	c.MaxContext = 3_000
	c.SubAgentPrefixTokens = Range{50, 150}
	c.SubAgentTaskTokens = Range{5, 30}
	return c
}

// Small is a tiny corpus for unit, property and fuzz tests: contexts of tens to hundreds
// of tokens, and every event frequent enough that a handful of groups shows all of them.
func Small() Config {
	return Config{
		Groups:    4,
		GroupSize: 4,
		VocabSize: 151_000,

		SystemPrefixTokens: Range{40, 120},
		TaskPromptTokens:   Range{10, 40},
		CallsPerSession:    Range{6, 14},
		ToolOutputTokens:   Skewed{Min: 5, Max: 60, Median: 20, Sigma: 0.8},
		ResponseTokens:     Skewed{Min: minResponseTokens, Max: 80, Median: 28, Sigma: 0.7},
		NudgeTokens:        Range{2, 6},
		ThinkProb:          0.3,
		StopProb:           0.1,

		CompactAt:     600,
		SummaryTokens: Range{20, 60},
		MaxContext:    1_000,

		DriftProb:          0.2,
		StripReasoningProb: 0.2,
		SubAgentProb:       0.2,

		SubAgentPrefixTokens: Range{30, 80},
		SubAgentTaskTokens:   Range{5, 20},
		SubAgentCalls:        Range{1, 4},

		RetryProb:        0.2,
		MultiChoiceProb:  0.2,
		Choices:          Range{2, 3},
		SharedLeadProb:   0.5,
		SharedLeadTokens: Range{2, 4},

		UntrainableProb: 0.2,

		PolicyVersions: 3,
		FailedProb:     0.1,
		TimeoutProb:    0.1,
	}
}

// turnSlack bounds the template tokens of one turn (role header, im_end, newlines,
// tool-response tags, a drift split) in the context-length proofs below.
const turnSlack = 16

// Validate reports every problem with the config, joined.
func (c *Config) Validate() error {
	var errs []error
	add := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	positive := func(name string, v int) {
		if v < 1 {
			add(fmt.Errorf("%s = %d, want >= 1", name, v))
		}
	}
	positive("Groups", c.Groups)
	positive("GroupSize", c.GroupSize)
	positive("PolicyVersions", c.PolicyVersions)
	if c.VocabSize < 1_000 || c.VocabSize > firstSpecialID {
		add(fmt.Errorf("VocabSize = %d, want in [1000, %d] so content ids never collide with template ids", c.VocabSize, firstSpecialID))
	}
	add(c.SystemPrefixTokens.validate("SystemPrefixTokens", 1))
	add(c.TaskPromptTokens.validate("TaskPromptTokens", 1))
	add(c.CallsPerSession.validate("CallsPerSession", 1))
	add(c.ToolOutputTokens.validate("ToolOutputTokens", 1))
	add(c.ResponseTokens.validate("ResponseTokens", minResponseTokens))
	add(c.NudgeTokens.validate("NudgeTokens", 1))
	add(c.SummaryTokens.validate("SummaryTokens", 1))
	add(c.SubAgentPrefixTokens.validate("SubAgentPrefixTokens", 1))
	add(c.SubAgentTaskTokens.validate("SubAgentTaskTokens", 1))
	add(c.SubAgentCalls.validate("SubAgentCalls", 1))
	add(c.Choices.validate("Choices", 2))
	add(c.SharedLeadTokens.validate("SharedLeadTokens", 1))

	probs := []struct {
		name string
		p    float64
	}{
		{"ThinkProb", c.ThinkProb}, {"StopProb", c.StopProb},
		{"DriftProb", c.DriftProb}, {"StripReasoningProb", c.StripReasoningProb}, {"SubAgentProb", c.SubAgentProb},
		{"RetryProb", c.RetryProb}, {"MultiChoiceProb", c.MultiChoiceProb}, {"SharedLeadProb", c.SharedLeadProb},
		{"UntrainableProb", c.UntrainableProb}, {"FailedProb", c.FailedProb}, {"TimeoutProb", c.TimeoutProb},
	}
	for _, p := range probs {
		if !(p.p >= 0 && p.p <= 1) {
			add(fmt.Errorf("%s = %v, want in [0, 1]", p.name, p.p))
		}
	}
	// These are alternatives drawn from one uniform number each.
	if s := c.DriftProb + c.StripReasoningProb + c.SubAgentProb; s > 1 {
		add(fmt.Errorf("DriftProb + StripReasoningProb + SubAgentProb = %v, want <= 1", s))
	}
	if s := c.RetryProb + c.MultiChoiceProb; s > 1 {
		add(fmt.Errorf("RetryProb + MultiChoiceProb = %v, want <= 1", s))
	}
	if s := c.FailedProb + c.TimeoutProb; s > 1 {
		add(fmt.Errorf("FailedProb + TimeoutProb = %v, want <= 1", s))
	}
	if len(errs) > 0 {
		return fmt.Errorf("corpus: invalid config: %w", errors.Join(errs...))
	}
	if err := c.validateContextBounds(); err != nil {
		return fmt.Errorf("corpus: invalid config: %w", err)
	}
	return nil
}

// validateContextBounds proves from the maxima that no call can exceed MaxContext: a main
// prompt is at most CompactAt (longer ones are compacted), and a compacted prompt must be
// shorter than CompactAt or every later call would compact again.
func (c *Config) validateContextBounds() error {
	result := max(c.ToolOutputTokens.Max, c.NudgeTokens.Max, c.ResponseTokens.Max)
	compacted := c.SystemPrefixTokens.Max + c.TaskPromptTokens.Max + c.SummaryTokens.Max +
		c.ResponseTokens.Max + result + 6*turnSlack
	if compacted >= c.CompactAt {
		return fmt.Errorf("CompactAt = %d, but a compacted prompt can reach %d tokens (prefix+task+summary+last turn); raise CompactAt or lower those maxima",
			c.CompactAt, compacted)
	}
	if c.CompactAt+c.ResponseTokens.Max > c.MaxContext {
		return fmt.Errorf("CompactAt + ResponseTokens.Max = %d exceeds MaxContext = %d",
			c.CompactAt+c.ResponseTokens.Max, c.MaxContext)
	}
	if c.SubAgentProb > 0 {
		sub := c.SubAgentPrefixTokens.Max + c.SubAgentTaskTokens.Max + 3*turnSlack +
			c.SubAgentCalls.Max*(c.ResponseTokens.Max+max(c.ToolOutputTokens.Max, c.NudgeTokens.Max)+2*turnSlack)
		if sub > c.MaxContext {
			return fmt.Errorf("a sub-agent context can reach %d tokens, over MaxContext = %d", sub, c.MaxContext)
		}
	}
	return nil
}

func (r Range) validate(name string, floor int) error {
	if r.Min < floor {
		return fmt.Errorf("%s.Min = %d, want >= %d", name, r.Min, floor)
	}
	if r.Min > r.Max {
		return fmt.Errorf("%s: Min %d > Max %d", name, r.Min, r.Max)
	}
	return nil
}

func (s Skewed) validate(name string, floor int) error {
	if err := (Range{s.Min, s.Max}).validate(name, floor); err != nil {
		return err
	}
	if !(s.Median > 0) || s.Median > float64(s.Max) {
		return fmt.Errorf("%s.Median = %v, want in (0, Max=%d]", name, s.Median, s.Max)
	}
	if !(s.Sigma >= 0) {
		return fmt.Errorf("%s.Sigma = %v, want >= 0", name, s.Sigma)
	}
	return nil
}

// Presets are the names Preset knows, smallest first.
const Presets = "small, cpu, medium, default or longtool"

// Preset returns the named corpus configuration (Small, CPU, Medium, Default or LongTool) with its
// group count replaced by groups when groups > 0.
func Preset(name string, groups int) (Config, error) {
	var c Config
	switch name {
	case "small":
		c = Small()
	case "cpu":
		c = CPU()
	case "medium":
		c = Medium()
	case "default":
		c = Default()
	case "longtool":
		c = LongTool()
	default:
		return Config{}, fmt.Errorf("unknown corpus %q (want %s)", name, Presets)
	}
	if groups > 0 {
		c.Groups = groups
	}
	return c, nil
}
