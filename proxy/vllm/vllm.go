// Package vllm is the proxy's engine for vLLM's OpenAI-compatible server.
package vllm

import (
	"context"
	"encoding/json"

	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/internal/upstream"
	gojson "github.com/goccy/go-json"
)

// Engine talks to vLLM's OpenAI-compatible server (>= 0.10.2), asking for token ids with
// return_token_ids and for the sampled tokens' log-probabilities with logprobs. vLLM should
// run with --logprobs-mode processed_logprobs, so that the log-probabilities are those of
// the distribution actually sampled from (after temperature and top-p), which is what the
// trainer's importance ratio needs.
type Engine struct {
	BaseURL string       // e.g. http://127.0.0.1:8000
	Model   string       // served model; empty: the first the server lists
	Client  *http.Client // nil: a client without overall timeout (streams are long)

	cache upstream.ServedModel
}

var _ proxy.Engine = (*Engine)(nil)

// New returns the engine for the vLLM server at baseURL serving model (empty: the first
// model the server lists).
func New(baseURL, model string) *Engine { return &Engine{BaseURL: baseURL, Model: model} }

func (v *Engine) client() *http.Client {
	if v.Client != nil {
		return v.Client
	}
	return upstream.Client
}

// served returns the model name to send upstream.
func (v *Engine) served(ctx context.Context) (string, error) {
	return v.cache.Get(ctx, v.Model, v.Models)
}

// request is ChatRequest plus the token-id flags.
type request struct {
	*proxy.ChatRequest
	Logprobs       bool           `json:"logprobs"`
	ReturnTokenIDs bool           `json:"return_token_ids"`
	StreamOptions  map[string]any `json:"stream_options,omitempty"`
}

func (v *Engine) body(ctx context.Context, req *proxy.ChatRequest, stream bool) ([]byte, error) {
	model, err := v.served(ctx)
	if err != nil {
		return nil, err
	}
	r := *req
	r.Model, r.Stream = model, stream
	b, err := upstream.EncodeRequest(&r, func(r *proxy.ChatRequest) ([]byte, error) {
		vr := request{ChatRequest: r, Logprobs: true, ReturnTokenIDs: true}
		if stream {
			vr.StreamOptions = map[string]any{"include_usage": true}
		}
		return upstream.Marshal(vr)
	})
	if err != nil {
		return nil, &proxy.Error{Status: http.StatusInternalServerError, Kind: proxy.ErrInternal, Message: "encoding the upstream request: " + err.Error()}
	}
	return b, nil
}

// post sends body to path and returns the response, or an *Error for a refused connection
// or an error status.
func (v *Engine) post(ctx context.Context, path string, body []byte) (*http.Response, error) {
	return upstream.PostJSON(ctx, v.client(), v.BaseURL, path, body, upstream.MapError)
}

// chunkChoice is a choice of a vLLM response or stream chunk.
type chunkChoice struct {
	Index        int             `json:"index"`
	Message      *message        `json:"message"`
	Delta        *delta          `json:"delta"`
	FinishReason *string         `json:"finish_reason"`
	TokenIDs     []int32         `json:"token_ids"`
	Logprobs     *choiceLogprobs `json:"logprobs"`
	MetaInfo     map[string]any  `json:"meta_info,omitempty"`
	// StopReason is what stopped a "stop" finish: the matched stop string, a stop token
	// id (a number), or null for the end-of-sequence token. vLLM sends it on the
	// non-streamed choice and on the stream's finishing chunk.
	StopReason json.RawMessage `json:"stop_reason"`
}

// message is a non-streamed answer's message. vLLM 0.32 names its reasoning "reasoning"
// (ChatMessage in entrypoints/openai/chat_completion/protocol.py); older versions
// "reasoning_content", which the embedded ChatMessage reads.
type message struct {
	proxy.ChatMessage
	Reasoning *string `json:"reasoning"`
}

// chat is m as the normalized message, its reasoning under either name.
func (m *message) chat() *proxy.ChatMessage {
	if m == nil {
		return nil
	}
	out := m.ChatMessage
	if out.ReasoningContent == "" && m.Reasoning != nil {
		out.ReasoningContent = *m.Reasoning
	}
	return &out
}

