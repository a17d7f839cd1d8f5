package corpus

import (
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/floe-rl/floe/trace"
)

// smallN is Small with enough groups that every event kind shows up.
func smallN(groups int) Config {
	cfg := Small()
	cfg.Groups = groups
	return cfg
}

func mustGenerate(t *testing.T, cfg Config, seed int64) ([]trace.Group, *events) {
	t.Helper()
	groups, ev, err := generate(cfg, seed)
	if err != nil {
		t.Fatalf("generate: %v", err)
	}
	return groups, ev
}

// requests returns the choice-0 call of every request of s, in order.
func requests(s *trace.Session) []*trace.Call {
	var out []*trace.Call
	for i := range s.Calls {
		if s.Calls[i].Choice == 0 {
			out = append(out, &s.Calls[i])
		}
	}
	return out
}

func hasPrefix(s, prefix []int32) bool {
	return len(s) >= len(prefix) && slices.Equal(s[:len(prefix)], prefix)
}

func extends(next, prompt, response []int32) bool {
	n := len(prompt) + len(response)
	return len(next) >= n && slices.Equal(next[:len(prompt)], prompt) && slices.Equal(next[len(prompt):n], response)
}

func TestValidateRejects(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Config)
		want   string
	}{
		{"min over max", func(c *Config) { c.CallsPerSession = Range{10, 5} }, "CallsPerSession: Min 10 > Max 5"},
		{"no groups", func(c *Config) { c.Groups = 0 }, "Groups = 0"},
		{"probability", func(c *Config) { c.DriftProb = 1.5 }, "DriftProb"},
		{"history events over 1", func(c *Config) { c.DriftProb, c.StripReasoningProb, c.SubAgentProb = 0.5, 0.4, 0.3 }, "DriftProb + StripReasoningProb + SubAgentProb"},
		{"response too short", func(c *Config) { c.ResponseTokens.Min = 3 }, "ResponseTokens.Min = 3"},
		{"median outside", func(c *Config) { c.ToolOutputTokens.Median = 1e9 }, "ToolOutputTokens.Median"},
		{"vocab collides", func(c *Config) { c.VocabSize = 152_000 }, "VocabSize"},
		{"compaction cannot shrink", func(c *Config) { c.CompactAt = 10_000 }, "CompactAt = 10000"},
		{"context over cap", func(c *Config) { c.MaxContext = 48_500 }, "exceeds MaxContext"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := Default()
			tt.mutate(&cfg)
			_, err := Generate(cfg, 1)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Generate error = %v, want one containing %q", err, tt.want)
			}
		})
	}
	for _, cfg := range []Config{Default(), Small()} {
		if err := cfg.Validate(); err != nil {
			t.Errorf("built-in config invalid: %v", err)
		}
	}
}

func TestDeterminism(t *testing.T) {
	cfg := smallN(6)
	a, _ := mustGenerate(t, cfg, 7)
	b, _ := mustGenerate(t, cfg, 7)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("same seed produced different groups")
	}
	c, _ := mustGenerate(t, cfg, 8)
	if reflect.DeepEqual(a, c) {
		t.Fatal("different seeds produced identical groups")
	}
	// Each group has its own stream, so a shorter corpus is a prefix of a longer one.
	cfg.Groups = 2
	d, _ := mustGenerate(t, cfg, 7)
	if !reflect.DeepEqual(a[:2], d) {
		t.Fatal("the first groups depend on Config.Groups")
	}
}

