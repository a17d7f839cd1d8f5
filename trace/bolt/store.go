// Package bolt is floe's durable trace store on bbolt: sessions and their API keys, every
// recorded call with its token ids and log-probabilities, session outcomes, GRPO groups,
// and the READY buffer's steps with their commit state.
//
// *Store plays every role of trace's store contract (see the assertions below). A call is durable when
// Record returns: every write is an fsynced bbolt transaction, and writes that arrive
// while one is in flight are committed together in the next (group commit), so
// concurrent sessions share an fsync without a timer delaying a lone caller.
//
// A prompt is stored by reference: against the longest prefix it shares with an earlier
// call's prompt ++ response in the same session, so disk grows with the distinct tokens
// of a session, not with the sum of its prompt lengths. See encode.go for the format.
//
// Retention: a committed step, once archived elsewhere, is forgotten (archive.go) and the
// file compacted when that pays (compact.go), so the store holds what is in flight.
package bolt

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"

	"github.com/floe-rl/floe/trace"
)

// FormatVersion is the on-disk format this package writes and the newest it reads.
// Version 2 added the usage totals, the policy version, a group's created/timed-out
// fields and a step's staleness cut-off; version 3 a step's token budget, which older
// floes kept beside the store in BudgetsFile; version 4 a step's decisions
// (trace.StepDecisions). An older store is upgraded in place when opened read-write
// (after which an older floe refuses it rather than skip what it cannot keep up to date:
// one that rewrote a format 4 step record on commit would drop its decisions).
const FormatVersion = 4

// BudgetsFile is where floe before format 3 kept, in the data dir, the token budget of
// each step formed with a budget other than the fixed one: a JSON object from step
// number (a decimal string) to budget. A read-write open moves it into the step records
// and removes it.
const BudgetsFile = "step-budgets.json"

// FileName is the database file inside the data dir.
const FileName = "floe.db"

// The store's errors are trace's, so callers test them without importing bolt.
var (
	ErrUnknownSession  = trace.ErrUnknownSession
	ErrSessionExists   = trace.ErrSessionExists
	ErrSessionFinished = trace.ErrSessionFinished
	ErrUnknownGroup    = trace.ErrUnknownGroup
	ErrGroupSize       = trace.ErrGroupSize
	ErrUnknownStep     = trace.ErrUnknownStep
	ErrStepConflict    = trace.ErrStepConflict
	ErrCommitted       = trace.ErrCommitted
	ErrClosed          = trace.ErrClosed
	ErrReadOnly        = trace.ErrReadOnly
	// ErrFormat: the file was written by a newer floe, or is not a floe store.
	ErrFormat = errors.New("unsupported store format")
	// ErrCorrupt: the file is not a readable bbolt database, or a record in it does not
	// decode. The file is never truncated or recreated.
	ErrCorrupt = errors.New("corrupt store")
)

// *Store plays every role of the store contract.
var (
	_ trace.CallRecorder   = (*Store)(nil)
	_ trace.SessionKeys    = (*Store)(nil)
	_ trace.SessionStore   = (*Store)(nil)
	_ trace.GroupStore     = (*Store)(nil)
	_ trace.StepStore      = (*Store)(nil)
	_ trace.PolicyVersions = (*Store)(nil)
	_ trace.GroupReader    = (*Store)(nil)
	_ trace.StepArchive    = (*Store)(nil)
	_ trace.DroppedArchive = (*Store)(nil)
	_ trace.Compactor      = (*Store)(nil)
	_ trace.Tombstones     = (*Store)(nil)
)

// CommitMode is how writes reach disk. Every mode fsyncs before the write returns.
type CommitMode int

const (
	// CommitGroup (default): one writer goroutine; writes that queue while a transaction
	// is being committed go into the next transaction together. No added delay for a lone
	// writer.
	CommitGroup CommitMode = iota
	// CommitUpdate: each write is its own bbolt Update (one fsync each).
	CommitUpdate
	// CommitBatch: bbolt's DB.Batch (coalesces for up to MaxBatchDelay, default 10ms).
	CommitBatch
)

// Options configures a Store. The zero value is the production setting.
type Options struct {
	Commit CommitMode
	// LockTimeout bounds the wait for the file lock another process holds (default 2s).
	LockTimeout time.Duration
	// ReadOnly opens an existing store for reading (a shared lock, nothing written, an
	// older format refused rather than upgraded); every write fails with ErrReadOnly.
	ReadOnly bool
}

var (
	bMeta     = []byte("meta")
	bKeys     = []byte("keys")
	bSessions = []byte("sessions")
	bGroups   = []byte("groups")
	bSteps    = []byte("steps")
	// bForgotten holds a tombstone for each group and session id forgotten once archived
	// (tombKey), so that an id is never used twice (archive.go).
	bForgotten = []byte("forgotten")
	kFormat    = []byte("format")
	kInfo      = []byte("info")
	kCalls     = []byte("calls")
	kMembers   = []byte("sessions")
	kUsage     = []byte("usage")
	kPolicy    = []byte("policy_version")
)

// Store is the durable trace store. Its methods are safe for concurrent use.
type Store struct {
	// db is replaced by a compaction (compact.go): read it under dbmu, or as the writer.
	dbmu sync.RWMutex
	db   *bolt.DB
	path string
	opt  Options

	mu    sync.Mutex // guards cache
	cache map[string]*sessCache

	// oldBudgets, in a read-only store only, are the step budgets of a BudgetsFile not
	// yet moved into the store (nil when none).
	oldBudgets map[int64]int

	// stageHook, set by crash tests only, is called at each point of a compaction.
	stageHook func(stage string)

	wmu    sync.RWMutex // guards closed and the send side of writes
	closed bool
	writes chan *writeReq
	done   chan struct{}
}

