package batcher

import "fmt"

// leaf is one root-to-leaf path of a forest in DFS order.
type leaf struct {
	node   int32
	length int64 // rows on the path
	shared int64 // rows this path shares with the previous leaf's path (0 at a tree's first leaf)
	loss   int64 // loss rows first reached at this leaf
}

// layout is the DFS view of a forest that cutting and encoding need: leaves in order and
// each node's leaf range, so "the part of a tree that leaves [lo, hi) need" is a range test.
type layout struct {
	f      *forest
	leaves []leaf
	leafLo []int32 // per node: index of its first leaf
	leafHi []int32 // per node: one past its last leaf
	trees  []treeSpan
}

// treeSpan is one root and its leaves [lo, hi).
type treeSpan struct {
	root   int32
	lo, hi int32
}

func newLayout(f *forest) *layout {
	n := len(f.nodes)
	l := &layout{f: f, leafLo: make([]int32, n), leafHi: make([]int32, n)}
	type frame struct{ n, child int32 }
	stack := make([]frame, 0, 64)
	var shared int64 = -1 // depth of the first node entered since the last leaf
	var loss int64        // loss rows entered since the last leaf
	enter := func(n int32) {
		nd := &f.nodes[n]
		if shared < 0 {
			shared = int64(nd.depth)
		}
		if nd.sample != none {
			loss += int64(len(nd.tokens))
		}
		l.leafLo[n] = int32(len(l.leaves))
		if nd.first == none {
			l.leaves = append(l.leaves, leaf{node: n, length: int64(nd.depth) + int64(len(nd.tokens)), shared: shared, loss: loss})
			shared, loss = -1, 0
		}
		stack = append(stack, frame{n: n, child: nd.first})
	}
	for root := f.nodes[0].first; root != none; root = f.nodes[root].next {
		lo := int32(len(l.leaves))
		enter(root)
		for len(stack) > 0 {
			top := &stack[len(stack)-1]
			if c := top.child; c != none {
				top.child = f.nodes[c].next
				enter(c)
				continue
			}
			l.leafHi[top.n] = int32(len(l.leaves))
			stack = stack[:len(stack)-1]
		}
		l.trees = append(l.trees, treeSpan{root: root, lo: lo, hi: int32(len(l.leaves))})
	}
	return l
}

// piece is the part of one tree that leaves [lo, hi) need: their root-to-leaf paths. The
// ancestors it shares with the piece before it are repeated as context; their loss is
// trained only in the piece where they first appear.
type piece struct {
	lay    *layout
	base   int32 // step sample index of the group's first session
	root   int32
	lo, hi int32
	rows   int64
	attn   float64 // Σ(depth+1) over its rows
	loss   int64
}

// tri is Σ(d+1) for d in [0, x): the attention cost of a path of x rows.
func tri(x int64) float64 { return float64(x) * float64(x+1) / 2 }

func (l *layout) newPiece(root, lo, hi int32) piece {
	p := piece{lay: l, root: root, lo: lo, hi: hi}
	first := &l.leaves[lo]
	p.rows = first.shared
	p.attn = tri(first.shared)
	for k := lo; k < hi; k++ {
		lf := &l.leaves[k]
		p.rows += lf.length - lf.shared
		p.attn += tri(lf.length) - tri(lf.shared)
		p.loss += lf.loss
	}
	return p
}

// cut splits every tree of the layout into pieces of at most budget rows. A tree that
// fits is one piece. A larger one is cut between leaves where the repeated ancestor rows
// add up to the least (fewest pieces among equals): consecutive leaves of different
// sessions share only the group prompt, leaves of one session share its history.
func (l *layout) cut(budget int64, sessionName func(sample int32) string) ([]piece, error) {
	var out []piece
	for _, t := range l.trees {
		var total int64
		for k := t.lo; k < t.hi; k++ {
			lf := &l.leaves[k]
			if lf.length > budget {
				return nil, fmt.Errorf("session %s: a root-to-leaf path of %d rows is longer than the token budget of %d rows",
					sessionName(l.f.nodes[lf.node].creator), lf.length, budget)
			}
			total += lf.length - lf.shared
		}
		if total <= budget {
			out = append(out, l.newPiece(t.root, t.lo, t.hi))
			continue
		}
		out = append(out, l.cutTree(t, budget)...)
	}
	return out, nil
}

// cutTree is a shortest-path over cut positions: best[j] is the least repeated rows for
// leaves [lo, lo+j), and a piece [i, j) fits when shared_i + Σ_{i<=k<j}(length_k - shared_k)
// <= budget. That sum only grows as i moves left, so the scan for each j stops early.
func (l *layout) cutTree(t treeSpan, budget int64) []piece {
	n := int(t.hi - t.lo)
	lv := l.leaves[t.lo:t.hi]
	type state struct {
		extra  int64
		pieces int
		from   int
	}
	best := make([]state, n+1)
	for j := 1; j <= n; j++ {
		best[j] = state{extra: -1}
		var span int64 // Σ (length - shared) over leaves [i, j)
		for i := j - 1; i >= 0; i-- {
			span += lv[i].length - lv[i].shared
			if lv[i].shared+span > budget {
				break
			}
			prev := best[i]
			cand := state{extra: prev.extra + lv[i].shared, pieces: prev.pieces + 1, from: i}
			if best[j].extra < 0 || cand.extra < best[j].extra ||
				(cand.extra == best[j].extra && cand.pieces < best[j].pieces) {
				best[j] = cand
			}
		}
	}
	pieces := make([]piece, best[n].pieces)
	for j, k := n, len(pieces)-1; j > 0; j, k = best[j].from, k-1 {
		i := best[j].from
		pieces[k] = l.newPiece(t.root, t.lo+int32(i), t.lo+int32(j))
	}
	return pieces
}
