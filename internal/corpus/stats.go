package corpus

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/floe-rl/floe/trace"
)

// Dist summarizes a sample of counts; percentiles are nearest-rank.
type Dist struct {
	N                  int
	Min, P50, P90, Max int
	Mean               float64
}

func distOf(xs []int) Dist {
	if len(xs) == 0 {
		return Dist{}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	var sum float64
	for _, x := range s {
		sum += float64(x)
	}
	rank := func(p float64) int { return s[max(0, int(math.Ceil(p*float64(len(s))))-1)] }
	return Dist{N: len(s), Min: s[0], P50: rank(0.5), P90: rank(0.9), Max: s[len(s)-1], Mean: sum / float64(len(s))}
}

// Stats describes a corpus. Measure fills everything but Events, which only the generator
// can count (GenerateWithStats).
type Stats struct {
	Groups, Sessions int
	Calls            int // call records; an n > 1 request is n records
	Requests         int // distinct (session, Index)
	TrainableCalls   int
	UntrainableCalls int

	InputTokens         int64 // Σ len(prompt)+len(response) over all calls: what per_request forwards
	InputTokensPerGroup Dist
	PromptTokens        Dist // per call record
	ResponseTokens      Dist // per call record with token ids
	RequestsPerSession  Dist
	LongestContext      int  // max prompt+response of one call
	SharedPrefix        Dist // per group: common prefix of its sessions' first prompts

	Retries             int // requests repeated with an identical prompt at the next Index
	MultiChoiceRequests int // requests recorded with n > 1 choices
	Transitions         int // consecutive requests of a session, retries excluded
	ChainBreaks         int // transitions whose next prompt does not extend prompt+response

	Events *Events // nil unless the stats came from GenerateWithStats
}

// Events are counted by the generator while it plays sessions.
type Events struct {
	Compactions       int
	Drifts            int
	StrippedReasoning int
	SubAgentRuns      int
	SubAgentCalls     int
	ToolOutputTokens  Dist
}

func (e *events) public() *Events {
	return &Events{
		Compactions:       e.Compactions,
		Drifts:            e.Drifts,
		StrippedReasoning: e.StrippedReasoning,
		SubAgentRuns:      e.SubAgentRuns,
		SubAgentCalls:     e.SubAgentCalls,
		ToolOutputTokens:  distOf(e.ToolOutputTokens),
	}
}

// Measure computes the statistics that can be read off the groups themselves.
func Measure(groups []trace.Group) Stats {
	st := Stats{Groups: len(groups)}
	var perGroup, prompts, responses, perSession, shared []int
	for gi := range groups {
		g := &groups[gi]
		in := g.InputTokens()
		st.InputTokens += in
		perGroup = append(perGroup, int(in))
		var firsts [][]int32
		for si := range g.Sessions {
			s := &g.Sessions[si]
			st.Sessions++
			var prev *trace.Call // choice 0 of the previous request
			requests := 0
			for ci := range s.Calls {
				c := &s.Calls[ci]
				st.Calls++
				if c.Trainable {
					st.TrainableCalls++
				} else {
					st.UntrainableCalls++
				}
				prompts = append(prompts, len(c.PromptIDs))
				if c.ResponseIDs != nil {
					responses = append(responses, len(c.ResponseIDs))
				}
				st.LongestContext = max(st.LongestContext, len(c.PromptIDs)+len(c.ResponseIDs))
				if c.Choice == 1 {
					st.MultiChoiceRequests++
				}
				if c.Choice != 0 {
					continue
				}
				requests++
				if c.Index == 0 {
					firsts = append(firsts, c.PromptIDs)
				}
				if prev != nil && c.Index == prev.Index+1 {
					st.measureTransition(prev, c)
				}
				prev = c
			}
			st.Requests += requests
			perSession = append(perSession, requests)
		}
		shared = append(shared, commonPrefix(firsts))
	}
	st.InputTokensPerGroup = distOf(perGroup)
	st.PromptTokens = distOf(prompts)
	st.ResponseTokens = distOf(responses)
	st.RequestsPerSession = distOf(perSession)
	st.SharedPrefix = distOf(shared)
	return st
}

func (st *Stats) measureTransition(prev, c *trace.Call) {
	if slices.Equal(prev.PromptIDs, c.PromptIDs) {
		st.Retries++
		return
	}
	st.Transitions++
	p, r := prev.PromptIDs, prev.ResponseIDs
	if len(c.PromptIDs) < len(p)+len(r) ||
		!slices.Equal(c.PromptIDs[:len(p)], p) ||
		!slices.Equal(c.PromptIDs[len(p):len(p)+len(r)], r) {
		st.ChainBreaks++
	}
}

func commonPrefix(seqs [][]int32) int {
	if len(seqs) == 0 {
		return 0
	}
	n := len(seqs[0])
	for _, s := range seqs[1:] {
		n = min(n, len(s))
		for i := range n {
			if s[i] != seqs[0][i] {
				n = i
				break
			}
		}
	}
	return n
}

// Markdown renders the statistics as two tables: distributions, then counts.
func (s Stats) Markdown() string {
	var b strings.Builder
	b.WriteString("| distribution (tokens unless noted) | n | min | p50 | mean | p90 | max |\n")
	b.WriteString("|---|--:|--:|--:|--:|--:|--:|\n")
	row := func(name string, d Dist) {
		fmt.Fprintf(&b, "| %s | %d | %d | %d | %.0f | %d | %d |\n", name, d.N, d.Min, d.P50, d.Mean, d.P90, d.Max)
	}
	row("prompt per call", s.PromptTokens)
	row("response per call", s.ResponseTokens)
	if s.Events != nil {
		row("tool output", s.Events.ToolOutputTokens)
	}
	row("input tokens per group", s.InputTokensPerGroup)
	row("requests per session (count)", s.RequestsPerSession)
	row("group-shared prefix", s.SharedPrefix)

	b.WriteString("\n| count | value |\n|---|--:|\n")
	count := func(name string, v any) { fmt.Fprintf(&b, "| %s | %v |\n", name, v) }
	count("groups", s.Groups)
	count("sessions", s.Sessions)
	count("requests", s.Requests)
	count("call records (trainable / untrainable)", fmt.Sprintf("%d (%d / %d)", s.Calls, s.TrainableCalls, s.UntrainableCalls))
	count("input tokens (Σ prompt+response)", s.InputTokens)
	count("longest context (prompt+response)", s.LongestContext)
	count("retries", s.Retries)
	count("n>1 requests", s.MultiChoiceRequests)
	count("chain breaks / transitions", fmt.Sprintf("%d / %d", s.ChainBreaks, s.Transitions))
	if e := s.Events; e != nil {
		count("compactions", e.Compactions)
		count("re-tokenization drifts", e.Drifts)
		count("stripped reasoning", e.StrippedReasoning)
		count("sub-agent runs (calls)", fmt.Sprintf("%d (%d)", e.SubAgentRuns, e.SubAgentCalls))
	}
	return b.String()
}