// New opens the store <dir>/floe.db, creating dir and an empty store when there is none.
// A file with a newer format version, a bbolt file that is not a floe store, or a file
// that is not a valid bbolt database is refused with an error wrapping ErrFormat or
// ErrCorrupt; the file is left as it is.
func New(dir string, opt Options) (*Store, error) {
	path := filepath.Join(dir, FileName)
	if opt.ReadOnly {
		if _, err := os.Stat(path); err != nil {
			return nil, fmt.Errorf("trace store: %w", err)
		}
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("trace store: %w", err)
	}
	if opt.LockTimeout <= 0 {
		opt.LockTimeout = 2 * time.Second
	}
	if fi, err := os.Stat(path); err == nil && fi.Size() == 0 {
		// bbolt would initialise an empty file in place; an empty floe.db is not one floe
		// wrote (bbolt writes its meta pages before Open returns), so refuse it.
		return nil, fmt.Errorf("%w: %s is empty (0 bytes), not a floe store; move it away to start fresh", ErrCorrupt, path)
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: opt.LockTimeout, ReadOnly: opt.ReadOnly})
	if err != nil {
		switch {
		case errors.Is(err, berrors.ErrTimeout):
			return nil, fmt.Errorf("trace store %s: locked by another process (is another floe running on this data dir?): %w", path, err)
		case errors.Is(err, berrors.ErrVersionMismatch):
			return nil, fmt.Errorf("%w: %s: bbolt file version mismatch: %v", ErrFormat, path, err)
		case errors.As(err, new(*fs.PathError)):
			return nil, fmt.Errorf("trace store %s: %w", path, err)
		default: // ErrInvalid, ErrChecksum, "file size too small", …
			return nil, fmt.Errorf("%w: %s is not a readable bbolt database (left untouched): %v", ErrCorrupt, path, err)
		}
	}
	if !opt.ReadOnly {
		// Only now, holding the lock: another floe's compaction in progress is not ours.
		if err := removeCompactLeftover(path); err != nil {
			_ = db.Close() // the error above is the one to report
			return nil, err
		}
	}
	budgets, err := initialise(db, dir, path, opt.ReadOnly)
	if err != nil {
		_ = db.Close() // the error above is the one to report
		return nil, err
	}
	s := &Store{db: db, path: path, opt: opt, cache: map[string]*sessCache{}, oldBudgets: budgets}
	if opt.Commit == CommitGroup && !opt.ReadOnly {
		s.writes = make(chan *writeReq, 256)
		s.done = make(chan struct{})
		go s.committer()
	}
	return s, nil
}

// initialise checks the format of an existing store or writes the buckets of a new one,
// and upgrades an older store opened read-write. It returns the budgets of BudgetsFile
// when the store was opened read-only with the file still beside it (an older store, or
// a crash between an upgrade and the file's removal): Steps reads them from memory then.
func initialise(db *bolt.DB, dir, path string, readOnly bool) (map[int64]int, error) {
	budgetsPath := filepath.Join(dir, BudgetsFile)
	budgets, err := readBudgets(budgetsPath)
	if err != nil {
		return nil, err
	}
	run := db.Update
	if readOnly {
		run = db.View
	}
	err = run(func(tx *bolt.Tx) error {
		meta := tx.Bucket(bMeta)
		if meta == nil && readOnly {
			return fmt.Errorf("%w: %s is not a floe store (no meta bucket)", ErrFormat, path)
		}
		if meta == nil {
			return createMeta(tx, path)
		}
		v := meta.Get(kFormat)
		if len(v) != 4 {
			return fmt.Errorf("%w: %s has no readable format version", ErrCorrupt, path)
		}
		got := binary.BigEndian.Uint32(v)
		if got > FormatVersion || got == 0 {
			return fmt.Errorf("%w: %s has format version %d; this floe reads format version %d (use the floe that wrote it, or a new data dir)",
				ErrFormat, path, got, FormatVersion)
		}
		for _, b := range [][]byte{bKeys, bSessions, bGroups, bSteps} {
			if tx.Bucket(b) == nil {
				return fmt.Errorf("%w: %s lacks bucket %q", ErrCorrupt, path, b)
			}
		}
		if readOnly {
			// Formats 2 and 3 differ by the budgets, which are read from the file instead,
			// and by the steps' decisions, which their records lack (as after an upgrade);
			// format 1 lacks the totals, which only an upgrade counts.
			if got < 2 {
				return fmt.Errorf("%w: %s has format version %d and is opened read-only: open it read-write once with this floe to upgrade it to %d",
					ErrFormat, path, got, FormatVersion)
			}
			return nil
		}
		return upgrade(tx, meta, got, budgets, budgetsPath)
	})
	if err != nil {
		return nil, err
	}
	if budgets == nil {
		return nil, nil
	}
	if readOnly {
		return budgets, nil
	}
	// The budgets are in the store now; the file goes only after that commit, so a crash
	// in between leaves it for the next open to apply again.
	if err := os.Remove(budgetsPath); err != nil {
		return nil, fmt.Errorf("trace store: removing %s after moving it into the store: %w", budgetsPath, err)
	}
	if err := syncDir(dir); err != nil {
		return nil, fmt.Errorf("trace store: %w", err)
	}
	return nil, nil
}

