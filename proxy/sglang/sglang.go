// Package sglang is the proxy's engine for SGLang's OpenAI-compatible server.
package sglang

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"slices"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/internal/upstream"
	gojson "github.com/goccy/go-json"
)

// Engine talks to SGLang's OpenAI-compatible server. It asks /v1/chat/completions for
// the sampled tokens' log-probabilities (logprobs), the prompt's token ids
// (return_prompt_token_ids), the response's token ids (return_token_ids) and, for servers
// that predate return_token_ids, the per-token (logprob, id) pairs of meta_info
// (return_meta_info). SGLang gives these only on non-streaming calls, so every upstream
// call is non-streaming; a streaming caller gets the answer replayed as its own SSE events
// once it is complete (see Stream).
//
// SGLang reports the log-probability of softmax(logits / temperature), before top-k,
// top-p and min-p filtering; the environment variable SGLANG_RETURN_ORIGINAL_LOGPROB
// switches it to the raw model's (before temperature) and must stay unset for training.
//
// SGLang wire format, as read in the SGLang source (github.com/sgl-project/sglang):
//
//   - python/sglang/srt/entrypoints/openai/protocol.py (at 004c82e07d876f6e4a0ad6e15325706b0f478f1a):
//     ChatCompletionRequest takes logprobs, top_logprobs, return_prompt_token_ids,
//     return_token_ids and return_meta_info; each ChatCompletionResponseChoice carries
//     message, logprobs (ChoiceLogprobs: content[].logprob), finish_reason ("stop",
//     "length", "tool_calls", "content_filter", "function_call" or "abort"),
//     prompt_token_ids, token_ids and meta_info, each omitted when unset. TokenizeRequest
//     takes messages, tools, tool_choice and chat_template_kwargs (or a prompt);
//     TokenizeResponse answers tokens, count and max_model_len. ModelList is
//     {"object":"list","data":[{"id":…}]}. ErrorResponse is {object, message, type,
//     param, code}.
//   - python/sglang/srt/entrypoints/openai/serving_chat.py (at 002897c23becbd522d88b8115a763a21765f978a
//     and later): _build_chat_response sets each choice's prompt_token_ids (the
//     tokenized prompt, the same for every choice of an n > 1 request) when
//     return_prompt_token_ids (or later return_token_ids) is set and its meta_info when
//     return_meta_info is set; since sgl-project/sglang#30917 also the raw generated ids
//     (output_ids, before reasoning and tool-call parsing) when return_token_ids is set,
//     as choices[].token_ids, which #35225 renamed choices[].response_token_ids.
//     _convert_to_internal_request refuses all three id flags when stream is true.
//   - python/sglang/srt/managers/tokenizer_manager.py: meta_info.output_token_logprobs is a
//     list of (logprob, token_id, token_text) tuples (detokenize_logprob_tokens), JSON
//     arrays on the wire, one per generated token; the request validation refuses a
//     prompt over the context with "The input (N tokens) is longer than the model's
//     context length (C tokens)." and a prompt plus max tokens over it with "Requested
//     token count exceeds the model's maximum context length of C tokens. You requested a
//     total of T tokens: N tokens from the input messages and M tokens for the
//     completion. …", both answered as 400.
//   - python/sglang/srt/entrypoints/openai/serving_base.py: create_error_response answers
//     the flat ErrorResponse (older servers) or OpenAI's {"error": {message, type, param,
//     code}} envelope (newer ones).
//   - python/sglang/srt/entrypoints/http_server.py: GET /v1/models, POST /v1/tokenize
//     (also /tokenize), POST /v1/chat/completions; serving_tokenize.py renders a
//     TokenizeRequest's messages with the chat template as the chat endpoint does.
//   - python/sglang/srt/layers/sampler.py: the log-probabilities above (log of the
//     temperature-scaled softmax; SGLANG_RETURN_ORIGINAL_LOGPROB for the raw ones).
type Engine struct {
	BaseURL string       // e.g. http://127.0.0.1:30000
	Model   string       // served model; empty: the first the server lists
	Client  *http.Client // nil: a shared client with many idle connections per host

	cache upstream.ServedModel
}

var _ proxy.Engine = (*Engine)(nil)

// New returns the engine for the SGLang server at baseURL serving model (empty: the first
// model the server lists).
func New(baseURL, model string) *Engine { return &Engine{BaseURL: baseURL, Model: model} }

