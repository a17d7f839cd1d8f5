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
type index struct {
	body   []byte
	starts []int32 // offsets in body, increasing
	ends   []int32 // the offset after the value starting at starts[k]
}

// indexMinString is the shortest string the index notes: a shorter one is skipped as
// fast as it is looked up.
const indexMinString = 64

// newIndex is an empty index of body, nil for a body too long for its offsets.
func newIndex(body []byte) *index {
	if len(body) == 0 || len(body) > math.MaxInt32 {
		return nil
	}
	n := len(body) / 256
	return &index{body: body, starts: make([]int32, 0, n), ends: make([]int32, 0, n)}
}

// open notes a value starting at i whose end is not known yet; its slot is returned.
func (x *index) open(i int) int {
	x.starts = append(x.starts, int32(i))
	x.ends = append(x.ends, -1)
	return len(x.ends) - 1
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