// createMeta makes an empty database a floe store of the current format; a bbolt file
// holding anything else is refused.
func createMeta(tx *bolt.Tx, path string) error {
	empty := true
	tx.ForEach(func([]byte, *bolt.Bucket) error { empty = false; return nil }) //nolint:errcheck // the callback returns nil, so ForEach does
	if !empty {
		return fmt.Errorf("%w: %s is a bbolt database without floe's meta bucket: not a floe store", ErrFormat, path)
	}
	m, err := tx.CreateBucket(bMeta)
	if err != nil {
		return err
	}
	if err := m.Put(kFormat, binary.BigEndian.AppendUint32(nil, FormatVersion)); err != nil {
		return err
	}
	for _, b := range [][]byte{bKeys, bSessions, bGroups, bSteps} {
		if _, err := tx.CreateBucket(b); err != nil {
			return err
		}
	}
	if _, err := tx.CreateBucket(bForgotten); err != nil {
		return err
	}
	return putJSON(m, kUsage, Totals{})
}

// upgrade brings a store of format got to the current one, in the open transaction.
func upgrade(tx *bolt.Tx, meta *bolt.Bucket, got uint32, budgets map[int64]int, budgetsPath string) error {
	// The forgotten ids' tombstones came after format 3, without a format change: an older
	// floe ignores the bucket.
	if _, err := tx.CreateBucketIfNotExists(bForgotten); err != nil {
		return err
	}
	if got == 1 {
		// Version 1 -> 2: the usage totals, by one scan; the other new fields read as
		// absent (zero) in old records.
		t, err := countTotals(tx)
		if err != nil {
			return err
		}
		if err := putJSON(meta, kUsage, t); err != nil {
			return err
		}
	}
	// Version 2 -> 3: the budgets file into the step records. Also on a format 3 store
	// whose upgrade crashed before the file was removed: the same values again.
	if err := applyBudgets(tx, budgets, budgetsPath); err != nil {
		return err
	}
	// Version 3 -> 4: nothing to rewrite. An older floe's step records hold no decisions
	// (trace.StepRecord.Decisions nil); only floe serve, which has the settings the older
	// floe formed them with, can decide them, once, at its first start on the store
	// (UndecidedSteps, DecideStep). The format is raised now so that an older floe, which
	// would drop the decisions when it rewrites a record, refuses the store from here on.
	if got == FormatVersion {
		return nil
	}
	return meta.Put(kFormat, binary.BigEndian.AppendUint32(nil, FormatVersion))
}

// readBudgets reads an older floe's BudgetsFile at path: nil when there is none. A file
// that does not parse is an error, never ignored: steps formed again without their
// budgets would differ from the ones served before.
func readBudgets(path string) (map[int64]int, error) {
	raw, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("trace store: step budgets: %w", err)
	}
	var m map[string]int
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, fmt.Errorf("%w: step budgets file %s: %v", ErrCorrupt, path, err)
	}
	out := make(map[int64]int, len(m))
	for k, v := range m {
		n, err := strconv.ParseInt(k, 10, 64)
		if err != nil || n < 0 || v <= 0 {
			return nil, fmt.Errorf("%w: step budgets file %s: entry %q: %d is not a step number and a positive budget", ErrCorrupt, path, k, v)
		}
		out[n] = v
	}
	return out, nil
}

// applyBudgets writes budgets into the records of the steps they name, committed or not,
// where the record has none. An entry for a step never saved (floe recorded the budget
// just before saving the step, then stopped) has no record to go into and is dropped.
func applyBudgets(tx *bolt.Tx, budgets map[int64]int, path string) error {
	steps := tx.Bucket(bSteps)
	for n, budget := range budgets {
		raw := steps.Get(seqKey(uint64(n)))
		if raw == nil {
			continue
		}
		var sv stepValue
		if err := json.Unmarshal(raw, &sv); err != nil {
			return fmt.Errorf("%w: step %d: %v", ErrCorrupt, n, err)
		}
		if sv.TokenBudget != 0 {
			continue
		}
		sv.TokenBudget = budget
		if err := putJSON(steps, seqKey(uint64(n)), sv); err != nil {
			return fmt.Errorf("moving %s into the store: step %d: %w", path, n, err)
		}
	}
	return nil
}

// syncDir fsyncs directory dir, so that a removal in it is durable.
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

// Path is the database file.
func (s *Store) Path() string { return s.path }

// Close flushes queued writes and closes the file. Writes after Close fail with ErrClosed.
func (s *Store) Close() error {
	s.wmu.Lock()
	if s.closed {
		s.wmu.Unlock()
		return nil
	}
	s.closed = true
	if s.writes != nil {
		close(s.writes)
	}
	s.wmu.Unlock()
	if s.done != nil {
		<-s.done
	}
	return s.db.Close()
}

// sessionInfo is a session's record, JSON in its bucket under "info".
type sessionInfo struct {
	Task     string       `json:"task"`
	Group    string       `json:"group"`
	Status   trace.Status `json:"status"`
	Reward   float64      `json:"reward"`
	Created  time.Time    `json:"created"`
	Finished time.Time    `json:"finished,omitzero"`
	Stored   int          `json:"stored"`     // calls stored (next storage seq)
	Next     int          `json:"next_index"` // next call index
}

// groupInfo is a group's record, JSON under "info" in its bucket.
type groupInfo struct {
	Task       string    `json:"task"`
	Size       int       `json:"size,omitempty"`
	Step       int64     `json:"step"` // -1 until SaveStep puts the group into a step
	Dropped    bool      `json:"dropped,omitempty"`
	DropReason string    `json:"drop_reason,omitempty"`
	Created    time.Time `json:"created,omitzero"` // zero in stores written before it was kept
	// DropSeq numbers the group among the groups the store dropped (from 1; 0 in stores
	// written before it was kept): with its id's hash it names the group's archive
	// partition, unique even where an id came back.
	DropSeq uint64 `json:"drop_seq,omitempty"`
	// TimedOut: the group outlived the group timeout; it is complete with the sessions it
	// has, whatever its size.
	TimedOut bool `json:"timed_out,omitempty"`
}