func (s *Engine) client() *http.Client {
	if s.Client != nil {
		return s.Client
	}
	return upstream.Client
}

// served returns the model name to send upstream.
func (s *Engine) served(ctx context.Context) (string, error) {
	return s.cache.Get(ctx, s.Model, s.Models)
}

func (s *Engine) post(ctx context.Context, path string, body []byte) (*http.Response, error) {
	return upstream.PostJSON(ctx, s.client(), s.BaseURL, path, body, mapError)
}

// request is ChatRequest plus SGLang's token flags. Streaming is never asked for:
// SGLang refuses the id flags on a stream.
type request struct {
	*proxy.ChatRequest
	Logprobs             bool `json:"logprobs"`
	ReturnPromptTokenIDs bool `json:"return_prompt_token_ids"`
	ReturnTokenIDs       bool `json:"return_token_ids"`
	// ReturnMetaInfo asks for meta_info.output_token_logprobs, the only source of the
	// response's token ids on servers older than return_token_ids; newer servers answer
	// both, and the two are checked against each other.
	ReturnMetaInfo bool `json:"return_meta_info"`
}

func (s *Engine) body(ctx context.Context, req *proxy.ChatRequest) ([]byte, error) {
	model, err := s.served(ctx)
	if err != nil {
		return nil, err
	}
	r := *req
	r.Model, r.Stream = model, false
	b, err := upstream.EncodeRequest(&r, func(r *proxy.ChatRequest) ([]byte, error) {
		return upstream.Marshal(request{ChatRequest: r, Logprobs: true, ReturnPromptTokenIDs: true, ReturnTokenIDs: true, ReturnMetaInfo: true})
	})
	if err != nil {
		return nil, &proxy.Error{Status: http.StatusInternalServerError, Kind: proxy.ErrInternal, Message: "encoding the upstream request: " + err.Error()}
	}
	return b, nil
}

// response is a non-streaming /v1/chat/completions answer.
type response struct {
	ID      string           `json:"id"`
	Choices []responseChoice `json:"choices"`
	Usage   *proxy.Usage     `json:"usage"`
}

type responseChoice struct {
	Index          int                `json:"index"`
	Message        *proxy.ChatMessage `json:"message"`
	FinishReason   *string            `json:"finish_reason"`
	Logprobs       *choiceLogprobs    `json:"logprobs"`
	PromptTokenIDs []int32            `json:"prompt_token_ids"`
	// The generated ids under return_token_ids: token_ids from sgl-project/sglang#30917,
	// response_token_ids since #35225.
	TokenIDs         []int32   `json:"token_ids"`
	ResponseTokenIDs []int32   `json:"response_token_ids"`
	MetaInfo         *metaInfo `json:"meta_info"`
	// MatchedStop is what stopped a "stop" finish: the matched stop string, a stop token
	// id (a number), or null (SGLang's name for vLLM's stop_reason).
	MatchedStop json.RawMessage `json:"matched_stop"`
}

// choiceLogprobs is ChoiceLogprobs. A log-probability is a pointer because SGLang's JSON
// encoder writes -inf and NaN as null, which must not read as 0 (probability one).
type choiceLogprobs struct {
	Content []struct {
		Logprob *float64 `json:"logprob"`
	} `json:"content"`
}

type metaInfo struct {
	OutputTokenLogprobs []tokenLogprob `json:"output_token_logprobs"`
}

// tokenLogprob is one (logprob, token_id, token_text) tuple of
// meta_info.output_token_logprobs; only the token id is used.
type tokenLogprob struct {
	ID int32
}

func (t *tokenLogprob) UnmarshalJSON(b []byte) error {
	var tuple []json.RawMessage
	if err := gojson.Unmarshal(b, &tuple); err != nil {
		return fmt.Errorf("an output_token_logprobs entry is not a (logprob, token_id, text) array: %w", err)
	}
	if len(tuple) < 2 {
		return fmt.Errorf("an output_token_logprobs entry has %d fields, want (logprob, token_id, text)", len(tuple))
	}
	if err := gojson.Unmarshal(tuple[1], &t.ID); err != nil {
		return fmt.Errorf("an output_token_logprobs token id: %w", err)
	}
	return nil
}

