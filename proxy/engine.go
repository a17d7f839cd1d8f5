package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"

	"errors"
	"fmt"
	gojson "github.com/goccy/go-json"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Engine is an inference server as the proxy uses it.
type Engine interface {
	// Complete sends a non-streaming request and returns the answer with its token data.
	Complete(ctx context.Context, req *ChatRequest) (*Result, error)
	// Stream sends a streaming request, handing choice 0's deltas to sink as they arrive,
	// and returns the whole answer once the upstream stream ends. An error from the sink
	// (the caller went away) cancels the upstream request.
	Stream(ctx context.Context, req *ChatRequest, sink StreamSink) (*Result, error)
	// CountTokens returns the prompt length of req as the upstream's tokenizer sees it.
	CountTokens(ctx context.Context, req *ChatRequest) (int, error)
	// Models lists the served models.
	Models(ctx context.Context) ([]string, error)
}

// StreamSink receives a streamed answer.
type StreamSink interface {
	Delta(d Delta) error
	// Flush is called whenever no more upstream data is at hand: events written since the
	// last flush go to the caller now. Deltas that arrive together leave together.
	Flush()
}

// TokenData is what training needs of one choice.
type TokenData struct {
	ResponseIDs []int32
	Logprobs    []float32
	// Problem says why the token data cannot be trained on ("" when it can).
	Problem string
}

// Result is an upstream answer: what the caller sees and what floe records.
type Result struct {
	Response  Response
	PromptIDs []int32
	Choices   []TokenData // per choice, by index
	Upstream  []byte      // the request body sent upstream
	Latency   time.Duration
}

// VLLM talks to vLLM's OpenAI-compatible server (>= 0.10.2), asking for token ids with
// return_token_ids and for the sampled tokens' log-probabilities with logprobs. vLLM should
// run with --logprobs-mode processed_logprobs, so that the log-probabilities are those of
// the distribution actually sampled from (after temperature and top-p), which is what the
// trainer's importance ratio needs.
type VLLM struct {
	BaseURL string       // e.g. http://127.0.0.1:8000
	Model   string       // served model; empty: the first the server lists
	Client  *http.Client // nil: a client without overall timeout (streams are long)

	cache servedModel
}

var _ Engine = (*VLLM)(nil)

// NewEngine returns the engine of kind ("vllm" or "sglang") for the inference server at
// baseURL serving model (empty: the first model the server lists), so that callers can
// choose the engine by a flag.
func NewEngine(kind, baseURL, model string) (Engine, error) {
	switch strings.ToLower(strings.TrimSpace(kind)) {
	case "vllm":
		return &VLLM{BaseURL: baseURL, Model: model}, nil
	case "sglang":
		return &SGLang{BaseURL: baseURL, Model: model}, nil
	default:
		return nil, fmt.Errorf("unknown inference engine %q: the supported engines are \"vllm\" and \"sglang\"", kind)
	}
}

// upstreamClient keeps enough idle connections for hundreds of concurrent sessions; the
// default transport keeps two per host, so a busy proxy would open a TCP connection per
// call.
var upstreamClient = &http.Client{Transport: func() http.RoundTripper {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConns, t.MaxIdleConnsPerHost = 1024, 1024
	return t
}()}

func (v *VLLM) client() *http.Client {
	if v.Client != nil {
		return v.Client
	}
	return upstreamClient
}

// served returns the model name to send upstream.
func (v *VLLM) served(ctx context.Context) (string, error) {
	return v.cache.get(ctx, v.Model, v.Models)
}

// servedModel remembers the model an engine sends upstream when none was configured: the
// first one the server lists, asked once.
type servedModel struct {
	mu   sync.Mutex
	name string
}

