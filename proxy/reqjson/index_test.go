package reqjson

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"testing"
)

// checkIndex: every end the index holds is where scanning b finds the value's end.
func checkIndex(t *testing.T, b []byte, ix *index) {
	t.Helper()
	if ix == nil {
		return
	}
	for k, start := range ix.starts {
		want, err := skipValue(b, int(start), nil)
		if err != nil || int(ix.ends[k]) != want {
			t.Fatalf("index: value at %d ends at %d, scanning says %d (%v)", start, ix.ends[k], want, err)
		}
	}
}

// walk reads v whole through the package's getters, as the dialects do.
func walk(t *testing.T, v Value) any {
	t.Helper()
	switch v.Kind() {
	case Object:
		f, err := v.Object()
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]any{}
		for _, k := range f.Keys() {
			out[k] = walk(t, f.Get(k))
		}
		return out
	case Array:
		elems, err := v.Array()
		if err != nil {
			t.Fatal(err)
		}
		out := []any{}
		for _, e := range elems {
			out = append(out, walk(t, e))
		}
		return out
	case String:
		s, err := v.String()
		if err != nil {
			t.Fatal(err)
		}
		return s
	case Number:
		n, err := v.Number()
		if err != nil {
			t.Fatal(err)
		}
		return *n
	case Boolean:
		b, _ := v.Bool()
		return b
	}
	return nil
}

// TestIndexedReadsMatchEncodingJSON: a body read through Parse (which indexes where its
// values end) reads as encoding/json reads it, and every indexed end is where scanning
// finds it: agent-like histories with long strings full of escapes, nested containers and
// strings just under, at and over the indexed length.
func TestIndexedReadsMatchEncodingJSON(t *testing.T) {
	code := strings.Repeat("if (a < b && c[\"k\"] != '\\\\') {\n\treturn \"x\\ty\";\n}\n", 20)
	var hist []any
	for i := 0; i < 30; i++ {
		hist = append(hist,
			map[string]any{"role": "user", "content": fmt.Sprintf("turn %d é 😀", i)},
			map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{"id": fmt.Sprint("c", i), "type": "function",
				"function": map[string]any{"name": "read", "arguments": `{"path":"a/b.go","n":[1,2,{"x":[]}]}`}}}},
			map[string]any{"role": "tool", "tool_call_id": fmt.Sprint("c", i), "content": []any{map[string]any{"type": "text", "text": code[:i*37%len(code)]}}},
			map[string]any{"k": strings.Repeat("y", indexMinString-3+i%5), "e": map[string]any{}, "a": []any{}, "n": -1.5e3, "t": true},
		)
	}
	for name, body := range map[string][]byte{
		"history":   mustMarshal(t, map[string]any{"model": "m", "messages": hist, "stream": true}),
		"spaced":    []byte(" {\n \"a\" : [ { \"b\" : \"" + strings.Repeat("z", 100) + "\" } , [ ] , { } ] , \"c\" : \"" + strings.Repeat("\\\"", 40) + "\" } "),
		"duplicate": []byte(`{"a":{"x":1},"a":["` + strings.Repeat("q", 70) + `"]}`),
	} {
		t.Run(name, func(t *testing.T) {
			f, err := Parse(body)
			if err != nil {
				t.Fatal(err)
			}
			if f.ix == nil || len(f.ix.starts) == 0 {
				t.Fatal("Parse built no index")
			}
			checkIndex(t, body, f.ix)
			indexed := At(body, BodyPath)
			indexed.ix = f.ix
			got := walk(t, indexed)
			plain := walk(t, At(body, BodyPath))
			var want any
			if err := json.Unmarshal(body, &want); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Error("read with the index differs from encoding/json's")
			}
			if !reflect.DeepEqual(plain, want) {
				t.Error("read without the index differs from encoding/json's")
			}
		})
	}
}

// TestIndexFindsNothingOutsideItsBody: a slice of another buffer with the same bytes is
// scanned, not looked up.
func TestIndexFindsNothingOutsideItsBody(t *testing.T) {
	body := []byte(`{"a":["` + strings.Repeat("x", 80) + `"]}`)
	ix := newIndex(body)
	if !valid(body, ix) {
		t.Fatal("not valid")
	}
	if end, ok := ix.end(body, 5); !ok || end != len(body)-1 {
		t.Errorf("the array in the body: end %d, %v; want %d", end, ok, len(body)-1)
	}
	other := append([]byte(nil), body...)
	if _, ok := ix.end(other, 5); ok {
		t.Error("a copy of the body was looked up in the body's index")
	}
	var none *index
	if _, ok := none.end(body, 5); ok {
		t.Error("a nil index found a value")
	}
}

func mustMarshal(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
