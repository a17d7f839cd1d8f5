package archive

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/memory"
	"github.com/apache/arrow-go/v18/parquet"
	"github.com/apache/arrow-go/v18/parquet/compress"
	"github.com/apache/arrow-go/v18/parquet/pqarrow"

	"github.com/floe-rl/floe/trace"
)

// PartFile is the one file of a step's partition.
const PartFile = "part-0.parquet"

// Step is one committed step with everything the archive keeps of it.
type Step struct {
	Record    trace.StepRecord
	Committed time.Time
	// Groups are the step's groups in its order, each with its sessions and their calls.
	Groups []trace.Group
	// Sessions holds what a trace.Session does not: when it was created and finished,
	// and its advantage. A session missing here has null times and advantage.
	Sessions map[string]SessionInfo
}

// SessionInfo is a session's facts beside trace.Session.
type SessionInfo struct {
	Created, Finished time.Time
	// Advantage is the session's advantage within its group as the batcher computed it;
	// nil when the session did not train (dropped from its group by -drop-failed).
	Advantage *float64
}

// PartitionDir is the directory of step n's partition of table under root.
func PartitionDir(root, table string, n int64) string {
	return filepath.Join(root, table, fmt.Sprintf("step-%06d", n))
}

// DroppedDir names the partition directory (under each table) of dropped group id, the
// seq-th group the store dropped: a hash of the id, which may hold any character, and
// the store's number for the drop, so that a second group of a reused id (one dropped by
// a floe before ids were kept from reuse) never replaces the first's files, while the
// same group archived again after a crash replaces its own.
func DroppedDir(id string, seq uint64) string {
	h := sha256.Sum256([]byte(id))
	return fmt.Sprintf("dropped-%s-%06d", hex.EncodeToString(h[:8]), seq)
}

// WriteOptions bound what writing a step or a dropped group holds in memory, and mark
// its stages for crash tests. The zero value is the production setting.
type WriteOptions struct {
	// BatchBytes and BatchRows: the calls gathered are written out as one row group once
	// they hold this many bytes of JSON and token ids, or this many rows (defaults 64 MiB
	// and 16,384), so a step of any size streams through a bounded buffer.
	BatchBytes int64
	BatchRows  int
	// At, when set, is called after each file.
	At func(Stage)
}

func (o WriteOptions) withDefaults() WriteOptions {
	if o.BatchBytes <= 0 {
		o.BatchBytes = batchBytes
	}
	if o.BatchRows <= 0 {
		o.BatchRows = batchRows
	}
	if o.At == nil {
		o.At = func(Stage) {}
	}
	return o
}

// GroupSource hands a step's groups to yield one at a time, in the step's order, each
// with its sessions' facts; the writer keeps nothing of a group's calls after yield
// returns, so a source that reads each group from the store when asked keeps one group
// in memory at a time.
type GroupSource func(yield func(g *trace.Group, sessions map[string]SessionInfo) error) error

// StepHead is a step's record, without its groups' data.
type StepHead struct {
	Record    trace.StepRecord
	Committed time.Time
}

// WriteDroppedGroup writes a group dropped before any step for reason, as WriteStepRows
// writes a step: the calls and sessions source hands its Rows, streamed, then its
// sessions, atomically, with a null step and the reason on each session, in partitions
// named dir (DroppedDir).
func WriteDroppedGroup(root, dir, reason string, source func(*Rows) error, mem memory.Allocator, opt WriteOptions) error {
	opt = opt.withDefaults()
	r := &Rows{sess: newSessionsBuilder(mem), dropReason: reason}
	defer r.sess.release()
	err := writeCallsFile(filepath.Join(root, CallsTable, dir, PartFile), mem, opt, func(add AddCall) error {
		r.add = add
		return source(r)
	})
	if err != nil {
		return fmt.Errorf("archive dropped group %s calls: %w", dir, err)
	}
	opt.At(StageCalls)
	if err := writeRecord(filepath.Join(root, SessionsTable, dir), r.sess.b, mem); err != nil {
		return fmt.Errorf("archive dropped group %s sessions: %w", dir, err)
	}
	opt.At(StageSessions)
	return nil
}