// get returns fixed when set, else the first model list names (asked on first use).
func (s *servedModel) get(ctx context.Context, fixed string, list func(context.Context) ([]string, error)) (string, error) {
	if fixed != "" {
		return fixed, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.name != "" {
		return s.name, nil
	}
	models, err := list(ctx)
	if err != nil {
		return "", err
	}
	if len(models) == 0 {
		return "", &Error{Status: http.StatusBadGateway, Kind: ErrUpstreamUnavailable, Message: "the inference server lists no models"}
	}
	s.name = models[0]
	return s.name, nil
}

// vllmRequest is ChatRequest plus the token-id flags.
type vllmRequest struct {
	*ChatRequest
	Logprobs       bool           `json:"logprobs"`
	ReturnTokenIDs bool           `json:"return_token_ids"`
	StreamOptions  map[string]any `json:"stream_options,omitempty"`
}

func (v *VLLM) body(ctx context.Context, req *ChatRequest, stream bool) ([]byte, error) {
	model, err := v.served(ctx)
	if err != nil {
		return nil, err
	}
	r := *req
	r.Model, r.Stream = model, stream
	vr := vllmRequest{ChatRequest: &r, Logprobs: true, ReturnTokenIDs: true}
	if stream {
		vr.StreamOptions = map[string]any{"include_usage": true}
	}
	b, err := gojson.Marshal(vr)
	if err != nil {
		return nil, &Error{Status: http.StatusInternalServerError, Kind: ErrInternal, Message: "encoding the upstream request: " + err.Error()}
	}
	return b, nil
}

// post sends body to path and returns the response, or an *Error for a refused connection
// or an error status.
func (v *VLLM) post(ctx context.Context, path string, body []byte) (*http.Response, error) {
	return postJSON(ctx, v.client(), v.BaseURL, path, body, upstreamError)
}

// postJSON sends the JSON body to baseURL+path and returns the response, or an *Error for
// a refused connection or an error status; mapErr reads an error answer, so that each
// engine can recognise its server's own wording.
func postJSON(ctx context.Context, c *http.Client, baseURL, path string, body []byte, mapErr func(status int, body []byte) *Error) (*http.Response, error) {
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(baseURL, "/")+path, bytes.NewReader(body))
	if err != nil {
		return nil, &Error{Status: http.StatusInternalServerError, Kind: ErrInternal, Message: err.Error()}
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(hr)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, &Error{Status: http.StatusBadGateway, Kind: ErrUpstreamUnavailable,
			Message: fmt.Sprintf("the inference server at %s is unreachable: %v", baseURL, err)}
	}
	if resp.StatusCode >= 300 {
		defer resp.Body.Close()
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return nil, mapErr(resp.StatusCode, msg)
	}
	return resp, nil
}

// vLLM words a context overflow as: "This model's maximum context length is 4096 tokens.
// However, you requested 5000 tokens (4000 in the messages, 1000 in the completion)."
var (
	contextLengthRE = regexp.MustCompile(`maximum context length is (\d+) tokens`)
	inMessagesRE    = regexp.MustCompile(`\((\d+) in the messages`)
	requestedRE     = regexp.MustCompile(`requested (\d+) tokens`)
)

// upstreamMessage is the message of an upstream error answer: the top-level "message" of
// vLLM's (and older SGLang's) flat error object, the "error.message" of OpenAI's envelope,
// or the whole body when it is neither.
func upstreamMessage(body []byte) string {
	msg := string(body)
	var shaped struct {
		Message string `json:"message"`
		Error   *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &shaped) == nil {
		if shaped.Message != "" {
			msg = shaped.Message
		} else if shaped.Error != nil && shaped.Error.Message != "" {
			msg = shaped.Error.Message
		}
	}
	return msg
}

