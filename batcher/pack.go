package batcher

import (
	"cmp"
	"container/heap"
	"fmt"
	"maps"
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

// pack places units into micro-batches of at most budget rows and returns the pieces it
// formed and the bins holding them.
//
//  1. Each tree that had to be split is packed on its own into as few pieces as fit: its
//     units largest first, each into the piece where it adds the fewest path rows (a
//     sibling session under the same group prompt adds none), then the one it leaves the
//     least room in.
//  2. All pieces are packed best-fit decreasing into n bins.
//  3. When n is not a multiple of dp, rounding up would leave up to dp-1 bins' worth of
//     budget unused, so the pieces are first re-packed into the multiple below: pieces
//     best-fit, and a piece that fits no bin whole is broken into its units, each placed
//     where it adds the fewest path rows. If that fails, the pieces of pass 2 are spread
//     worst-fit over the multiple above, so that no rank gets an empty micro-batch while
//     another is full.
//  4. With a pass cost c > 0, fewer micro-batches are tried, dp at a time, down to the
//     floor ceil(rows/budget): every piece may now be split, a tree that fits included,
//     at its branch points into subtrees placed where they add the fewest path rows.
//     The plan of least rows + c × micro-batches wins (splitPack).
//  5. With dp > 1, the micro-batches are levelled: the same count is re-packed under a
//     lower cap or worst-fit, within a small row overhead, so that the micro-batches of
//     every rank are alike and lockstep passes wait on no straggler (level). Then units
//     and whole pieces are moved or swapped between micro-batches while that lowers the
//     lockstep cost further, never adding rows nor micro-batches (refine).
func pack(units []unit, budget int64, dp int, passCost float64, w weight) ([]piece, []bin, error) {
	var parts []*part
	for start := 0; start < len(units); {
		end := start + 1
		for end < len(units) && units[end].lay == units[start].lay && units[end].root == units[start].root {
			end++
		}
		tree := units[start:end]
		for i := range tree {
			if u := &tree[i]; u.above+u.rows > budget {
				return nil, nil, fmt.Errorf("internal error: unit of %d rows under a path of %d exceeds the budget of %d", u.rows, u.above, budget)
			}
		}
		parts = packTree(parts, tree, budget)
		start = end
	}
	// Stable, so equal parts keep their input order and the step stays deterministic.
	slices.SortStableFunc(parts, func(a, b *part) int { return cmp.Compare(b.rows, a.rows) })
	drafts := bestFit(parts, budget)
	n := len(drafts)
	down, up := n/dp*dp, (max(n, 1)+dp-1)/dp*dp
	if down != n && down > 0 {
		if re, ok := repack(parts, budget, down); ok {
			drafts = re
		}
	}
	if len(drafts) != down && up != n {
		if spread, ok := worstFit(parts, budget, up); ok {
			drafts = spread
		} else {
			drafts = append(drafts, make([]*binDraft, up-n)...)
		}
	}
	drafts = splitPack(parts, drafts, budget, dp, passCost)
	if dp > 1 {
		drafts = level(parts, drafts, budget, dp, passCost > 0, w)
		drafts = refine(drafts, budget, draftRows(drafts), dp, w)
	}
	var pieces []piece
	bins := make([]bin, len(drafts))
	for b, d := range drafts {
		if d == nil {
			continue
		}
		for _, p := range d.parts {
			pieces = append(pieces, p.finish())
			bins[b].add(len(pieces)-1, &pieces[len(pieces)-1])
		}
		if bins[b].rows > budget {
			return nil, nil, fmt.Errorf("internal error: micro-batch of %d rows exceeds the budget of %d", bins[b].rows, budget)
		}
	}
	return pieces, bins, nil
}

// part is a piece being packed: it remembers its units and which path nodes it holds, so
// that more units of its tree can join it paying only for the path they add.
type part struct {
	piece
	units  []*unit
	onPath map[int32]bool
}

// pathCost is the number of rows of u's path not yet in p.
func (p *part) pathCost(u *unit, limit int64) int64 {
	nodes := u.lay.f.nodes
	var extra int64
	for n := nodes[u.node].parent; n > 0 && !p.onPath[n]; n = nodes[n].parent {
		if extra += int64(len(nodes[n].tokens)); extra > limit {
			return extra
		}
	}
	return extra
}

// addUnit puts u and the missing part of its path into p and returns the rows added.
func (p *part) addUnit(u *unit) int64 {
	l := u.lay
	nodes := l.f.nodes
	added := u.rows
	for n := nodes[u.node].parent; n > 0 && !p.onPath[n]; n = nodes[n].parent {
		if p.onPath == nil {
			p.onPath = make(map[int32]bool)
		}
		p.onPath[n] = true
		nd := &nodes[n]
		rows := int64(len(nd.tokens))
		added += rows
		p.attn += tri(int64(nd.depth)+rows) - tri(int64(nd.depth))
	}
	p.rows += added
	p.attn += l.subAttn[u.node]
	p.units = append(p.units, u)
	return added
}

// finish returns the piece with its leaf ranges sorted and its loss rows counted.
func (p *part) finish() piece {
	pc := p.piece
	pc.ranges = make([]leafRange, len(p.units))
	for i, u := range p.units {
		pc.ranges[i] = leafRange{pc.lay.leafLo[u.node], pc.lay.leafHi[u.node]}
	}
	slices.SortFunc(pc.ranges, func(a, b leafRange) int { return cmp.Compare(a.lo, b.lo) })
	for _, r := range pc.ranges {
		for k := r.lo; k < r.hi; k++ {
			pc.loss += pc.lay.leaves[k].loss
		}
	}
	return pc
}

func newPart(u *unit) *part {
	return &part{piece: piece{lay: u.lay, base: u.base, root: u.root}}
}

// binDraft is a micro-batch being packed.
type binDraft struct {
	rows  int64
	parts []*part
}

// unitCost is the rows u adds to d (its own and the path d lacks), or -1 when it does not
// fit within budget; p is the part of u's tree it would join, nil for a new one.
func (d *binDraft) unitCost(u *unit, budget int64) (int64, *part) {
	room := budget - d.rows - u.rows
	if room < 0 {
		return -1, nil
	}
	for _, p := range d.parts {
		if p.lay == u.lay && p.root == u.root {
			if extra := p.pathCost(u, room); extra <= room {
				return u.rows + extra, p
			}
			return -1, nil
		}
	}
	if u.above > room {
		return -1, nil
	}
	return u.rows + u.above, nil
}

// placeUnit puts u into the draft among ds where it adds the fewest rows, then leaves the
// least room; with grow it opens a new draft when none fits. It reports whether u was placed.
func placeUnit(ds []*binDraft, u *unit, budget int64, grow bool) ([]*binDraft, bool) {
	best, bestCost, bestLeft := -1, int64(0), int64(0)
	var bestPart *part
	for i, d := range ds {
		c, p := d.unitCost(u, budget)
		if c < 0 {
			continue
		}
		left := budget - d.rows - c
		if best < 0 || c < bestCost || (c == bestCost && left < bestLeft) {
			best, bestCost, bestLeft, bestPart = i, c, left, p
		}
	}
	if best < 0 {
		if !grow {
			return ds, false
		}
		ds = append(ds, &binDraft{})
		best = len(ds) - 1
	}
	d := ds[best]
	if bestPart == nil {
		bestPart = newPart(u)
		d.parts = append(d.parts, bestPart)
	}
	d.rows += bestPart.addUnit(u)
	return ds, true
}

// packTree appends the parts of one tree given as its units: one part when the tree is
// whole, else as few as a best-fit pass over its units makes.
func packTree(out []*part, units []unit, budget int64) []*part {
	if len(units) == 1 && units[0].above == 0 {
		p := newPart(&units[0])
		p.addUnit(&units[0])
		return append(out, p)
	}
	order := make([]*unit, len(units))
	for i := range units {
		order[i] = &units[i]
	}
	slices.SortStableFunc(order, func(a, b *unit) int { return cmp.Compare(b.above+b.rows, a.above+a.rows) })
	var ds []*binDraft
	for _, u := range order {
		ds, _ = placeUnit(ds, u, budget, true)
	}
	for _, d := range ds {
		out = append(out, d.parts...)
	}
	return out
}

// bestFit puts each part, largest first, into the open draft it leaves least room in.
// open holds draft indices sorted by remaining room, so the choice is a binary search.
func bestFit(parts []*part, budget int64) []*binDraft {
	var ds []*binDraft
	var open []int
	room := func(b int) int64 { return budget - ds[b].rows }
	for _, p := range parts {
		k := sort.Search(len(open), func(k int) bool { return room(open[k]) >= p.rows })
		var b int
		if k == len(open) {
			ds = append(ds, &binDraft{})
			b = len(ds) - 1
		} else {
			b = open[k]
			open = slices.Delete(open, k, k+1)
		}
		ds[b].rows += p.rows
		ds[b].parts = append(ds[b].parts, p)
		if r := room(b); r > 0 {
			at := sort.Search(len(open), func(k int) bool { return room(open[k]) >= r })
			open = slices.Insert(open, at, b)
		}
	}
	return ds
}

// repack tries to fit the parts into exactly n drafts: each part best-fit whole, or else
// broken into its units, each placed where it adds the fewest rows. Parts are copied, so a
// failed attempt leaves them as they were.
func repack(parts []*part, budget int64, n int) ([]*binDraft, bool) {
	ds := make([]*binDraft, n)
	for i := range ds {
		ds[i] = &binDraft{}
	}
	for _, p := range parts {
		best := -1
		for i, d := range ds {
			if d.rows+p.rows <= budget && (best < 0 || d.rows > ds[best].rows) {
				best = i
			}
		}
		if best >= 0 {
			cp := *p
			cp.units, cp.onPath = slices.Clone(p.units), maps.Clone(p.onPath)
			ds[best].rows += p.rows
			ds[best].parts = append(ds[best].parts, &cp)
			continue
		}
		for _, u := range p.units {
			var ok bool
			if ds, ok = placeUnit(ds, u, budget, false); !ok {
				return nil, false
			}
		}
	}
	return ds, true
}

// draftRows is the rows the drafts hold, paths included.
func draftRows(ds []*binDraft) int64 {
	var rows int64
	for _, d := range ds {
		if d != nil {
			rows += d.rows
		}
	}
	return rows
}

// splitPack returns the plan of least rows + passCost × micro-batches among drafts and
// re-packs of the parts into dp, 2dp, ... fewer micro-batches, down to the floor
// ceil(rows/budget). A re-pack may split any piece, a tree that fits the budget included.
// With passCost 0 a split never pays (it only adds path rows), so drafts stand.
func splitPack(parts []*part, drafts []*binDraft, budget int64, dp int, passCost float64) []*binDraft {
	if passCost <= 0 || len(drafts) <= dp {
		return drafts
	}
	var total int64
	for _, p := range parts {
		total += p.rows
	}
	floor := (total + budget - 1) / budget
	best, bestCost := drafts, float64(draftRows(drafts))+passCost*float64(len(drafts))
	for n := len(drafts) - dp; n > 0 && int64(n) >= floor; n -= dp {
		ds, ok := splitRepack(parts, budget, n, true)
		if !ok {
			break
		}
		if c := float64(draftRows(ds)) + passCost*float64(n); c < bestCost {
			best, bestCost = ds, c
		}
	}
	return best
}

// levelOverhead is the most rows, as a fraction of the plan's, that levelling may add by
// splitting pieces to even out the micro-batches. A levelled plan is taken only when its
// lockstep cost (the wall time of ranks running micro-batch k together, the added rows
// included) is lower, so the cap only bounds what the pass-cost objective may lose: on
// the TRL comparison's corpora levelling adds at most ~3.5% rows where it takes a
// lockstep imbalance from 1.13 to 1.04 (docs/batcher.md).
const levelOverhead = 0.05

// weight is a micro-batch's rank-balancing cost from its rows and Σ(depth+1) (Config.cost
// without the padding).
type weight struct{ row, attn float64 }

func (w weight) of(d *binDraft) float64 {
	if d == nil {
		return 0
	}
	var attn float64
	for _, p := range d.parts {
		attn += p.attn
	}
	return w.row*float64(d.rows) + w.attn*attn
}

// lockstepCost is the cost a lockstep run of the drafts waits on: sorted heaviest first and
// cut into rows of dp (as balance assigns them), Σ over rows of the heaviest.
func lockstepCost(ds []*binDraft, dp int, w weight) float64 {
	costs := make([]float64, len(ds))
	for i, d := range ds {
		costs[i] = w.of(d)
	}
	slices.SortFunc(costs, func(a, b float64) int { return cmp.Compare(b, a) })
	var t float64
	for k := 0; k < len(costs); k += dp {
		t += costs[k]
	}
	return t
}

// level re-packs the drafts' parts into as many micro-batches so that they come out alike
// and lockstep micro-batch k of every rank waits on none: worst-fit (each part into the
// emptiest micro-batch, split when it fits there only in part), and best-fit under caps
// found by bisection between the mean and the heaviest micro-batch. Of the plans that add
// at most levelOverhead rows, the one of least lockstepCost wins. With split false, no tree
// that fits the budget is split.
func level(parts []*part, drafts []*binDraft, budget int64, dp int, split bool, w weight) []*binDraft {
	n := len(drafts)
	if n < 2*dp {
		return drafts
	}
	rows := draftRows(drafts)
	limit := rows + int64(float64(rows)*levelOverhead)
	best, bestT := drafts, lockstepCost(drafts, dp, w)
	try := func(ds []*binDraft, ok bool) bool {
		if !ok || draftRows(ds) > limit {
			return false
		}
		if t := lockstepCost(ds, dp, w); t < bestT {
			best, bestT = ds, t
		}
		return true
	}
	try(worstFitSplit(parts, budget, n, split, w))
	var heaviest int64
	for _, d := range drafts {
		if d != nil {
			heaviest = max(heaviest, d.rows)
		}
	}
	lo, hi := (rows+int64(n)-1)/int64(n), heaviest
	for lo < hi && hi-lo > max(1, lo/200) {
		mid := (lo + hi) / 2
		if try(splitRepack(parts, mid, n, split)) {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	return best
}

// worstFitSplit puts each part, largest first, into the lightest of n drafts by weight,
// or when it does not fit there whole, its units where they add the fewest rows (split
// further when split is set).
func worstFitSplit(parts []*part, budget int64, n int, split bool, w weight) ([]*binDraft, bool) {
	ds := make([]*binDraft, n)
	load := make([]float64, n)
	for i := range ds {
		ds[i] = &binDraft{}
	}
	for _, p := range parts {
		e := 0
		for i := range ds {
			if load[i] < load[e] {
				e = i
			}
		}
		if ds[e].rows+p.rows <= budget {
			cp := *p
			cp.units, cp.onPath = slices.Clone(p.units), maps.Clone(p.onPath)
			ds[e].rows += p.rows
			ds[e].parts = append(ds[e].parts, &cp)
			load[e] = w.of(ds[e])
			continue
		}
		if ds[e].rows+p.rows <= budget {
			cp := *p
			cp.units, cp.onPath = slices.Clone(p.units), maps.Clone(p.onPath)
			ds[e].rows += p.rows
			ds[e].parts = append(ds[e].parts, &cp)
			continue
		}
		for _, u := range p.units {
			if !placeSplit(ds, u, budget, split) {
				return nil, false
			}
		}
		for i := range ds {
			load[i] = w.of(ds[i])
		}
	}
	return ds, true
}

// splitRepack fits the parts into exactly n drafts of at most budget rows: each part
// best-fit whole, or else broken into its units, each placed where it adds the fewest
// path rows; a unit that fits nowhere is split at its top node into its children's
// subtrees, recursively. Parts are copied, so a failed attempt leaves them as they were.
func splitRepack(parts []*part, budget int64, n int, split bool) ([]*binDraft, bool) {
	ds := make([]*binDraft, n)
	for i := range ds {
		ds[i] = &binDraft{}
	}
	// order holds the drafts fullest first, ties by index, so the fullest draft a part fits
	// is a binary search away.
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	less := func(a, b int) int {
		if c := cmp.Compare(ds[b].rows, ds[a].rows); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	}
	for _, p := range parts {
		k := sort.Search(len(order), func(k int) bool { return ds[order[k]].rows+p.rows <= budget })
		if k < len(order) {
			best := order[k]
			// The fullest that fits may tie with drafts after it; the lowest index wins.
			for j := k + 1; j < len(order) && ds[order[j]].rows == ds[best].rows; j++ {
				best = min(best, order[j])
			}
			at := slices.Index(order, best)
			order = slices.Delete(order, at, at+1)
			cp := *p
			cp.units, cp.onPath = slices.Clone(p.units), maps.Clone(p.onPath)
			ds[best].rows += p.rows
			ds[best].parts = append(ds[best].parts, &cp)
			at, _ = slices.BinarySearchFunc(order, best, less)
			order = slices.Insert(order, at, best)
			continue
		}
		for _, u := range p.units {
			if !placeSplit(ds, u, budget, split) {
				return nil, false
			}
		}
		slices.SortFunc(order, less)
	}
	return ds, true
}

// placeSplit places u whole where it adds the fewest rows, or else its top node's
// children's subtrees, largest first, each beside the path down to it.
func placeSplit(ds []*binDraft, u *unit, budget int64, split bool) bool {
	if _, ok := placeUnit(ds, u, budget, false); ok {
		return true
	}
	if !split {
		return false
	}
	l := u.lay
	nd := &l.f.nodes[u.node]
	if nd.first == none {
		return false
	}
	path := u.above + int64(len(nd.tokens))
	var kids []*unit
	for c := nd.first; c != none; c = l.f.nodes[c].next {
		kids = append(kids, &unit{lay: l, base: u.base, root: u.root, node: c, above: path, rows: l.subRows[c]})
	}
	slices.SortStableFunc(kids, func(a, b *unit) int { return cmp.Compare(b.rows, a.rows) })
	for _, k := range kids {
		if !placeSplit(ds, k, budget, true) {
			return false
		}
	}
	return true
}

// worstFit puts each part, largest first, into the emptiest of n drafts; ok is false when
// some part fits nowhere.
func worstFit(parts []*part, budget int64, n int) ([]*binDraft, bool) {
	ds := make([]*binDraft, n)
	for i := range ds {
		ds[i] = &binDraft{}
	}
	h := &roomHeap{ds: ds, idx: make([]int, n)}
	for i := range h.idx {
		h.idx[i] = i
	}
	heap.Init(h)
	for _, p := range parts {
		d := ds[h.idx[0]]
		if budget-d.rows < p.rows {
			return nil, false
		}
		d.rows += p.rows
		d.parts = append(d.parts, p)
		heap.Fix(h, 0)
	}
	return ds, true
}

// roomHeap orders bins by rows ascending (most room first), ties by index.
type roomHeap struct {
	ds  []*binDraft
	idx []int
}

func (h *roomHeap) Len() int { return len(h.idx) }
func (h *roomHeap) Less(a, b int) bool {
	ra, rb := h.ds[h.idx[a]].rows, h.ds[h.idx[b]].rows
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

// refineRounds bounds refine's moves per step, and refineWork the draft costs its
// candidate moves may visit in all: a deterministic bound on its time, tens of
// milliseconds at most (the issue-23 settings visit ~40k; per_request's 768 micro-batches
// of the default corpus at dp 8, 8.5M).
const (
	refineRounds = 512
	refineWork   = 1 << 24
)

// refine moves units (whole subtrees, as pack cut them) or whole pieces between the
// drafts, or swaps two pieces, while that lowers their lockstep cost (lockstepCost:
// sorted heaviest first, cut into rows of dp, Σ of each row's heaviest), every draft
// stays within budget and the drafts within limit rows. It returns the drafts as of the
// last move that lowered the lockstep cost, or the drafts given when none did.
//
// Each round takes, out of a row's heaviest draft, the move that lowers the lockstep
// cost most. When there is none, it takes the move between any two drafts that evens
// them most (lowers Σ cost²) while the lockstep cost stays as it is, so that a later
// round finds one: every round lowers the lockstep cost, or keeps it and lowers Σ cost²,
// so no plan repeats. A move goes into one of the 2·dp lightest drafts, or a unit into a
// draft holding a piece of its tree (where it adds fewest path rows). Ties go to the first
// found: the plan is deterministic. A moved unit brings the path rows above it that its
// new micro-batch lacks and leaves behind those its old piece no longer needs; pack
// passes the levelled plan's rows as limit, so refine never adds rows, and never changes
// the number of micro-batches: the pass-cost objective cannot get worse, only the
// lockstep wait lower.
//
// Why: level evens the drafts by rows (best-fit under row caps) or greedily by cost
// (worst-fit over whole pieces). But a micro-batch's cost is mostly attention where
// contexts are long (Σ(depth+1)/16384 reaches 1.4× the rows at 60k-token paths), so
// drafts of equal rows differ by up to 2× in cost; and where a micro-batch holds about one
// session, no cap evens them: the heaviest unsplittable units fix the top row, and only
// the rows below it can be evened, each against its own heaviest. That left lockstep
// imbalances of 1.060 and 1.076 on the two settings of issue 23 (default:8 at B = 65536,
// dp 8; medium:6 seed 7 at B = 16384, dp 16); moving single units out of each row's
// heaviest micro-batch brings them to 1.043 and 1.049 with no more rows. Balancing the
// sums alone (Karmarkar–Karp) would not: it evens ranks, not micro-batch k across ranks.
func refine(ds []*binDraft, budget, limit int64, dp int, w weight) []*binDraft {
	n := len(ds)
	if dp < 2 || n < dp {
		return ds
	}
	in := ds
	ds = slices.Clone(ds)
	for i, d := range ds {
		if d == nil {
			ds[i] = &binDraft{}
		} else {
			ds[i] = &binDraft{rows: d.rows, parts: d.parts} // parts are cloned before they change
		}
	}
	pw := func(p *part) float64 { return w.row*float64(p.rows) + w.attn*p.attn }
	costs := make([]float64, n)
	for i, d := range ds {
		costs[i] = w.of(d)
	}
	rows := draftRows(ds)
	order := make([]int, n) // drafts heaviest first, ties by index
	work := 0
	// stepCost is the lockstep cost with draft a at ca and draft b at cb instead: the two
	// merged into the others' order.
	stepCost := func(a int, ca float64, b int, cb float64) float64 {
		work += n
		if ca < cb {
			ca, cb = cb, ca
		}
		var t float64
		k := 0
		emit := func(c float64) {
			if k%dp == 0 {
				t += c
			}
			k++
		}
		pending := 2
		for _, i := range order {
			if i == a || i == b {
				continue
			}
			c := costs[i]
			if pending == 2 && ca >= c {
				emit(ca)
				pending--
			}
			if pending == 1 && cb >= c {
				emit(cb)
				pending--
			}
			emit(c)
		}
		if pending == 2 {
			emit(ca)
		}
		if pending >= 1 {
			emit(cb)
		}
		return t
	}
	// kept is the plan as of the last move that lowered the lockstep cost: the evening
	// moves after it, which lowered nothing yet, are dropped. Parts are cloned before they
	// change, so copies of the drafts stay as they were.
	var kept []binDraft
	type move struct {
		src, dst   int
		pi, ui, qi int // part in src; unit in it (-1: the whole part); part in dst to swap (-1: none)
		srcC, dstC float64
		rows       int64 // rows added
	}
	type tree struct {
		lay  *layout
		root int32
	}
	light := min(n, 2*dp)
	holds := map[tree][]int{} // the drafts holding a piece of each tree, this round
	mark := make([]bool, n)
	// each calls fn with every move out of draft a: a whole part to a light draft, a part
	// swapped for a lighter one there (with swaps), a unit of a part of several to a light
	// draft or one holding its tree.
	each := func(a int, swaps bool, fn func(move)) {
		da := ds[a]
		lightest := order[n-light:]
		for i, p := range da.parts {
			wp := pw(p)
			for _, b := range lightest {
				if b == a {
					continue
				}
				db := ds[b]
				work++
				if db.rows+p.rows <= budget {
					fn(move{a, b, i, -1, -1, costs[a] - wp, costs[b] + wp, 0})
				}
				if !swaps {
					continue
				}
				for j, q := range db.parts {
					work++
					wq := pw(q)
					if wq >= wp || da.rows-p.rows+q.rows > budget || db.rows-q.rows+p.rows > budget {
						continue
					}
					fn(move{a, b, i, -1, j, costs[a] - wp + wq, costs[b] + wp - wq, 0})
				}
			}
			if len(p.units) < 2 {
				continue
			}
			targets := slices.Clone(lightest)
			for _, b := range lightest {
				mark[b] = true
			}
			for _, b := range holds[tree{p.lay, p.root}] {
				if !mark[b] {
					targets = append(targets, b)
				}
			}
			for _, b := range lightest {
				mark[b] = false
			}
			for ui, u := range p.units {
				rest := p.without(ui)
				work += len(p.units)
				freed, wFreed := p.rows-rest.rows, wp-pw(rest)
				for _, b := range targets {
					if b == a {
						continue
					}
					work++
					if add, wAdd := ds[b].unitWeight(u, budget, w); add >= 0 {
						fn(move{a, b, i, ui, -1, costs[a] - wFreed, costs[b] + wAdd, add - freed})
					}
				}
			}
		}
	}
	for range refineRounds {
		if work > refineWork {
			break
		}
		for i := range order {
			order[i] = i
		}
		slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(costs[b], costs[a]) })
		clear(holds)
		for i, d := range ds {
			for _, p := range d.parts {
				k := tree{p.lay, p.root}
				if h := holds[k]; len(h) == 0 || h[len(h)-1] != i {
					holds[k] = append(h, i)
				}
			}
		}
		var t float64
		for k := 0; k < n; k += dp {
			t += costs[order[k]]
		}
		// First the move out of a row's heaviest draft that lowers the lockstep cost most.
		bestT := t * (1 - 1e-9)
		var best *move
		for k := 0; k < n; k += dp {
			each(order[k], true, func(m move) {
				if m.dstC >= costs[m.src] || rows+m.rows > limit {
					return
				}
				if c := stepCost(m.src, m.srcC, m.dst, m.dstC); c < bestT {
					bestT, best = c, &m
				}
			})
		}
		lowered := best != nil
		if best == nil {
			// None: the move that evens two drafts most and keeps the lockstep cost.
			type even struct {
				m move
				d float64
			}
			var cands []even
			for a := range ds {
				each(a, false, func(m move) {
					if m.dstC >= costs[m.src] || rows+m.rows > limit {
						return
					}
					d := m.srcC*m.srcC + m.dstC*m.dstC - costs[m.src]*costs[m.src] - costs[m.dst]*costs[m.dst]
					if d < -1e-9*costs[m.src]*costs[m.src] {
						cands = append(cands, even{m, d})
					}
				})
			}
			slices.SortStableFunc(cands, func(x, y even) int { return cmp.Compare(x.d, y.d) })
			for _, c := range cands[:min(len(cands), 32)] {
				if stepCost(c.m.src, c.m.srcC, c.m.dst, c.m.dstC) <= t {
					best = &c.m
					break
				}
			}
		}
		if best == nil {
			break
		}
		m := *best
		da, db := ds[m.src], ds[m.dst]
		p := da.parts[m.pi]
		switch {
		case m.ui >= 0:
			u := p.units[m.ui]
			rest := p.without(m.ui)
			da.parts = slices.Clone(da.parts)
			da.parts[m.pi] = rest
			da.rows += rest.rows - p.rows
			db.parts = slices.Clone(db.parts)
			var into *part
			for j, q := range db.parts {
				if q.lay == u.lay && q.root == u.root {
					cp := *q
					cp.units, cp.onPath = slices.Clone(q.units), maps.Clone(q.onPath)
					into, db.parts[j] = &cp, &cp
					break
				}
			}
			if into == nil {
				into = newPart(u)
				db.parts = append(db.parts, into)
			}
			db.rows += into.addUnit(u)
		case m.qi < 0:
			da.parts = slices.Delete(slices.Clone(da.parts), m.pi, m.pi+1)
			db.parts = append(slices.Clone(db.parts), p)
			da.rows -= p.rows
			db.rows += p.rows
		default:
			q := db.parts[m.qi]
			da.parts, db.parts = slices.Clone(da.parts), slices.Clone(db.parts)
			da.parts[m.pi], db.parts[m.qi] = q, p
			da.rows += q.rows - p.rows
			db.rows += p.rows - q.rows
		}
		costs[m.src], costs[m.dst] = w.of(da), w.of(db)
		rows = draftRows(ds)
		if lowered {
			kept = kept[:0]
			for _, d := range ds {
				kept = append(kept, *d)
			}
		}
	}
	if kept == nil {
		return in
	}
	out := make([]*binDraft, n)
	for i := range kept {
		out[i] = &kept[i]
	}
	return out
}

// without returns a new part holding p's units but the i-th, and only their paths.
func (p *part) without(i int) *part {
	var np *part
	for k, u := range p.units {
		if k == i {
			continue
		}
		if np == nil {
			np = newPart(u)
		}
		np.addUnit(u)
	}
	return np
}

// unitWeight is the rows and the weight u adds to d: its own and the path d's part of
// its tree lacks (all of it when d has none); rows is -1 when it does not fit budget.
func (d *binDraft) unitWeight(u *unit, budget int64, w weight) (int64, float64) {
	rows, _ := d.unitCost(u, budget)
	if rows < 0 {
		return -1, 0
	}
	extra := rows - u.rows
	attn := u.lay.subAttn[u.node] + tri(u.above) - tri(u.above-extra)
	return rows, w.row*float64(rows) + w.attn*attn
}
