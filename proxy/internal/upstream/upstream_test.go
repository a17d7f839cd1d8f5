package upstream

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/floe-rl/floe/proxy"
)

// TestConnectTimeout: a connection not made within the call's connect timeout ends the
// call with a 504 timeout naming the flag (a nanosecond: no dial finishes in time).
func TestConnectTimeout(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	defer srv.Close()
	c := &http.Client{Transport: Client.Transport.(*http.Transport).Clone()}
	ctx := proxy.WithUpstreamTimeouts(context.Background(), proxy.UpstreamTimeouts{Connect: time.Nanosecond})
	_, err := PostJSON(ctx, c, srv.URL, "/v1/chat/completions", []byte(`{}`), MapError)
	var e *proxy.Error
	if !errors.As(err, &e) || e.Kind != proxy.ErrTimeout || e.Status != 504 || !strings.Contains(e.Message, "upstream-connect-timeout") {
		t.Fatalf("err %v; want a 504 timeout naming -upstream-connect-timeout", err)
	}
	// The request never reached the server: a replica pool fails over at once.
	var un *proxy.UnreachableError
	if !errors.As(err, &un) {
		t.Errorf("err %T is not a proxy.UnreachableError", err)
	}
}

// TestSessionHeaderAndUnreachable: a call names its session in the header its context
// asks for (and in none when it asks for none); a server that refuses the connection
// gives a proxy.UnreachableError whose message names it without its credentials.
func TestSessionHeaderAndUnreachable(t *testing.T) {
	got := make(chan http.Header, 4)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Clone()
		_, _ = w.Write([]byte(`{"data":[{"id":"m"}]}`))
	}))
	defer srv.Close()
	for _, tc := range []struct{ header, want string }{{"X-Session-ID", "sess-1"}, {"X-SMG-Routing-Key", "sess-1"}, {"", ""}} {
		ctx := proxy.WithSession(context.Background(), "sess-1", tc.header)
		resp, err := PostJSON(ctx, Client, srv.URL, "/v1/chat/completions", []byte(`{}`), MapError)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		h := <-got
		if tc.header != "" && h.Get(tc.header) != tc.want {
			t.Errorf("header %s = %q, want %q", tc.header, h.Get(tc.header), tc.want)
		}
		if tc.header == "" && (h.Get("X-Session-ID") != "" || h.Get("Authorization") != "") {
			t.Errorf("with no session header the call carries %v", h)
		}
		if _, err := ListModels(ctx, Client, srv.URL, MapError); err != nil {
			t.Fatal(err)
		}
		if h := <-got; tc.header != "" && h.Get(tc.header) != tc.want {
			t.Errorf("models: header %s = %q, want %q", tc.header, h.Get(tc.header), tc.want)
		}
	}

	dead := httptest.NewServer(http.NotFoundHandler())
	addr := dead.Listener.Addr().String()
	dead.Close()
	for _, call := range []func() error{
		func() error {
			_, err := PostJSON(context.Background(), Client, "http://user:secret@"+addr, "/v1/chat/completions", []byte(`{}`), MapError)
			return err
		},
		func() error {
			_, err := ListModels(context.Background(), Client, "http://user:secret@"+addr, MapError)
			return err
		},
	} {
		err := call()
		var un *proxy.UnreachableError
		if !errors.As(err, &un) || un.Err.Status != http.StatusBadGateway || strings.Contains(err.Error(), "secret") ||
			!strings.Contains(err.Error(), "http://"+addr+" is unreachable") {
			t.Errorf("a refused connection: %T %v; want a 502 UnreachableError naming http://%s without its password", err, err, addr)
		}
	}
}

// TestEncodeRequestSplicesLargeStrings: a request whose messages carry large strings
// (with characters JSON escapes, and invalid UTF-8) encodes to the same JSON value as the
// plain encoder gives, in a body allocated at its final size.
func TestEncodeRequestSplicesLargeStrings(t *testing.T) {
	big := func(c string) string { return strings.Repeat(c, spliceMin/len(c)+7) }
	special := big("a\"b\\c\nd\re\tf<g>h&i\u2028j\u2029k\x01é😀") + "\xff\xfe"
	r := &proxy.ChatRequest{Model: "m", Messages: []proxy.ChatMessage{
		{Role: "system", Content: "small"},
		{Role: "user", Content: special},
		{Role: "user", Content: []proxy.ChatPart{{Type: "text", Text: big("t")}, {Type: "image_url", ImageURL: &proxy.ChatImageURL{URL: "data:image/png;base64," + big("Q")}}}},
		{Role: "assistant", Content: "", ReasoningContent: big("r"), ToolCalls: []proxy.ChatToolCall{{ID: "c1", Type: "function", Function: proxy.ChatFunctionCall{Name: "f", Arguments: big(`{"x":1}`)}}}},
		{Role: "user", Content: "floe-splice-" + nonce + "-0"}, // even a caller who knew the nonce only confuses its own text
	}}
	enc := func(r *proxy.ChatRequest) ([]byte, error) { return Marshal(r) }
	got, err := EncodeRequest(r, enc)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != cap(got) {
		t.Errorf("body of %d bytes in a buffer of %d: not sized once", len(got), cap(got))
	}
	want, _ := enc(r)
	var g, w any
	if err := json.Unmarshal(got, &g); err != nil {
		t.Fatalf("spliced body is not JSON: %v", err)
	}
	_ = json.Unmarshal(want, &w)
	if !reflect.DeepEqual(g, w) {
		t.Error("spliced body differs from the encoder's")
	}
	if !bytes.Equal(got, want) {
		t.Error("spliced body is not byte for byte the encoder's")
	}
	if r.Messages[1].Content != special {
		t.Error("EncodeRequest changed the caller's request")
	}
}
