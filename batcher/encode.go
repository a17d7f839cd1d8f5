package batcher

import (
	"encoding/json"
	"fmt"
	"unsafe"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/memory"
)

// MetadataKey is the record-batch metadata key whose value is MicroBatchMeta as JSON.
const MetadataKey = "floe"

// MicroBatchSchema is the schema of every micro-batch record: one row per token, in DFS
// pre-order. Row k is visible to row q iff k <= q < subtree_end[k].
func MicroBatchSchema() *arrow.Schema {
	return arrow.NewSchema([]arrow.Field{
		{Name: "input_ids", Type: arrow.PrimitiveTypes.Int32},
		{Name: "position_ids", Type: arrow.PrimitiveTypes.Int32},
		{Name: "subtree_end", Type: arrow.PrimitiveTypes.Int32},
		{Name: "pred_idx", Type: arrow.PrimitiveTypes.Int32},
		{Name: "loss_mask", Type: arrow.PrimitiveTypes.Uint8},
		{Name: "old_logprobs", Type: arrow.PrimitiveTypes.Float32},
		{Name: "advantages", Type: arrow.PrimitiveTypes.Float32},
		{Name: "sample_idx", Type: arrow.PrimitiveTypes.Int32},
		{Name: "temperature", Type: arrow.PrimitiveTypes.Float32},
	}, nil)
}

// SampleTableSchema is the schema of the step's sample table.
func SampleTableSchema() *arrow.Schema {
	return arrow.NewSchema([]arrow.Field{
		{Name: "sample_idx", Type: arrow.PrimitiveTypes.Int32},
		{Name: "session_id", Type: arrow.BinaryTypes.String},
		{Name: "group_id", Type: arrow.BinaryTypes.String},
		{Name: "task_id", Type: arrow.BinaryTypes.String},
		{Name: "reward", Type: arrow.PrimitiveTypes.Float64},
		{Name: "advantage", Type: arrow.PrimitiveTypes.Float32},
		{Name: "policy_version", Type: arrow.PrimitiveTypes.Int64},
		{Name: "num_calls", Type: arrow.PrimitiveTypes.Int32},
		{Name: "num_loss_tokens", Type: arrow.PrimitiveTypes.Int64},
		{Name: "num_truncated_calls", Type: arrow.PrimitiveTypes.Int32},
	}, nil)
}

// MicroBatchMeta is the JSON carried under MetadataKey by every micro-batch record.
type MicroBatchMeta struct {
	Step             int64  `json:"step"`
	Rank             int    `json:"rank"`
	MicroBatch       int    `json:"micro_batch"`
	NumMicroBatches  int    `json:"num_micro_batches"`
	LossTokensGlobal int64  `json:"loss_tokens_global"` // loss rows of the whole step, all ranks: the token-mean denominator
	PolicyVersionMin int64  `json:"policy_version_min"`
	PolicyVersionMax int64  `json:"policy_version_max"`
	Strategy         string `json:"strategy"`
	Rows             int64  `json:"rows"` // rows before padding
}

// Meta returns the metadata of micro-batch i of rank.
func (st *Step) Meta(rank, i int) MicroBatchMeta {
	return MicroBatchMeta{
		Step: st.Number, Rank: rank, MicroBatch: i, NumMicroBatches: len(st.Ranks[rank]),
		LossTokensGlobal: st.Stats.LossRows, PolicyVersionMin: st.PolicyVersionMin,
		PolicyVersionMax: st.PolicyVersionMax, Strategy: string(st.Strategy), Rows: st.Ranks[rank][i].Rows,
	}
}

// Record encodes micro-batch i of rank as an Arrow record batch allocated from mem. The
// caller releases it.
func (st *Step) Record(mem memory.Allocator, rank, i int) (arrow.RecordBatch, error) {
	if rank < 0 || rank >= len(st.Ranks) {
		return nil, fmt.Errorf("step %d: rank %d out of range [0, %d)", st.Number, rank, len(st.Ranks))
	}
	if i < 0 || i >= len(st.Ranks[rank]) {
		return nil, fmt.Errorf("step %d rank %d: micro-batch %d out of range [0, %d)", st.Number, rank, i, len(st.Ranks[rank]))
	}
	mb := &st.Ranks[rank][i]
	meta, err := json.Marshal(st.Meta(rank, i))
	if err != nil {
		return nil, fmt.Errorf("step %d rank %d micro-batch %d: metadata: %w", st.Number, rank, i, err)
	}
	cols := newColumns(mem, int(mb.PaddedRows))
	defer cols.release()
	var row int32
	for _, pi := range mb.bin.pieces {
		row = cols.writePiece(&st.pieces[pi], st.advantages, row)
	}
	if int64(row) != mb.Rows {
		return nil, fmt.Errorf("internal error: step %d rank %d micro-batch %d wrote %d rows, planned %d", st.Number, rank, i, row, mb.Rows)
	}
	cols.writePadding(row)
	return cols.record(MicroBatchSchema(), arrow.NewMetadata([]string{MetadataKey}, []string{string(meta)})), nil
}

// columns are the nine output columns of one micro-batch, written in place in buffers
// from the allocator: no builders, no per-row appends.
type columns struct {
	n                                 int
	bufs                              [9]*memory.Buffer
	ids, pos, end, pred, sample       []int32
	mask                              []uint8
	logprobs, advantages, temperature []float32
}

var columnWidths = [9]int{4, 4, 4, 4, 1, 4, 4, 4, 4}

