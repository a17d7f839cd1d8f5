package reqjson

import (
	"runtime"
	"strings"
	"testing"
)

// shapedBody is a request of about size bytes whose bulk, in a field floe ignores, is unit
// repeated: the shapes a hostile harness can pad a body with.
func shapedBody(size int, unit string) []byte {
	head, tail := `{"model":"m","messages":[{"role":"user","content":"hi"}],"junk":[`, `0]}`
	var b strings.Builder
	b.Grow(size)
	b.WriteString(head)
	for b.Len()+len(unit)+len(tail) <= size {
		b.WriteString(unit)
	}
	b.WriteString(tail)
	return []byte(b.String())
}

// TestIndexIsBoundedByTheBody: Parse's index holds at most a quarter of its body (and
// allocates less than a body in all while it grows), whatever the body's shape: a body
// of millions of empty arrays cost eight bytes per three of body before; long strings
// and big containers are still indexed.
func TestIndexIsBoundedByTheBody(t *testing.T) {
	const size = 8 << 20
	tests := []struct {
		name, unit string
	}{
		{"empty arrays", `[],`},
		{"empty objects", `{},`},
		{"numbers", `1,`},
		{"deep objects", `{"a":{"a":{"a":{"a":{}}}}},`},
		{"nested arrays", strings.Repeat("[", 40) + strings.Repeat("]", 40) + ","},
		{"short strings", `"abc",`},
		{"long strings", `"` + strings.Repeat("x", 100) + `",`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			body := shapedBody(size, tt.unit)
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			f, err := Parse(body)
			runtime.ReadMemStats(&after)
			if err != nil {
				t.Fatal(err)
			}
			alloc := float64(after.TotalAlloc-before.TotalAlloc) / float64(len(body))
			t.Logf("%s: Parse allocated %.3f bodies", tt.name, alloc)
			if alloc > 0.8 { // a quarter live, and what its growth allocated before
				t.Errorf("Parse allocated %.2f bodies; want at most 0.8", alloc)
			}
			if f.ix == nil || cap(f.ix.starts) > max(len(body)/indexBytesPerEntry, 64) {
				t.Errorf("the index has room for %d entries; want at most one per %d bytes of body", cap(f.ix.starts), indexBytesPerEntry)
			}
		})
	}
}
