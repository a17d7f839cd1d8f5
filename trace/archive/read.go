package archive

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/memory"
	"github.com/apache/arrow-go/v18/parquet/file"
	"github.com/apache/arrow-go/v18/parquet/pqarrow"

	"github.com/floe-rl/floe/trace"
)

// The readers turn archived rows back into Go values: for tests and tools that check an
// archive against what was recorded. They read whole files into memory.

// CallRow is one row of the calls table.
type CallRow struct {
	Step    *int64
	GroupID string
	TaskID  string
	trace.Call
}

// SessionRow is one row of the sessions table.
type SessionRow struct {
	Step       *int64 // nil: the group was dropped
	GroupID    string
	Session    trace.Session // without calls
	Advantage  *float64
	Calls      int
	Created    time.Time
	Finished   time.Time
	DropReason string
}

// StepRow is one row of the steps table.
type StepRow struct {
	Record    trace.StepRecord
	Sessions  int
	Calls     int
	Committed time.Time
}

// Files lists the Parquet files of table under root (every step's partition), in path
// order; temporary files of an interrupted write are not listed.
func Files(root, table string) ([]string, error) {
	files, err := filepath.Glob(filepath.Join(root, table, "*", "*.parquet"))
	if err != nil {
		return nil, err
	}
	sort.Strings(files)
	return files, nil
}

// readFile reads one Parquet file, checking it holds schema.
func readFile(path string, schema *arrow.Schema, mem memory.Allocator) (arrow.Table, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }() // read only: a Close error loses nothing
	rdr, err := file.NewParquetReader(f, file.WithReadProps(nil))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	defer func() { _ = rdr.Close() }() // read only, as f
	fr, err := pqarrow.NewFileReader(rdr, pqarrow.ArrowReadProperties{}, mem)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	tbl, err := fr.ReadTable(context.Background())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if !sameColumns(tbl.Schema(), schema) {
		tbl.Release()
		return nil, fmt.Errorf("%s: schema %s, want %s", path, tbl.Schema(), schema)
	}
	return tbl, nil
}

// sameColumns: the same names and types in the same order (Parquet adds field metadata).
func sameColumns(got, want *arrow.Schema) bool {
	if got.NumFields() != want.NumFields() {
		return false
	}
	for i, f := range want.Fields() {
		g := got.Field(i)
		if g.Name != f.Name || !arrow.TypeEqual(g.Type, f.Type) {
			return false
		}
	}
	return true
}

// eachRow calls fn for every row of every record batch of tbl, with the batch's columns.
func eachRow(tbl arrow.Table, fn func(cols []arrow.Array, i int) error) error {
	tr := array.NewTableReader(tbl, 0)
	defer tr.Release()
	for tr.Next() {
		rec := tr.RecordBatch()
		cols := rec.Columns()
		for i := 0; i < int(rec.NumRows()); i++ {
			if err := fn(cols, i); err != nil {
				return err
			}
		}
	}
	return tr.Err()
}

// ReadCallsFile reads the calls of one file of CallsSchema.
func ReadCallsFile(path string, mem memory.Allocator) ([]CallRow, error) {
	tbl, err := readFile(path, CallsSchema, mem)
	if err != nil {
		return nil, err
	}
	defer tbl.Release()
	var out []CallRow
	err = eachRow(tbl, func(c []arrow.Array, i int) error {
		r := CallRow{Step: optInt64(c[0], i), GroupID: str(c[1], i), TaskID: str(c[3], i)}
		r.SessionID = str(c[2], i)
		r.Index = int(c[4].(*array.Int32).Value(i))
		r.Choice = int(c[5].(*array.Int32).Value(i))
		r.API = str(c[6], i)
		r.Started, r.Finished = timeAt(c[7], i), timeAt(c[8], i)
		r.UpstreamLatency = time.Duration(c[9].(*array.Int64).Value(i))
		r.PromptIDs = int32s(c[10], i)
		r.ResponseIDs = int32s(c[11], i)
		r.Logprobs = float32s(c[12], i)
		r.PolicyVersion = c[13].(*array.Int64).Value(i)
		temp, topP := optFloat(c[14], i), optFloat(c[15], i)
		var topK *int
		if c[16].IsValid(i) {
			k := int(c[16].(*array.Int32).Value(i))
			topK = &k
		}
		if temp != nil || topP != nil || topK != nil {
			r.Sampling = &trace.Sampling{Temperature: temp, TopP: topP, TopK: topK}
		}
		r.FinishReason = str(c[17], i)
		r.Trainable = c[18].(*array.Boolean).Value(i)
		r.UntrainableReason = str(c[19], i)
		r.Request = raw(c[20], i)
		r.UpstreamRequest = raw(c[21], i)
		r.Response = raw(c[22], i)
		out = append(out, r)
		return nil
	})
	return out, err
}

