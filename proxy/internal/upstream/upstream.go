// Package upstream holds what the vLLM and SGLang engines share: both servers speak
// OpenAI-compatible HTTP (POST JSON, /v1/models, a tokenize endpoint answering a count)
// and word errors alike once SGLang's context-length wording is mapped to vLLM's.
package upstream

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/floe-rl/floe/proxy"
	gojson "github.com/goccy/go-json"
)

// Client keeps enough idle connections for hundreds of concurrent sessions; the
// default transport keeps two per host, so a busy proxy would open a TCP connection per
// call. It connects within the call's proxy.UpstreamTimeouts.Connect. An idle connection
// is closed after 4 s, before vLLM's and SGLang's uvicorn closes it at its 5 s keep-alive:
// otherwise a call could be written to a connection the server is closing, and fail for
// nothing the replica did.
var Client = &http.Client{Transport: func() http.RoundTripper {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConns, t.MaxIdleConnsPerHost = 1024, 1024
	t.IdleConnTimeout = 4 * time.Second
	t.DialContext = dial
	return t
}()}

// dial connects as the default transport does, within the connect timeout the call's
// context carries.
func dial(ctx context.Context, network, addr string) (net.Conn, error) {
	d := net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	if t := proxy.UpstreamTimeoutsFrom(ctx).Connect; t > 0 {
		d.Timeout = t
	}
	return d.DialContext(ctx, network, addr)
}

// watchdog ends an upstream call that runs past its deadlines: FirstByte from sending
// to the first byte of the answer's body, then Idle between reads. It cancels the call's
// context with the timeout error as its cause, which the body's reads then return.
type watchdog struct {
	t      proxy.UpstreamTimeouts
	cancel context.CancelCauseFunc
	timer  *time.Timer
	begun  atomic.Bool  // the first byte arrived
	last   atomic.Int64 // unix nanoseconds of the last read that returned data
	mu     sync.Mutex
	err    *proxy.Error // the deadline that ran out
	done   bool
}

func newWatchdog(t proxy.UpstreamTimeouts, cancel context.CancelCauseFunc) *watchdog {
	w := &watchdog{t: t, cancel: cancel}
	if t.FirstByte > 0 {
		w.timer = time.AfterFunc(t.FirstByte, w.fire)
	}
	return w
}

func (w *watchdog) fire() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.done {
		return
	}
	if !w.begun.Load() {
		w.err = proxy.TimeoutError("sent no answer", w.t.FirstByte, "upstream-first-byte-timeout")
	} else {
		if rest := time.Until(time.Unix(0, w.last.Load()).Add(w.t.Idle)); rest > 0 {
			w.timer.Reset(rest)
			return
		}
		w.err = proxy.TimeoutError("sent nothing more", w.t.Idle, "upstream-idle-timeout")
	}
	w.done = true
	w.cancel(w.err)
}

// read notes that data arrived.
func (w *watchdog) read() {
	if w.begun.Load() {
		w.last.Store(time.Now().UnixNano())
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.last.Store(time.Now().UnixNano())
	w.begun.Store(true)
	if w.done || w.t.Idle <= 0 {
		if w.timer != nil {
			w.timer.Stop()
		}
		return
	}
	if w.timer == nil {
		w.timer = time.AfterFunc(w.t.Idle, w.fire)
	} else {
		w.timer.Reset(w.t.Idle)
	}
}

// stop ends the watch and returns the deadline that ran out, if one did.
func (w *watchdog) stop() *proxy.Error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.done = true
	if w.timer != nil {
		w.timer.Stop()
	}
	return w.err
}

func (w *watchdog) timedOut() *proxy.Error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// watchedBody is an upstream answer's body under its watchdog.
type watchedBody struct {
	io.ReadCloser
	w      *watchdog
	cancel context.CancelCauseFunc
}

func (b *watchedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 {
		b.w.read()
	}
	if err != nil && err != io.EOF {
		if e := b.w.timedOut(); e != nil {
			return n, e
		}
	}
	return n, err
}

func (b *watchedBody) Close() error {
	_ = b.w.stop() // Read reports a timeout; Close only ends the watch
	err := b.ReadCloser.Close()
	b.cancel(nil)
	return err
}

// ServedModel remembers the model an engine sends upstream when none was configured: the
// first one the server lists, asked once.
type ServedModel struct {
	mu   sync.Mutex
	name string
}

// Get returns fixed when set, else the first model list names (asked on first use).
func (s *ServedModel) Get(ctx context.Context, fixed string, list func(context.Context) ([]string, error)) (string, error) {
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
		return "", &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable, Message: "the inference server lists no models"}
	}
	s.name = models[0]
	return s.name, nil
}