func TestCallsValidate(t *testing.T) {
	def := Default()
	def.Groups = 2
	for name, cfg := range map[string]Config{"small": smallN(20), "default": def} {
		t.Run(name, func(t *testing.T) {
			groups, _ := mustGenerate(t, cfg, 3)
			untrainable := 0
			for gi := range groups {
				g := &groups[gi]
				if err := g.Validate(); err != nil {
					t.Fatal(err)
				}
				if g.ID == "" || g.TaskID == "" {
					t.Fatalf("group %d lacks ID or TaskID", gi)
				}
				for _, s := range g.Sessions {
					if s.GroupID != g.ID || s.TaskID != g.TaskID || !strings.HasPrefix(s.ID, g.ID+"-s") {
						t.Fatalf("session %q: ids %q/%q do not match group %q/%q", s.ID, s.GroupID, s.TaskID, g.ID, g.TaskID)
					}
					for i, c := range s.Calls {
						if i > 0 && c.Index < s.Calls[i-1].Index {
							t.Fatalf("%s: Index decreases at record %d", s.ID, i)
						}
						if c.FinishReason == "" {
							t.Fatalf("%s call %d: no finish reason", s.ID, c.Index)
						}
						if c.PolicyVersion < 0 || c.PolicyVersion >= int64(cfg.PolicyVersions) {
							t.Fatalf("%s call %d: policy version %d", s.ID, c.Index, c.PolicyVersion)
						}
						if c.Trainable {
							continue
						}
						untrainable++
						if c.UntrainableReason == "" {
							t.Fatalf("%s call %d: untrainable without a reason", s.ID, c.Index)
						}
						if c.Validate() == nil {
							t.Fatalf("%s call %d: marked untrainable but its token data validates", s.ID, c.Index)
						}
					}
				}
			}
			if name == "small" && untrainable == 0 {
				t.Fatal("Small produced no untrainable calls")
			}
		})
	}
}

func TestResponseLayout(t *testing.T) {
	groups, _ := mustGenerate(t, smallN(10), 4)
	cfg := Small()
	for _, g := range groups {
		for _, s := range g.Sessions {
			for _, c := range s.Calls {
				r := c.ResponseIDs
				if r == nil {
					continue
				}
				if len(r) < cfg.ResponseTokens.Min || len(r) > cfg.ResponseTokens.Max {
					t.Fatalf("%s call %d: response of %d tokens outside %v", s.ID, c.Index, len(r), cfg.ResponseTokens)
				}
				endsImEnd := r[len(r)-1] == tokImEnd
				if endsImEnd != (c.FinishReason != finishLimit) {
					t.Fatalf("%s call %d: finish %q but ends with im_end = %v", s.ID, c.Index, c.FinishReason, endsImEnd)
				}
				if (c.FinishReason == finishTool) != slices.Contains(r, tokToolCall) {
					t.Fatalf("%s call %d: finish %q disagrees with tool call tokens", s.ID, c.Index, c.FinishReason)
				}
				if (r[0] == tokThink) != slices.Contains(r, tokThinkEnd) {
					t.Fatalf("%s call %d: unbalanced think block", s.ID, c.Index)
				}
			}
		}
	}
}

// TestChain checks the token model: most transitions extend prompt+response exactly, and
// every one that does not is explained by an event the generator counted.
func TestChain(t *testing.T) {
	cfg := smallN(20)
	cfg.UntrainableProb = 0 // calls without token ids would hide breaks
	groups, ev := mustGenerate(t, cfg, 5)
	st := Measure(groups)
	// Small makes events frequent on purpose, so only ask that chains exist; Default below
	// must chain in most transitions.
	if st.ChainBreaks >= st.Transitions {
		t.Fatalf("%d of %d transitions break the chain", st.ChainBreaks, st.Transitions)
	}
	explained := ev.Drifts + ev.StrippedReasoning + ev.Compactions + 2*ev.SubAgentRuns
	// A compaction may coincide with another event on the same transition.
	if st.ChainBreaks > explained || st.ChainBreaks < explained-ev.Compactions {
		t.Fatalf("%d chain breaks, events explain %d (compactions %d)", st.ChainBreaks, explained, ev.Compactions)
	}
	seen := map[string]int{}
	for gi := range groups {
		for k, v := range kinds(&groups[gi]) {
			seen[k] += v
		}
	}
	// Classified from tokens alone; a compaction on the same transition hides the other event.
	if seen["unexplained"] != 0 || seen["sub-agent"] != 2*ev.SubAgentRuns ||
		seen["drift"] > ev.Drifts || seen["stripped"] > ev.StrippedReasoning || seen["compaction"] > ev.Compactions ||
		seen["drift"]+seen["stripped"]+seen["compaction"]+seen["sub-agent"] != st.ChainBreaks {
		t.Fatalf("breaks classified from tokens %v disagree with generator events %+v", seen, *ev.public())
	}
	if st.Retries != ev.Retries || st.MultiChoiceRequests != ev.MultiChoiceRequests {
		t.Fatalf("Measure saw %d retries / %d n>1, generator made %d / %d",
			st.Retries, st.MultiChoiceRequests, ev.Retries, ev.MultiChoiceRequests)
	}

	def := Default()
	def.Groups = 2
	groups, _ = mustGenerate(t, def, 1)
	st = Measure(groups)
	if st.ChainBreaks*5 > st.Transitions {
		t.Fatalf("Default: %d of %d transitions break the chain", st.ChainBreaks, st.Transitions)
	}
}

