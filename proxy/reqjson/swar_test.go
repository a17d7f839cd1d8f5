package reqjson

import (
	"math/rand/v2"
	"testing"
)

// TestPrefixesMatchBytewiseScans: the eight-bytes-at-a-time scans stop exactly where a
// byte-by-byte scan does, for special bytes at every position of a word and every byte
// value around the limits.
func TestPrefixesMatchBytewiseScans(t *testing.T) {
	naivePlain := func(b []byte) int {
		for i, c := range b {
			if c < 0x20 || c == '"' || c == '\\' {
				return i
			}
		}
		return len(b)
	}
	naiveASCII := func(b []byte) int {
		for i, c := range b {
			if c < 0x20 || c == '\\' || c >= 0x80 {
				return i
			}
		}
		return len(b)
	}
	var inputs [][]byte
	for n := 0; n <= 24; n++ {
		for pos := 0; pos < n; pos++ {
			for _, c := range []byte{0, 0x1f, 0x20, '!', '"', '#', '\\', ']', 0x7f, 0x80, 0xc3, 0xff} {
				b := make([]byte, n)
				for i := range b {
					b[i] = 'a'
				}
				b[pos] = c
				inputs = append(inputs, b)
			}
		}
	}
	r := rand.New(rand.NewPCG(3, 4))
	for i := 0; i < 5000; i++ {
		b := make([]byte, r.IntN(40))
		for j := range b {
			b[j] = byte(0x20 + r.IntN(0x60))
			if r.IntN(30) == 0 {
				b[j] = byte(r.IntN(256))
			}
		}
		inputs = append(inputs, b)
	}
	for _, b := range inputs {
		if got, want := plainPrefix(b), naivePlain(b); got != want {
			t.Fatalf("plainPrefix(%q) = %d, want %d", b, got, want)
		}
		if got, want := asciiPrefix(b), naiveASCII(b); got != want {
			t.Fatalf("asciiPrefix(%q) = %d, want %d", b, got, want)
		}
		n, ascii := plainRun(b)
		wantASCII := true
		for _, c := range b[:naivePlain(b)] {
			wantASCII = wantASCII && c < 0x80
		}
		if n != naivePlain(b) || ascii != wantASCII {
			t.Fatalf("plainRun(%q) = %d, %v; want %d, %v", b, n, ascii, naivePlain(b), wantASCII)
		}
	}
}
