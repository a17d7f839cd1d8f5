package bolt

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/floe-rl/floe/trace"
)

// A bbolt file never shrinks: pages freed by ForgetStep are reused by later writes, so
// the file stays at the size of the most the store ever held at once. Compaction
// rewrites the live pages into a fresh file when that size is far above what is held
// now (after a burst, or once archiving starts on a store that grew without it).

// compactSuffix names the file a compaction writes beside the store; one left by a
// crash is removed when the store is next opened read-write.
const compactSuffix = ".compact"

// compactTxBytes bounds one transaction of the copy.
const compactTxBytes = 64 << 20

// compactedBytes is about the size bbolt gives a file holding live bytes: below its 16 MiB
// allocation step the file is its memory map, a power of two from 32 KiB; above, the
// data and up to one step more.
func compactedBytes(live int64) int64 {
	const step = 16 << 20
	if live > step {
		return live + step
	}
	n := int64(32 << 10)
	for n < live {
		n *= 2
	}
	return n
}

// live is the bytes of pages in use: the high-water mark less the free pages.
func (s *Store) live() (int64, error) {
	s.dbmu.RLock()
	defer s.dbmu.RUnlock()
	var hwm int64
	if err := s.db.View(func(tx *bolt.Tx) error { hwm = tx.Size(); return nil }); err != nil {
		return 0, err
	}
	return hwm - int64(s.db.Stats().FreeAlloc), nil
}

// CompactIfWorth compacts the store when p says a file of its size is worth compacting
// into one holding its live pages (or liveFloor bytes, when more); the Compaction says
// the live bytes also when it does not compact (trace.Compactor).
func (s *Store) CompactIfWorth(p trace.CompactPolicy, liveFloor int64) (trace.Compaction, error) {
	fi, err := os.Stat(s.path)
	if err != nil {
		return trace.Compaction{}, fmt.Errorf("compact: %w", err)
	}
	live, err := s.live()
	if err != nil {
		return trace.Compaction{}, fmt.Errorf("compact: %w", err)
	}
	c := trace.Compaction{BeforeBytes: fi.Size(), LiveBytes: live, AfterBytes: fi.Size()}
	if !p.Worth(fi.Size(), compactedBytes(max(live, liveFloor))) {
		return c, nil
	}
	return s.Compact()
}

// Compact rewrites the store into a fresh file of its live pages (bbolt's Compact): the
// copy is written beside the store, fsynced, and renamed over it, and the directory
// fsynced; the store then reopens it. Writes wait meanwhile (they queue in order), reads
// go on against the old file until the swap. A crash leaves the old file or the new one,
// each complete.
func (s *Store) Compact() (trace.Compaction, error) {
	var c trace.Compaction
	err := s.exclusive(func() error {
		began := time.Now()
		fi, err := os.Stat(s.path)
		if err != nil {
			return err
		}
		c.BeforeBytes = fi.Size()
		if c.LiveBytes, err = s.live(); err != nil {
			return err
		}
		tmp := s.path + compactSuffix
		if err := os.Remove(tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		// The copy is fsynced once, whole, before the rename makes it the store.
		dst, err := bolt.Open(tmp, 0o600, &bolt.Options{NoSync: true, Timeout: s.opt.LockTimeout})
		if err != nil {
			return err
		}
		s.at("compact-opened")
		s.dbmu.RLock()
		err = bolt.Compact(dst, s.db, compactTxBytes)
		s.dbmu.RUnlock()
		if err == nil {
			err = dst.Sync()
		}
		if cerr := dst.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			_ = os.Remove(tmp) // best effort: the compaction error is the one to report, and Open removes a leftover
			return err
		}
		s.at("compact-copied")
		s.dbmu.Lock()
		defer s.dbmu.Unlock()
		if err := s.db.Close(); err != nil {
			return err
		}
		if err := os.Rename(tmp, s.path); err != nil {
			return s.reopen(err)
		}
		if err := syncDir(filepath.Dir(s.path)); err != nil {
			return s.reopen(err)
		}
		s.at("compact-renamed")
		if err := s.reopen(nil); err != nil {
			return err
		}
		if fi, err := os.Stat(s.path); err == nil {
			c.AfterBytes = fi.Size()
		}
		c.Compacted, c.Took = true, time.Since(began)
		return nil
	})
	if err != nil {
		return c, fmt.Errorf("compact %s: %w", s.path, err)
	}
	return c, nil
}

// reopen opens the store's file again after a compaction closed it, with dbmu held, and
// returns cause (the compaction's error, nil when it succeeded) or the open's error.
func (s *Store) reopen(cause error) error {
	db, err := bolt.Open(s.path, 0o600, &bolt.Options{Timeout: s.opt.LockTimeout})
	if err != nil {
		return errors.Join(cause, fmt.Errorf("reopening after compaction: %w", err))
	}
	s.db = db
	return cause
}

// at marks a point of a compaction for crash tests.
func (s *Store) at(stage string) {
	if s.stageHook != nil {
		s.stageHook(stage)
	}
}

// removeCompactLeftover removes the copy of a compaction a crash interrupted before its
// rename: the store file is the old one, whole.
func removeCompactLeftover(path string) error {
	err := os.Remove(path + compactSuffix)
	if err == nil || errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return fmt.Errorf("trace store: removing an interrupted compaction's %s: %w", path+compactSuffix, err)
}