func seqKey(n uint64) []byte { return binary.BigEndian.AppendUint64(nil, n) }

func getJSON(b *bolt.Bucket, key []byte, v any, what string) error {
	raw := b.Get(key)
	if raw == nil {
		return fmt.Errorf("%w: %s has no record", ErrCorrupt, what)
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return fmt.Errorf("%w: %s: %v", ErrCorrupt, what, err)
	}
	return nil
}

func putJSON(b *bolt.Bucket, key []byte, v any) error {
	raw, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return b.Put(key, raw)
}

func sessionBucket(tx *bolt.Tx, id string) (*bolt.Bucket, sessionInfo, error) {
	var info sessionInfo
	b := tx.Bucket(bSessions).Bucket([]byte(id))
	if b == nil {
		return nil, info, fmt.Errorf("%w: %q", ErrUnknownSession, id)
	}
	return b, info, getJSON(b, kInfo, &info, "session "+id)
}

func groupBucket(tx *bolt.Tx, id string) (*bolt.Bucket, groupInfo, error) {
	var info groupInfo
	b := tx.Bucket(bGroups).Bucket([]byte(id))
	if b == nil {
		return nil, info, fmt.Errorf("%w: %q", ErrUnknownGroup, id)
	}
	return b, info, getJSON(b, kInfo, &info, "group "+id)
}

// CreateSession stores a new running session s (its ID, TaskID and GroupID; other fields
// are ignored) and, when key is not empty, key as its API key. The session joins group
// s.GroupID, created on first use; every session of a group must have the group's task.
// A positive groupSize sets the group's size in the same write, or fails with
// ErrGroupSize, creating nothing, when the group already has another.
func (s *Store) CreateSession(sess trace.Session, key string, groupSize int) error {
	if sess.ID == "" {
		return errors.New("create session: empty id")
	}
	if groupSize < 0 || (groupSize > 0 && sess.GroupID == "") {
		return fmt.Errorf("create session %q: group size %d for group %q", sess.ID, groupSize, sess.GroupID)
	}
	return s.write(func(tx *bolt.Tx) error { return createSession(tx, sess, key, groupSize) })
}

func createSession(tx *bolt.Tx, sess trace.Session, key string, groupSize int) error {
	all := tx.Bucket(bSessions)
	if all.Bucket([]byte(sess.ID)) != nil {
		return fmt.Errorf("create session: %w: %q", ErrSessionExists, sess.ID)
	}
	if forgotten(tx, tombSession, sess.ID) {
		return fmt.Errorf("create session: %w: %q (archived)", ErrSessionExists, sess.ID)
	}
	if sess.GroupID != "" && forgotten(tx, tombGroup, sess.GroupID) {
		return fmt.Errorf("create session %q: group %q is closed (archived)", sess.ID, sess.GroupID)
	}
	keys := tx.Bucket(bKeys)
	if key != "" {
		if old := keys.Get([]byte(key)); old != nil && string(old) != sess.ID {
			return fmt.Errorf("create session %q: key is already the key of session %q", sess.ID, old)
		}
	}
	if sess.GroupID != "" {
		groups := tx.Bucket(bGroups)
		g := groups.Bucket([]byte(sess.GroupID))
		if g == nil {
			var err error
			if g, err = groups.CreateBucket([]byte(sess.GroupID)); err != nil {
				return err
			}
			if _, err := g.CreateBucket(kMembers); err != nil {
				return err
			}
			if err := putJSON(g, kInfo, groupInfo{Task: sess.TaskID, Step: -1, Created: time.Now().UTC()}); err != nil {
				return err
			}
		}
		var gi groupInfo
		if err := getJSON(g, kInfo, &gi, "group "+sess.GroupID); err != nil {
			return err
		}
		if gi.Task != sess.TaskID {
			return fmt.Errorf("create session %q: group %q is for task %q, not %q", sess.ID, sess.GroupID, gi.Task, sess.TaskID)
		}
		if gi.Step >= 0 || gi.Dropped || gi.TimedOut {
			return fmt.Errorf("create session %q: group %q is closed (in step %d, dropped %v, timed out %v)",
				sess.ID, sess.GroupID, gi.Step, gi.Dropped, gi.TimedOut)
		}
		if groupSize > 0 && gi.Size != groupSize {
			if gi.Size != 0 {
				return fmt.Errorf("create session %q: group %q: %w to %d, not %d", sess.ID, sess.GroupID, ErrGroupSize, gi.Size, groupSize)
			}
			gi.Size = groupSize
			if err := putJSON(g, kInfo, gi); err != nil {
				return err
			}
		}
		m := g.Bucket(kMembers)
		n, _ := m.NextSequence()
		if err := m.Put(seqKey(n), []byte(sess.ID)); err != nil {
			return err
		}
	}
	b, err := all.CreateBucket([]byte(sess.ID))
	if err != nil {
		return err
	}
	if _, err := b.CreateBucket(kCalls); err != nil {
		return err
	}
	info := sessionInfo{Task: sess.TaskID, Group: sess.GroupID, Status: trace.StatusRunning, Created: time.Now().UTC()}
	if err := putJSON(b, kInfo, info); err != nil {
		return err
	}
	if err := updateTotals(tx, func(t *Totals) { t.Sessions++ }); err != nil {
		return err
	}
	if key != "" {
		return keys.Put([]byte(key), []byte(sess.ID))
	}
	return nil
}

// Resolve returns the session of key, without its calls (trace.SessionKeys).
func (s *Store) Resolve(key string) (trace.Session, error) {
	var out trace.Session
	err := s.view(func(tx *bolt.Tx) error {
		v := tx.Bucket(bKeys).Get([]byte(key))
		if v == nil {
			return fmt.Errorf("resolve: %w (unknown key)", ErrUnknownSession)
		}
		var err error
		out, _, err = readSession(tx, string(v), false)
		return err
	})
	return out, err
}