// Complete sends one non-streaming request and returns every choice with its token data.
func (s *Engine) Complete(ctx context.Context, req *proxy.ChatRequest) (*proxy.Result, error) {
	body, err := s.body(ctx, req)
	if err != nil {
		return nil, err
	}
	var sr response
	latency, err := upstream.Complete(ctx, s.post, body, &sr)
	if err != nil {
		return nil, err
	}
	if len(sr.Choices) == 0 {
		return nil, &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable, Message: "the inference server answered with no choices"}
	}
	// The choices of one request share its prompt: choice 0's ids are the call's.
	res := &proxy.Result{Upstream: body, Latency: latency, PromptIDs: sr.Choices[0].PromptTokenIDs}
	res.Response.ID = sr.ID
	if sr.Usage != nil {
		res.Response.Usage = *sr.Usage
	}
	for i := range sr.Choices {
		c := &sr.Choices[i]
		ch := upstream.AnswerChoice(c.Index, c.Message, c.FinishReason)
		if ch.FinishReason == proxy.FinishStop {
			ch.StopSequence = upstream.StopSequence(c.MatchedStop, req.Stop)
		}
		res.Response.Choices = append(res.Response.Choices, ch)
		res.Choices = append(res.Choices, tokenData(c, res.PromptIDs, ch.FinishReason))
	}
	return res, nil
}

// tokenData gathers one choice's token data and says why it cannot be trained on,
// if it cannot. prompt is choice 0's prompt_token_ids, which a sibling choice must repeat
// when it carries its own.
func tokenData(c *responseChoice, prompt []int32, finish string) proxy.TokenData {
	var metaIDs []int32
	if c.MetaInfo != nil && c.MetaInfo.OutputTokenLogprobs != nil {
		metaIDs = make([]int32, len(c.MetaInfo.OutputTokenLogprobs))
		for i, t := range c.MetaInfo.OutputTokenLogprobs {
			metaIDs[i] = t.ID
		}
	}
	ids, source := c.ResponseTokenIDs, "response_token_ids"
	if ids == nil {
		ids, source = c.TokenIDs, "token_ids"
	}
	if ids == nil {
		ids, source, metaIDs = metaIDs, "meta_info.output_token_logprobs", nil
	}
	td := proxy.TokenData{ResponseIDs: ids}
	null := -1
	if c.Logprobs != nil {
		td.Logprobs = make([]float32, len(c.Logprobs.Content))
		for i, x := range c.Logprobs.Content {
			if x.Logprob == nil {
				if null < 0 {
					null = i
				}
				continue
			}
			td.Logprobs[i] = float32(*x.Logprob)
		}
	}
	switch {
	case len(prompt) == 0:
		td.Problem = "SGLang returned no prompt_token_ids (floe asks for them with return_prompt_token_ids and return_token_ids on a non-streaming /v1/chat/completions; the server is too old)"
	case c.PromptTokenIDs != nil && !slices.Equal(c.PromptTokenIDs, prompt):
		td.Problem = fmt.Sprintf("the prompt_token_ids of choice %d differ from choice 0's", c.Index)
	case ids == nil:
		td.Problem = "SGLang returned no token ids for the response (none of response_token_ids, token_ids, meta_info.output_token_logprobs)"
	case metaIDs != nil && !slices.Equal(ids, metaIDs):
		td.Problem = fmt.Sprintf("SGLang's %s (%d ids) disagree with meta_info.output_token_logprobs (%d ids)", source, len(ids), len(metaIDs))
	case c.Logprobs == nil:
		td.Problem = "SGLang returned no logprobs"
	case len(td.Logprobs) != len(ids):
		td.Problem = fmt.Sprintf("%d logprobs for %d response token ids", len(td.Logprobs), len(ids))
	case null >= 0:
		td.Problem = fmt.Sprintf("the logprob of response token %d is null (SGLang writes -inf and NaN as null)", null)
	case finish == "abort":
		// An aborted generation (preemption, shutdown) is a fragment, not an answer.
		td.Problem = "SGLang aborted the generation (finish_reason abort)"
	}
	return td
}