// setSession names the call's session in the header the context asks for (a router's
// affinity key), when it does.
func setSession(ctx context.Context, hr *http.Request) {
	if id, header := proxy.SessionFrom(ctx); id != "" && header != "" {
		hr.Header.Set(header, id)
	}
}

// unreachable is the error of a call that got no answer from the server at baseURL, by
// what a replica pool may make of it: a failed dial (the request never reached the
// server) is a proxy.UnreachableError, so that the pool marks the replica down and fails
// over; any other (a reset or EOF before any answer, the server closing a kept-alive
// connection: the keep-alive race, or the request's own doing) is a proxy.DroppedError,
// retried once and marking nothing down. The message names the server without the
// credentials its URL may hold.
func unreachable(baseURL string, err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err // its URL may hold credentials
	}
	label := proxy.ReplicaLabel(baseURL)
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return &proxy.UnreachableError{Err: &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable,
			Message: fmt.Sprintf("the inference server at %s is unreachable: %v", label, err)}}
	}
	return &proxy.DroppedError{Err: &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable,
		Message: fmt.Sprintf("the inference server at %s dropped the connection with no answer: %v", label, err)}}
}

// PostJSON sends the JSON body to baseURL+path and returns the response, or an *Error for
// a refused connection or an error status; mapErr reads an error answer, so that each
// engine can recognise its server's own wording.
//
// The call keeps to the proxy.UpstreamTimeouts its context carries: connecting (with
// Client), the first byte of the answer's body, and the silence between reads of it; past
// one, the call ends with a 504 *Error of kind ErrTimeout, from PostJSON or from a read of
// the body.
func PostJSON(ctx context.Context, c *http.Client, baseURL, path string, body []byte, mapErr func(status int, body []byte) *proxy.Error) (*http.Response, error) {
	t := proxy.UpstreamTimeoutsFrom(ctx)
	parent := ctx
	var wd *watchdog
	cancel := context.CancelCauseFunc(func(error) {})
	if t.FirstByte > 0 || t.Idle > 0 {
		ctx, cancel = context.WithCancelCause(ctx)
		wd = newWatchdog(t, cancel)
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(baseURL, "/")+path, bytes.NewReader(body))
	if err != nil {
		cancel(nil)
		return nil, &proxy.Error{Status: http.StatusInternalServerError, Kind: proxy.ErrInternal, Message: err.Error()}
	}
	hr.Header.Set("Content-Type", "application/json")
	setSession(ctx, hr)
	resp, err := c.Do(hr)
	if err != nil {
		if wd != nil {
			if e := wd.stop(); e != nil {
				return nil, e
			}
		}
		cancel(nil)
		if parent.Err() != nil {
			return nil, parent.Err()
		}
		var ne net.Error
		if t.Connect > 0 && errors.As(err, &ne) && ne.Timeout() {
			return nil, &proxy.UnreachableError{Err: proxy.TimeoutError("did not accept a connection", t.Connect, "upstream-connect-timeout")}
		}
		return nil, unreachable(baseURL, err)
	}
	if resp.StatusCode >= 300 {
		defer cancel(nil)
		defer func() { _ = resp.Body.Close() }() // the body is read or abandoned; its Close error changes nothing
		if wd != nil {
			defer func() { _ = wd.stop() }() // the status is the error here, not a timeout
		}
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return nil, mapErr(resp.StatusCode, msg)
	}
	if wd != nil {
		resp.Body = &watchedBody{ReadCloser: resp.Body, w: wd, cancel: cancel}
	}
	return resp, nil
}

