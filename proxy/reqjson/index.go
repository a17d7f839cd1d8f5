package reqjson

import (
	"math"
	"slices"
	"unsafe"
)

// index is where a body's containers and long strings end, noted by Parse's check of the
// whole body. Without it, reading an agent's history level by level skips each tool
// result once per level it is nested in (the body, messages, a message, its content, a
// part): five or six reads of most of the body besides the check and the decode. With
// it, skipping a container or a long string is a binary search.
//
// The index is bounded by the body: it notes only values of at least indexMinString
// bytes (a shorter one is skipped as fast as it is looked up), and at most one per
// indexBytesPerEntry bytes of body, so that a body of millions of tiny containers
// (`[[],[],…]`, 3 bytes each) costs at most a quarter of its size here, not eight
// bytes per container: the values past the bound are found by scanning.
type index struct {
	body   []byte
	starts []int32 // offsets in body, increasing
	ends   []int32 // the offset after the value starting at starts[k]
	max    int     // the most entries
}

// indexBytesPerEntry is the body bytes per index entry allowed: 8 bytes an entry, so the
// index is at most a quarter of its body.
const indexBytesPerEntry = 32

// indexMinString is the shortest string the index notes: a shorter one is skipped as
// fast as it is looked up.
const indexMinString = 64

// newIndex is an empty index of body, nil for a body too long for its offsets.
func newIndex(body []byte) *index {
	if len(body) == 0 || len(body) > math.MaxInt32 {
		return nil
	}
	limit := max(len(body)/indexBytesPerEntry, 16)
	n := min(len(body)/256, limit)
	return &index{body: body, starts: make([]int32, 0, n), ends: make([]int32, 0, n), max: limit}
}

// open notes a container starting at i whose end is not known yet; its slot is returned,
// or -1 when the index is full.
func (x *index) open(i int) int {
	if len(x.starts) >= x.max {
		return -1
	}
	x.push(i, -1)
	return len(x.ends) - 1
}

// push appends an entry, growing the slices by doubling up to max, never past it.
func (x *index) push(start, end int) {
	if len(x.starts) == cap(x.starts) {
		n := min(max(2*cap(x.starts), 64), x.max)
		x.starts = append(make([]int32, 0, n), x.starts...)
		x.ends = append(make([]int32, 0, n), x.ends...)
	}
	x.starts = append(x.starts, int32(start))
	x.ends = append(x.ends, int32(end))
}

// close notes where the container of slot, which starts at i, ends. A short one is
// dropped again: it is the last entry, since everything inside it is shorter still and
// was dropped before.
func (x *index) close(slot, i, end int) {
	switch {
	case slot < 0:
	case end-i < indexMinString && slot == len(x.ends)-1:
		x.starts, x.ends = x.starts[:slot], x.ends[:slot]
	default:
		x.ends[slot] = int32(end)
	}
}

// note notes a string from i to end, if it is long enough and the index has room.
func (x *index) note(i, end int) {
	if end-i >= indexMinString && len(x.starts) < x.max {
		x.push(i, end)
	}
}

// end returns the index in b after the value starting at b[i], when the index holds it;
// b must be a part of the indexed body for that (any other slice finds nothing).
func (x *index) end(b []byte, i int) (int, bool) {
	if x == nil || i >= len(b) {
		return 0, false
	}
	off := uintptr(unsafe.Pointer(&b[i])) - uintptr(unsafe.Pointer(unsafe.SliceData(x.body)))
	if off >= uintptr(len(x.body)) {
		return 0, false
	}
	k, found := slices.BinarySearch(x.starts, int32(off))
	if !found || x.ends[k] < 0 {
		return 0, false
	}
	return i + int(x.ends[k]-int32(off)), true
}
