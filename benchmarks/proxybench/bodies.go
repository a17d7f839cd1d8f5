package proxybench

import (
	"encoding/json"
	"fmt"
	"strings"
)

// Dialect is one provider API the proxy serves, as the benchmark sends it.
type Dialect string

// The dialects, in the order the report lists them.
const (
	Chat      Dialect = "openai_chat"
	Responses Dialect = "openai_responses"
	Anthropic Dialect = "anthropic"
	Gemini    Dialect = "gemini"
)

// AllDialects is every dialect the proxy serves.
var AllDialects = []Dialect{Chat, Responses, Anthropic, Gemini}

// Label names the dialect in the report.
func (d Dialect) Label() string {
	switch d {
	case Chat:
		return "OpenAI chat"
	case Responses:
		return "OpenAI Responses → chat"
	case Anthropic:
		return "Anthropic Messages → chat"
	case Gemini:
		return "Gemini → chat"
	}
	return string(d)
}

// request is one prepared call: where it goes and its body.
type request struct {
	path string
	body []byte
}

// path is where the dialect's generate call goes; Gemini carries the stream flag in it.
func (d Dialect) path(stream bool) string {
	switch d {
	case Responses:
		return "/v1/responses"
	case Anthropic:
		return "/v1/messages"
	case Gemini:
		if stream {
			return "/v1beta/models/m:streamGenerateContent?alt=sse"
		}
		return "/v1beta/models/m:generateContent"
	}
	return "/v1/chat/completions"
}

// turn is one round of an agent's history: the user (or the harness) says something, the
// model calls a tool, the tool answers with a file's worth of code.
type turn struct {
	user, tool, path, output string
}

// history builds turns until the body of each dialect is at least size bytes: an agent
// session as Claude Code, Codex and Gemini CLI send it, mostly tool results (source
// files, with the quotes, tabs and newlines that JSON escapes).
func history(i int) turn {
	var out strings.Builder
	for j := 0; j < 30; j++ {
		fmt.Fprintf(&out, "\tif err := s.step%d(ctx, \"arg-%d\"); err != nil {\n\t\treturn fmt.Errorf(\"step %d: %%w\", err)\n\t}\n", j, i, j)
	}
	return turn{
		user:   fmt.Sprintf("Turn %d: the test TestStep%d still fails with \"unexpected EOF\"; read the file and fix the loop, keeping the API as it is. ", i, i) + strings.Repeat("Context line. ", 8),
		tool:   "read_file",
		path:   fmt.Sprintf("internal/step/step_%d.go", i),
		output: "package step\n\nfunc (s *Stepper) Run(ctx context.Context) error {\n" + out.String() + "\treturn nil\n}\n",
	}
}

const systemPrompt = "You are a coding agent working in a Go repository. Use the tools to read and edit files, run tests, and report what you changed. "

// toolSchema is one tool's parameters, shared by every dialect's declaration.
var toolSchema = map[string]any{"type": "object", "properties": map[string]any{
	"path": map[string]any{"type": "string", "description": "file path, relative to the repository root"}}, "required": []string{"path"}}

var toolNames = []string{"read_file", "write_file", "list_dir", "grep", "run_tests", "edit_file", "shell", "web_fetch"}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// Body returns a request of dialect d of at least size bytes (grown by whole turns),
// streaming or not.
func Body(d Dialect, size int, stream bool) []byte {
	// Start from the number of turns the first turn's size predicts, then add turns one
	// at a time: re-encoding from none would take quadratic time at 512 KiB.
	base, one := len(encode(d, nil, stream)), len(encode(d, []turn{history(0)}, stream))
	n := max((size-base)/max(one-base, 1)-1, 0)
	turns := make([]turn, 0, n+4)
	for i := 0; i < n; i++ {
		turns = append(turns, history(i))
	}
	for {
		b := encode(d, turns, stream)
		if len(b) >= size {
			return b
		}
		turns = append(turns, history(len(turns)))
	}
}