// vLLM's context-length refusals, in the words of each version (the numbers are what
// the dialects answer with: Claude Code and Codex compact their history, or lower
// max_tokens, on their provider's own wording of these).
var (
	// Every version: "This model's maximum context length is 4096 tokens. …"
	contextLengthRE = regexp.MustCompile(`maximum context length is (\d+) tokens`)
	// Before 0.10: "… However, you requested 5000 tokens (4000 in the messages, 1000 in
	// the completion). …"
	inMessagesRE = regexp.MustCompile(`\((\d+) in the messages, (\d+) in the completion\)`)
	requestedRE  = regexp.MustCompile(`requested (\d+) tokens`)
	// 0.10 and later, until the renderer: "'max_tokens' or 'max_completion_tokens' is too
	// large: 32000. This model's maximum context length is 32768 tokens and your request
	// has 17177 input tokens (32000 > 32768 - 17177)." and "… However, your request has
	// 40000 input tokens. …"
	tooLargeRE   = regexp.MustCompile(`is too large: (\d+)\.`)
	requestHasRE = regexp.MustCompile(`your request has (\d+) input tokens`)
	// 0.32 (vllm/renderers/params.py, TokenizeParams._token_len_check): "… However, your
	// prompt contains at least 4097 input tokens, which exceeds this limit even without
	// any output tokens. Please reduce the length of the input prompt. (parameter=
	// input_tokens, value=4097)". "at least" because vLLM stops tokenizing one token past
	// the limit: the count is then max + 1, a lower bound.
	promptContainsRE = regexp.MustCompile(`your prompt contains (?:at least )?(\d+) input tokens`)
	// 0.32 (_text_len_check), before tokenizing a text longer than any prompt of max
	// tokens can be: "… However, your prompt contains 90000 characters (more than 65536
	// characters, which is the upper bound for 4096 input tokens). …"
	promptCharsRE = regexp.MustCompile(`your prompt contains \d+ characters \(more than`)
	// 0.32 (TokenizeParams.__post_init__), max_tokens alone over the model's length,
	// checked before the prompt is tokenized: "max_completion_tokens=5000 cannot be
	// greater than max_model_len=4096. Please request fewer output tokens.
	// (parameter=max_completion_tokens, value=5000)"
	budgetOverModelRE = regexp.MustCompile(`(?:max_tokens|max_completion_tokens|max_output_tokens)=(\d+) cannot be greater than max_model_len=(\d+)`)
	// 0.32 (serve/utils/api_utils.py, get_max_tokens), a prompt over the length after
	// truncation: "Input length (5000) exceeds model's maximum context length (4096)."
	inputLengthRE = regexp.MustCompile(`Input length \((\d+)\) exceeds model's maximum context length \((\d+)\)`)
)

// Message is the message of an upstream error answer: the top-level "message" of
// vLLM's (and older SGLang's) flat error object, the "error.message" of OpenAI's envelope,
// or the whole body when it is neither.
func Message(body []byte) string {
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

// MapError turns an upstream error response into an *Error of the right kind.
func MapError(status int, body []byte) *proxy.Error {
	msg := Message(body)
	if e := contextLengthError(msg); e != nil {
		return e
	}
	switch {
	case status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable:
		return &proxy.Error{Status: http.StatusServiceUnavailable, Kind: proxy.ErrOverloaded, Message: "inference server busy: " + msg}
	case status >= 500:
		return &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable, Message: fmt.Sprintf("inference server error %d: %s", status, msg)}
	case status == http.StatusNotFound:
		return &proxy.Error{Status: http.StatusNotFound, Kind: proxy.ErrNotFound, Message: "inference server: " + msg}
	default:
		return &proxy.Error{Status: http.StatusBadRequest, Kind: proxy.ErrInvalidRequest, Message: "inference server rejected the request: " + msg}
	}
}

// contextLengthError reads a context-length refusal in any of vLLM's wordings into an
// ErrContextLength with the numbers it gives, or returns nil for any other message.
// PromptTokens is 0 when vLLM did not tokenize the prompt (max_tokens alone over the
// length), and MaxTokens + 1 when it stopped counting there: PromptTokensUnknown says
// when an engine should count them itself.
func contextLengthError(msg string) *proxy.Error {
	atoi := func(s string) int { n, _ := strconv.Atoi(s); return n }
	e := &proxy.Error{Status: http.StatusBadRequest, Kind: proxy.ErrContextLength, Message: msg}
	if m := budgetOverModelRE.FindStringSubmatch(msg); m != nil {
		e.CompletionTokens, e.MaxTokens = atoi(m[1]), atoi(m[2])
		return e
	}
	if m := inputLengthRE.FindStringSubmatch(msg); m != nil {
		e.PromptTokens, e.MaxTokens = atoi(m[1]), atoi(m[2])
		return e
	}
	m := contextLengthRE.FindStringSubmatch(msg)
	if m == nil {
		return nil
	}
	e.MaxTokens = atoi(m[1])
	switch {
	case inMessagesRE.MatchString(msg):
		p := inMessagesRE.FindStringSubmatch(msg)
		e.PromptTokens, e.CompletionTokens = atoi(p[1]), atoi(p[2])
	case promptContainsRE.MatchString(msg):
		e.PromptTokens = atoi(promptContainsRE.FindStringSubmatch(msg)[1])
	case promptCharsRE.MatchString(msg):
		// More characters than max tokens can hold: more than max tokens, by how many
		// vLLM did not count.
		e.PromptTokens = e.MaxTokens + 1
	case requestHasRE.MatchString(msg):
		e.PromptTokens = atoi(requestHasRE.FindStringSubmatch(msg)[1])
		if b := tooLargeRE.FindStringSubmatch(msg); b != nil {
			e.CompletionTokens = atoi(b[1])
		}
	case requestedRE.MatchString(msg):
		e.PromptTokens = atoi(requestedRE.FindStringSubmatch(msg)[1])
	}
	return e
}

