// Package reqjson decodes the JSON bodies harnesses send to the proxy, strictly and with
// errors that name the offending field by its path, so that every dialect rejects a bad
// request the same way:
//
//	messages[2].content[0].text: want string, got number
//
// The rules, the same for every dialect:
//
//   - Null is absent. A field that is null reads exactly as one that is missing: the
//     typed getters return the zero value (String "", Bool false, Number and Int nil,
//     Object an empty object, Array nil), and Required fails with "<path>: required".
//   - Anything else of the wrong JSON type is an error, "<path>: want <type>, got <kind>",
//     where kind is one of string, number, boolean, object, array. Numbers are never
//     read from strings, nor strings from numbers.
//   - Unknown fields are never an error: harnesses (Claude Code, Codex, Gemini CLI, Qwen
//     Code, Pi) send many fields floe has no use for, and a dialect reads only the ones
//     it needs.
//   - Every error is a *proxy.Error of kind invalid_request (HTTP 400) whose message is
//     "<path>: <what is wrong>"; the whole body is "request body". Messages name fields
//     and the caller's own values, never session ids or file paths.
//
// The body is checked to be well-formed JSON once, by Parse; values below it are
// decoded on demand, so a field floe never reads costs nothing beyond that check.
package reqjson

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"strconv"

	"github.com/floe-rl/floe/proxy"
)

// Kind is a JSON value's type as error messages name it.
type Kind string

const (
	Null    Kind = "null" // also an absent field
	String  Kind = "string"
	Number  Kind = "number"
	Boolean Kind = "boolean"
	Object  Kind = "object"
	Array   Kind = "array"
)

// BodyPath names the whole request body in errors.
const BodyPath = "request body"

// Value is one JSON value of a request and the path that names it in errors.
type Value struct {
	raw json.RawMessage
	// The path is built only when asked for (mostly for an error): parent's path, then
	// .key, or [index] when index >= 0.
	parent, key string
	index       int
	ix          *index // where the body's values end; nil: found by scanning
}

// Fields is a JSON object whose fields are read by name.
type Fields struct {
	path   string
	fields []field // in order; a key sent twice counts as its last value, as in encoding/json
	ix     *index
}

// Parse checks that body is well-formed JSON holding an object and returns its fields.
func Parse(body []byte) (Fields, error) {
	v := At(body, BodyPath)
	if len(v.raw) == 0 {
		return Fields{}, v.Errorf("want object, got nothing")
	}
	ix := newIndex(body)
	if !valid(body, ix) {
		var probe any // encoding/json says what is wrong, and where
		err := json.Unmarshal(body, &probe)
		return Fields{}, v.Errorf("malformed JSON: %v", err)
	}
	if v.Kind() != Object {
		return Fields{}, v.Wrong("object")
	}
	v.ix = ix
	f, err := v.Object()
	if err != nil {
		return Fields{}, err
	}
	f.path = ""
	return f, nil
}

// At is raw as a Value named path; raw must be well-formed JSON (a part of a body Parse
// accepted) or empty (absent).
func At(raw json.RawMessage, path string) Value {
	return Value{raw: bytes.TrimSpace(raw), key: path, index: -1}
}

// Path names the value in errors.
func (v Value) Path() string {
	switch {
	case v.index >= 0:
		return v.parent + "[" + strconv.Itoa(v.index) + "]"
	case v.parent == "":
		return v.key
	}
	return v.parent + "." + v.key
}

// Raw is a copy of the value's JSON text, nil when it is absent or null. A copy, so that
// what a request keeps of its body (tool schemas, tool choice) does not keep the whole
// body alive: a maximum-size body is released once it is decoded.
func (v Value) Raw() json.RawMessage {
	if v.Kind() == Null {
		return nil
	}
	return bytes.Clone(v.raw)
}

// Kind is the value's JSON type; Null for an absent value.
func (v Value) Kind() Kind {
	if len(v.raw) == 0 {
		return Null
	}
	switch v.raw[0] {
	case '"':
		return String
	case '{':
		return Object
	case '[':
		return Array
	case 't', 'f':
		return Boolean
	case 'n':
		return Null
	}
	return Number
}

// IsNull reports whether the value is absent or null.
func (v Value) IsNull() bool { return v.Kind() == Null }

// Errorf is an invalid-request error about the value: "<path>: <message>".
func (v Value) Errorf(format string, args ...any) error {
	return proxy.InvalidRequest("%s: %s", v.Path(), fmt.Sprintf(format, args...))
}

