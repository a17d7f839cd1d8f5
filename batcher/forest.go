package batcher

import (
	"bytes"
	"unsafe"
)

// none marks a missing node index.
const none int32 = -1

// node is a run of tokens in a radix forest: every token of the run has the same loss
// owner, and the run's context is the path from the root. Runs are sub-slices of the
// recorded calls' arrays; nothing is copied until the micro-batch is encoded.
type node struct {
	tokens   []int32
	logprobs []float32 // one per token when the run is sampled (loss), nil when context
	temp     float32   // with logprobs: the temperature the run was sampled at
	sample   int32     // step sample index of the loss owner, none when context
	creator  int32     // step sample index of the session whose call created the node
	parent   int32
	first    int32 // first child
	last     int32 // last child: children keep insertion order, which is the DFS order
	next     int32 // next sibling
	depth    int32 // position of tokens[0]: rows above this node
}

// forest holds the sequences of one group. Node 0 is a sentinel whose children are the
// roots, so a root is just a child at depth 0.
type forest struct {
	nodes []node
}

// cursor is a position in the forest: just after tokens[:off] of node n.
type cursor struct {
	n   int32
	off int
}

func newForest(capacity int) *forest {
	f := &forest{nodes: make([]node, 1, capacity+1)}
	f.nodes[0] = node{sample: none, creator: none, parent: none, first: none, last: none, next: none}
	return f
}

func (f *forest) top() cursor { return cursor{n: 0} }

// rows is the number of distinct rows the forest holds.
func (f *forest) rows() int64 {
	var n int64
	for i := range f.nodes {
		n += int64(len(f.nodes[i].tokens))
	}
	return n
}

// addChild appends a new node under parent and returns its index.
func (f *forest) addChild(parent int32, tokens []int32, logprobs []float32, temp float32, sample, creator int32) int32 {
	p := &f.nodes[parent]
	idx := int32(len(f.nodes))
	nd := node{
		tokens: tokens, logprobs: logprobs, temp: temp, sample: sample, creator: creator,
		parent: parent, first: none, last: none, next: none,
		depth: p.depth + int32(len(p.tokens)),
	}
	if p.last == none {
		p.first = idx
	} else {
		f.nodes[p.last].next = idx
	}
	p.last = idx
	f.nodes = append(f.nodes, nd)
	return idx
}

// split cuts node n after at tokens: n keeps tokens[:at] and gets a single child holding
// the rest of the run and all of n's former children.
func (f *forest) split(n int32, at int) int32 {
	idx := int32(len(f.nodes))
	old := f.nodes[n]
	tail := node{
		tokens: old.tokens[at:], temp: old.temp, sample: old.sample, creator: old.creator,
		parent: n, first: old.first, last: old.last, next: none,
		depth: old.depth + int32(at),
	}
	if old.logprobs != nil {
		tail.logprobs = old.logprobs[at:]
	}
	f.nodes = append(f.nodes, tail)
	for c := tail.first; c != none; c = f.nodes[c].next {
		f.nodes[c].parent = idx
	}
	h := &f.nodes[n]
	h.tokens = old.tokens[:at]
	if old.logprobs != nil {
		h.logprobs = old.logprobs[:at]
	}
	h.first, h.last = idx, idx
	return idx
}

// insert walks tokens down from cur, sharing every existing row it can and creating the
// rest, and returns the cursor after the last token. With logprobs == nil the tokens are
// context and may pass through any row. With logprobs set they are sampled by sample: they
// may only claim rows that carry no loss yet (a row trains at most one call), so where
// another call already sampled the same tokens the path branches off instead.
func (f *forest) insert(cur cursor, tokens []int32, logprobs []float32, temp float32, sample, creator int32) cursor {
	claim := logprobs != nil
	for len(tokens) > 0 {
		nd := &f.nodes[cur.n]
		if cur.off < len(nd.tokens) {
			m := 0
			if !claim || nd.sample == none {
				m = commonPrefix(nd.tokens[cur.off:], tokens)
			}
			if m == 0 {
				f.split(cur.n, cur.off)
				continue // now at the end of cur.n
			}
			if claim {
				n := cur.n
				if cur.off > 0 {
					n = f.split(n, cur.off)
				}
				if m < len(f.nodes[n].tokens) {
					f.split(n, m)
				}
				f.nodes[n].logprobs = logprobs[:m]
				f.nodes[n].temp = temp
				f.nodes[n].sample = sample
				cur = cursor{n: n, off: m}
				logprobs = logprobs[m:]
			} else {
				cur.off += m
			}
			tokens = tokens[m:]
			continue
		}
		c := f.findChild(cur.n, tokens, claim)
		if c == none {
			n := f.addChild(cur.n, tokens, logprobs, temp, orNone(claim, sample), creator)
			return cursor{n: n, off: len(tokens)}
		}
		cur = cursor{n: c}
	}
	return cur
}

func orNone(ok bool, v int32) int32 {
	if ok {
		return v
	}
	return none
}

// findChild returns the child of n to descend into for tokens, or none. Siblings share a
// first token only where two calls sampled the same tokens; context then follows the
// sibling it shares most with, so a later prompt continues the branch it extends.
func (f *forest) findChild(n int32, tokens []int32, claim bool) int32 {
	best, bestLen := none, 0
	for c := f.nodes[n].first; c != none; c = f.nodes[c].next {
		ch := &f.nodes[c]
		if ch.tokens[0] != tokens[0] || (claim && ch.sample != none) {
			continue
		}
		if claim {
			return c
		}
		if best == none {
			best, bestLen = c, -1 // computed only if a second candidate shows up
			continue
		}
		if bestLen < 0 {
			bestLen = commonPrefix(f.nodes[best].tokens, tokens)
		}
		if l := commonPrefix(ch.tokens, tokens); l > bestLen {
			best, bestLen = c, l
		}
	}
	return best
}

// commonPrefix returns the length of the longest common prefix of a and b. Equal runs are
// the common case and are compared as bytes (the runtime's vectorised memequal); only the
// block holding the first difference is scanned token by token.
func commonPrefix(a, b []int32) int {
	n := min(len(a), len(b))
	if n == 0 {
		return 0
	}
	a, b = a[:n], b[:n]
	if bytes.Equal(int32Bytes(a), int32Bytes(b)) {
		return n
	}
	const block = 256
	i := 0
	for i+block <= n && bytes.Equal(int32Bytes(a[i:i+block]), int32Bytes(b[i:i+block])) {
		i += block
	}
	for i < n && a[i] == b[i] {
		i++
	}
	return i
}

func int32Bytes(s []int32) []byte {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), len(s)*4)
}