type delta struct {
	Content          *string `json:"content"`
	ReasoningContent *string `json:"reasoning_content"`
	Reasoning        *string `json:"reasoning"` // newer vLLM name for reasoning_content
	ToolCalls        []struct {
		Index    int    `json:"index"`
		ID       string `json:"id"`
		Function struct {
			Name      string `json:"name"`
			Arguments string `json:"arguments"`
		} `json:"function"`
	} `json:"tool_calls"`
}

type choiceLogprobs struct {
	Content []struct {
		Logprob float32 `json:"logprob"`
	} `json:"content"`
}

type response struct {
	ID             string        `json:"id"`
	Choices        []chunkChoice `json:"choices"`
	Usage          *proxy.Usage  `json:"usage"`
	PromptTokenIDs []int32       `json:"prompt_token_ids"`
}

func (v *Engine) Complete(ctx context.Context, req *proxy.ChatRequest) (*proxy.Result, error) {
	body, err := v.body(ctx, req, false)
	if err != nil {
		return nil, err
	}
	var vr response
	latency, err := upstream.Complete(ctx, v.post, body, &vr)
	if err != nil {
		return nil, v.countPrompt(ctx, req, err)
	}
	res := &proxy.Result{Upstream: body, Latency: latency, PromptIDs: vr.PromptTokenIDs}
	res.Response.ID = vr.ID
	if vr.Usage != nil {
		res.Response.Usage = *vr.Usage
	}
	for _, c := range vr.Choices {
		ch := upstream.AnswerChoice(c.Index, c.Message.chat(), c.FinishReason)
		if ch.FinishReason == proxy.FinishStop {
			ch.StopSequence = upstream.StopSequence(c.StopReason, req.Stop)
		}
		res.Response.Choices = append(res.Response.Choices, ch)
		res.Choices = append(res.Choices, tokenData(c.TokenIDs, c.Logprobs, vr.PromptTokenIDs))
	}
	if len(res.Response.Choices) == 0 {
		return nil, &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable, Message: "the inference server answered with no choices"}
	}
	return res, nil
}

// tokenData checks one choice's token data.
func tokenData(ids []int32, lp *choiceLogprobs, prompt []int32) proxy.TokenData {
	td := proxy.TokenData{ResponseIDs: ids}
	if lp != nil {
		td.Logprobs = make([]float32, len(lp.Content))
		for i, c := range lp.Content {
			td.Logprobs[i] = c.Logprob
		}
	}
	switch {
	case len(prompt) == 0:
		td.Problem = "the inference server returned no prompt_token_ids (vLLM >= 0.10.2 with return_token_ids is needed)"
	case ids == nil:
		td.Problem = "the inference server returned no token_ids for the response"
	case lp == nil:
		td.Problem = "the inference server returned no logprobs"
	case len(td.Logprobs) != len(ids):
		td.Problem = fmt.Sprintf("%d logprobs for %d response token ids", len(td.Logprobs), len(ids))
	}
	return td
}

// streamChoice accumulates one choice of a stream.
type streamChoice struct {
	content, reasoning strings.Builder
	calls              []proxy.ChatToolCall
	ids                []int32
	logprobs           []float32
	sawIDs, sawLP      bool
	finish             string
	stopReason         json.RawMessage
}

