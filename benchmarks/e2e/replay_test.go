package e2e

import (
	"encoding/json"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/floe-rl/floe/internal/corpus"
	"github.com/floe-rl/floe/trace"
)

// TestFromCorpusKeepsTheSharing replays the small corpus as messages and checks that
// what calls share as tokens they share as messages: when a call's prompt extends the
// previous call's prompt and response, its messages extend the previous call's messages
// with an assistant message that is exactly the previous scripted output. Every request
// carries its session's tag once, the group's sessions share their first messages up to
// it, and the requests are valid OpenAI Chat bodies.
func TestFromCorpusKeepsTheSharing(t *testing.T) {
	cfg := corpus.Small()
	cfg.UntrainableProb = 0
	groups, err := corpus.Generate(cfg, 3)
	if err != nil {
		t.Fatal(err)
	}
	broken := corpus.Small()
	broken.UntrainableProb = 1
	if g, _ := corpus.Generate(broken, 3); g != nil {
		if _, err := FromCorpus(g); err == nil || !strings.Contains(err.Error(), "no response tokens") {
			t.Fatalf("a corpus without response tokens: %v", err)
		}
	}
	sessions, err := FromCorpus(groups)
	if err != nil {
		t.Fatal(err)
	}
	byID := map[string]trace.Session{}
	want := 0
	for _, g := range groups {
		for _, s := range g.Sessions {
			byID[s.ID] = s
			want++
		}
	}
	if len(sessions) != want {
		t.Fatalf("%d sessions replayed, the corpus has %d", len(sessions), want)
	}
	extended, cut := 0, 0
	for _, rs := range sessions {
		src := byID[rs.ID]
		var calls []trace.Call
		for _, c := range src.Calls {
			if c.Choice == 0 {
				calls = append(calls, c)
			}
		}
		if len(rs.Calls) != len(calls) {
			t.Fatalf("session %s: %d calls, want %d", rs.ID, len(rs.Calls), len(calls))
		}
		if rs.Reward != src.Reward || (src.Status != trace.StatusRunning && rs.Status != string(src.Status)) {
			t.Fatalf("session %s: outcome %v %s, want %v %s", rs.ID, rs.Reward, rs.Status, src.Reward, src.Status)
		}
		for k, c := range rs.Calls {
			tags := 0
			for _, m := range c.Messages {
				tags += strings.Count(m.Content, rs.Tag)
			}
			if tags != 1 || c.Messages[0].Role != "system" {
				t.Fatalf("session %s call %d: %d tags, first role %s", rs.ID, k, tags, c.Messages[0].Role)
			}
			body, err := c.Body("m")
			if err != nil || !json.Valid(body) {
				t.Fatalf("body: %v", err)
			}
			if calls[k].FinishReason == "length" {
				cut++
				if c.Output.Finish != "length" || c.MaxTokens != len(calls[k].ResponseIDs) {
					t.Fatalf("session %s call %d: a cut response replays as %+v, max_tokens %d", rs.ID, k, c.Output, c.MaxTokens)
				}
			}
			if k == 0 {
				continue
			}
			prev, cur := calls[k-1], calls[k]
			full := slices.Concat(prev.PromptIDs, prev.ResponseIDs)
			if len(cur.PromptIDs) < len(full) || !slices.Equal(cur.PromptIDs[:len(full)], full) || prev.FinishReason == "length" {
				continue
			}
			extended++
			pm, cm := rs.Calls[k-1].Messages, c.Messages
			if len(cm) <= len(pm) || !reflect.DeepEqual(cm[:len(pm)], pm) {
				t.Fatalf("session %s call %d extends call %d's tokens but not its messages", rs.ID, k, k-1)
			}
			a, o := cm[len(pm)], rs.Calls[k-1].Output
			if a.Role != "assistant" || a.Content != o.Content || a.ReasoningContent != o.Reasoning || len(a.ToolCalls) != len(o.ToolCalls) {
				t.Fatalf("session %s call %d: history %+v is not call %d's output %+v", rs.ID, k, a, k-1, o)
			}
			for i, tc := range a.ToolCalls {
				if tc.Function.Name != o.ToolCalls[i].Name || tc.Function.Arguments != o.ToolCalls[i].Arguments {
					t.Fatalf("session %s call %d: tool call %+v, output %+v", rs.ID, k, tc, o.ToolCalls[i])
				}
			}
		}
	}
	if extended < len(sessions) {
		t.Fatalf("only %d calls extend their predecessor: the check saw too little", extended)
	}
	t.Logf("%d sessions, %d calls extending their predecessor, %d cut by max_tokens", len(sessions), extended, cut)

	// The sessions of a group share their system message and their task up to the tag.
	first := map[string]Message{}
	for _, rs := range sessions {
		m := rs.Calls[0].Messages
		task := Message{Role: m[1].Role, Content: strings.TrimSuffix(m[1].Content, " "+rs.Tag)}
		if f, ok := first[rs.Group]; ok && !reflect.DeepEqual(f, task) {
			t.Fatalf("group %s: sessions differ before the tag: %q vs %q", rs.Group, f.Content, task.Content)
		}
		first[rs.Group] = task
	}
}
