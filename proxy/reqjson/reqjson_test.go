package reqjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/floe-rl/floe/proxy"
)

func errMessage(t *testing.T, err error) string {
	t.Helper()
	if err == nil {
		return ""
	}
	var e *proxy.Error
	if !errors.As(err, &e) || e.Status != http.StatusBadRequest || e.Kind != proxy.ErrInvalidRequest {
		t.Fatalf("error %v is not a 400 invalid_request *proxy.Error", err)
	}
	return e.Message
}

func TestParse(t *testing.T) {
	tests := []struct{ body, wantErr string }{
		{`{"a":1}`, ""},
		{` {"a":1} `, ""},
		{``, "request body: want object, got nothing"},
		{`[1]`, "request body: want object, got array"},
		{`"s"`, "request body: want object, got string"},
		{`null`, "request body: want object, got null"},
		{`{"a":`, "request body: malformed JSON: unexpected end of JSON input"},
		{`{"a":1}x`, "request body: malformed JSON: invalid character 'x' after top-level value"},
	}
	for _, tt := range tests {
		_, err := Parse([]byte(tt.body))
		if got := errMessage(t, err); got != tt.wantErr {
			t.Errorf("Parse(%q) error %q, want %q", tt.body, got, tt.wantErr)
		}
	}
}

