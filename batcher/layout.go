package batcher

import "fmt"

// leaf is one root-to-leaf path of a forest in DFS order.
type leaf struct {
	node   int32
	length int64 // rows on the path
	loss   int64 // loss rows first reached at this leaf
}

// layout is the DFS view of a forest that cutting and encoding need: leaves in order,
// each node's leaf range and subtree size, so "the part of a tree that these leaves need"
// is a range test.
type layout struct {
	f       *forest
	leaves  []leaf
	leafLo  []int32   // per node: index of its first leaf
	leafHi  []int32   // per node: one past its last leaf
	subRows []int64   // per node: rows in its subtree, its own run included
	subAttn []float64 // per node: Σ(depth+1) over its subtree's rows
	trees   []int32   // roots
}

func newLayout(f *forest) *layout {
	n := len(f.nodes)
	l := &layout{f: f, leafLo: make([]int32, n), leafHi: make([]int32, n), subRows: make([]int64, n), subAttn: make([]float64, n)}
	type frame struct{ n, child int32 }
	stack := make([]frame, 0, 64)
	var loss int64 // loss rows entered since the last leaf
	enter := func(n int32) {
		nd := &f.nodes[n]
		if nd.sample != none {
			loss += int64(len(nd.tokens))
		}
		l.leafLo[n] = int32(len(l.leaves))
		end := int64(nd.depth) + int64(len(nd.tokens))
		l.subRows[n] = int64(len(nd.tokens))
		l.subAttn[n] = tri(end) - tri(int64(nd.depth))
		if nd.first == none {
			l.leaves = append(l.leaves, leaf{node: n, length: end, loss: loss})
			loss = 0
		}
		stack = append(stack, frame{n: n, child: nd.first})
	}
	for root := f.nodes[0].first; root != none; root = f.nodes[root].next {
		enter(root)
		for len(stack) > 0 {
			top := &stack[len(stack)-1]
			if c := top.child; c != none {
				top.child = f.nodes[c].next
				enter(c)
				continue
			}
			l.leafHi[top.n] = int32(len(l.leaves))
			if p := f.nodes[top.n].parent; p > 0 {
				l.subRows[p] += l.subRows[top.n]
				l.subAttn[p] += l.subAttn[top.n]
			}
			stack = stack[:len(stack)-1]
		}
		l.trees = append(l.trees, root)
	}
	return l
}

// leafRange is the leaves [lo, hi) in DFS order: the leaves of one subtree.
type leafRange struct{ lo, hi int32 }

// piece is the part of one tree that one micro-batch holds: some of its units and the
// paths from the root down to them. Path rows that another piece of the tree also needs are
// repeated there as context; a node's loss is trained only in the piece holding its first
// leaf.
type piece struct {
	lay    *layout
	base   int32 // step sample index of the group's first session
	root   int32
	ranges []leafRange // sorted, disjoint
	rows   int64
	attn   float64 // Σ(depth+1) over its rows
	loss   int64
}

// tri is Σ(d+1) for d in [0, x): the attention cost of a path of x rows.
func tri(x int64) float64 { return float64(x) * float64(x+1) / 2 }

// holds reports whether leaf k is one of the piece's.
func (p *piece) holds(k int32) bool {
	for _, r := range p.ranges {
		if k >= r.lo && k < r.hi {
			return true
		}
	}
	return false
}

// overlaps reports whether any of the piece's leaves lies in [lo, hi).
func (p *piece) overlaps(lo, hi int32) bool {
	for _, r := range p.ranges {
		if r.lo < hi && lo < r.hi {
			return true
		}
	}
	return false
}

// cutFloor is the fewest rows any cut of the forest's trees into pieces of at most budget
// rows can forward. Every piece holding a leaf below node n holds the whole path down to
// n's end (e rows) and at most budget-e rows below it, so the b rows below n need at least
// ceil(b/(budget-e)) pieces, each repeating n's rows.
func (l *layout) cutFloor(budget int64) int64 {
	var total int64
	for n := 1; n < len(l.f.nodes); n++ {
		nd := &l.f.nodes[n]
		own := int64(len(nd.tokens))
		end := int64(nd.depth) + own
		below := l.subRows[n] - own
		k := int64(1)
		if below > 0 && end < budget {
			k = max(1, (below+budget-end-1)/(budget-end))
		}
		total += k * own
	}
	return total
}

// unit is a whole subtree that goes into one micro-batch, with the path above it that must
// come along. A tree that fits the budget is a single unit with no path above it; a larger
// one is split at its branch points into the largest subtrees that fit beside their path.
type unit struct {
	lay   *layout
	base  int32 // step sample index of the group's first session
	root  int32 // the tree's root
	node  int32 // the subtree's top node
	above int64 // rows on the path above node
	rows  int64 // rows of the subtree
}

// units splits every tree of the layout into units of at most budget rows, path included.
// It fails when a single root-to-leaf path is longer than the budget.
func (l *layout) units(budget int64, base int32, sessionName func(sample int32) string) ([]unit, error) {
	for _, lf := range l.leaves {
		if lf.length > budget {
			return nil, fmt.Errorf("session %s: a root-to-leaf path of %d rows is longer than the token budget of %d rows",
				sessionName(l.f.nodes[lf.node].creator), lf.length, budget)
		}
	}
	var out []unit
	var split func(root, v int32, above int64)
	split = func(root, v int32, above int64) {
		if above+l.subRows[v] <= budget {
			out = append(out, unit{lay: l, base: base, root: root, node: v, above: above, rows: l.subRows[v]})
			return
		}
		// v has children: a leaf on its own always fits, as checked above.
		path := above + int64(len(l.f.nodes[v].tokens))
		for c := l.f.nodes[v].first; c != none; c = l.f.nodes[c].next {
			split(root, c, path)
		}
	}
	for _, root := range l.trees {
		split(root, root, 0)
	}
	return out, nil
}
