package corpus

import "math/rand/v2"

// Template token ids, as in the Qwen2.5/Qwen3 tokenizer, so rendered turns have the byte
// structure a real proxy records. The low ones (newline, role names) are ordinary
// vocabulary entries; content sampling skips them so the template stays unambiguous.
const (
	tokNewline       int32 = 198 // "\n"
	tokDoubleNewline int32 = 271 // "\n\n"
	tokUser          int32 = 872
	tokSystem        int32 = 8948
	tokAssistant     int32 = 77091

	firstSpecialID        = 151_643 // <|endoftext|>; VocabSize may not reach it
	tokImStart      int32 = 151_644
	tokImEnd        int32 = 151_645
	tokToolCall     int32 = 151_657
	tokToolCallEnd  int32 = 151_658
	tokToolResponse int32 = 151_665
	tokToolRespEnd  int32 = 151_666
	tokThink        int32 = 151_667
	tokThinkEnd     int32 = 151_668
)

// isTemplate reports whether id is one of the template ids above.
func isTemplate(id int32) bool {
	switch id {
	case tokNewline, tokDoubleNewline, tokUser, tokSystem, tokAssistant:
		return true
	}
	return id >= firstSpecialID
}

// vocab draws content token ids.
type vocab struct {
	rng  *rand.Rand
	size int
}

func (v vocab) token() int32 {
	for {
		if id := int32(v.rng.IntN(v.size)); !isTemplate(id) {
			return id
		}
	}
}

// appendText appends n content tokens.
func (v vocab) appendText(dst []int32, n int) []int32 {
	for range n {
		dst = append(dst, v.token())
	}
	return dst
}

// appendTurn renders "<|im_start|>role\n" body "<|im_end|>\n".
func appendTurn(dst []int32, role int32, body []int32) []int32 {
	dst = append(dst, tokImStart, role, tokNewline)
	dst = append(dst, body...)
	return append(dst, tokImEnd, tokNewline)
}

// appendToolResult renders a tool result the way Qwen3's template does: a user turn
// wrapping the output in <tool_response> tags.
func appendToolResult(dst []int32, output []int32) []int32 {
	dst = append(dst, tokImStart, tokUser, tokNewline, tokToolResponse, tokNewline)
	dst = append(dst, output...)
	return append(dst, tokNewline, tokToolRespEnd, tokImEnd, tokNewline)
}

// appendAssistantHeader opens the turn the model is asked to complete.
func appendAssistantHeader(dst []int32) []int32 {
	return append(dst, tokImStart, tokAssistant, tokNewline)
}

const assistantHeaderLen = 3
