package proxy

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestStoredRequest(t *testing.T) {
	big := strings.Repeat("x", StoredFieldBytes+1)
	many := `{"model":"m"` + strings.Repeat(`,"f":"`+strings.Repeat("y", 60<<10)+`"`, 40) + `}` // 40 fields that each fit
	for _, tt := range []struct {
		name, body string
		max        int
		whole      bool     // stored as it came
		kept       []string // fields that must stay
		dropped    []string // fields the marker must name
	}{
		{"small", `{"model":"m","junk":"` + big + `"}`, 1 << 20, true, nil, nil},
		{"no limit", `{"model":"m","junk":"` + big + `"}`, 0, true, nil, nil},
		{"large unknown field", `{"model":"m","messages":[{"role":"user","content":"hi"}],"junk":"` + big + `"}`, 1024, false, []string{"model", "messages"}, []string{"junk"}},
		{"large nested value", `{"model":"m","messages":[{"role":"user","content":"` + big + `"}]}`, 1024, false, []string{"model"}, []string{"messages"}},
		{"over the total", many, 1 << 20, false, []string{"model", "f"}, []string{"f"}},
		{"escaped key and value", `{"a\"b":"c\\\"d","junk":"` + big + `"}`, 1024, false, []string{`a"b`}, []string{"junk"}},
		{"not an object", `["` + big + `"]`, 1024, false, nil, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := storedRequest([]byte(tt.body), tt.max)
			if tt.whole {
				if !bytes.Equal(got, []byte(tt.body)) {
					t.Fatal("changed a request within the limit")
				}
				return
			}
			if len(got) > tt.max+4<<10 || !json.Valid(got) {
				t.Fatalf("stored %d bytes, valid JSON %v", len(got), json.Valid(got))
			}
			var doc map[string]json.RawMessage
			_ = json.Unmarshal(got, &doc)
			var mark truncated
			if err := json.Unmarshal(doc["floe_truncated"], &mark); err != nil || mark.OriginalBytes != len(tt.body) {
				t.Fatalf("marker %s: %v", doc["floe_truncated"], err)
			}
			for _, k := range tt.kept {
				if doc[k] == nil {
					t.Errorf("field %q was dropped", k)
				}
			}
			names := map[string]bool{}
			for _, d := range mark.Dropped {
				names[d.Field] = true
			}
			for _, k := range tt.dropped {
				if !names[k] {
					t.Errorf("the marker does not name %q: %+v", k, mark.Dropped)
				}
			}
		})
	}
}

func TestValidUTF8(t *testing.T) {
	ok := []byte(`{"a":"é"}`)
	if got := validUTF8(ok); &got[0] != &ok[0] {
		t.Error("copied valid UTF-8")
	}
	got := validUTF8([]byte("{\"a\":\"\xff\xfeb\"}"))
	if !utf8.Valid(got) || !json.Valid(got) || !strings.Contains(string(got), "\uFFFDb") {
		t.Errorf("%q", got)
	}
}