// upstreamError turns an upstream error response into an *Error of the right kind.
func upstreamError(status int, body []byte) *Error {
	msg := upstreamMessage(body)
	if m := contextLengthRE.FindStringSubmatch(msg); m != nil {
		e := &Error{Status: http.StatusBadRequest, Kind: ErrContextLength, Message: msg}
		e.MaxTokens, _ = strconv.Atoi(m[1])
		if p := inMessagesRE.FindStringSubmatch(msg); p != nil {
			e.PromptTokens, _ = strconv.Atoi(p[1])
		} else if p := requestedRE.FindStringSubmatch(msg); p != nil {
			e.PromptTokens, _ = strconv.Atoi(p[1])
		}
		return e
	}
	switch {
	case status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable:
		return &Error{Status: http.StatusServiceUnavailable, Kind: ErrOverloaded, Message: "inference server busy: " + msg}
	case status >= 500:
		return &Error{Status: http.StatusBadGateway, Kind: ErrUpstreamUnavailable, Message: fmt.Sprintf("inference server error %d: %s", status, msg)}
	case status == http.StatusNotFound:
		return &Error{Status: http.StatusNotFound, Kind: ErrNotFound, Message: "inference server: " + msg}
	default:
		return &Error{Status: http.StatusBadRequest, Kind: ErrInvalidRequest, Message: "inference server rejected the request: " + msg}
	}
}

// vllmChoice is a choice of a vLLM response or stream chunk.
type vllmChoice struct {
	Index        int            `json:"index"`
	Message      *ChatMessage   `json:"message"`
	Delta        *vllmDelta     `json:"delta"`
	FinishReason *string        `json:"finish_reason"`
	TokenIDs     []int32        `json:"token_ids"`
	Logprobs     *vllmLogprobs  `json:"logprobs"`
	MetaInfo     map[string]any `json:"meta_info,omitempty"`
}

type vllmDelta struct {
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

type vllmLogprobs struct {
	Content []struct {
		Logprob float32 `json:"logprob"`
	} `json:"content"`
}

type vllmResponse struct {
	ID             string       `json:"id"`
	Choices        []vllmChoice `json:"choices"`
	Usage          *Usage       `json:"usage"`
	PromptTokenIDs []int32      `json:"prompt_token_ids"`
}

func (v *VLLM) Complete(ctx context.Context, req *ChatRequest) (*Result, error) {
	body, err := v.body(ctx, req, false)
	if err != nil {
		return nil, err
	}
	var vr vllmResponse
	latency, err := complete(ctx, v.post, body, &vr)
	if err != nil {
		return nil, err
	}
	res := &Result{Upstream: body, Latency: latency, PromptIDs: vr.PromptTokenIDs}
	res.Response.ID = vr.ID
	if vr.Usage != nil {
		res.Response.Usage = *vr.Usage
	}
	for _, c := range vr.Choices {
		res.Response.Choices = append(res.Response.Choices, answerChoice(c.Index, c.Message, c.FinishReason))
		res.Choices = append(res.Choices, tokenData(c.TokenIDs, c.Logprobs, vr.PromptTokenIDs))
	}
	if len(res.Response.Choices) == 0 {
		return nil, &Error{Status: http.StatusBadGateway, Kind: ErrUpstreamUnavailable, Message: "the inference server answered with no choices"}
	}
	return res, nil
}

// tokenData checks one choice's token data.
func tokenData(ids []int32, lp *vllmLogprobs, prompt []int32) TokenData {
	td := TokenData{ResponseIDs: ids}
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
	calls              []ChatToolCall
	ids                []int32
	logprobs           []float32
	sawIDs, sawLP      bool
	finish             string
}

func (v *VLLM) Stream(ctx context.Context, req *ChatRequest, sink StreamSink) (*Result, error) {
	body, err := v.body(ctx, req, true)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := time.Now()
	resp, err := v.post(ctx, "/v1/chat/completions", body)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	res := &Result{Upstream: body}
	var choices []*streamChoice
	choice := func(i int) *streamChoice {
		for len(choices) <= i {
			choices = append(choices, &streamChoice{})
		}
		return choices[i]
	}
	done := false
	err = readSSE(resp.Body, sink.Flush, func(data []byte) error {
		if string(data) == "[DONE]" {
			done = true
			return errStopSSE
		}
		var chunk vllmResponse
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
			if c.Delta == nil {
				continue
			}
			d := Delta{}
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
					sc.calls = append(sc.calls, ChatToolCall{Type: "function"})
				}
				call := &sc.calls[tc.Index]
				if tc.ID != "" {
					call.ID = tc.ID
				}
				call.Function.Name += tc.Function.Name
				call.Function.Arguments += tc.Function.Arguments
				d.ToolCalls = append(d.ToolCalls, ToolCallDelta{Index: tc.Index, ID: tc.ID, Name: tc.Function.Name, Arguments: tc.Function.Arguments})
			}
			if c.Index == 0 && (d.Content != "" || d.Reasoning != "" || len(d.ToolCalls) > 0) {
				if err := sink.Delta(d); err != nil {
					return fmt.Errorf("%w: %w", errCallerGone, err)
				}
			}
		}
		return nil
	})
	res.Latency = time.Since(start)
	finishStream(res, choices)
	if err != nil && !errors.Is(err, errStopSSE) {
		if errors.Is(err, errCallerGone) || ctx.Err() != nil {
			return res, errCallerGone
		}
		return res, &Error{Status: http.StatusBadGateway, Kind: ErrUpstreamUnavailable, Message: "the inference server's stream broke: " + err.Error()}
	}
	if !done {
		return res, &Error{Status: http.StatusBadGateway, Kind: ErrUpstreamUnavailable, Message: "the inference server closed the stream before [DONE]"}
	}
	if len(res.Response.Choices) == 0 {
		return res, &Error{Status: http.StatusBadGateway, Kind: ErrUpstreamUnavailable, Message: "the inference server streamed no choices"}
	}
	return res, nil
}