func (v *Engine) Stream(ctx context.Context, req *proxy.ChatRequest, sink proxy.StreamSink) (*proxy.Result, error) {
	body, err := v.body(ctx, req, true)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := time.Now()
	resp, err := v.post(ctx, "/v1/chat/completions", body)
	if err != nil {
		return nil, v.countPrompt(ctx, req, err)
	}
	defer func() { _ = resp.Body.Close() }() // the body is read or abandoned; its Close error changes nothing
	res := &proxy.Result{Upstream: body}
	var choices []*streamChoice
	choice := func(i int) *streamChoice {
		for len(choices) <= i {
			choices = append(choices, &streamChoice{})
		}
		return choices[i]
	}
	done := false
	err = proxy.ReadSSE(resp.Body, sink.Flush, func(data []byte) error {
		if string(data) == "[DONE]" {
			done = true
			return errStopSSE
		}
		var chunk response
		if err := gojson.Unmarshal(data, &chunk); err != nil {
			return fmt.Errorf("a stream chunk is not JSON: %w", err)
		}
		if res.Response.ID == "" {
			res.Response.ID = chunk.ID
		}
		if chunk.PromptTokenIDs != nil {
			res.PromptIDs = chunk.PromptTokenIDs
		}
		if chunk.Usage != nil {
			res.Response.Usage = *chunk.Usage
		}
		for _, c := range chunk.Choices {
			sc := choice(c.Index)
			if c.TokenIDs != nil {
				sc.sawIDs = true
				sc.ids = append(sc.ids, c.TokenIDs...)
			}
			if c.Logprobs != nil {
				sc.sawLP = true
				for _, x := range c.Logprobs.Content {
					sc.logprobs = append(sc.logprobs, x.Logprob)
				}
			}
			if c.FinishReason != nil && *c.FinishReason != "" {
				sc.finish = *c.FinishReason
			}
			if len(c.StopReason) > 0 && string(c.StopReason) != "null" {
				sc.stopReason = c.StopReason
			}
			if c.Delta == nil {
				continue
			}
			d := proxy.Delta{}
			if c.Delta.Content != nil {
				d.Content = *c.Delta.Content
				sc.content.WriteString(d.Content)
			}
			if r := c.Delta.ReasoningContent; r != nil {
				d.Reasoning = *r
			} else if r := c.Delta.Reasoning; r != nil {
				d.Reasoning = *r
			}
			sc.reasoning.WriteString(d.Reasoning)
			for _, tc := range c.Delta.ToolCalls {
				for len(sc.calls) <= tc.Index {
					sc.calls = append(sc.calls, proxy.ChatToolCall{Type: "function"})
				}
				call := &sc.calls[tc.Index]
				if tc.ID != "" {
					call.ID = tc.ID
				}
				call.Function.Name += tc.Function.Name
				call.Function.Arguments += tc.Function.Arguments
				d.ToolCalls = append(d.ToolCalls, proxy.ToolCallDelta{Index: tc.Index, ID: tc.ID, Name: tc.Function.Name, Arguments: tc.Function.Arguments})
			}
			if c.Index == 0 && (d.Content != "" || d.Reasoning != "" || len(d.ToolCalls) > 0) {
				if err := sink.Delta(d); err != nil {
					return fmt.Errorf("%w: %w", proxy.ErrCallerGone, err)
				}
			}
		}
		return nil
	})
	res.Latency = time.Since(start)
	if done {
		// The deltas read with [DONE] go to the caller before the wait for the body's end,
		// which may block.
		sink.Flush()
		// Read on to the body's end (the chunked encoding's last chunk, right after
		// [DONE]): a body closed before its end takes its connection with it, and every
		// streamed call would then open a new one to the inference server. A server that
		// sends nothing more for drainWait loses the connection (the read is cancelled).
		t := time.AfterFunc(drainWait, cancel)
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, drainBytes))
		t.Stop()
	}
	finishStream(res, choices, req.Stop)
	if err != nil && !errors.Is(err, errStopSSE) {
		if errors.Is(err, proxy.ErrCallerGone) || ctx.Err() != nil {
			return res, proxy.ErrCallerGone
		}
		var timeout *proxy.Error
		if errors.As(err, &timeout) && timeout.Kind == proxy.ErrTimeout {
			return res, timeout
		}
		return res, &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable, Message: "the inference server's stream broke: " + err.Error()}
	}
	if !done {
		return res, &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable, Message: "the inference server closed the stream before [DONE]"}
	}
	if len(res.Response.Choices) == 0 {
		return res, &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable, Message: "the inference server streamed no choices"}
	}
	return res, nil
}