func newColumns(mem memory.Allocator, n int) *columns {
	c := &columns{n: n}
	for k := range c.bufs {
		c.bufs[k] = memory.NewResizableBuffer(mem)
		c.bufs[k].Resize(n * columnWidths[k])
	}
	c.ids = int32s(c.bufs[0])
	c.pos = int32s(c.bufs[1])
	c.end = int32s(c.bufs[2])
	c.pred = int32s(c.bufs[3])
	c.mask = c.bufs[4].Bytes()
	c.logprobs = float32s(c.bufs[5])
	c.advantages = float32s(c.bufs[6])
	c.sample = int32s(c.bufs[7])
	c.temperature = float32s(c.bufs[8])
	return c
}

func int32s(b *memory.Buffer) []int32 {
	bs := b.Bytes()
	if len(bs) == 0 {
		return nil
	}
	return unsafe.Slice((*int32)(unsafe.Pointer(&bs[0])), len(bs)/4)
}

func float32s(b *memory.Buffer) []float32 {
	bs := b.Bytes()
	if len(bs) == 0 {
		return nil
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&bs[0])), len(bs)/4)
}

func (c *columns) release() {
	for _, b := range c.bufs {
		b.Release()
	}
}

// record wraps the buffers as arrays; the record holds its own references.
func (c *columns) record(schema *arrow.Schema, meta arrow.Metadata) arrow.RecordBatch {
	arrs := make([]arrow.Array, len(c.bufs))
	for k, b := range c.bufs {
		data := array.NewData(schema.Field(k).Type, c.n, []*memory.Buffer{nil, b}, nil, 0, 0)
		arrs[k] = array.MakeFromData(data)
		data.Release()
	}
	rec := array.NewRecordBatchWithMetadata(schema, arrs, int64(c.n), meta)
	for _, a := range arrs {
		a.Release()
	}
	return rec
}

// writePiece lays out a piece's nodes in DFS pre-order from row start and returns the row
// after it. A node whose first leaf lies in another piece is trained there: here its rows
// are context only.
func (c *columns) writePiece(p *piece, advantages []float32, start int32) int32 {
	l := p.lay
	f := l.f
	type frame struct {
		n, child     int32
		first, after int32 // the node's rows
	}
	stack := make([]frame, 0, 64)
	row := start
	visit := func(n, pred int32) {
		nd := &f.nodes[n]
		k := int32(len(nd.tokens))
		r0, r1 := row, row+k
		copy(c.ids[r0:r1], nd.tokens)
		pos := c.pos[r0:r1]
		for t := range pos {
			pos[t] = nd.depth + int32(t)
		}
		pr := c.pred[r0:r1]
		pr[0] = pred
		for t := 1; t < len(pr); t++ {
			pr[t] = r0 + int32(t) - 1
		}
		if nd.sample != none && p.holds(l.leafLo[n]) {
			fill(c.mask[r0:r1], 1)
			copy(c.logprobs[r0:r1], nd.logprobs)
			s := p.base + nd.sample
			fill(c.advantages[r0:r1], advantages[s])
			fill(c.sample[r0:r1], s)
			fill(c.temperature[r0:r1], nd.temp)
		} else {
			clear(c.mask[r0:r1])
			clear(c.logprobs[r0:r1])
			clear(c.advantages[r0:r1])
			fill(c.sample[r0:r1], none)
			fill(c.temperature[r0:r1], 1)
		}
		row = r1
		stack = append(stack, frame{n: n, child: nd.first, first: r0, after: r1})
	}
	visit(p.root, none)
	for len(stack) > 0 {
		top := &stack[len(stack)-1]
		if ch := top.child; ch != none {
			top.child = f.nodes[ch].next
			if p.overlaps(l.leafLo[ch], l.leafHi[ch]) {
				visit(ch, top.after-1)
			}
			continue
		}
		// Every row of a node sees the rest of the node and all it leads to.
		fill(c.end[top.first:top.after], row)
		stack = stack[:len(stack)-1]
	}
	return row
}

// writePadding fills rows [from, n) so that each sees only itself and trains nothing.
func (c *columns) writePadding(from int32) {
	for r := from; r < int32(c.n); r++ {
		c.ids[r], c.pos[r], c.end[r], c.pred[r], c.sample[r] = 0, 0, r+1, none, none
	}
	clear(c.mask[from:])
	clear(c.logprobs[from:])
	clear(c.advantages[from:])
	fill(c.temperature[from:], 1)
}

func fill[T any](s []T, v T) {
	for i := range s {
		s[i] = v
	}
}

// SampleTable encodes the step's sample table.
func (st *Step) SampleTable(mem memory.Allocator) arrow.RecordBatch {
	b := array.NewRecordBuilder(mem, SampleTableSchema())
	defer b.Release()
	for i := range st.Samples {
		s := &st.Samples[i]
		b.Field(0).(*array.Int32Builder).Append(s.Index)
		b.Field(1).(*array.StringBuilder).Append(s.SessionID)
		b.Field(2).(*array.StringBuilder).Append(s.GroupID)
		b.Field(3).(*array.StringBuilder).Append(s.TaskID)
		b.Field(4).(*array.Float64Builder).Append(s.Reward)
		b.Field(5).(*array.Float32Builder).Append(s.Advantage)
		b.Field(6).(*array.Int64Builder).Append(s.PolicyVersion)
		b.Field(7).(*array.Int32Builder).Append(s.NumCalls)
		b.Field(8).(*array.Int64Builder).Append(s.NumLossTokens)
		b.Field(9).(*array.Int32Builder).Append(s.NumTruncatedCalls)
	}
	return b.NewRecordBatch()
}