// Stream serves a streaming caller from one non-streaming upstream call: SGLang returns
// token ids only without streaming (its serving_chat.py refuses return_token_ids,
// return_prompt_token_ids and return_meta_info with stream), and its streamed tool-call
// and reasoning parsing cannot be matched to ids chunk by chunk. Once the answer is
// complete, choice 0 goes to sink as reasoning, text and one fragment per tool call,
// which the caller's dialect writes as its own SSE events; the server then records the
// call and ends the stream. What is recorded is exactly what Complete records.
func (s *Engine) Stream(ctx context.Context, req *proxy.ChatRequest, sink proxy.StreamSink) (*proxy.Result, error) {
	res, err := s.Complete(ctx, req)
	if err != nil {
		return nil, err
	}
	for _, d := range answerDeltas(res.Response.Choices[0].Message) {
		if err := sink.Delta(d); err != nil {
			return res, fmt.Errorf("%w: %w", proxy.ErrCallerGone, err)
		}
	}
	sink.Flush()
	return res, nil
}

// answerDeltas splits a complete assistant message into the deltas a stream of it would
// have carried: its reasoning, its text, then each tool call whole (id, name, arguments).
func answerDeltas(m proxy.ChatMessage) []proxy.Delta {
	var out []proxy.Delta
	if m.ReasoningContent != "" {
		out = append(out, proxy.Delta{Reasoning: m.ReasoningContent})
	}
	if text, _ := m.Content.(string); text != "" {
		out = append(out, proxy.Delta{Content: text})
	}
	for i, tc := range m.ToolCalls {
		out = append(out, proxy.Delta{ToolCalls: []proxy.ToolCallDelta{{Index: i, ID: tc.ID, Name: tc.Function.Name, Arguments: tc.Function.Arguments}}})
	}
	return out
}

// tokenizeRequest is SGLang's TokenizeRequest for a conversation: the server
// renders it with the chat template exactly as /v1/chat/completions would (generation
// prompt included) and counts the tokens.
type tokenizeRequest struct {
	Model              string              `json:"model"`
	Messages           []proxy.ChatMessage `json:"messages"`
	Tools              []proxy.ChatTool    `json:"tools,omitempty"`
	ToolChoice         json.RawMessage     `json:"tool_choice,omitempty"`
	ChatTemplateKwargs map[string]any      `json:"chat_template_kwargs,omitempty"`
}

// CountTokens asks SGLang's /v1/tokenize, which takes messages on servers whose
// TokenizeRequest has them (older ones take only a prompt and refuse the request).
func (s *Engine) CountTokens(ctx context.Context, req *proxy.ChatRequest) (int, error) {
	model, err := s.served(ctx)
	if err != nil {
		return 0, err
	}
	body, err := gojson.Marshal(tokenizeRequest{Model: model, Messages: req.Messages, Tools: req.Tools,
		ToolChoice: req.ToolChoice, ChatTemplateKwargs: req.ChatTemplateKwargs})
	if err != nil {
		return 0, fmt.Errorf("encoding the tokenize request: %w", err)
	}
	return upstream.TokenCount(ctx, s.client(), s.BaseURL, "/v1/tokenize", body, mapError)
}

func (s *Engine) Models(ctx context.Context) ([]string, error) {
	return upstream.ListModels(ctx, s.client(), s.BaseURL, mapError)
}

// SGLang's two context-length refusals (tokenizer_manager.py's request validation).
var (
	inputTooLongRE = regexp.MustCompile(`The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)`)
	requestedRE    = regexp.MustCompile(`maximum context length of (\d+) tokens\. You requested a total of (\d+) tokens: (\d+) tokens from the input messages and (\d+) tokens for the completion`)
)

// mapError turns an SGLang error answer into an *Error. SGLang words a context overflow
// differently from vLLM; its words are put into vLLM's and mapped by upstream.MapError, so
// that every dialect answers an SGLang overflow exactly as a vLLM one (Anthropic's
// "input length and `max_tokens` exceed context limit", on which Claude Code lowers
// max_tokens, is read from vLLM's "(N in the messages, M in the completion)").
func mapError(status int, body []byte) *proxy.Error {
	msg := upstream.Message(body)
	if m := requestedRE.FindStringSubmatch(msg); m != nil {
		return upstream.MapError(http.StatusBadRequest, fmt.Appendf(nil,
			"This model's maximum context length is %s tokens. However, you requested %s tokens (%s in the messages, %s in the completion). Please reduce the length of the messages or completion.",
			m[1], m[2], m[3], m[4]))
	}
	if m := inputTooLongRE.FindStringSubmatch(msg); m != nil {
		return upstream.MapError(http.StatusBadRequest, fmt.Appendf(nil,
			"This model's maximum context length is %s tokens. However, you requested %s tokens in the messages, Please reduce the length of the messages.",
			m[2], m[1]))
	}
	return upstream.MapError(status, body)
}