// finishStream turns the accumulated choices into the result, whole or partial.
func finishStream(res *proxy.Result, choices []*streamChoice, stop []string) {
	for i, sc := range choices {
		msg := proxy.ChatMessage{Role: "assistant", Content: sc.content.String(), ReasoningContent: sc.reasoning.String(), ToolCalls: sc.calls}
		ch := proxy.Choice{Index: i, Message: msg, FinishReason: sc.finish}
		if ch.FinishReason == proxy.FinishStop {
			ch.StopSequence = upstream.StopSequence(sc.stopReason, stop)
		}
		res.Response.Choices = append(res.Response.Choices, ch)
		var ids []int32
		if sc.sawIDs {
			ids = sc.ids
			if ids == nil {
				ids = []int32{}
			}
		}
		var lp *choiceLogprobs
		if sc.sawLP {
			lp = &choiceLogprobs{}
			for _, x := range sc.logprobs {
				lp.Content = append(lp.Content, struct {
					Logprob float32 `json:"logprob"`
				}{x})
			}
		}
		res.Choices = append(res.Choices, tokenData(ids, lp, res.PromptIDs))
	}
}

// tokenizeRequest is vLLM's TokenizeChatRequest for the conversation a chat call would
// render: the same messages, tools and chat_template_kwargs (enable_thinking changes the
// template's output), with the generation prompt.
type tokenizeRequest struct {
	Model               string            `json:"model"`
	Messages            []tokenizeMessage `json:"messages"`
	Tools               []proxy.ChatTool  `json:"tools,omitempty"`
	ChatTemplateKwargs  map[string]any    `json:"chat_template_kwargs,omitempty"`
	AddGenerationPrompt bool              `json:"add_generation_prompt"`
}

// tokenizeMessage is a message as /tokenize must get it: with its reasoning under
// "reasoning" as well as "reasoning_content". vLLM's chat-template parser
// (renderers/chat_utils.py, _parse_chat_message_content) reads an assistant's
// reasoning from "reasoning" only; /v1/chat/completions first renames
// "reasoning_content" to "reasoning" (ChatCompletionRequest._normalize_messages_before),
// /tokenize's TokenizeChatRequest does not, so a history with thinking counted 10
// tokens short of the prompt the chat call rendered (328 against 338). Older vLLM,
// which reads "reasoning_content", finds it too.
type tokenizeMessage struct {
	proxy.ChatMessage
	Reasoning string `json:"reasoning,omitempty"`
}

// CountTokens counts the prompt a chat call of req would render (vLLM's /tokenize).
func (v *Engine) CountTokens(ctx context.Context, req *proxy.ChatRequest) (int, error) {
	model, err := v.served(ctx)
	if err != nil {
		return 0, err
	}
	tr := tokenizeRequest{Model: model, Tools: req.Tools, ChatTemplateKwargs: req.ChatTemplateKwargs, AddGenerationPrompt: true}
	tr.Messages = make([]tokenizeMessage, len(req.Messages))
	for i, m := range req.Messages {
		tr.Messages[i] = tokenizeMessage{ChatMessage: m, Reasoning: m.ReasoningContent}
	}
	body, err := upstream.Marshal(tr)
	if err != nil {
		return 0, fmt.Errorf("encoding the tokenize request: %w", err)
	}
	return upstream.TokenCount(ctx, v.client(), v.BaseURL, "/tokenize", body, upstream.MapError)
}

// countPrompt completes a context-length refusal (err) with the prompt's exact length
// when vLLM did not give it (upstream.PromptTokensUnknown), by counting req's prompt
// with /tokenize: the harness is then told how far over the limit it is, and, when
// max_tokens alone was too large, that its prompt fits. Any other error, or a count that
// fails, is returned as it was.
func (v *Engine) countPrompt(ctx context.Context, req *proxy.ChatRequest, err error) error {
	var e *proxy.Error
	if !errors.As(err, &e) || !upstream.PromptTokensUnknown(e) || ctx.Err() != nil {
		return err
	}
	n, cerr := v.CountTokens(ctx, req)
	if cerr != nil || n <= 0 {
		return err
	}
	counted := *e
	counted.PromptTokens = n
	return &counted
}

func (v *Engine) Models(ctx context.Context) ([]string, error) {
	return upstream.ListModels(ctx, v.client(), v.BaseURL, upstream.MapError)
}

// drainBytes bounds what is read of an upstream stream after its [DONE], for its
// connection to be reused; a server sending more than this after it loses the connection.
const drainBytes = 4 << 10

// drainWait bounds the wait for the end of an upstream stream's body after its [DONE].
const drainWait = 50 * time.Millisecond

// errStopSSE ends reading the upstream stream at its [DONE].
var errStopSSE = errors.New("end of stream")
