package upstream

import (
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
	gojson "github.com/goccy/go-json"
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
	enc := func(r *proxy.ChatRequest) ([]byte, error) { return gojson.Marshal(r) }
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
	if r.Messages[1].Content != special {
		t.Error("EncodeRequest changed the caller's request")
	}
}