// Open resolves key, creating a session with id key (no task, no group) and key as its key
// when the key is unknown (trace.SessionKeys, for open sessions).
func (s *Store) Open(key string) (string, error) {
	if key == "" {
		return "", errors.New("open session: empty key")
	}
	var id string
	err := s.write(func(tx *bolt.Tx) error {
		if v := tx.Bucket(bKeys).Get([]byte(key)); v != nil {
			id = string(v)
			return nil
		}
		id = key
		if tx.Bucket(bSessions).Bucket([]byte(key)) != nil {
			return tx.Bucket(bKeys).Put([]byte(key), []byte(key))
		}
		return createSession(tx, trace.Session{ID: key}, key, 0)
	})
	return id, err
}

// FinishSession records the outcome of a running session. It fails with ErrUnknownSession
// or ErrSessionFinished, and for a status other than completed, failed or timeout or a
// reward that is not finite. Calls recorded after it are refused.
func (s *Store) FinishSession(id string, reward float64, status trace.Status) error {
	switch status {
	case trace.StatusCompleted, trace.StatusFailed, trace.StatusTimeout:
	default:
		return fmt.Errorf("finish session %q: status %q is not completed, failed or timeout", id, status)
	}
	if math.IsNaN(reward) || math.IsInf(reward, 0) {
		return fmt.Errorf("finish session %q: reward %v is not finite", id, reward)
	}
	sc := s.sessionCache(id)
	sc.mu.Lock()
	defer sc.mu.Unlock()
	err := s.write(func(tx *bolt.Tx) error {
		b, info, err := sessionBucket(tx, id)
		if err != nil {
			return fmt.Errorf("finish session: %w", err)
		}
		if info.Status != trace.StatusRunning {
			return fmt.Errorf("finish session %q: %w (%s)", id, ErrSessionFinished, info.Status)
		}
		info.Status, info.Reward, info.Finished = status, reward, time.Now().UTC()
		return putJSON(b, kInfo, info)
	})
	s.dropCache(id, sc)
	return err
}

// SetGroupSize records how many sessions make group id complete (the control API's
// group_size), so that FinishedGroups knows after a restart. The first size given is
// kept: the same size again is a no-op, another one fails with ErrGroupSize (sessions
// of one group disagreeing on its size is a harness bug a silent overwrite would hide).
func (s *Store) SetGroupSize(id string, size int) error {
	if size < 0 {
		return fmt.Errorf("group %q: negative size %d", id, size)
	}
	return s.write(func(tx *bolt.Tx) error {
		b, gi, err := groupBucket(tx, id)
		if err != nil {
			return fmt.Errorf("set group size: %w", err)
		}
		switch {
		case gi.Size == size:
			return nil
		case gi.Size != 0:
			return fmt.Errorf("group %q: %w to %d, not %d", id, ErrGroupSize, gi.Size, size)
		}
		gi.Size = size
		return putJSON(b, kInfo, gi)
	})
}

// DropGroup marks a group dropped (too few usable sessions, timed out): it is never
// listed by FinishedGroups again.
func (s *Store) DropGroup(id, reason string) error {
	return s.write(func(tx *bolt.Tx) error {
		b, gi, err := groupBucket(tx, id)
		if err != nil {
			return fmt.Errorf("drop group: %w", err)
		}
		if gi.Step >= 0 {
			return fmt.Errorf("drop group %q: it is in step %d", id, gi.Step)
		}
		if gi.DropSeq == 0 {
			if gi.DropSeq, err = tx.Bucket(bGroups).NextSequence(); err != nil {
				return err
			}
		}
		gi.Dropped, gi.DropReason = true, reason
		return putJSON(b, kInfo, gi)
	})
}

// TimeOutGroup ends group id at the group timeout. In one write the group is marked timed
// out, which closes it to new sessions and makes it complete with the sessions it has,
// whatever its size; then each of its running sessions finishes with status timeout and
// reward 0 (calls recorded later in them are refused). It returns the sessions it
// finished. Safe to repeat, after a crash part way too: finished sessions are left as
// they are.
func (s *Store) TimeOutGroup(id string) ([]string, error) {
	var running []string
	err := s.write(func(tx *bolt.Tx) error {
		running = running[:0] // fn may run again
		b, gi, err := groupBucket(tx, id)
		if err != nil {
			return err
		}
		if gi.Step >= 0 || gi.Dropped {
			return nil
		}
		if !gi.TimedOut {
			gi.TimedOut = true
			if err := putJSON(b, kInfo, gi); err != nil {
				return err
			}
		}
		return b.Bucket(kMembers).ForEach(func(_, sid []byte) error {
			_, info, err := sessionBucket(tx, string(sid))
			if err == nil && info.Status == trace.StatusRunning {
				running = append(running, string(sid))
			}
			return err
		})
	})
	if err != nil {
		return nil, fmt.Errorf("time out group %q: %w", id, err)
	}
	var ended []string
	for _, sid := range running {
		// Through FinishSession, one session at a time, so that a call being recorded in
		// it either lands before the timeout or is refused after it.
		switch err := s.FinishSession(sid, 0, trace.StatusTimeout); {
		case err == nil:
			ended = append(ended, sid)
		case errors.Is(err, ErrSessionFinished): // finished by its driver meanwhile
		default:
			return ended, fmt.Errorf("time out group %q: %w", id, err)
		}
	}
	return ended, nil
}

// Session returns session id with all its calls, prompts reconstructed in full.
func (s *Store) Session(id string) (trace.Session, error) {
	var out trace.Session
	err := s.view(func(tx *bolt.Tx) error {
		var err error
		out, _, err = readSession(tx, id, true)
		return err
	})
	return out, err
}

