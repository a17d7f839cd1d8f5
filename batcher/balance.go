package batcher

import (
	"container/heap"
	"slices"
	"sort"
)

// partition is a partial solution of balanced Karmarkar-Karp: one subset per rank, each
// holding the same number of bins, kept sorted by load, heaviest first.
type partition struct {
	load []float64
	bins [][]int
}

func (p *partition) spread() float64 { return p.load[0] - p.load[len(p.load)-1] }

// balance assigns bins to ranks, every rank the same number, so that the ranks are even in
// lockstep — micro-batch k of every rank alike — and in sum. Bins sorted by cost are cut
// into rows of dp, heaviest first: row k becomes micro-batch k of every rank, and sorted
// rows minimise Σ_k max over row k, the time a lockstep run takes. Within a row the bins
// go heaviest first to the rank of least load so far, so rank sums stay even too; the
// result is then checked against balanced Karmarkar-Karp (largest differencing,
// kkBalance) on the sum, and the rows are kept unless KK's heaviest rank is more than
// lockstepSlack lighter. len(costs) must be a multiple of dp. The result lists bin
// indices per rank, micro-batch order.
func balance(costs []float64, dp int) [][]int {
	order := make([]int, len(costs))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return costs[order[a]] > costs[order[b]] })
	out := make([][]int, dp)
	load := make([]float64, dp)
	ranks := make([]int, dp)
	for start := 0; start < len(order); start += dp {
		for r := range ranks {
			ranks[r] = r
		}
		sort.SliceStable(ranks, func(a, b int) bool { return load[ranks[a]] < load[ranks[b]] })
		for i, r := range ranks {
			b := order[start+i]
			out[r] = append(out[r], b)
			load[r] += costs[b]
		}
	}
	if len(order) == 0 {
		return out
	}
	kk := kkBalance(costs, dp)
	var kkMax float64
	for _, bins := range kk {
		var l float64
		for _, b := range bins {
			l += costs[b]
		}
		kkMax = max(kkMax, l)
	}
	if kkMax*(1+lockstepSlack) < slices.Max(load) {
		for _, bins := range kk { // heaviest first, so lockstep rows stay as alike as KK allows
			sort.SliceStable(bins, func(a, b int) bool { return costs[bins[a]] > costs[bins[b]] })
		}
		return kk
	}
	return out
}

// lockstepSlack is how much heavier the lockstep rows' heaviest rank may be than
// Karmarkar-Karp's before balance falls back to KK's sum-balanced assignment.
const lockstepSlack = 0.02

// kkBalance assigns bins to ranks, every rank the same number, so that the ranks' costs
// are as even as the largest differencing method gets them: bins sorted by cost are cut
// into rows of dp (one bin per rank), then the two partitions with the largest spread are
// merged repeatedly, heaviest subset of one with the lightest of the other.
func kkBalance(costs []float64, dp int) [][]int {
	order := make([]int, len(costs))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return costs[order[a]] > costs[order[b]] })
	h := &partitionHeap{}
	for start := 0; start < len(order); start += dp {
		p := &partition{load: make([]float64, dp), bins: make([][]int, dp)}
		for r := 0; r < dp; r++ {
			b := order[start+r]
			p.load[r] = costs[b]
			p.bins[r] = []int{b}
		}
		h.items = append(h.items, p)
	}
	if len(h.items) == 0 {
		return make([][]int, dp)
	}
	heap.Init(h)
	for h.Len() > 1 {
		a := heap.Pop(h).(*partition)
		b := heap.Pop(h).(*partition)
		for r := 0; r < dp; r++ {
			o := dp - 1 - r
			a.load[r] += b.load[o]
			a.bins[r] = append(a.bins[r], b.bins[o]...)
		}
		sortPartition(a)
		heap.Push(h, a)
	}
	return h.items[0].bins
}

func sortPartition(p *partition) {
	idx := make([]int, len(p.load))
	for i := range idx {
		idx[i] = i
	}
	sort.SliceStable(idx, func(a, b int) bool { return p.load[idx[a]] > p.load[idx[b]] })
	load := make([]float64, len(idx))
	bins := make([][]int, len(idx))
	for i, k := range idx {
		load[i], bins[i] = p.load[k], p.bins[k]
	}
	p.load, p.bins = load, bins
}

// partitionHeap pops the partition with the largest spread first.
type partitionHeap struct{ items []*partition }

func (h *partitionHeap) Len() int           { return len(h.items) }
func (h *partitionHeap) Less(a, b int) bool { return h.items[a].spread() > h.items[b].spread() }
func (h *partitionHeap) Swap(a, b int)      { h.items[a], h.items[b] = h.items[b], h.items[a] }
func (h *partitionHeap) Push(x any)         { h.items = append(h.items, x.(*partition)) }
func (h *partitionHeap) Pop() any {
	x := h.items[len(h.items)-1]
	h.items = h.items[:len(h.items)-1]
	return x
}