// finishStream turns the accumulated choices into the result, whole or partial.
func finishStream(res *Result, choices []*streamChoice) {
	for i, sc := range choices {
		msg := ChatMessage{Role: "assistant", Content: sc.content.String(), ReasoningContent: sc.reasoning.String(), ToolCalls: sc.calls}
		res.Response.Choices = append(res.Response.Choices, Choice{Index: i, Message: msg, FinishReason: sc.finish})
		var ids []int32
		if sc.sawIDs {
			ids = sc.ids
			if ids == nil {
				ids = []int32{}
			}
		}
		var lp *vllmLogprobs
		if sc.sawLP {
			lp = &vllmLogprobs{}
			for _, x := range sc.logprobs {
				lp.Content = append(lp.Content, struct {
					Logprob float32 `json:"logprob"`
				}{x})
			}
		}
		res.Choices = append(res.Choices, tokenData(ids, lp, res.PromptIDs))
	}
}

var (
	errStopSSE    = errors.New("end of stream")
	errCallerGone = errors.New("the caller went away")
)

// maxSSELine bounds one line of an upstream stream.
const maxSSELine = 64 << 20

// readSSE calls onData with the data of each event of an SSE stream until the stream
// ends or onData returns an error. Multi-line data fields are joined with newlines. idle,
// when not nil, is called whenever the bytes read so far are used up, before blocking for
// more.
func readSSE(r io.Reader, idle func(), onData func([]byte) error) error {
	br := bufio.NewReaderSize(r, 64<<10)
	var data, long []byte
	have := false
	for {
		if idle != nil && br.Buffered() == 0 {
			idle()
		}
		line, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			long = append(long[:0], line...)
			for errors.Is(err, bufio.ErrBufferFull) && len(long) <= maxSSELine {
				line, err = br.ReadSlice('\n')
				long = append(long, line...)
			}
			if len(long) > maxSSELine {
				return fmt.Errorf("an SSE line is longer than %d bytes", maxSSELine)
			}
			line = long
		}
		if err != nil && !(errors.Is(err, io.EOF) && len(line) > 0) {
			if errors.Is(err, io.EOF) {
				break
			}
			return err
		}
		line = bytes.TrimRight(line, "\r\n")
		if len(line) == 0 {
			if have {
				if err := onData(data); err != nil {
					return err
				}
				data, have = data[:0], false
			}
			continue
		}
		if rest, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			rest = bytes.TrimPrefix(rest, []byte(" "))
			if have {
				data = append(data, '\n')
			}
			data = append(data, rest...)
			have = true
		}
		// event:, id:, retry: and comments carry nothing the proxy needs.
		if err != nil { // a last line without newline
			break
		}
	}
	if have {
		return onData(data)
	}
	return nil
}

