package trace

import (
	"path/filepath"
	"time"
)

// ArchiveDirName is the archive's directory inside the data dir unless Retention says
// another.
const ArchiveDirName = "archive"

// Retention is what floe keeps of what it recorded, and for how long: one noun in one
// place, as litestream's Store carries its retention (docs/archive.md). floe serve reads
// its archiving and compaction fields, and the in-memory store of floe proxy its bound.
// The zero value keeps everything where it is and bounds nothing; each zero duration or
// size takes its documented default.
type Retention struct {
	// Archive moves each committed step's calls, sessions and record (and each dropped
	// group) out of the durable store into Parquet under ArchiveDir, so the store stays
	// bounded (-archive).
	Archive bool
	// ArchiveDir is where archived steps go (-archive-dir); "": <data-dir>/archive.
	ArchiveDir string
	// RetryAfter is how long a step or dropped group that failed to archive is left
	// before it is tried again, doubling with each failure in a row up to MaxRetryAfter
	// (defaults 1 minute and 30 minutes); the others go on meanwhile.
	RetryAfter, MaxRetryAfter time.Duration
	// CompactMinFileBytes: a smaller store file is never compacted (default 1 MiB).
	// CompactFactor: the store is compacted when its file is at least this many times
	// the size a compacted one would have (default 2).
	CompactMinFileBytes int64
	CompactFactor       float64
	// MaxStoredBytes, when positive, bounds the calls an in-memory store keeps: past it
	// the oldest are dropped and counted (floe proxy's -max-stored-bytes).
	MaxStoredBytes int64
}

// Dir is where the archive of a store in dataDir goes.
func (r Retention) Dir(dataDir string) string {
	if r.ArchiveDir != "" {
		return r.ArchiveDir
	}
	return filepath.Join(dataDir, ArchiveDirName)
}