// PromptTokensUnknown reports whether e, a context-length error, lacks the prompt's
// exact length: vLLM 0.32 stops tokenizing one token past the limit ("at least 4097
// input tokens"), refuses a text too long to tokenize by its characters, and checks
// max_tokens before tokenizing at all. An engine then counts the prompt itself, so that
// the harness is told by how much it is over (Claude Code compacts by that much).
func PromptTokensUnknown(e *proxy.Error) bool {
	return e.Kind == proxy.ErrContextLength && (e.PromptTokens == 0 || (e.MaxTokens > 0 && e.PromptTokens == e.MaxTokens+1))
}

// AnswerChoice is an engine's choice as the normalized answer: an assistant message
// (empty content rather than none) and its finish reason.
func AnswerChoice(index int, m *proxy.ChatMessage, finishReason *string) proxy.Choice {
	msg := proxy.ChatMessage{Role: "assistant", Content: ""}
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
	return proxy.Choice{Index: index, Message: msg, FinishReason: finish}
}

// StopSequence is the stop string that ended a choice, given what the engine says
// stopped it (vLLM's stop_reason, SGLang's matched_stop: the matched stop string, a stop
// token id as a number, or null for the end of sequence). Only a string that is one of
// the request's stop sequences counts.
func StopSequence(stoppedBy json.RawMessage, stop []string) string {
	var s string
	if len(stoppedBy) == 0 || json.Unmarshal(stoppedBy, &s) != nil || s == "" {
		return ""
	}
	if slices.Contains(stop, s) {
		return s
	}
	return ""
}

// Complete posts a non-streaming chat completion and decodes the answer into out; it
// returns the time from sending to the end of the answer.
func Complete(ctx context.Context, post func(context.Context, string, []byte) (*http.Response, error), body []byte, out any) (time.Duration, error) {
	start := time.Now()
	resp, err := post(ctx, "/v1/chat/completions", body)
	if err != nil {
		return 0, err
	}
	defer func() { _ = resp.Body.Close() }() // the body is read or abandoned; its Close error changes nothing
	raw, err := io.ReadAll(resp.Body)
	if err == nil {
		err = gojson.Unmarshal(raw, out)
	}
	if err != nil {
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		var timeout *proxy.Error
		if errors.As(err, &timeout) && timeout.Kind == proxy.ErrTimeout {
			return 0, timeout
		}
		return 0, &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable, Message: "reading the inference server's answer: " + err.Error()}
	}
	return time.Since(start), nil
}

// TokenCount posts a tokenize request (vLLM's /tokenize, SGLang's /v1/tokenize: both answer
// {"count": n, ...}) and returns the count.
func TokenCount(ctx context.Context, c *http.Client, baseURL, path string, body []byte, mapErr func(status int, body []byte) *proxy.Error) (int, error) {
	resp, err := PostJSON(ctx, c, baseURL, path, body, mapErr)
	if err != nil {
		return 0, err
	}
	defer func() { _ = resp.Body.Close() }() // the body is read or abandoned; its Close error changes nothing
	var out struct {
		Count *int `json:"count"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || out.Count == nil {
		return 0, &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable, Message: "the inference server's " + path + " answer has no count"}
	}
	return *out.Count, nil
}

// ListModels asks an OpenAI-compatible server's GET /v1/models (vLLM and SGLang answer
// the same {"object":"list","data":[{"id":…}]}) for the ids of its models.
func ListModels(ctx context.Context, c *http.Client, baseURL string, mapErr func(status int, body []byte) *proxy.Error) ([]string, error) {
	hr, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(baseURL, "/")+"/v1/models", nil)
	if err != nil {
		return nil, fmt.Errorf("building the /v1/models request for %s: %w", baseURL, err)
	}
	setSession(ctx, hr)
	resp, err := c.Do(hr)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, unreachable(baseURL, err)
	}
	defer func() { _ = resp.Body.Close() }() // the body is read or abandoned; its Close error changes nothing
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
		return nil, &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable, Message: "reading /v1/models: " + err.Error()}
	}
	var ids []string
	for _, d := range out.Data {
		ids = append(ids, d.ID)
	}
	return ids, nil
}
