package proxy

import (
	"bytes"
	"testing"
)

func FuzzReadSSE(f *testing.F) {
	f.Add([]byte("data: {\"a\":1}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("event: x\ndata: a\ndata: b\n\n: comment\ndata:c"))
	f.Fuzz(func(t *testing.T, in []byte) {
		var n int
		_ = ReadSSE(bytes.NewReader(in), nil, func(b []byte) error { n += len(b); return nil })
		if n > len(in) {
			t.Fatalf("read %d data bytes from %d input bytes", n, len(in))
		}
	})
}
