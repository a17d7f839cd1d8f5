package batcher

import (
	"container/heap"
	"fmt"
	"slices"
	"sort"
)

// bin is one micro-batch: pieces laid out one after another, padded at the end.
type bin struct {
	pieces []int // indices into the step's pieces
	rows   int64
	attn   float64
	loss   int64
}

func (b *bin) add(i int, p *piece) {
	b.pieces = append(b.pieces, i)
	b.rows += p.rows
	b.attn += p.attn
	b.loss += p.loss
}

// paddedRows rounds rows up to the pad multiple; an empty bin still holds one block of
// padding, so every rank runs the same number of forward passes.
func paddedRows(rows int64, pad int) int64 {
	m := int64(pad)
	if rows == 0 {
		return m
	}
	return (rows + m - 1) / m * m
}

// cost weighs a bin for rank balancing; padding rows see only themselves.
func (c Config) cost(b *bin) float64 {
	padded := paddedRows(b.rows, c.PadMultiple)
	return c.RowCost*float64(padded) + c.AttnCost*(b.attn+float64(padded-b.rows))
}

// pack places pieces into bins of at most budget rows: best-fit decreasing, then, when
// the bin count is not a multiple of dp, the same pieces are spread worst-fit over the
// next multiple so that no rank gets an empty micro-batch while another is full.
func pack(pieces []piece, budget int64, dp int) ([]bin, error) {
	order := make([]int, len(pieces))
	for i := range order {
		order[i] = i
	}
	// Stable, so equal pieces keep their input order and the step stays deterministic.
	sort.SliceStable(order, func(a, b int) bool {
		pa, pb := &pieces[order[a]], &pieces[order[b]]
		if pa.rows != pb.rows {
			return pa.rows > pb.rows
		}
		return pa.attn > pb.attn
	})
	for _, i := range order {
		if pieces[i].rows > budget {
			return nil, fmt.Errorf("internal error: piece of %d rows exceeds the budget of %d", pieces[i].rows, budget)
		}
	}
	bins := bestFit(pieces, order, budget)
	want := (max(len(bins), 1) + dp - 1) / dp * dp
	if want != len(bins) {
		if spread, ok := worstFit(pieces, order, budget, want); ok {
			bins = spread
		} else {
			bins = append(bins, make([]bin, want-len(bins))...)
		}
	}
	for i := range bins {
		if bins[i].rows > budget {
			return nil, fmt.Errorf("internal error: micro-batch of %d rows exceeds the budget of %d", bins[i].rows, budget)
		}
	}
	return bins, nil
}

// bestFit puts each piece, largest first, into the open bin it leaves least room in.
// open holds bin indices sorted by remaining room, so the choice is a binary search.
func bestFit(pieces []piece, order []int, budget int64) []bin {
	var bins []bin
	var open []int
	room := func(b int) int64 { return budget - bins[b].rows }
	for _, i := range order {
		p := &pieces[i]
		k := sort.Search(len(open), func(k int) bool { return room(open[k]) >= p.rows })
		var b int
		if k == len(open) {
			bins = append(bins, bin{})
			b = len(bins) - 1
		} else {
			b = open[k]
			open = slices.Delete(open, k, k+1)
		}
		bins[b].add(i, p)
		if r := room(b); r > 0 {
			at := sort.Search(len(open), func(k int) bool { return room(open[k]) >= r })
			open = slices.Insert(open, at, b)
		}
	}
	return bins
}

// worstFit puts each piece, largest first, into the emptiest of n bins; ok is false when
// some piece fits nowhere.
func worstFit(pieces []piece, order []int, budget int64, n int) ([]bin, bool) {
	bins := make([]bin, n)
	h := &roomHeap{bins: bins, idx: make([]int, n)}
	for i := range h.idx {
		h.idx[i] = i
	}
	heap.Init(h)
	for _, i := range order {
		b := h.idx[0]
		if budget-bins[b].rows < pieces[i].rows {
			return nil, false
		}
		bins[b].add(i, &pieces[i])
		heap.Fix(h, 0)
	}
	return bins, true
}

// roomHeap orders bins by rows ascending (most room first), ties by index.
type roomHeap struct {
	bins []bin
	idx  []int
}

func (h *roomHeap) Len() int { return len(h.idx) }
func (h *roomHeap) Less(a, b int) bool {
	ra, rb := h.bins[h.idx[a]].rows, h.bins[h.idx[b]].rows
	if ra != rb {
		return ra < rb
	}
	return h.idx[a] < h.idx[b]
}
func (h *roomHeap) Swap(a, b int) { h.idx[a], h.idx[b] = h.idx[b], h.idx[a] }
func (h *roomHeap) Push(x any)    { h.idx = append(h.idx, x.(int)) }
func (h *roomHeap) Pop() any {
	x := h.idx[len(h.idx)-1]
	h.idx = h.idx[:len(h.idx)-1]
	return x
}