// ReadCalls reads every call archived under root, step by step.
func ReadCalls(root string, mem memory.Allocator) ([]CallRow, error) {
	files, err := Files(root, CallsTable)
	if err != nil {
		return nil, err
	}
	var out []CallRow
	for _, f := range files {
		rows, err := ReadCallsFile(f, mem)
		if err != nil {
			return nil, err
		}
		out = append(out, rows...)
	}
	return out, nil
}

// ReadSessions reads every session archived under root.
func ReadSessions(root string, mem memory.Allocator) ([]SessionRow, error) {
	files, err := Files(root, SessionsTable)
	if err != nil {
		return nil, err
	}
	var out []SessionRow
	for _, f := range files {
		tbl, err := readFile(f, SessionsSchema, mem)
		if err != nil {
			return nil, err
		}
		err = eachRow(tbl, func(c []arrow.Array, i int) error {
			out = append(out, SessionRow{Step: optInt64(c[0], i), GroupID: str(c[1], i), DropReason: str(c[10], i),
				Session: trace.Session{ID: str(c[2], i), TaskID: str(c[3], i), GroupID: str(c[1], i),
					Status: trace.Status(str(c[4], i)), Reward: c[5].(*array.Float64).Value(i)},
				Advantage: optFloat(c[6], i), Calls: int(c[7].(*array.Int32).Value(i)),
				Created: timeAt(c[8], i), Finished: timeAt(c[9], i)})
			return nil
		})
		tbl.Release()
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}

// ReadSteps reads every step archived under root.
func ReadSteps(root string, mem memory.Allocator) ([]StepRow, error) {
	files, err := Files(root, StepsTable)
	if err != nil {
		return nil, err
	}
	var out []StepRow
	for _, f := range files {
		tbl, err := readFile(f, StepsSchema, mem)
		if err != nil {
			return nil, err
		}
		err = eachRow(tbl, func(c []arrow.Array, i int) error {
			gl := c[1].(*array.List)
			from, to := gl.ValueOffsets(i)
			vals := gl.ListValues().(*array.String)
			var groups []string
			for k := from; k < to; k++ {
				groups = append(groups, vals.Value(int(k)))
			}
			out = append(out, StepRow{Record: trace.StepRecord{N: c[0].(*array.Int64).Value(i), Groups: groups,
				TokenBudget: int(c[4].(*array.Int64).Value(i)), MinPolicyVersion: c[5].(*array.Int64).Value(i),
				Committed: true, Saved: timeAt(c[6], i)},
				Sessions: int(c[2].(*array.Int32).Value(i)), Calls: int(c[3].(*array.Int32).Value(i)),
				Committed: timeAt(c[7], i)})
			return nil
		})
		tbl.Release()
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}

func str(a arrow.Array, i int) string {
	if a.IsNull(i) {
		return ""
	}
	return a.(*array.String).Value(i)
}

func raw(a arrow.Array, i int) json.RawMessage {
	if a.IsNull(i) {
		return nil
	}
	return json.RawMessage(a.(*array.LargeString).Value(i))
}

func optInt64(a arrow.Array, i int) *int64 {
	if a.IsNull(i) {
		return nil
	}
	v := a.(*array.Int64).Value(i)
	return &v
}

func optFloat(a arrow.Array, i int) *float64 {
	if a.IsNull(i) {
		return nil
	}
	v := a.(*array.Float64).Value(i)
	return &v
}

func timeAt(a arrow.Array, i int) time.Time {
	if a.IsNull(i) {
		return time.Time{}
	}
	return time.UnixMicro(int64(a.(*array.Timestamp).Value(i))).UTC()
}

func int32s(a arrow.Array, i int) []int32 {
	l := a.(*array.List)
	from, to := l.ValueOffsets(i)
	return append([]int32{}, l.ListValues().(*array.Int32).Int32Values()[from:to]...)
}

func float32s(a arrow.Array, i int) []float32 {
	l := a.(*array.List)
	from, to := l.ValueOffsets(i)
	return append([]float32{}, l.ListValues().(*array.Float32).Float32Values()[from:to]...)
}