// Stage names the points WriteStep passes, for crash tests.
type Stage string

const (
	StageCalls    Stage = "calls-written"
	StageSessions Stage = "sessions-written"
	StageSteps    Stage = "steps-written"
)

// WriteStepGroups writes step head's files (WriteStepRows) from groups, each held whole
// in memory while it is written.
func WriteStepGroups(root string, head StepHead, groups GroupSource, mem memory.Allocator, opt WriteOptions) error {
	return WriteStepRows(root, head, func(r *Rows) error { return groups(r.Group) }, mem, opt)
}

// Rows takes a step's rows as its source reads them (WriteStepRows): each call is
// appended to the calls being written and not kept.
type Rows struct {
	step *int64 // nil: a dropped group's
	// dropReason is a dropped group's reason, on each of its sessions.
	dropReason string
	add        AddCall
	sess       *sessionsBuilder
	nSessions  int
	nCalls     int
}

// Call adds call c of group groupID (task taskID).
func (r *Rows) Call(groupID, taskID string, c *trace.Call) error {
	r.nCalls++
	return r.add(r.step, groupID, taskID, c)
}

// Session adds session s of group groupID (its calls, if any, are not read: calls is how
// many it has).
func (r *Rows) Session(groupID string, s *trace.Session, calls int, info SessionInfo) {
	r.nSessions++
	r.sess.append(r.step, groupID, s, calls, info, r.dropReason)
}

// Group adds group g, held in memory: each session's calls, then the session.
func (r *Rows) Group(g *trace.Group, info map[string]SessionInfo) error {
	for si := range g.Sessions {
		s := &g.Sessions[si]
		for ci := range s.Calls {
			if err := r.Call(g.ID, s.TaskID, &s.Calls[ci]); err != nil {
				return err
			}
		}
		r.Session(g.ID, s, len(s.Calls), info[s.ID])
	}
	return nil
}

// WriteStepRows writes step head's three partition files under root: its calls, its
// sessions, then its step row (last, so a step row means its other files are complete).
// source hands the step's calls and sessions to its Rows; the calls stream into one
// file, a row group whenever opt's bounds are reached, so a step's size never decides
// what is held in memory. Each file is written to a hidden temporary name, fsynced and
// renamed over the final name, and its directory fsynced: after a crash a file is whole
// or absent, and writing a step again replaces its files rather than adding rows.
func WriteStepRows(root string, head StepHead, source func(*Rows) error, mem memory.Allocator, opt WriteOptions) error {
	opt = opt.withDefaults()
	n := head.Record.N
	r := &Rows{step: &n, sess: newSessionsBuilder(mem)}
	defer r.sess.release()
	err := writeCallsFile(filepath.Join(PartitionDir(root, CallsTable, n), PartFile), mem, opt, func(add AddCall) error {
		r.add = add
		return source(r)
	})
	if err != nil {
		return fmt.Errorf("archive step %d calls: %w", n, err)
	}
	opt.At(StageCalls)
	if err := writeRecord(PartitionDir(root, SessionsTable, n), r.sess.b, mem); err != nil {
		return fmt.Errorf("archive step %d sessions: %w", n, err)
	}
	opt.At(StageSessions)
	steps := array.NewRecordBuilder(mem, StepsSchema)
	defer steps.Release()
	appendStep(steps, head, r.nSessions, r.nCalls)
	if err := writeRecord(PartitionDir(root, StepsTable, n), steps, mem); err != nil {
		return fmt.Errorf("archive step %d: %w", n, err)
	}
	opt.At(StageSteps)
	return nil
}

// writerProps: zstd, which every reader named in docs/archive.md decodes; rows in groups
// of at most 64k so that a reader can skip by statistics.
func writerProps(mem memory.Allocator) (*parquet.WriterProperties, pqarrow.ArrowWriterProperties) {
	return parquet.NewWriterProperties(parquet.WithCompression(compress.Codecs.Zstd), parquet.WithAllocator(mem),
			parquet.WithMaxRowGroupLength(64<<10)),
		pqarrow.NewArrowWriterProperties(pqarrow.WithStoreSchema(), pqarrow.WithAllocator(mem))
}

