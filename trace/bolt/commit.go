package bolt

import (
	"errors"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"
)

type writeReq struct {
	fn   func(*bolt.Tx) error
	excl func() error // instead of fn: runs alone, between transactions (compaction)
	done chan error
}

// maxGroup bounds the writes one group-commit transaction takes.
const maxGroup = 256

// write runs fn in a read-write transaction and returns once it is committed and fsynced
// (or failed). fn may run more than once (after another write of its group failed), each
// time in a fresh transaction, so it must read what it depends on from tx.
func (s *Store) write(fn func(*bolt.Tx) error) error {
	s.wmu.RLock()
	if s.closed {
		s.wmu.RUnlock()
		return ErrClosed
	}
	if s.opt.ReadOnly {
		s.wmu.RUnlock()
		return ErrReadOnly
	}
	switch s.opt.Commit {
	case CommitUpdate:
		defer s.wmu.RUnlock()
		return s.db.Update(fn)
	case CommitBatch:
		defer s.wmu.RUnlock()
		return s.db.Batch(fn)
	}
	r := &writeReq{fn: fn, done: make(chan error, 1)}
	s.writes <- r
	s.wmu.RUnlock()
	return <-r.done
}

// failed carries the write of a group that failed, so that the others can be retried.
type failed struct {
	i   int
	err error
}

func (f *failed) Error() string { return f.err.Error() }

// committer is the group-commit loop: it takes the writes queued while the previous
// transaction was committing and commits them in one transaction. When one fails, that
// one gets its error and the others are retried one transaction each.
func (s *Store) committer() {
	defer close(s.done)
	group := make([]*writeReq, 0, maxGroup)
	var held *writeReq // an exclusive request met while draining: it runs after the group
	for r := range s.writes {
		if r.excl != nil {
			r.done <- r.excl()
			continue
		}
		group = append(group[:0], r)
	drain:
		for len(group) < maxGroup {
			select {
			case r, ok := <-s.writes:
				if !ok {
					break drain
				}
				if r.excl != nil {
					held = r
					break drain
				}
				group = append(group, r)
			default:
				break drain
			}
		}
		s.commitGroup(group)
		if held != nil {
			held.done <- held.excl()
			held = nil
		}
	}
}

// commitGroup commits group in one transaction; when one write fails, that one gets its
// error and the others are retried one transaction each.
func (s *Store) commitGroup(group []*writeReq) {
	err := s.db.Update(func(tx *bolt.Tx) error {
		for i, r := range group {
			if err := r.fn(tx); err != nil {
				return &failed{i, err}
			}
		}
		return nil
	})
	var f *failed
	if !errors.As(err, &f) {
		for _, r := range group {
			r.done <- err
		}
		return
	}
	for i, r := range group {
		if i == f.i {
			r.done <- f.err
			continue
		}
		r.done <- s.db.Update(r.fn)
	}
}

// exclusive runs fn with no write in flight and none starting until it returns: in the
// committer between two transactions (group commit), or holding the write lock (the
// other modes). Reads go on meanwhile; fn takes dbmu to swap the database under them.
func (s *Store) exclusive(fn func() error) error {
	s.wmu.RLock()
	if s.closed {
		s.wmu.RUnlock()
		return ErrClosed
	}
	if s.opt.ReadOnly {
		s.wmu.RUnlock()
		return ErrReadOnly
	}
	if s.writes == nil {
		s.wmu.RUnlock()
		s.wmu.Lock()
		defer s.wmu.Unlock()
		if s.closed {
			return ErrClosed
		}
		return fn()
	}
	r := &writeReq{excl: fn, done: make(chan error, 1)}
	s.writes <- r
	s.wmu.RUnlock()
	return <-r.done
}

// view runs fn in a read transaction; on a closed store it fails with ErrClosed, as
// writes do, rather than with bbolt's own error.
func (s *Store) view(fn func(*bolt.Tx) error) error {
	s.dbmu.RLock()
	defer s.dbmu.RUnlock()
	err := s.db.View(fn)
	if errors.Is(err, berrors.ErrDatabaseNotOpen) {
		return ErrClosed
	}
	return err
}
