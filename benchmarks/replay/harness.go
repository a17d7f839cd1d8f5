package replay

import (
	"embed"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
)

// The captures are the real CLIs' first requests (capture_harness.py says how they were
// taken); they are embedded so a replay needs nothing beside the binary.
//
//go:embed testdata/harness/*.json
var captures embed.FS

// Harness is a real harness CLI's context: the system messages (and whatever it puts
// around the user's task) and the tool schemas it sends with every model call.
type Harness struct {
	CLI     string `json:"cli"`
	Package string `json:"package"`
	Version string `json:"version"`
	// Messages are the first request's messages; "{{TASK}}" stands where the task goes.
	Messages []struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	} `json:"messages"`
	Tools json.RawMessage `json:"tools"` // OpenAI Chat function tools
}

// TaskPlaceholder marks where the task's text goes in a harness's messages.
const TaskPlaceholder = "{{TASK}}"

// HarnessNames are the captured harnesses.
func HarnessNames() []string {
	ents, _ := captures.ReadDir("testdata/harness")
	var out []string
	for _, e := range ents {
		out = append(out, strings.TrimSuffix(e.Name(), ".json"))
	}
	slices.Sort(out)
	return out
}

// LoadHarness returns the captured context of a harness CLI: claude-code or pi.
func LoadHarness(name string) (*Harness, error) {
	raw, err := captures.ReadFile("testdata/harness/" + name + ".json")
	if err != nil {
		return nil, fmt.Errorf("no captured harness %q (have %s)", name, strings.Join(HarnessNames(), ", "))
	}
	var h Harness
	if err := json.Unmarshal(raw, &h); err != nil {
		return nil, fmt.Errorf("harness capture %s: %w", name, err)
	}
	return &h, nil
}

// HarnessFor names the captured harness that recorded rollouts of this agent (NeMo Gym's
// agent_ref name), or "" when none was captured.
func HarnessFor(agent string) string {
	switch {
	case strings.Contains(agent, "claude_code"), strings.Contains(agent, "claude-code"):
		return "claude-code"
	case strings.HasSuffix(agent, "_pi"), agent == "pi":
		return "pi"
	}
	return ""
}
