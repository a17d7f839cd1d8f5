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
	b.w.stop()
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
		defer resp.Body.Close()
		if wd != nil {
			defer wd.stop()
		}
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return nil, mapErr(resp.StatusCode, msg)
	}
	if wd != nil {
		resp.Body = &watchedBody{ReadCloser: resp.Body, w: wd, cancel: cancel}
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
	if m := contextLengthRE.FindStringSubmatch(msg); m != nil {
		e := &proxy.Error{Status: http.StatusBadRequest, Kind: proxy.ErrContextLength, Message: msg}
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
		return &proxy.Error{Status: http.StatusServiceUnavailable, Kind: proxy.ErrOverloaded, Message: "inference server busy: " + msg}
	case status >= 500:
		return &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable, Message: fmt.Sprintf("inference server error %d: %s", status, msg)}
	case status == http.StatusNotFound:
		return &proxy.Error{Status: http.StatusNotFound, Kind: proxy.ErrNotFound, Message: "inference server: " + msg}
	default:
		return &proxy.Error{Status: http.StatusBadRequest, Kind: proxy.ErrInvalidRequest, Message: "inference server rejected the request: " + msg}
	}
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

// Complete posts a non-streaming chat completion and decodes the answer into out; it
// returns the time from sending to the end of the answer.
func Complete(ctx context.Context, post func(context.Context, string, []byte) (*http.Response, error), body []byte, out any) (time.Duration, error) {
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
	defer resp.Body.Close()
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
		return nil, &proxy.Error{Status: http.StatusBadGateway, Kind: proxy.ErrUpstreamUnavailable, Message: "reading /v1/models: " + err.Error()}
	}
	var ids []string
	for _, d := range out.Data {
		ids = append(ids, d.ID)
	}
	return ids, nil
}
