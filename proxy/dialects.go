package proxy

// DefaultDialects serves all four provider APIs.
func DefaultDialects() Dialects {
	return Dialects{Anthropic: Anthropic{}, Chat: OpenAIChat{}, Responses: Responses{}, Gemini: Gemini{}}
}
