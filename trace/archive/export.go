package archive

import (
	"fmt"
	"io"

	"github.com/apache/arrow-go/v18/arrow/memory"
	"github.com/apache/arrow-go/v18/parquet/pqarrow"

	"github.com/floe-rl/floe/trace"
)

// AddCall takes one call for WriteCalls: in step (nil: in none), of group groupID and
// task taskID.
type AddCall func(step *int64, groupID, taskID string, c *trace.Call) error

// batchBytes and batchRows bound what WriteCalls holds in memory before it writes a row
// group: a long export streams, whatever the data dir's size.
const (
	batchBytes = 64 << 20
	batchRows  = 16 << 10
)

// WriteCalls writes the calls produce hands to its AddCall as one Parquet file of
// CallsSchema at path, in row groups of bounded size, atomically (WriteFileAtomic): an
// export that fails or is killed leaves no partial file.
func WriteCalls(path string, mem memory.Allocator, produce func(AddCall) error) error {
	if err := writeCallsFile(path, mem, WriteOptions{}.withDefaults(), produce); err != nil {
		return fmt.Errorf("writing calls: %w", err)
	}
	return nil
}

// writeCallsFile streams the calls produce hands to its AddCall into path through one
// Parquet writer, writing a row group whenever opt's bounds are reached.
func writeCallsFile(path string, mem memory.Allocator, opt WriteOptions, produce func(AddCall) error) error {
	return WriteFileAtomic(path, func(w io.Writer) error {
		props, aprops := writerProps(mem)
		fw, err := pqarrow.NewFileWriter(CallsSchema, w, props, aprops)
		if err != nil {
			return err
		}
		cb := NewCallsBuilder(mem)
		defer cb.Release()
		flush := func() error {
			rec := cb.NewRecordBatch()
			defer rec.Release()
			if rec.NumRows() == 0 {
				return nil
			}
			return fw.Write(rec)
		}
		err = produce(func(step *int64, groupID, taskID string, c *trace.Call) error {
			cb.Append(step, groupID, taskID, c)
			if cb.Rows() >= opt.BatchRows || cb.Bytes() >= opt.BatchBytes {
				return flush()
			}
			return nil
		})
		if err == nil {
			err = flush()
		}
		if cerr := fw.Close(); err == nil {
			err = cerr
		}
		return err
	})
}
