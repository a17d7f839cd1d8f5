// Package archive writes floe's traces as Parquet (arrow-go's pqarrow) and reads them
// back: the archive of committed steps floe serve keeps under <data-dir>/archive, and
// floe export's copy of a data dir's calls. The layout and every column are documented
// in docs/archive.md; pyarrow, pandas, DuckDB and Hugging Face datasets open it as it is.
//
// Layout: one directory per step and table, archive/{calls,sessions,steps}/step-NNNNNN/
// part-0.parquet; a group dropped before any step (never trained) has its calls and
// sessions under dropped-<hash of its id>/ instead, with a null step. The step is a column of every file, not a Hive key (step=N): Hugging
// Face datasets ignores Hive keys, and pandas and pyarrow refuse a Hive key that is also
// a column of the files (they infer it as int32 or a dictionary, never the file's type).
package archive

import (
	"github.com/apache/arrow-go/v18/arrow"
)

// The tables, each a directory under the archive root.
const (
	CallsTable    = "calls"
	SessionsTable = "sessions"
	StepsTable    = "steps"
)

var ts = &arrow.TimestampType{Unit: arrow.Microsecond, TimeZone: "UTC"}

// CallsSchema is one row per recorded call (one per choice of an n > 1 request).
//
// The JSON columns (request, upstream_request, response) are LargeString, 64-bit
// offsets: a row group of long agent transcripts passes 2 GiB of JSON, where a String
// column's 32-bit offsets would wrap.
var CallsSchema = arrow.NewSchema([]arrow.Field{
	{Name: "step", Type: arrow.PrimitiveTypes.Int64, Nullable: true}, // null: in no step (floe export)
	{Name: "group_id", Type: arrow.BinaryTypes.String},
	{Name: "session_id", Type: arrow.BinaryTypes.String},
	{Name: "task_id", Type: arrow.BinaryTypes.String},
	{Name: "call_index", Type: arrow.PrimitiveTypes.Int32},
	{Name: "choice", Type: arrow.PrimitiveTypes.Int32},
	{Name: "api", Type: arrow.BinaryTypes.String},
	{Name: "started", Type: ts, Nullable: true},
	{Name: "finished", Type: ts, Nullable: true},
	{Name: "upstream_latency_ns", Type: arrow.PrimitiveTypes.Int64},
	{Name: "prompt_ids", Type: arrow.ListOf(arrow.PrimitiveTypes.Int32)},
	{Name: "response_ids", Type: arrow.ListOf(arrow.PrimitiveTypes.Int32)},
	{Name: "logprobs", Type: arrow.ListOf(arrow.PrimitiveTypes.Float32)},
	{Name: "policy_version", Type: arrow.PrimitiveTypes.Int64},
	{Name: "temperature", Type: arrow.PrimitiveTypes.Float64, Nullable: true},
	{Name: "top_p", Type: arrow.PrimitiveTypes.Float64, Nullable: true},
	{Name: "top_k", Type: arrow.PrimitiveTypes.Int32, Nullable: true},
	{Name: "finish_reason", Type: arrow.BinaryTypes.String},
	{Name: "trainable", Type: arrow.FixedWidthTypes.Boolean},
	{Name: "untrainable_reason", Type: arrow.BinaryTypes.String, Nullable: true},
	{Name: "request", Type: arrow.BinaryTypes.LargeString, Nullable: true},
	{Name: "upstream_request", Type: arrow.BinaryTypes.LargeString, Nullable: true},
	{Name: "response", Type: arrow.BinaryTypes.LargeString, Nullable: true},
}, nil)

// SessionsSchema is one row per session of a step's groups (or of a dropped group).
var SessionsSchema = arrow.NewSchema([]arrow.Field{
	{Name: "step", Type: arrow.PrimitiveTypes.Int64, Nullable: true}, // null: the group was dropped
	{Name: "group_id", Type: arrow.BinaryTypes.String},
	{Name: "session_id", Type: arrow.BinaryTypes.String},
	{Name: "task_id", Type: arrow.BinaryTypes.String},
	{Name: "status", Type: arrow.BinaryTypes.String},
	{Name: "reward", Type: arrow.PrimitiveTypes.Float64},
	{Name: "advantage", Type: arrow.PrimitiveTypes.Float64, Nullable: true}, // null: not trained (dropped from its group)
	{Name: "calls", Type: arrow.PrimitiveTypes.Int32},
	{Name: "created", Type: ts, Nullable: true},
	{Name: "finished", Type: ts, Nullable: true},
	{Name: "drop_reason", Type: arrow.BinaryTypes.String, Nullable: true}, // why the group was dropped; null when it trained
}, nil)

// StepsSchema is one row per committed step.
var StepsSchema = arrow.NewSchema([]arrow.Field{
	{Name: "step", Type: arrow.PrimitiveTypes.Int64},
	{Name: "groups", Type: arrow.ListOf(arrow.BinaryTypes.String)},
	{Name: "sessions", Type: arrow.PrimitiveTypes.Int32},
	{Name: "calls", Type: arrow.PrimitiveTypes.Int32},
	{Name: "token_budget", Type: arrow.PrimitiveTypes.Int64},
	{Name: "min_policy_version", Type: arrow.PrimitiveTypes.Int64},
	{Name: "saved", Type: ts, Nullable: true},
	{Name: "committed", Type: ts, Nullable: true},
}, nil)