// writeRecord writes the rows of b as dir/part-0.parquet, atomically.
func writeRecord(dir string, b *array.RecordBuilder, mem memory.Allocator) error {
	rec := b.NewRecordBatch()
	defer rec.Release()
	return WriteFileAtomic(filepath.Join(dir, PartFile), func(w io.Writer) error {
		props, aprops := writerProps(mem)
		fw, err := pqarrow.NewFileWriter(rec.Schema(), w, props, aprops)
		if err != nil {
			return err
		}
		if err := fw.Write(rec); err != nil {
			_ = fw.Close() // the Write error is the one to report
			return err
		}
		return fw.Close()
	})
}

// WriteFileAtomic writes path through write: to a hidden temporary name in its
// directory (pyarrow and DuckDB's *.parquet globs skip it), fsynced, renamed over path,
// and the directory fsynced, so path is whole or as it was, also after a kill.
func WriteFileAtomic(path string, write func(io.Writer) error) error {
	dir := filepath.Dir(path)
	if err := mkdirSynced(dir); err != nil {
		return err
	}
	tmp := filepath.Join(dir, "."+filepath.Base(path)+".tmp")
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	// The parquet writer closes a sink that is an io.Closer; the file is closed here.
	bw := bufio.NewWriterSize(f, 1<<20)
	err = write(bw)
	if err == nil {
		err = bw.Flush()
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(tmp) // best effort: the write error is the one to report, and the next write truncates tmp
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	return syncDir(dir)
}

// mkdirSynced creates dir and its missing parents, fsyncing each parent that gained an
// entry, so that a file renamed into dir survives a crash with its path.
func mkdirSynced(dir string) error {
	if _, err := os.Stat(dir); err == nil {
		return nil
	}
	parent := filepath.Dir(dir)
	if parent != dir {
		if err := mkdirSynced(parent); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, 0o755); err != nil && !os.IsExist(err) {
		return err
	}
	return syncDir(parent)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer func() { _ = d.Close() }() // opened only to fsync, checked below
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}

// CallsBuilder accumulates rows of CallsSchema.
type CallsBuilder struct {
	b    *array.RecordBuilder
	rows int
	size int64 // bytes of JSON and token data appended, to size batches
}

// NewCallsBuilder returns an empty builder; Release it.
func NewCallsBuilder(mem memory.Allocator) *CallsBuilder {
	return &CallsBuilder{b: array.NewRecordBuilder(mem, CallsSchema)}
}

// Release frees the builder.
func (cb *CallsBuilder) Release() { cb.b.Release() }

// Rows is the number of rows appended since the last NewRecordBatch.
func (cb *CallsBuilder) Rows() int { return cb.rows }

// Bytes is about how much data was appended since the last NewRecordBatch.
func (cb *CallsBuilder) Bytes() int64 { return cb.size }

// NewRecordBatch returns the rows appended so far and empties the builder.
func (cb *CallsBuilder) NewRecordBatch() arrow.RecordBatch {
	cb.rows, cb.size = 0, 0
	return cb.b.NewRecordBatch()
}

// Append adds call c of group groupID (task taskID) in step (nil: in none).
func (cb *CallsBuilder) Append(step *int64, groupID, taskID string, c *trace.Call) {
	f := cb.b.Fields()
	if step != nil {
		f[0].(*array.Int64Builder).Append(*step)
	} else {
		f[0].AppendNull()
	}
	f[1].(*array.StringBuilder).Append(groupID)
	f[2].(*array.StringBuilder).Append(c.SessionID)
	f[3].(*array.StringBuilder).Append(taskID)
	f[4].(*array.Int32Builder).Append(int32(c.Index))
	f[5].(*array.Int32Builder).Append(int32(c.Choice))
	f[6].(*array.StringBuilder).Append(c.API)
	appendTime(f[7], c.Started)
	appendTime(f[8], c.Finished)
	f[9].(*array.Int64Builder).Append(int64(c.UpstreamLatency))
	appendInt32s(f[10].(*array.ListBuilder), c.PromptIDs)
	appendInt32s(f[11].(*array.ListBuilder), c.ResponseIDs)
	lp := f[12].(*array.ListBuilder)
	lp.Append(true)
	lp.ValueBuilder().(*array.Float32Builder).AppendValues(c.Logprobs, nil)
	f[13].(*array.Int64Builder).Append(c.PolicyVersion)
	var temp, topP *float64
	var topK *int
	if s := c.Sampling; s != nil {
		temp, topP, topK = s.Temperature, s.TopP, s.TopK
	}
	appendFloat(f[14], temp)
	appendFloat(f[15], topP)
	if topK != nil {
		f[16].(*array.Int32Builder).Append(int32(*topK))
	} else {
		f[16].AppendNull()
	}
	f[17].(*array.StringBuilder).Append(c.FinishReason)
	f[18].(*array.BooleanBuilder).Append(c.Trainable)
	appendString(f[19], c.UntrainableReason)
	appendLargeString(f[20], c.Request)
	appendLargeString(f[21], c.UpstreamRequest)
	appendLargeString(f[22], c.Response)
	cb.rows++
	cb.size += int64(len(c.Request)+len(c.UpstreamRequest)+len(c.Response)) + 4*int64(len(c.PromptIDs)+2*len(c.ResponseIDs))
}

func appendTime(b array.Builder, t time.Time) {
	if t.IsZero() {
		b.AppendNull()
		return
	}
	b.(*array.TimestampBuilder).Append(arrow.Timestamp(t.UnixMicro()))
}

func appendFloat(b array.Builder, v *float64) {
	if v == nil {
		b.AppendNull()
		return
	}
	b.(*array.Float64Builder).Append(*v)
}

// appendString appends s, or null when it is empty (no reason, no request kept).
func appendString(b array.Builder, s string) {
	if s == "" {
		b.AppendNull()
		return
	}
	b.(*array.StringBuilder).Append(s)
}

// appendLargeString appends JSON j, or null when there is none.
func appendLargeString(b array.Builder, j []byte) {
	if len(j) == 0 {
		b.AppendNull()
		return
	}
	b.(*array.LargeStringBuilder).Append(string(j))
}

func appendInt32s(lb *array.ListBuilder, v []int32) {
	lb.Append(true)
	lb.ValueBuilder().(*array.Int32Builder).AppendValues(v, nil)
}

type sessionsBuilder struct{ b *array.RecordBuilder }

func newSessionsBuilder(mem memory.Allocator) *sessionsBuilder {
	return &sessionsBuilder{b: array.NewRecordBuilder(mem, SessionsSchema)}
}

func (sb *sessionsBuilder) release() { sb.b.Release() }

func (sb *sessionsBuilder) append(step *int64, groupID string, s *trace.Session, calls int, info SessionInfo, dropReason string) {
	f := sb.b.Fields()
	if step != nil {
		f[0].(*array.Int64Builder).Append(*step)
	} else {
		f[0].AppendNull()
	}
	f[1].(*array.StringBuilder).Append(groupID)
	f[2].(*array.StringBuilder).Append(s.ID)
	f[3].(*array.StringBuilder).Append(s.TaskID)
	f[4].(*array.StringBuilder).Append(string(s.Status))
	f[5].(*array.Float64Builder).Append(s.Reward)
	appendFloat(f[6], info.Advantage)
	f[7].(*array.Int32Builder).Append(int32(calls))
	appendTime(f[8], info.Created)
	appendTime(f[9], info.Finished)
	appendString(f[10], dropReason)
}

func appendStep(b *array.RecordBuilder, st StepHead, sessions, calls int) {
	f := b.Fields()
	f[0].(*array.Int64Builder).Append(st.Record.N)
	gl := f[1].(*array.ListBuilder)
	gl.Append(true)
	gl.ValueBuilder().(*array.StringBuilder).AppendValues(st.Record.Groups, nil)
	f[2].(*array.Int32Builder).Append(int32(sessions))
	f[3].(*array.Int32Builder).Append(int32(calls))
	f[4].(*array.Int64Builder).Append(int64(st.Record.TokenBudget))
	f[5].(*array.Int64Builder).Append(st.Record.MinPolicyVersion)
	appendTime(f[6], st.Record.Saved)
	appendTime(f[7], st.Committed)
}
