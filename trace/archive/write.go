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

// DroppedDir is the directory of dropped group id's partition of table under root: named
// by a hash of the id, which may hold any character.
func DroppedDir(root, table, id string) string {
	h := sha256.Sum256([]byte(id))
	return filepath.Join(root, table, "dropped-"+hex.EncodeToString(h[:8]))
}

// WriteDroppedGroup writes group g, dropped before any step for reason, as WriteStep
// writes a step: its calls then its sessions, atomically, with a null step and the
// reason on each session.
func WriteDroppedGroup(root string, g *trace.Group, reason string, sessions map[string]SessionInfo, mem memory.Allocator, at func(Stage)) error {
	if at == nil {
		at = func(Stage) {}
	}
	calls := NewCallsBuilder(mem)
	defer calls.Release()
	sess := newSessionsBuilder(mem)
	defer sess.release()
	for si := range g.Sessions {
		s := &g.Sessions[si]
		for ci := range s.Calls {
			calls.Append(nil, g.ID, s.TaskID, &s.Calls[ci])
		}
		sess.append(nil, g.ID, s, sessions[s.ID], reason)
	}
	if err := writeRecord(DroppedDir(root, CallsTable, g.ID), calls.b, mem); err != nil {
		return fmt.Errorf("archive dropped group %s calls: %w", g.ID, err)
	}
	at(StageCalls)
	if err := writeRecord(DroppedDir(root, SessionsTable, g.ID), sess.b, mem); err != nil {
		return fmt.Errorf("archive dropped group %s sessions: %w", g.ID, err)
	}
	at(StageSessions)
	return nil
}

// Stage names the points WriteStep passes, for crash tests.
type Stage string

const (
	StageCalls    Stage = "calls-written"
	StageSessions Stage = "sessions-written"
	StageSteps    Stage = "steps-written"
)

// WriteStep writes step st's three partition files under root: its calls, its sessions,
// then its step row (last, so a step row means its other files are complete). Each file
// is written to a hidden temporary name, fsynced and renamed over the final name, and
// its directory fsynced: after a crash a file is whole or absent, and writing a step
// again replaces its files rather than adding rows. at, when set, is called after each
// file.
func WriteStep(root string, st *Step, mem memory.Allocator, at func(Stage)) error {
	if at == nil {
		at = func(Stage) {}
	}
	n := st.Record.N
	calls := NewCallsBuilder(mem)
	defer calls.Release()
	sess := newSessionsBuilder(mem)
	defer sess.release()
	nSessions, nCalls := 0, 0
	for gi := range st.Groups {
		g := &st.Groups[gi]
		for si := range g.Sessions {
			s := &g.Sessions[si]
			nSessions++
			for ci := range s.Calls {
				calls.Append(&n, g.ID, s.TaskID, &s.Calls[ci])
				nCalls++
			}
			sess.append(&n, g.ID, s, st.Sessions[s.ID], "")
		}
	}
	if err := writeRecord(PartitionDir(root, CallsTable, n), calls.b, mem); err != nil {
		return fmt.Errorf("archive step %d calls: %w", n, err)
	}
	at(StageCalls)
	if err := writeRecord(PartitionDir(root, SessionsTable, n), sess.b, mem); err != nil {
		return fmt.Errorf("archive step %d sessions: %w", n, err)
	}
	at(StageSessions)
	steps := array.NewRecordBuilder(mem, StepsSchema)
	defer steps.Release()
	appendStep(steps, st, nSessions, nCalls)
	if err := writeRecord(PartitionDir(root, StepsTable, n), steps, mem); err != nil {
		return fmt.Errorf("archive step %d: %w", n, err)
	}
	at(StageSteps)
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
			fw.Close()
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
		os.Remove(tmp)
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
	defer d.Close()
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
	appendString(f[20], string(c.Request))
	appendString(f[21], string(c.UpstreamRequest))
	appendString(f[22], string(c.Response))
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

func appendInt32s(lb *array.ListBuilder, v []int32) {
	lb.Append(true)
	lb.ValueBuilder().(*array.Int32Builder).AppendValues(v, nil)
}

type sessionsBuilder struct{ b *array.RecordBuilder }

func newSessionsBuilder(mem memory.Allocator) *sessionsBuilder {
	return &sessionsBuilder{b: array.NewRecordBuilder(mem, SessionsSchema)}
}

func (sb *sessionsBuilder) release() { sb.b.Release() }

func (sb *sessionsBuilder) append(step *int64, groupID string, s *trace.Session, info SessionInfo, dropReason string) {
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
	f[7].(*array.Int32Builder).Append(int32(len(s.Calls)))
	appendTime(f[8], info.Created)
	appendTime(f[9], info.Finished)
	appendString(f[10], dropReason)
}

func appendStep(b *array.RecordBuilder, st *Step, sessions, calls int) {
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
