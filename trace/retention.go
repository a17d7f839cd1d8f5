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
	// Compact says when the durable store's file is rewritten smaller once archived
	// steps left it (Compactor).
	Compact CompactPolicy
	// MaxStoredBytes, when positive, bounds the calls an in-memory store keeps: past it
	// the oldest are dropped and counted (floe proxy's -max-stored-bytes).
	MaxStoredBytes int64
}

// DefaultMaxStoredBytes is floe proxy's MaxStoredBytes unless -max-stored-bytes says
// another (256 MiB): under load with long agent histories its in-memory store otherwise
// grew by gigabytes a minute.
const DefaultMaxStoredBytes = 256 << 20

// The defaults of Retention's zero fields.
const (
	defaultRetryAfter    = time.Minute
	defaultMaxRetryAfter = 30 * time.Minute
	// maxRetryDoublings stops the doubling long before a time.Duration overflows.
	maxRetryDoublings    = 16
	defaultCompactMin    = 1 << 20
	defaultCompactFactor = 2
)

// Dir is where the archive of a store in dataDir goes.
func (r Retention) Dir(dataDir string) string {
	if r.ArchiveDir != "" {
		return r.ArchiveDir
	}
	return filepath.Join(dataDir, ArchiveDirName)
}

// RetryWait is how long what failed to archive failures times in a row (at least 1)
// waits before it is tried again: RetryAfter, doubled with each failure after the first,
// at most MaxRetryAfter.
func (r Retention) RetryWait(failures int) time.Duration {
	wait, most := r.RetryAfter, r.MaxRetryAfter
	if wait <= 0 {
		wait = defaultRetryAfter
	}
	if most <= 0 {
		most = defaultMaxRetryAfter
	}
	for range min(failures-1, maxRetryDoublings) {
		wait = min(2*wait, most)
	}
	return wait
}

// CompactPolicy says when a store's file is worth compacting: a store reuses the space
// archived steps freed, so its file stays at the most it ever held, and compacting it
// holds back writes for as long as copying the live data takes.
type CompactPolicy struct {
	// MinFileBytes: a smaller file is never compacted (default 1 MiB).
	MinFileBytes int64
	// Factor: the file is compacted when it is at least Factor times the size a
	// compacted one would have (default 2; a factor of 1 or less takes the default).
	Factor float64
}

// Worth reports whether a file of fileBytes, which compacted would take compactedBytes,
// is worth compacting.
func (p CompactPolicy) Worth(fileBytes, compactedBytes int64) bool {
	if p.MinFileBytes <= 0 {
		p.MinFileBytes = defaultCompactMin
	}
	if p.Factor <= 1 {
		p.Factor = defaultCompactFactor
	}
	return fileBytes >= p.MinFileBytes && float64(fileBytes) >= p.Factor*float64(compactedBytes)
}

// Compaction is what one compaction (or the decision not to) found.
type Compaction struct {
	Compacted bool
	// BeforeBytes is the file's size before, LiveBytes the data in use, AfterBytes the
	// file's size after (BeforeBytes when not compacted).
	BeforeBytes, LiveBytes, AfterBytes int64
	Took                               time.Duration
}