// TestGetters: each getter on each kind of value, null and absent alike.
func TestGetters(t *testing.T) {
	body := `{"s":"x","n":1.5,"i":3,"f":2.0,"big":1e400,"huge":3000000000,"b":true,"o":{"k":"v"},"a":["p",null],"z":null,"e":""}`
	top, err := Parse([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	call := func(key, getter string) (any, string) {
		v := top.Get(key)
		var out any
		var err error
		switch getter {
		case "String":
			out, err = v.String()
		case "NonEmptyString":
			out, err = v.NonEmptyString()
		case "Bool":
			out, err = v.Bool()
		case "Number":
			var f *float64
			f, err = v.Number()
			if f != nil {
				out = *f
			}
		case "Int":
			var n *int
			n, err = v.Int()
			if n != nil {
				out = *n
			}
		case "Object":
			var f Fields
			f, err = v.Object()
			out = f.Len()
		case "Array":
			var a []Value
			a, err = v.Array()
			out = len(a)
		case "Strings":
			out, err = v.Strings()
		case "Required":
			err = v.Required()
		}
		return out, errMessage(t, err)
	}
	tests := []struct {
		key, getter string
		want        any
		wantErr     string
	}{
		{"s", "String", "x", ""},
		{"n", "String", "", "n: want string, got number"},
		{"z", "String", "", ""},
		{"missing", "String", "", ""},
		{"e", "NonEmptyString", "", "e: must not be empty"},
		{"z", "NonEmptyString", "", "z: required"},
		{"missing", "NonEmptyString", "", "missing: required"},
		{"s", "NonEmptyString", "x", ""},
		{"b", "Bool", true, ""},
		{"s", "Bool", false, "s: want boolean, got string"},
		{"z", "Bool", false, ""},
		{"n", "Number", 1.5, ""},
		{"s", "Number", nil, "s: want number, got string"},
		{"big", "Number", nil, "big: number 1e400 is out of range"},
		{"z", "Number", nil, ""},
		{"i", "Int", 3, ""},
		{"f", "Int", 2, ""},
		{"n", "Int", nil, "n: want integer, got 1.5"},
		{"huge", "Int", nil, "huge: integer 3000000000 is out of range"},
		{"b", "Int", nil, "b: want number, got boolean"},
		{"o", "Object", 1, ""},
		{"a", "Object", 0, "a: want object, got array"},
		{"z", "Object", 0, ""},
		{"a", "Array", 2, ""},
		{"o", "Array", 0, "o: want array, got object"},
		{"missing", "Array", 0, ""},
		{"a", "Strings", []string{"p", ""}, ""},
		{"s", "Strings", []string(nil), "s: want array, got string"},
		{"z", "Required", nil, "z: required"},
		{"s", "Required", nil, ""},
	}
	for _, tt := range tests {
		got, gotErr := call(tt.key, tt.getter)
		if gotErr != tt.wantErr || (tt.wantErr == "" && !reflect.DeepEqual(got, tt.want)) {
			t.Errorf("%s.%s() = %v, %q; want %v, %q", tt.key, tt.getter, got, gotErr, tt.want, tt.wantErr)
		}
	}
}

// TestPaths: nested fields and elements are named by their path.
func TestPaths(t *testing.T) {
	top, err := Parse([]byte(`{"messages":[{"content":"a"},{"content":[{"text":1}]}],"unknown":{"x":[1]}}`))
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := top.Get("messages").Array()
	if err != nil {
		t.Fatal(err)
	}
	m, _ := msgs[1].Object()
	parts, _ := m.Get("content").Array()
	p, _ := parts[0].Object()
	_, err = p.Get("text").String()
	if got, want := errMessage(t, err), "messages[1].content[0].text: want string, got number"; got != want {
		t.Errorf("error %q, want %q", got, want)
	}
	if got := parts[0].Path(); got != "messages[1].content[0]" {
		t.Errorf("path %q", got)
	}
	if got := msgs[0].Errorf("bad %q", "x"); !strings.HasSuffix(errMessage(t, got), `messages[0]: bad "x"`) {
		t.Errorf("Errorf = %v", got)
	}
	if !top.Has("unknown") || top.Has("absent") || top.Len() != 2 {
		t.Errorf("Has/Len wrong: %d", top.Len())
	}
}

// FuzzParse: nothing a caller sends makes the decoder panic, and every error is a 400.
func FuzzParse(f *testing.F) {
	f.Add([]byte(`{"a":[1,"x",{"b":null}],"c":true,"d":1.5e3}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		top, err := Parse(body)
		if err != nil {
			errMessage(t, err)
			return
		}
		var walk func(v Value, depth int)
		walk = func(v Value, depth int) {
			if depth > 20 {
				return
			}
			_, _ = v.String()
			_, _ = v.Bool()
			_, _ = v.Int()
			if a, err := v.Array(); err == nil {
				for _, e := range a {
					walk(e, depth+1)
				}
			}
			if o, err := v.Object(); err == nil {
				for _, k := range o.Keys() {
					walk(o.Get(k), depth+1)
				}
			}
		}
		for _, k := range top.Keys() {
			walk(top.Get(k), 0)
		}
	})
}

// FuzzDecodeString: strings decode exactly as encoding/json decodes them.
func FuzzDecodeString(f *testing.F) {
	for _, s := range []string{`"plain"`, `"a\nb\u00e9\ud83d\ude00"`, `"\ud800x"`, "\"\xff\"", `"\/\b\f\r\t\"\\"`, `"\u12"`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, s []byte) {
		var want string
		wantErr := json.Unmarshal(s, &want)
		if wantErr != nil || len(bytes.TrimSpace(s)) != len(s) || len(s) == 0 || s[0] != '"' {
			return
		}
		got, err := decodeString(s)
		if err != nil || got != want {
			t.Fatalf("decodeString(%q) = %q, %v; encoding/json: %q", s, got, err, want)
		}
	})
}

// FuzzValid: the body check agrees with encoding/json.Valid.
func FuzzValid(f *testing.F) {
	for _, s := range []string{`{"a":[1,-0.5e+3,true,false,null,"x\u00e9"]}`, `01`, `1.`, `-`, `"\x"`, "\"\x01\"", ` [ ] `, `{"a" 1}`, `[1,]`, `1e400`, "\"\xff\""} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if got, want := valid(b, nil), json.Valid(b); got != want {
			t.Fatalf("valid(%q) = %v, encoding/json says %v", b, got, want)
		}
		ix := newIndex(b)
		if got, want := valid(b, ix), json.Valid(b); got != want {
			t.Fatalf("valid(%q) with an index = %v, encoding/json says %v", b, got, want)
		}
		if json.Valid(b) {
			checkIndex(t, b, ix)
		}
	})
}