// kinds classifies each chain break by what the next prompt looks like, so the test
// checks each event's token semantics rather than trusting the generator's counters.
func kinds(g *trace.Group) map[string]int {
	out := map[string]int{}
	system := g.Sessions[0].Calls[0].PromptIDs[:slices.Index(g.Sessions[0].Calls[0].PromptIDs, tokImEnd)+2]
	for _, s := range g.Sessions {
		reqs := requests(&s)
		for i := 1; i < len(reqs); i++ {
			p, c := reqs[i-1], reqs[i]
			P, R, N := p.PromptIDs, p.ResponseIDs, c.PromptIDs
			switch {
			case slices.Equal(P, N):
				out["retry"]++
			case extends(N, P, R):
				out["chain"]++
			case !hasPrefix(N, system) || !hasPrefix(P, system):
				out["sub-agent"]++
			case !hasPrefix(N, P):
				out["compaction"]++
			case R[0] == tokThink && extends(N, P, R[slices.Index(R, tokThinkEnd)+2:]):
				out["stripped"]++
			default:
				// A split: after the first mismatch, the rest of R follows one or two
				// tokens later than a plain copy would put it.
				tail := N[len(P):]
				m := 0
				for m < len(R) && tail[m] == R[m] {
					m++
				}
				for k := 1; k <= 2; k++ {
					if m+k <= len(R) && len(tail) >= m+2+len(R)-m-k && slices.Equal(tail[m+2:m+2+len(R)-m-k], R[m+k:]) {
						out["drift"]++
						break
					}
					if k == 2 {
						out["unexplained"]++
					}
				}
			}
		}
	}
	return out
}

func TestEventsOccur(t *testing.T) {
	groups, ev := mustGenerate(t, smallN(20), 11)
	seen := map[string]int{}
	for gi := range groups {
		for k, v := range kinds(&groups[gi]) {
			seen[k] += v
		}
	}
	shared, length, think, statuses := 0, 0, 0, map[trace.Status]int{}
	for _, g := range groups {
		for _, s := range g.Sessions {
			statuses[s.Status]++
			for i, c := range s.Calls {
				if c.FinishReason == finishLimit {
					length++
				}
				if len(c.ResponseIDs) > 0 && c.ResponseIDs[0] == tokThink {
					think++
				}
				if i > 0 && slices.Equal(c.PromptIDs, s.Calls[i-1].PromptIDs) {
					a, b := s.Calls[i-1].ResponseIDs, c.ResponseIDs
					if len(a) > 2 && len(b) > 2 && slices.Equal(a[:2], b[:2]) && a[0] != tokThink {
						shared++
					}
				}
			}
		}
	}
	tests := []struct {
		name string
		n    int
	}{
		{"chained transitions", seen["chain"]},
		{"drift", seen["drift"]},
		{"stripped reasoning", seen["stripped"]},
		{"compaction", seen["compaction"]},
		{"sub-agent", seen["sub-agent"]},
		{"retry", seen["retry"]},
		{"n>1 request", ev.MultiChoiceRequests},
		{"untrainable call", ev.Untrainable},
		{"siblings sharing leading tokens", shared},
		{"length finish", length},
		{"think block", think},
		{"failed session", statuses[trace.StatusFailed]},
		{"timeout session", statuses[trace.StatusTimeout]},
		{"completed session", statuses[trace.StatusCompleted]},
	}
	for _, tt := range tests {
		if tt.n == 0 {
			t.Errorf("no %s in 20 Small groups", tt.name)
		}
	}
	if seen["unexplained"] > 0 {
		// An untrainable call without token ids before a transition is the only excuse.
		t.Logf("%d transitions unexplained (calls without token ids)", seen["unexplained"])
	}
}