func (v *VLLM) CountTokens(ctx context.Context, req *ChatRequest) (int, error) {
	model, err := v.served(ctx)
	if err != nil {
		return 0, err
	}
	body, err := json.Marshal(map[string]any{"model": model, "messages": req.Messages, "tools": req.Tools, "add_generation_prompt": true})
	if err != nil {
		return 0, err
	}
	return tokenCount(ctx, v.client(), v.BaseURL, "/tokenize", body, upstreamError)
}

// answerChoice is an engine's choice as the normalized answer: an assistant message
// (empty content rather than none) and its finish reason.
func answerChoice(index int, m *ChatMessage, finishReason *string) Choice {
	msg := ChatMessage{Role: "assistant", Content: ""}
	if m != nil {
		msg = *m
		msg.Role = "assistant"
		if msg.Content == nil {
			msg.Content = ""
		}
	}
	finish := ""
	if finishReason != nil {
		finish = *finishReason
	}
	return Choice{Index: index, Message: msg, FinishReason: finish}
}

// complete posts a non-streaming chat completion and decodes the answer into out; it
// returns the time from sending to the end of the answer.
func complete(ctx context.Context, post func(context.Context, string, []byte) (*http.Response, error), body []byte, out any) (time.Duration, error) {
	start := time.Now()
	resp, err := post(ctx, "/v1/chat/completions", body)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err == nil {
		err = gojson.Unmarshal(raw, out)
	}
	if err != nil {
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		return 0, &Error{Status: http.StatusBadGateway, Kind: ErrUpstreamUnavailable, Message: "reading the inference server's answer: " + err.Error()}
	}
	return time.Since(start), nil
}

// tokenCount posts a tokenize request (vLLM's /tokenize, SGLang's /v1/tokenize: both answer
// {"count": n, ...}) and returns the count.
func tokenCount(ctx context.Context, c *http.Client, baseURL, path string, body []byte, mapErr func(status int, body []byte) *Error) (int, error) {
	resp, err := postJSON(ctx, c, baseURL, path, body, mapErr)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var out struct {
		Count *int `json:"count"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || out.Count == nil {
		return 0, &Error{Status: http.StatusBadGateway, Kind: ErrUpstreamUnavailable, Message: "the inference server's " + path + " answer has no count"}
	}
	return *out.Count, nil
}

func (v *VLLM) Models(ctx context.Context) ([]string, error) {
	return listModels(ctx, v.client(), v.BaseURL, upstreamError)
}

// listModels asks an OpenAI-compatible server's GET /v1/models (vLLM and SGLang answer
// the same {"object":"list","data":[{"id":…}]}) for the ids of its models.
func listModels(ctx context.Context, c *http.Client, baseURL string, mapErr func(status int, body []byte) *Error) ([]string, error) {
	hr, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(baseURL, "/")+"/v1/models", nil)
	if err != nil {
		return nil, fmt.Errorf("building the /v1/models request for %s: %w", baseURL, err)
	}
	resp, err := c.Do(hr)
	if err != nil {
		return nil, &Error{Status: http.StatusBadGateway, Kind: ErrUpstreamUnavailable,
			Message: fmt.Sprintf("the inference server at %s is unreachable: %v", baseURL, err)}
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return nil, mapErr(resp.StatusCode, msg)
	}
	var out struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return nil, &Error{Status: http.StatusBadGateway, Kind: ErrUpstreamUnavailable, Message: "reading /v1/models: " + err.Error()}
	}
	var ids []string
	for _, d := range out.Data {
		ids = append(ids, d.ID)
	}
	return ids, nil
}