// readSession reads a session; with calls, its calls too, and the full sequences and
// last JSON fields a Record cache needs.
func readSession(tx *bolt.Tx, id string, calls bool) (trace.Session, *sessCache, error) {
	b, info, err := sessionBucket(tx, id)
	if err != nil {
		return trace.Session{}, nil, err
	}
	out := trace.Session{ID: id, TaskID: info.Task, GroupID: info.Group, Reward: info.Reward, Status: info.Status}
	sc := &sessCache{loaded: true, stored: info.Stored, next: info.Next, finished: info.Status != trace.StatusRunning}
	if !calls {
		return out, sc, nil
	}
	cb := b.Bucket(kCalls)
	fulls := make([][]int32, 0, info.Stored)
	out.Calls = make([]trace.Call, 0, info.Stored)
	cur := cb.Cursor()
	for k, v := cur.First(); k != nil; k, v = cur.Next() {
		seq := len(fulls)
		if len(k) != 8 || binary.BigEndian.Uint64(k) != uint64(seq) {
			return trace.Session{}, nil, fmt.Errorf("%w: session %q: call key %x where seq %d was expected", ErrCorrupt, id, k, seq)
		}
		c, full, err := decodeCall(v, id, seq, fulls, &sc.blobs)
		if err != nil {
			return trace.Session{}, nil, fmt.Errorf("%w: %v", ErrCorrupt, err)
		}
		fulls = append(fulls, full)
		out.Calls = append(out.Calls, c)
	}
	if len(fulls) != info.Stored {
		return trace.Session{}, nil, fmt.Errorf("%w: session %q: %d calls stored, record says %d", ErrCorrupt, id, len(fulls), info.Stored)
	}
	for seq, full := range fulls {
		sc.addTip(seq, full, len(out.Calls[seq].PromptIDs))
	}
	return out, sc, nil
}

// Group returns group id with every session (in creation order) and its calls.
func (s *Store) Group(id string) (trace.Group, error) {
	var out trace.Group
	err := s.view(func(tx *bolt.Tx) error {
		var err error
		out, err = readGroup(tx, id, true, nil)
		return err
	})
	return out, err
}

// Groups lists every group's state, by id.
func (s *Store) Groups() ([]trace.GroupState, error) {
	var out []trace.GroupState
	err := s.view(func(tx *bolt.Tx) error {
		return tx.Bucket(bGroups).ForEachBucket(func(gid []byte) error {
			st, err := readGroupState(tx, string(gid))
			out = append(out, st)
			return err
		})
	})
	return out, err
}

// GroupState is group id's bookkeeping, without calls. ErrUnknownGroup.
func (s *Store) GroupState(id string) (trace.GroupState, error) {
	var st trace.GroupState
	err := s.view(func(tx *bolt.Tx) error {
		var err error
		st, err = readGroupState(tx, id)
		return err
	})
	return st, err
}

// SessionGroupState is the bookkeeping of session id's group, read without the
// session's calls. ErrUnknownSession.
func (s *Store) SessionGroupState(id string) (trace.GroupState, error) {
	var st trace.GroupState
	err := s.view(func(tx *bolt.Tx) error {
		_, info, err := sessionBucket(tx, id)
		if err != nil {
			return err
		}
		st, err = readGroupState(tx, info.Group)
		return err
	})
	return st, err
}

func readGroupState(tx *bolt.Tx, gid string) (trace.GroupState, error) {
	b, gi, err := groupBucket(tx, gid)
	if err != nil {
		return trace.GroupState{}, err
	}
	st := trace.GroupState{ID: gid, TaskID: gi.Task, Size: gi.Size, Step: gi.Step, Dropped: gi.Dropped,
		DropReason: gi.DropReason, Created: gi.Created, TimedOut: gi.TimedOut}
	err = b.Bucket(kMembers).ForEach(func(_, sid []byte) error {
		_, info, err := sessionBucket(tx, string(sid))
		if err != nil {
			return err
		}
		if gi.Created.IsZero() && (st.Created.IsZero() || info.Created.Before(st.Created)) {
			st.Created = info.Created
		}
		st.Sessions++
		if info.Status != trace.StatusRunning {
			st.Finished++
		}
		return nil
	})
	return st, err
}

// Totals is what the store holds, kept in the meta bucket under "usage" and updated in
// the transaction that creates each session or stores each call, so it is exact after
// any crash. A format 1 store gets it by one scan when it is upgraded.
type Totals struct {
	Sessions  int   `json:"sessions"`
	Calls     int   `json:"calls"`      // calls recorded and held
	PromptIDs int64 `json:"prompt_ids"` // Σ prompt lengths of those calls, in tokens
	// CallBytes is the encoded call records (prompts by reference), before bbolt's pages;
	// JSONBytes the part of it that is the recorded request, upstream request and answer.
	CallBytes int64 `json:"call_bytes"`
	JSONBytes int64 `json:"json_bytes"`
	// What ForgetStep removed once archived: the figures above no longer count it.
	ArchivedSteps    int `json:"archived_steps,omitempty"`
	ArchivedSessions int `json:"archived_sessions,omitempty"`
	ArchivedCalls    int `json:"archived_calls,omitempty"`
}

// Usage is what the store holds and what it costs on disk.
type Usage struct {
	Totals
	FileBytes int64 `json:"file_bytes"` // the database file's size
	DiskBytes int64 `json:"disk_bytes"` // blocks the file occupies (bbolt grows it ahead, sparse or not)
}