// Wrong is the error for a value of the wrong type: "<path>: want <want>, got <kind>".
func (v Value) Wrong(want string) error {
	return v.Errorf("want %s, got %s", want, v.Kind())
}

// Required fails with "<path>: required" when the value is absent or null.
func (v Value) Required() error {
	if v.IsNull() {
		return v.Errorf("required")
	}
	return nil
}

// String is a string value; "" when absent.
func (v Value) String() (string, error) {
	switch v.Kind() {
	case Null:
		return "", nil
	case String:
		s, err := decodeString(v.raw)
		if err != nil {
			return "", v.Errorf("malformed string")
		}
		return s, nil
	}
	return "", v.Wrong("string")
}

// NonEmptyString is a string that must be present and not "".
func (v Value) NonEmptyString() (string, error) {
	if err := v.Required(); err != nil {
		return "", err
	}
	s, err := v.String()
	if err == nil && s == "" {
		err = v.Errorf("must not be empty")
	}
	return s, err
}

// Bool is a boolean value; false when absent.
func (v Value) Bool() (bool, error) {
	switch v.Kind() {
	case Null:
		return false, nil
	case Boolean:
		return v.raw[0] == 't', nil
	}
	return false, v.Wrong("boolean")
}

// Number is a number value; nil when absent.
func (v Value) Number() (*float64, error) {
	switch v.Kind() {
	case Null:
		return nil, nil
	case Number:
		f, err := strconv.ParseFloat(string(v.raw), 64)
		if err != nil {
			return nil, v.Errorf("number %s is out of range", v.raw)
		}
		return &f, nil
	}
	return nil, v.Wrong("number")
}

// Int is a whole number (1 and 1.0 alike) within ±2^31; nil when absent.
func (v Value) Int() (*int, error) {
	f, err := v.Number()
	if err != nil || f == nil {
		return nil, err
	}
	if *f != math.Trunc(*f) {
		return nil, v.Errorf("want integer, got %s", v.raw)
	}
	if *f > math.MaxInt32 || *f < math.MinInt32 {
		return nil, v.Errorf("integer %s is out of range", v.raw)
	}
	n := int(*f)
	return &n, nil
}

// Object is an object value's fields; an absent value has none.
func (v Value) Object() (Fields, error) {
	switch v.Kind() {
	case Null:
		return Fields{path: v.Path()}, nil
	case Object:
		fields, err := scanObject(v.raw, v.ix)
		if err != nil {
			return Fields{}, v.Errorf("malformed object")
		}
		return Fields{path: v.Path(), fields: fields, ix: v.ix}, nil
	}
	return Fields{}, v.Wrong("object")
}

// Array is an array value's elements, each named path[i]; nil when absent.
func (v Value) Array() ([]Value, error) {
	switch v.Kind() {
	case Null:
		return nil, nil
	case Array:
		elems, err := scanArray(v.raw, v.ix)
		if err != nil {
			return nil, v.Errorf("malformed array")
		}
		out := make([]Value, len(elems))
		parent := v.Path()
		for i, raw := range elems {
			out[i] = Value{raw: raw, parent: parent, index: i, ix: v.ix}
		}
		return out, nil
	}
	return nil, v.Wrong("array")
}

// Strings is an array of strings; nil when absent. A null element reads as "".
func (v Value) Strings() ([]string, error) {
	elems, err := v.Array()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range elems {
		s, err := e.String()
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, nil
}

// Get is the field key, named "<path>.key" (just "key" at the top of the body).
func (f Fields) Get(key string) Value {
	v := Value{parent: f.path, key: key, index: -1, ix: f.ix}
	for i := len(f.fields) - 1; i >= 0; i-- {
		if f.fields[i].key == key {
			v.raw = f.fields[i].raw
			break
		}
	}
	return v
}

// Has reports whether the field key is present and not null.
func (f Fields) Has(key string) bool { return !f.Get(key).IsNull() }

// Path names the object in errors ("" for the body itself).
func (f Fields) Path() string { return f.path }

// Len is the number of fields, null and repeated ones included.
func (f Fields) Len() int { return len(f.fields) }

// Keys are the object's field names in the order sent (a repeated key repeats).
func (f Fields) Keys() []string {
	out := make([]string, 0, len(f.fields))
	for _, fl := range f.fields {
		out = append(out, fl.key)
	}
	return out
}
