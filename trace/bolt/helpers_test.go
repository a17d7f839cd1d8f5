package bolt

// Methods only the tests use: they are compiled into the test binary alone, so the
// product's Store carries none of them (issue 22, item 8).

import (
	"encoding/json"
	"errors"
	"fmt"

	bolt "go.etcd.io/bbolt"

	"github.com/floe-rl/floe/trace"
)

// AddKey makes key resolve to session.
func (s *Store) AddKey(key, session string) error {
	if key == "" {
		return errors.New("add key: empty key")
	}
	return s.write(func(tx *bolt.Tx) error {
		if tx.Bucket(bSessions).Bucket([]byte(session)) == nil {
			return fmt.Errorf("add key: %w: %q", ErrUnknownSession, session)
		}
		keys := tx.Bucket(bKeys)
		if old := keys.Get([]byte(key)); old != nil && string(old) != session {
			return fmt.Errorf("add key: key is already the key of session %q", old)
		}
		return keys.Put([]byte(key), []byte(session))
	})
}

// FinishedGroups lists the groups ready to be formed into a step (trace.GroupState.Complete).
func (s *Store) FinishedGroups() ([]string, error) {
	gs, err := s.Groups()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, g := range gs {
		if g.Complete() {
			out = append(out, g.ID)
		}
	}
	return out, nil
}

// UnfinishedSessions lists the running sessions (without calls), by id.
func (s *Store) UnfinishedSessions() ([]trace.Session, error) {
	var out []trace.Session
	err := s.view(func(tx *bolt.Tx) error {
		return tx.Bucket(bSessions).ForEachBucket(func(id []byte) error {
			sess, _, err := readSession(tx, string(id), false)
			if err == nil && sess.Status == trace.StatusRunning {
				out = append(out, sess)
			}
			return err
		})
	})
	return out, err
}

// SaveStep records that step n is formed from groups (in that order). It is durable when
// SaveStep returns; saving the same step again with the same groups is a no-op, with other
// groups an error, and a committed step fails with ErrCommitted. A group can be in one
// step only.
func (s *Store) SaveStep(n int64, groupIDs []string) error {
	return s.SaveStepRecord(trace.StepRecord{N: n, Groups: groupIDs})
}

// StepCommitted reports whether step n was committed.
func (s *Store) StepCommitted(n int64) (bool, error) {
	var committed bool
	err := s.view(func(tx *bolt.Tx) error {
		raw := tx.Bucket(bSteps).Get(seqKey(uint64(n)))
		if n < 0 || raw == nil {
			return fmt.Errorf("step %d: %w", n, ErrUnknownStep)
		}
		var sv stepValue
		if err := json.Unmarshal(raw, &sv); err != nil {
			return fmt.Errorf("%w: step %d: %v", ErrCorrupt, n, err)
		}
		committed = sv.Committed
		return nil
	})
	return committed, err
}