func TestMultiChoice(t *testing.T) {
	groups, _ := mustGenerate(t, smallN(10), 2)
	found := 0
	for _, g := range groups {
		for _, s := range g.Sessions {
			for i := 0; i < len(s.Calls); {
				j := i + 1
				for j < len(s.Calls) && s.Calls[j].Index == s.Calls[i].Index {
					j++
				}
				if n := j - i; n > 1 {
					found++
					if n < 2 || n > 3 {
						t.Fatalf("%s call %d: %d choices", s.ID, s.Calls[i].Index, n)
					}
					for k := i; k < j; k++ {
						if s.Calls[k].Choice != k-i || !slices.Equal(s.Calls[k].PromptIDs, s.Calls[i].PromptIDs) {
							t.Fatalf("%s call %d: choice %d out of order or with another prompt", s.ID, s.Calls[i].Index, k-i)
						}
					}
				}
				i = j
			}
		}
	}
	if found == 0 {
		t.Fatal("no n>1 request in Small")
	}
}

// TestNoAliasing writes a marker of its own into every slice of every call, then checks
// that no call's marker was overwritten by another's: each call owns its arrays.
func TestNoAliasing(t *testing.T) {
	groups, _ := mustGenerate(t, smallN(6), 9)
	var calls []*trace.Call
	for gi := range groups {
		for si := range groups[gi].Sessions {
			for ci := range groups[gi].Sessions[si].Calls {
				calls = append(calls, &groups[gi].Sessions[si].Calls[ci])
			}
		}
	}
	for i, c := range calls {
		for j := range c.PromptIDs {
			c.PromptIDs[j] = int32(-2*i - 1)
		}
		for j := range c.ResponseIDs {
			c.ResponseIDs[j] = int32(-2*i - 2)
		}
		for j := range c.Logprobs {
			c.Logprobs[j] = float32(-i - 1)
		}
	}
	for i, c := range calls {
		if cap(c.PromptIDs) != len(c.PromptIDs) || cap(c.ResponseIDs) != len(c.ResponseIDs) {
			t.Fatalf("call %d: slices have spare capacity another append could share", i)
		}
		ok := !slices.ContainsFunc(c.PromptIDs, func(v int32) bool { return v != int32(-2*i-1) }) &&
			!slices.ContainsFunc(c.ResponseIDs, func(v int32) bool { return v != int32(-2*i-2) }) &&
			!slices.ContainsFunc(c.Logprobs, func(v float32) bool { return v != float32(-i-1) })
		if !ok {
			t.Fatalf("call %d (%s #%d) shares a backing array with a later call", i, c.SessionID, c.Index)
		}
	}
}

func TestDefaultBounds(t *testing.T) {
	def := Default()
	def.Groups = 2
	// Long sessions on few sessions: compaction happens often without much memory.
	long := Default()
	long.Groups, long.GroupSize, long.CallsPerSession = 2, 2, Range{90, 90}
	for name, cfg := range map[string]Config{"default": def, "long": long} {
		t.Run(name, func(t *testing.T) {
			start := time.Now()
			groups, ev := mustGenerate(t, cfg, 1)
			st := Measure(groups)
			t.Logf("generated %d tokens in %v", st.InputTokens, time.Since(start))
			if st.LongestContext >= 60_000 {
				t.Fatalf("longest context %d, want < 60000", st.LongestContext)
			}
			if name == "long" && ev.Compactions == 0 {
				t.Fatal("90-request sessions never compacted")
			}
			r := st.RequestsPerSession
			if r.Min < cfg.CallsPerSession.Min || r.Max > cfg.CallsPerSession.Max {
				t.Fatalf("requests per session %d..%d outside %v", r.Min, r.Max, cfg.CallsPerSession)
			}
			if d := st.ResponseTokens; d.Min < cfg.ResponseTokens.Min || d.Max > cfg.ResponseTokens.Max || d.P50 >= int(d.Mean) {
				t.Fatalf("response lengths %+v: outside %v or not right-skewed", d, cfg.ResponseTokens)
			}
			tool := distOf(ev.ToolOutputTokens)
			if tool.Min < cfg.ToolOutputTokens.Min || tool.Max > cfg.ToolOutputTokens.Max || tool.P50 >= int(tool.Mean) {
				t.Fatalf("tool output lengths %+v: outside %v or not right-skewed", tool, cfg.ToolOutputTokens)
			}
			for _, g := range groups {
				first := g.Sessions[0].Calls[0].PromptIDs
				sys := slices.Index(first, tokImEnd) + 2 - 3 // system body, minus the turn's template tokens
				if sys < cfg.SystemPrefixTokens.Min || sys > cfg.SystemPrefixTokens.Max {
					t.Fatalf("group %s: system prefix of %d tokens outside %v", g.ID, sys, cfg.SystemPrefixTokens)
				}
			}
		})
	}
}