// updateTotals applies fn to tx's totals.
func updateTotals(tx *bolt.Tx, fn func(*Totals)) error {
	meta := tx.Bucket(bMeta)
	var t Totals
	if err := getJSON(meta, kUsage, &t, "usage totals"); err != nil {
		return err
	}
	fn(&t)
	return putJSON(meta, kUsage, t)
}

// countTotals scans every session and stored call (the upgrade from format 1).
func countTotals(tx *bolt.Tx) (Totals, error) {
	var t Totals
	all := tx.Bucket(bSessions)
	err := all.ForEachBucket(func(id []byte) error {
		t.Sessions++
		return all.Bucket(id).Bucket(kCalls).ForEach(func(_, v []byte) error {
			n, blob, err := callSizes(v)
			if err != nil {
				return fmt.Errorf("%w: session %q: %v", ErrCorrupt, id, err)
			}
			t.Calls++
			t.PromptIDs += int64(n)
			t.CallBytes += int64(len(v))
			t.JSONBytes += int64(blob)
			return nil
		})
	})
	return t, err
}

// Usage measures the store: its totals and its file.
func (s *Store) Usage() (Usage, error) {
	var u Usage
	err := s.view(func(tx *bolt.Tx) error {
		return getJSON(tx.Bucket(bMeta), kUsage, &u.Totals, "usage totals")
	})
	if err != nil {
		return u, err
	}
	fi, err := os.Stat(s.path)
	if err != nil {
		return u, fmt.Errorf("store usage: %w", err)
	}
	u.FileBytes, u.DiskBytes = fi.Size(), diskBytes(fi)
	return u, nil
}

// SetPolicyVersion records the policy version the trainer resumed rollouts under, so a
// restarted floe goes on with it (calls are stamped with it, staleness is measured
// against it).
func (s *Store) SetPolicyVersion(v int64) error {
	return s.write(func(tx *bolt.Tx) error {
		return tx.Bucket(bMeta).Put(kPolicy, binary.BigEndian.AppendUint64(nil, uint64(v)))
	})
}

// PolicyVersion is the last version SetPolicyVersion recorded; 0 when none.
func (s *Store) PolicyVersion() (int64, error) {
	var v int64
	err := s.view(func(tx *bolt.Tx) error {
		raw := tx.Bucket(bMeta).Get(kPolicy)
		switch {
		case raw == nil:
		case len(raw) == 8:
			v = int64(binary.BigEndian.Uint64(raw))
		default:
			return fmt.Errorf("%w: policy version of %d bytes", ErrCorrupt, len(raw))
		}
		return nil
	})
	return v, err
}

type stepValue struct {
	Groups           []string `json:"groups"`
	MinPolicyVersion int64    `json:"min_policy_version,omitempty"`
	TokenBudget      int      `json:"token_budget,omitempty"` // format 3
	// Decisions: format 4; nil in an older floe's record until floe serve decides it
	// (DecideStep), and in an archived step's tombstone.
	Decisions *trace.StepDecisions `json:"decisions,omitempty"`
	Committed bool                 `json:"committed"`
	Saved     time.Time            `json:"saved"`
	CommitAt  time.Time            `json:"committed_at,omitzero"`
	// Archived: the step's data went to the archive and left the store (ForgetStep);
	// the record stays, without its groups, to keep the step committed.
	Archived bool `json:"archived,omitempty"`
	// FilesWritten: the step's archive files are complete (MarkStepFilesWritten); its
	// groups may be leaving the store, one write each, and a restart only finishes that.
	FilesWritten bool `json:"files_written,omitempty"`
}

// SaveStepRecord is SaveStep with the rest of the record (its staleness cut-off, token
// budget and decisions), which Steps returns so that a restart forms the step again the
// same way. The same record again is a no-op; another record under its number, or a group
// already in another step, fails with ErrStepConflict; a committed step with
// ErrCommitted; an unknown group with ErrUnknownGroup.
func (s *Store) SaveStepRecord(rec trace.StepRecord) error {
	n, groupIDs := rec.N, rec.Groups
	if n < 0 {
		return fmt.Errorf("save step %d: negative step", n)
	}
	if len(groupIDs) == 0 {
		return fmt.Errorf("save step %d: no groups", n)
	}
	return s.write(func(tx *bolt.Tx) error {
		steps := tx.Bucket(bSteps)
		if raw := steps.Get(seqKey(uint64(n))); raw != nil {
			var sv stepValue
			if err := json.Unmarshal(raw, &sv); err != nil {
				return fmt.Errorf("%w: step %d: %v", ErrCorrupt, n, err)
			}
			if sv.Committed {
				return fmt.Errorf("save step %d: %w", n, ErrCommitted)
			}
			if !sv.record(n).Same(rec) {
				return fmt.Errorf("save step %d: %w: saved with groups %q (policy versions from %d, token budget %d) and its decisions, not %q (from %d, budget %d) or other decisions",
					n, ErrStepConflict, sv.Groups, sv.MinPolicyVersion, sv.TokenBudget, groupIDs, rec.MinPolicyVersion, rec.TokenBudget)
			}
			return nil
		}
		for _, gid := range groupIDs {
			b, gi, err := groupBucket(tx, gid)
			if err != nil {
				return fmt.Errorf("save step %d: %w", n, err)
			}
			if gi.Step >= 0 {
				return fmt.Errorf("save step %d: %w: group %q is in step %d", n, ErrStepConflict, gid, gi.Step)
			}
			if gi.Dropped {
				return fmt.Errorf("save step %d: group %q was dropped (%s)", n, gid, gi.DropReason)
			}
			gi.Step = n
			if err := putJSON(b, kInfo, gi); err != nil {
				return err
			}
		}
		return putJSON(steps, seqKey(uint64(n)), stepValue{Groups: groupIDs, MinPolicyVersion: rec.MinPolicyVersion,
			TokenBudget: rec.TokenBudget, Decisions: rec.Decisions, Saved: time.Now().UTC()})
	})
}