func encode(d Dialect, turns []turn, stream bool) []byte {
	sys := strings.Repeat(systemPrompt, 16)
	last := "Now run the tests again and tell me what is left."
	switch d {
	case Chat:
		var tools []any
		for _, n := range toolNames {
			tools = append(tools, map[string]any{"type": "function", "function": map[string]any{"name": n, "description": "the " + n + " tool", "parameters": toolSchema}})
		}
		msgs := []any{map[string]any{"role": "system", "content": sys}}
		for i, t := range turns {
			id := fmt.Sprintf("call_%d", i)
			args := string(mustJSON(map[string]string{"path": t.path}))
			msgs = append(msgs,
				map[string]any{"role": "user", "content": t.user},
				map[string]any{"role": "assistant", "content": "Reading the file.", "tool_calls": []any{map[string]any{"id": id, "type": "function", "function": map[string]any{"name": t.tool, "arguments": args}}}},
				map[string]any{"role": "tool", "tool_call_id": id, "content": t.output})
		}
		msgs = append(msgs, map[string]any{"role": "user", "content": last})
		return mustJSON(map[string]any{"model": "m", "stream": stream, "max_tokens": 1024, "temperature": 1, "tools": tools, "messages": msgs})
	case Responses:
		var tools []any
		for _, n := range toolNames {
			tools = append(tools, map[string]any{"type": "function", "name": n, "description": "the " + n + " tool", "parameters": toolSchema})
		}
		var input []any
		for i, t := range turns {
			id := fmt.Sprintf("call_%d", i)
			input = append(input,
				map[string]any{"type": "message", "role": "user", "content": []any{map[string]any{"type": "input_text", "text": t.user}}},
				map[string]any{"type": "message", "role": "assistant", "content": []any{map[string]any{"type": "output_text", "text": "Reading the file."}}},
				map[string]any{"type": "function_call", "call_id": id, "name": t.tool, "arguments": string(mustJSON(map[string]string{"path": t.path}))},
				map[string]any{"type": "function_call_output", "call_id": id, "output": t.output})
		}
		input = append(input, map[string]any{"type": "message", "role": "user", "content": []any{map[string]any{"type": "input_text", "text": last}}})
		return mustJSON(map[string]any{"model": "m", "stream": stream, "instructions": sys, "max_output_tokens": 1024, "tools": tools, "input": input, "store": false})
	case Anthropic:
		var tools []any
		for _, n := range toolNames {
			tools = append(tools, map[string]any{"name": n, "description": "the " + n + " tool", "input_schema": toolSchema})
		}
		var msgs []any
		for i, t := range turns {
			id := fmt.Sprintf("toolu_%d", i)
			msgs = append(msgs,
				map[string]any{"role": "user", "content": []any{map[string]any{"type": "text", "text": t.user}}},
				map[string]any{"role": "assistant", "content": []any{
					map[string]any{"type": "text", "text": "Reading the file."},
					map[string]any{"type": "tool_use", "id": id, "name": t.tool, "input": map[string]string{"path": t.path}}}},
				map[string]any{"role": "user", "content": []any{map[string]any{"type": "tool_result", "tool_use_id": id, "content": t.output}}})
		}
		msgs = append(msgs, map[string]any{"role": "user", "content": last})
		return mustJSON(map[string]any{"model": "m", "stream": stream, "max_tokens": 1024,
			"system": []any{map[string]any{"type": "text", "text": sys}}, "tools": tools, "messages": msgs})
	case Gemini:
		var decls []any
		for _, n := range toolNames {
			decls = append(decls, map[string]any{"name": n, "description": "the " + n + " tool", "parametersJsonSchema": toolSchema})
		}
		var contents []any
		for _, t := range turns {
			contents = append(contents,
				map[string]any{"role": "user", "parts": []any{map[string]any{"text": t.user}}},
				map[string]any{"role": "model", "parts": []any{map[string]any{"text": "Reading the file."}, map[string]any{"functionCall": map[string]any{"name": t.tool, "args": map[string]string{"path": t.path}}}}},
				map[string]any{"role": "user", "parts": []any{map[string]any{"functionResponse": map[string]any{"name": t.tool, "response": map[string]string{"output": t.output}}}}})
		}
		contents = append(contents, map[string]any{"role": "user", "parts": []any{map[string]any{"text": last}}})
		return mustJSON(map[string]any{"systemInstruction": map[string]any{"parts": []any{map[string]any{"text": sys}}},
			"tools": []any{map[string]any{"functionDeclarations": decls}}, "generationConfig": map[string]any{"maxOutputTokens": 1024}, "contents": contents})
	}
	panic("unknown dialect " + string(d))
}
