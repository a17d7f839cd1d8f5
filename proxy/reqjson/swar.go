package reqjson

import "encoding/binary"

// Strings are most of an agent's request (tool results, file contents) and every one is
// read twice, to validate and to decode it: these find the end of a string's plain run
// eight bytes at a time ("SIMD within a register").

const (
	ones  = 0x0101010101010101
	highs = 0x8080808080808080
)

// hasZero is non-zero when a byte of x is zero.
func hasZero(x uint64) uint64 { return (x - ones) &^ x & highs }

// hasLess is non-zero when a byte of x is below n (n ≤ 128).
func hasLess(x uint64, n byte) uint64 { return (x - ones*uint64(n)) &^ x & highs }

// plainPrefix is the length of b's leading run of bytes that a JSON string holds as they
// are: none is a control character, a quote or a backslash.
func plainPrefix(b []byte) int {
	i := 0
	for ; i+8 <= len(b); i += 8 {
		x := binary.LittleEndian.Uint64(b[i:])
		if hasLess(x, 0x20)|hasZero(x^(ones*'"'))|hasZero(x^(ones*'\\')) != 0 {
			break
		}
	}
	for ; i < len(b); i++ {
		if c := b[i]; c < 0x20 || c == '"' || c == '\\' {
			break
		}
	}
	return i
}

// asciiPrefix is the length of b's leading run of printable ASCII other than the
// backslash: text that decodes to itself.
func asciiPrefix(b []byte) int {
	i := 0
	for ; i+8 <= len(b); i += 8 {
		x := binary.LittleEndian.Uint64(b[i:])
		if hasLess(x, 0x20)|hasZero(x^(ones*'\\'))|x&highs != 0 {
			break
		}
	}
	for ; i < len(b); i++ {
		if c := b[i]; c < 0x20 || c == '\\' || c >= 0x80 {
			break
		}
	}
	return i
}

// plainRun is plainPrefix(b), and whether that run is all ASCII (so valid UTF-8 without
// another look at it): decodeString needs both, and most runs of source code are short
// and ASCII.
func plainRun(b []byte) (n int, ascii bool) {
	var high uint64
	i := 0
	for ; i+8 <= len(b); i += 8 {
		x := binary.LittleEndian.Uint64(b[i:])
		if hasLess(x, 0x20)|hasZero(x^(ones*'"'))|hasZero(x^(ones*'\\')) != 0 {
			break
		}
		high |= x
	}
	var tail byte
	for ; i < len(b); i++ {
		c := b[i]
		if c < 0x20 || c == '"' || c == '\\' {
			break
		}
		tail |= c
	}
	return i, high&highs == 0 && tail < 0x80
}
