package corpus

import "fmt"

// Turn is one turn of a rendered corpus prompt, read back: its role and its content
// tokens (template tokens removed). Role is system, user, assistant, or tool for a user
// turn wrapping a tool response.
type Turn struct {
	Role      string
	Content   []int32   // system, user and tool turns
	Assistant Assistant // assistant turns
}

// Assistant is an assistant turn's (or a response's) parts, as Qwen3 lays them out:
// [<think> reasoning </think>] content [<tool_call> args </tool_call>] [<|im_end|>].
type Assistant struct {
	Reasoning, Content, ToolArgs []int32
	ToolCall                     bool
}

// ParsePrompt reads a prompt the generator rendered (ChatML turns, ending in the open
// assistant header) back into its turns, so the corpus can be replayed as messages.
func ParsePrompt(ids []int32) ([]Turn, error) {
	var turns []Turn
	for i := 0; i < len(ids); {
		if ids[i] != tokImStart || i+2 >= len(ids) || ids[i+2] != tokNewline {
			return nil, fmt.Errorf("token %d: want <|im_start|> role newline, got id %d", i, ids[i])
		}
		role := ids[i+1]
		i += 3
		end := i
		for end < len(ids) && ids[end] != tokImEnd {
			end++
		}
		if end == len(ids) { // the open assistant header the model completes
			if role != tokAssistant || end != i {
				return nil, fmt.Errorf("the prompt does not end in the assistant header")
			}
			return turns, nil
		}
		body := ids[i:end]
		i = end + 1
		if i < len(ids) && ids[i] == tokNewline {
			i++
		}
		switch role {
		case tokSystem:
			turns = append(turns, Turn{Role: "system", Content: content(body)})
		case tokUser:
			r := "user"
			if len(body) > 0 && body[0] == tokToolResponse {
				r = "tool"
			}
			turns = append(turns, Turn{Role: r, Content: content(body)})
		case tokAssistant:
			turns = append(turns, Turn{Role: "assistant", Assistant: ParseAssistant(body)})
		default:
			return nil, fmt.Errorf("token %d: unknown role id %d", i, role)
		}
	}
	return nil, fmt.Errorf("the prompt does not end in the assistant header")
}

// ParseAssistant splits an assistant turn or a response into its parts.
func ParseAssistant(ids []int32) Assistant {
	var a Assistant
	part := &a.Content
	for _, id := range ids {
		switch id {
		case tokThink:
			part = &a.Reasoning
		case tokToolCall:
			part, a.ToolCall = &a.ToolArgs, true
		case tokThinkEnd, tokToolCallEnd:
			part = &a.Content
		default:
			if !isTemplate(id) {
				*part = append(*part, id)
			}
		}
	}
	return a
}

// content is body without its template tokens.
func content(body []int32) []int32 {
	out := make([]int32, 0, len(body))
	for _, id := range body {
		if !isTemplate(id) {
			out = append(out, id)
		}
	}
	return out
}