func TestStatsMarkdown(t *testing.T) {
	_, st, err := GenerateWithStats(Small(), 1)
	if err != nil {
		t.Fatal(err)
	}
	md := st.Markdown()
	for _, want := range []string{"prompt per call", "tool output", "compactions", "longest context", "| groups | 4 |"} {
		if !strings.Contains(md, want) {
			t.Errorf("Markdown lacks %q:\n%s", want, md)
		}
	}
	if strings.Contains(Measure(nil).Markdown(), "compactions") {
		t.Error("Measure alone cannot know compactions but Markdown shows them")
	}
}

func TestPresetsAreValid(t *testing.T) {
	for name, cfg := range map[string]Config{"medium": Medium(), "cpu": CPU(), "longtool": LongTool()} {
		t.Run(name, func(t *testing.T) { checkPreset(t, cfg) })
	}
}

func checkPreset(t *testing.T, cfg Config) {
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	cfg.Groups = 2
	groups, err := Generate(cfg, 1)
	if err != nil {
		t.Fatal(err)
	}
	st := Measure(groups)
	for _, g := range groups {
		for _, s := range g.Sessions {
			for _, c := range s.Calls {
				if n := len(c.PromptIDs) + len(c.ResponseIDs); n > cfg.MaxContext {
					t.Fatalf("a context of %d tokens over MaxContext %d", n, cfg.MaxContext)
				}
			}
		}
	}
	t.Logf("2 groups: %d calls, %d input tokens", st.Calls, st.InputTokens)
}

// TestParsePromptReadsWhatTheGeneratorRendered renders turns with the generator's own
// template functions and reads them back.
func TestParsePromptReadsWhatTheGeneratorRendered(t *testing.T) {
	sys, task, out := []int32{10, 11}, []int32{12}, []int32{13, 14}
	resp := []int32{tokThink, tokNewline, 20, tokNewline, tokThinkEnd, tokDoubleNewline, 21, 22,
		tokToolCall, tokNewline, 23, tokNewline, tokToolCallEnd, tokImEnd}
	var p []int32
	p = appendTurn(p, tokSystem, sys)
	p = appendTurn(p, tokUser, task)
	p = append(append(appendAssistantHeader(p), resp...), tokNewline)
	p = appendToolResult(p, out)
	p = appendAssistantHeader(p)
	turns, err := ParsePrompt(p)
	if err != nil {
		t.Fatal(err)
	}
	want := []Turn{
		{Role: "system", Content: sys},
		{Role: "user", Content: task},
		{Role: "assistant", Assistant: Assistant{Reasoning: []int32{20}, Content: []int32{21, 22}, ToolArgs: []int32{23}, ToolCall: true}},
		{Role: "tool", Content: out},
	}
	if !reflect.DeepEqual(turns, want) {
		t.Fatalf("turns\n got %+v\nwant %+v", turns, want)
	}
	if !reflect.DeepEqual(ParseAssistant(resp), want[2].Assistant) {
		t.Fatalf("ParseAssistant(response) = %+v", ParseAssistant(resp))
	}
	for name, bad := range map[string][]int32{
		"no header":    appendTurn(nil, tokSystem, sys),
		"not a turn":   {10, 11},
		"unknown role": append(appendTurn(nil, 99, sys), tokImStart, tokAssistant, tokNewline),
	} {
		if _, err := ParsePrompt(bad); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestPreset(t *testing.T) {
	for name, want := range map[string]Config{"small": Small(), "cpu": CPU(), "medium": Medium(), "default": Default(), "longtool": LongTool()} {
		got, err := Preset(name, 0)
		if err != nil || got.Groups != want.Groups {
			t.Errorf("Preset(%q, 0) = %d groups, %v; want %d", name, got.Groups, err, want.Groups)
		}
		if got, _ := Preset(name, 3); got.Groups != 3 {
			t.Errorf("Preset(%q, 3) has %d groups", name, got.Groups)
		}
	}
	if _, err := Preset("huge", 0); err == nil || !strings.Contains(err.Error(), Presets) {
		t.Errorf("Preset(huge): %v, want an error listing the presets", err)
	}
}
