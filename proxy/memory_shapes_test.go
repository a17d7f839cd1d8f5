package proxy_test

import (
	"io"
	"strings"
	"testing"

	"github.com/floe-rl/floe/proxy"
)

// shapedReader streams a chat request of exactly size bytes whose bulk, in a field floe
// ignores, is unit repeated (padded with spaces), so that the client holds none of it.
func shapedReader(size int, unit string) io.Reader {
	head, tail := `{"model":"m","messages":[{"role":"user","content":"hi"}],"junk":[`, `0]}`
	n := (size - len(head) - len(tail)) / len(unit)
	pad := size - len(head) - len(tail) - n*len(unit)
	return io.MultiReader(strings.NewReader(head), io.LimitReader(&cycleReader{unit: unit}, int64(n*len(unit))),
		strings.NewReader(strings.Repeat(" ", pad)), strings.NewReader(tail))
}

// cycleReader repeats unit for ever.
type cycleReader struct {
	unit string
	off  int
}

func (c *cycleReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = c.unit[c.off]
		c.off = (c.off + 1) % len(c.unit)
	}
	return len(p), nil
}

// TestPeakMemoryPerBodyShape: four concurrent maximum-size bodies of each shape a
// hostile harness can pad with (strings, numbers, empty containers, deep objects) raise
// the live heap by at most 2.5 bodies per request: the request index is bounded by the
// body (empty arrays cost 4.3 bodies per request before, nested arrays 5.2).
func TestPeakMemoryPerBodyShape(t *testing.T) {
	if testing.Short() || raceEnabled {
		t.Skip("sends hundreds of MiB; heap peaks mean nothing under the race detector")
	}
	const n, size, want = 4, proxy.DefaultMaxBodyBytes, 2.5
	for _, tt := range []struct{ name, unit string }{
		{"strings", `"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",`},
		{"numbers", `1,`},
		{"empty arrays", `[],`},
		{"empty objects", `{},`},
		{"deep objects", `{"a":{"a":{"a":{"a":{"a":{"a":{"a":{"a":{}}}}}}}}},`},
		{"nested arrays", strings.Repeat("[", 40) + strings.Repeat("]", 40) + ","},
	} {
		t.Run(tt.name, func(t *testing.T) {
			body := func() io.Reader { return shapedReader(size, tt.unit) }
			if per := peakPerRequestOf(t, n, size, body, tt.name); per > want {
				t.Errorf("peak live heap per request is %.2f bodies; want at most %.1f", per, want)
			}
		})
	}
}