// CommitStep records that the trainer consumed step n. Exactly once: a second commit,
// before or after a restart, fails with an error wrapping ErrCommitted; a step never
// saved fails with ErrUnknownStep.
func (s *Store) CommitStep(n int64) error {
	return s.write(func(tx *bolt.Tx) error {
		steps := tx.Bucket(bSteps)
		raw := steps.Get(seqKey(uint64(n)))
		if n < 0 || raw == nil {
			return fmt.Errorf("commit step %d: %w", n, ErrUnknownStep)
		}
		var sv stepValue
		if err := json.Unmarshal(raw, &sv); err != nil {
			return fmt.Errorf("%w: step %d: %v", ErrCorrupt, n, err)
		}
		if sv.Committed {
			return fmt.Errorf("commit step %d: %w", n, ErrCommitted)
		}
		sv.Committed, sv.CommitAt = true, time.Now().UTC()
		return putJSON(steps, seqKey(uint64(n)), sv)
	})
}

// Steps returns the saved steps not yet committed (by step number), which a restarted
// sidecar forms again from their groups and serves; and the highest committed step
// number (-1 when none), below which and at which nothing is served again. New steps are
// numbered after both.
func (s *Store) Steps() (uncommitted []trace.StepRecord, lastCommitted int64, err error) {
	lastCommitted = -1
	err = s.view(func(tx *bolt.Tx) error {
		return tx.Bucket(bSteps).ForEach(func(k, v []byte) error {
			var sv stepValue
			if len(k) != 8 {
				return fmt.Errorf("%w: step key %x", ErrCorrupt, k)
			}
			if err := json.Unmarshal(v, &sv); err != nil {
				return fmt.Errorf("%w: step %x: %v", ErrCorrupt, k, err)
			}
			n := int64(binary.BigEndian.Uint64(k))
			if sv.Committed {
				lastCommitted = max(lastCommitted, n)
				return nil
			}
			rec := sv.record(n)
			if rec.TokenBudget == 0 {
				rec.TokenBudget = s.oldBudgets[n] // read-only beside a budgets file not moved in yet
			}
			uncommitted = append(uncommitted, rec)
			return nil
		})
	})
	sort.Slice(uncommitted, func(i, j int) bool { return uncommitted[i].N < uncommitted[j].N })
	return uncommitted, lastCommitted, err
}

// record is step n's record as trace has it.
func (sv stepValue) record(n int64) trace.StepRecord {
	return trace.StepRecord{N: n, Groups: sv.Groups, MinPolicyVersion: sv.MinPolicyVersion, TokenBudget: sv.TokenBudget,
		Decisions: sv.Decisions, Committed: sv.Committed, Saved: sv.Saved}
}

// UndecidedSteps lists, by number, the step records an older floe wrote without
// decisions whose groups are still in the store: uncommitted, or committed and not yet
// archived. floe serve decides each once at start (DecideStep), before it forms or
// archives any step. A step whose archive files are written needs none: it is only
// forgotten.
func (s *Store) UndecidedSteps() ([]trace.StepRecord, error) {
	var out []trace.StepRecord
	err := s.view(func(tx *bolt.Tx) error {
		return tx.Bucket(bSteps).ForEach(func(k, v []byte) error {
			if len(k) != 8 {
				return fmt.Errorf("%w: step key %x", ErrCorrupt, k)
			}
			var sv stepValue
			if err := json.Unmarshal(v, &sv); err != nil {
				return fmt.Errorf("%w: step %x: %v", ErrCorrupt, k, err)
			}
			if sv.Decisions == nil && !sv.Archived && !sv.FilesWritten {
				n := int64(binary.BigEndian.Uint64(k))
				rec := sv.record(n)
				if rec.TokenBudget == 0 {
					rec.TokenBudget = s.oldBudgets[n]
				}
				out = append(out, rec)
			}
			return nil
		})
	})
	return out, err
}

// DecideStep records rec.Decisions, and rec.TokenBudget where the record has no budget,
// in the record of step rec.N, which an older floe wrote without them (UndecidedSteps),
// committed or not. Deciding it again the same way is a no-op; other decisions, or a
// record that differs otherwise, fail with ErrStepConflict; a step never saved with
// ErrUnknownStep.
func (s *Store) DecideStep(rec trace.StepRecord) error {
	if rec.Decisions == nil {
		return fmt.Errorf("decide step %d: no decisions given", rec.N)
	}
	return s.write(func(tx *bolt.Tx) error {
		sv, err := readStep(tx, rec.N)
		if err != nil {
			return fmt.Errorf("decide step %d: %w", rec.N, err)
		}
		if sv.Archived || sv.FilesWritten {
			return fmt.Errorf("decide step %d: archived already", rec.N)
		}
		decided := sv
		decided.Decisions = rec.Decisions
		if decided.TokenBudget == 0 {
			decided.TokenBudget = rec.TokenBudget
		}
		if !decided.record(rec.N).Same(rec) {
			return fmt.Errorf("decide step %d: %w: saved with groups %q (policy versions from %d, token budget %d), decided with %q (from %d, budget %d)",
				rec.N, ErrStepConflict, sv.Groups, sv.MinPolicyVersion, sv.TokenBudget, rec.Groups, rec.MinPolicyVersion, rec.TokenBudget)
		}
		if sv.Decisions != nil {
			if reflect.DeepEqual(sv.Decisions, rec.Decisions) {
				return nil
			}
			return fmt.Errorf("decide step %d: %w: decided already, otherwise", rec.N, ErrStepConflict)
		}
		return putJSON(tx.Bucket(bSteps), seqKey(uint64(rec.N)), decided)
	})
}
