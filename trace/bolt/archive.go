package bolt

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"slices"

	bolt "go.etcd.io/bbolt"

	"github.com/floe-rl/floe/trace"
)

// Retention: once a step is committed and written to the Parquet archive (sidecar), the
// step is marked files-written (MarkStepFilesWritten), then its groups, with their
// sessions, calls and keys, leave the store one transaction each (ForgetStep), so that
// the proxy's writes never wait behind a whole step; last, the step's record shrinks to
// a tombstone that keeps it committed: the numbering and the exactly-once commit
// survive, and the archived sessions' keys no longer resolve, so the proxy refuses them
// as unknown. A crash part way leaves a step marked files-written with some groups
// gone: it is not written again (its files are complete), only forgotten to the end.

// ArchivableSteps lists the committed steps whose data is still in the store (not yet
// forgotten), by number.
func (s *Store) ArchivableSteps() ([]int64, error) {
	var out []int64
	err := s.view(func(tx *bolt.Tx) error {
		return tx.Bucket(bSteps).ForEach(func(k, v []byte) error {
			var sv stepValue
			if len(k) != 8 {
				return fmt.Errorf("%w: step key %x", ErrCorrupt, k)
			}
			if err := json.Unmarshal(v, &sv); err != nil {
				return fmt.Errorf("%w: step %x: %v", ErrCorrupt, k, err)
			}
			if sv.Committed && !sv.Archived {
				out = append(out, int64(binary.BigEndian.Uint64(k)))
			}
			return nil
		})
	})
	return out, err
}

// CommittedStepHead reads committed step n's record, without its groups' data: the
// archiver then reads the groups one at a time (GroupSessions, EachCall), so a step
// of any size is never in memory whole (trace.StepArchive).
func (s *Store) CommittedStepHead(n int64) (trace.StepContents, error) {
	var out trace.StepContents
	err := s.view(func(tx *bolt.Tx) error {
		sv, err := readStep(tx, n)
		if err != nil {
			return err
		}
		if !sv.Committed || sv.Archived {
			return fmt.Errorf("step %d: committed %v, archived %v: nothing to archive", n, sv.Committed, sv.Archived)
		}
		out = trace.StepContents{Record: sv.record(n), CommittedAt: sv.CommitAt, FilesWritten: sv.FilesWritten}
		return nil
	})
	return out, err
}

// GroupSessions reads group gid with its sessions (in creation order) without their
// calls, and their times: the archiver then reads each session's calls one at a time
// (EachCall), so a group of any size is never in memory whole.
func (s *Store) GroupSessions(gid string) (trace.Group, map[string]trace.SessionTimes, error) {
	var g trace.Group
	times := map[string]trace.SessionTimes{}
	err := s.view(func(tx *bolt.Tx) error {
		var err error
		g, err = readGroup(tx, gid, false, times)
		return err
	})
	if err != nil {
		return trace.Group{}, nil, err
	}
	return g, times, nil
}

// EachCall calls fn with each call of session sid in order, in one read transaction,
// decoding one call at a time: a session of any length is never in memory whole (but
// for its token ids, which later prompts are stored against). fn must not keep c.
func (s *Store) EachCall(sid string, fn func(c *trace.Call) error) error {
	return s.view(func(tx *bolt.Tx) error {
		b, info, err := sessionBucket(tx, sid)
		if err != nil {
			return err
		}
		var blobs [3][]byte
		fulls := make([][]int32, 0, info.Stored)
		cur := b.Bucket(kCalls).Cursor()
		for k, v := cur.First(); k != nil; k, v = cur.Next() {
			seq := len(fulls)
			if len(k) != 8 || binary.BigEndian.Uint64(k) != uint64(seq) {
				return fmt.Errorf("%w: session %q: call key %x where seq %d was expected", ErrCorrupt, sid, k, seq)
			}
			c, full, err := decodeCall(v, sid, seq, fulls, &blobs)
			if err != nil {
				return fmt.Errorf("%w: %v", ErrCorrupt, err)
			}
			fulls = append(fulls, full)
			if err := fn(&c); err != nil {
				return err
			}
		}
		if len(fulls) != info.Stored {
			return fmt.Errorf("%w: session %q: %d calls stored, record says %d", ErrCorrupt, sid, len(fulls), info.Stored)
		}
		return nil
	})
}

// readGroup reads group gid with its sessions (in creation order), with their calls when
// calls is set, adding the sessions' times to times when it is not nil.
func readGroup(tx *bolt.Tx, gid string, calls bool, times map[string]trace.SessionTimes) (trace.Group, error) {
	b, gi, err := groupBucket(tx, gid)
	if err != nil {
		return trace.Group{}, err
	}
	g := trace.Group{ID: gid, TaskID: gi.Task}
	err = b.Bucket(kMembers).ForEach(func(_, sid []byte) error {
		sess, _, err := readSession(tx, string(sid), calls)
		if err != nil {
			return err
		}
		if times != nil {
			_, info, err := sessionBucket(tx, string(sid))
			if err != nil {
				return err
			}
			times[sess.ID] = trace.SessionTimes{Created: info.Created, Finished: info.Finished}
		}
		g.Sessions = append(g.Sessions, sess)
		return nil
	})
	if err != nil {
		return trace.Group{}, fmt.Errorf("group %s: %w", gid, err)
	}
	return g, nil
}

// DroppedGroup reads dropped group id with its sessions (without their calls) and their
// times, and the reason it was dropped. An error for a group not dropped.
func (s *Store) DroppedGroup(id string) (trace.Dropped, error) {
	d := trace.Dropped{Times: map[string]trace.SessionTimes{}}
	err := s.view(func(tx *bolt.Tx) error {
		_, gi, err := groupBucket(tx, id)
		if err != nil {
			return err
		}
		if !gi.Dropped || gi.Step >= 0 {
			return fmt.Errorf("group %q is not dropped", id)
		}
		d.Reason, d.Seq = gi.DropReason, gi.DropSeq
		d.Group, err = readGroup(tx, id, false, d.Times)
		return err
	})
	return d, err
}

// Tombstones: a group or session id forgotten once archived is kept as the kind and
// 16 bytes of its SHA-256 (tombKeyBytes, whatever the id's length), so that creating a
// session with that id, or in that group, is refused as a closed group is: a reused
// group id would train again, and its archive rows would mix two groups.
const (
	tombGroup   byte = 'g'
	tombSession byte = 's'
	// tombKeyBytes is a tombstone's key; its value is the fate (a byte and a uvarint,
	// 2–4 bytes for a step below 2M), and bbolt adds 16 bytes of leaf header: 35–37 bytes
	// a forgotten id.
	tombKeyBytes = 1 + 16
)

func tombKey(kind byte, id string) []byte {
	h := sha256.Sum256([]byte(id))
	return append([]byte{kind}, h[:tombKeyBytes-1]...)
}

// forgotten says whether id of kind was forgotten (a store opened read-only from before
// tombstones has none).
func forgotten(tx *bolt.Tx, kind byte, id string) bool {
	b := tx.Bucket(bForgotten)
	return b != nil && b.Get(tombKey(kind, id)) != nil
}

// A tombstone's value says where the id went: fateStep and the step's number, or
// fateDropped and the group's DropSeq (with the id, its archive partition). Tombstones
// written before the fate was kept hold the single byte 1: forgotten, fate unknown.
const (
	fateStep    byte = 's'
	fateDropped byte = 'd'
)

func stepFate(n int64) []byte       { return binary.AppendUvarint([]byte{fateStep}, uint64(n)) }
func droppedFate(seq uint64) []byte { return binary.AppendUvarint([]byte{fateDropped}, seq) }

func bury(tx *bolt.Tx, kind byte, id string, fate []byte) error {
	return tx.Bucket(bForgotten).Put(tombKey(kind, id), fate)
}

// ForgottenSession says whether session id was archived and forgotten, and where it
// went; ok is false for an id the store never forgot (unknown, or still live).
func (s *Store) ForgottenSession(id string) (f trace.Forgotten, ok bool, err error) {
	err = s.view(func(tx *bolt.Tx) error {
		b := tx.Bucket(bForgotten)
		if b == nil {
			return nil
		}
		v := b.Get(tombKey(tombSession, id))
		if v == nil {
			return nil
		}
		ok = true
		if len(v) < 2 {
			return nil
		}
		n, size := binary.Uvarint(v[1:])
		if size <= 0 {
			return fmt.Errorf("%w: session %q: a tombstone of %x", ErrCorrupt, id, v)
		}
		switch v[0] {
		case fateStep:
			f = trace.Forgotten{Known: true, Step: int64(n)}
		case fateDropped:
			f = trace.Forgotten{Known: true, Step: -1, Dropped: true, DropSeq: n}
		default:
			return fmt.Errorf("%w: session %q: a tombstone of %x", ErrCorrupt, id, v)
		}
		return nil
	})
	return f, ok, err
}

func readStep(tx *bolt.Tx, n int64) (stepValue, error) {
	var sv stepValue
	raw := tx.Bucket(bSteps).Get(seqKey(uint64(n)))
	if n < 0 || raw == nil {
		return sv, fmt.Errorf("step %d: %w", n, ErrUnknownStep)
	}
	if err := json.Unmarshal(raw, &sv); err != nil {
		return sv, fmt.Errorf("%w: step %d: %v", ErrCorrupt, n, err)
	}
	return sv, nil
}

// MarkStepFilesWritten records, in one small durable write, that committed step n's
// archive files are complete: from then on its groups may leave the store (ForgetStep),
// and a restart finishes forgetting it instead of writing its files again, which it
// could not do with some groups gone.
func (s *Store) MarkStepFilesWritten(n int64) error {
	return s.write(func(tx *bolt.Tx) error {
		sv, err := readStep(tx, n)
		if err != nil {
			return fmt.Errorf("mark step files written: %w", err)
		}
		if !sv.Committed {
			return fmt.Errorf("mark step %d files written: not committed", n)
		}
		if sv.Archived || sv.FilesWritten {
			return nil
		}
		sv.FilesWritten = true
		return putJSON(tx.Bucket(bSteps), seqKey(uint64(n)), sv)
	})
}

// ForgetStep marks committed step n files-written and removes its groups, their
// sessions with their calls and API keys, one durable transaction per group (a write of the proxy waits for one group,
// never a whole step), and last keeps the step as a committed tombstone (archived). Call
// it once the step is safely archived. Forgetting a step again, or after a crash part
// way, finishes what is left; a step not committed is refused. The usage totals lose
// what was removed and count it as archived.
func (s *Store) ForgetStep(n int64) error {
	var groups []string
	err := s.view(func(tx *bolt.Tx) error {
		sv, err := readStep(tx, n)
		if err != nil {
			return fmt.Errorf("forget: %w", err)
		}
		if !sv.Committed {
			return fmt.Errorf("forget step %d: not committed", n)
		}
		if !sv.Archived {
			groups = sv.Groups
		}
		return nil
	})
	if err != nil || groups == nil {
		return err
	}
	if err := s.MarkStepFilesWritten(n); err != nil {
		return err
	}
	for _, gid := range groups {
		if err := s.ForgetStepGroup(n, gid); err != nil {
			return err
		}
	}
	return s.write(func(tx *bolt.Tx) error {
		sv, err := readStep(tx, n)
		if err != nil {
			return fmt.Errorf("forget: %w", err)
		}
		if sv.Archived {
			return nil
		}
		for _, gid := range sv.Groups {
			if tx.Bucket(bGroups).Bucket([]byte(gid)) != nil {
				return fmt.Errorf("forget step %d: group %q is still in the store", n, gid)
			}
		}
		if err := updateTotals(tx, func(t *Totals) { t.ArchivedSteps++ }); err != nil {
			return err
		}
		// The decisions went to the archive (the sessions' advantages, the calls' marks).
		sv.Groups, sv.Decisions, sv.Archived, sv.FilesWritten = nil, nil, true, false
		return putJSON(tx.Bucket(bSteps), seqKey(uint64(n)), sv)
	})
}

// ForgetStepGroup removes group gid of committed step n in one durable write, once the
// step is marked files-written (the archiver calls it group by group, then ForgetStep
// for the tombstone); a group already forgotten (a crash after its write) is a no-op.
func (s *Store) ForgetStepGroup(n int64, gid string) error {
	var gone []string
	err := s.write(func(tx *bolt.Tx) error {
		gone = gone[:0] // fn may run again
		sv, err := readStep(tx, n)
		if err != nil {
			return fmt.Errorf("forget: %w", err)
		}
		if !sv.FilesWritten || !slices.Contains(sv.Groups, gid) {
			return fmt.Errorf("forget group %q of step %d: the step is not marked files-written, or has no such group", gid, n)
		}
		if tx.Bucket(bGroups).Bucket([]byte(gid)) == nil {
			if forgotten(tx, tombGroup, gid) {
				return nil
			}
			return fmt.Errorf("forget step %d: %w: group %q is missing", n, ErrCorrupt, gid)
		}
		removed, err := removeGroups(tx, []string{gid}, stepFate(n), &gone)
		if err != nil {
			return fmt.Errorf("forget step %d: %w", n, err)
		}
		return updateTotals(tx, func(t *Totals) { t.archived(removed) })
	})
	if err != nil {
		return err
	}
	s.dropCaches(gone)
	return nil
}

// ForgetDroppedGroup removes dropped group id, its sessions with their calls and keys, in
// one durable write, once the group is archived. An unknown group (forgotten already) is
// a no-op; a group not dropped is refused.
func (s *Store) ForgetDroppedGroup(id string) error {
	var gone []string
	err := s.write(func(tx *bolt.Tx) error {
		gone = gone[:0]
		b := tx.Bucket(bGroups).Bucket([]byte(id))
		if b == nil {
			return nil
		}
		_, gi, err := groupBucket(tx, id)
		if err != nil {
			return err
		}
		if !gi.Dropped || gi.Step >= 0 {
			return fmt.Errorf("forget group %q: not dropped", id)
		}
		removed, err := removeGroups(tx, []string{id}, droppedFate(gi.DropSeq), &gone)
		if err != nil {
			return fmt.Errorf("forget group %q: %w", id, err)
		}
		return updateTotals(tx, func(t *Totals) { t.archived(removed) })
	})
	if err != nil {
		return err
	}
	s.dropCaches(gone)
	return nil
}

// archived moves what was removed from the held figures to the archived ones.
func (t *Totals) archived(removed Totals) {
	t.Sessions -= removed.Sessions
	t.Calls -= removed.Calls
	t.PromptIDs -= removed.PromptIDs
	t.CallBytes -= removed.CallBytes
	t.JSONBytes -= removed.JSONBytes
	t.ArchivedSessions += removed.Sessions
	t.ArchivedCalls += removed.Calls
}

// removeGroups deletes groups gids, their sessions with their calls, and those
// sessions' keys, in tx, leaving tombstones that record fate; it appends the sessions to
// gone and returns what it removed.
func removeGroups(tx *bolt.Tx, gids []string, fate []byte, gone *[]string) (Totals, error) {
	groups, sessions := tx.Bucket(bGroups), tx.Bucket(bSessions)
	var removed Totals
	first := len(*gone)
	for _, gid := range gids {
		g := groups.Bucket([]byte(gid))
		if g == nil {
			return removed, fmt.Errorf("%w: group %q is missing", ErrCorrupt, gid)
		}
		if err := g.Bucket(kMembers).ForEach(func(_, sid []byte) error {
			*gone = append(*gone, string(sid))
			return nil
		}); err != nil {
			return removed, err
		}
		if err := groups.DeleteBucket([]byte(gid)); err != nil {
			return removed, err
		}
		if err := bury(tx, tombGroup, gid, fate); err != nil {
			return removed, err
		}
	}
	ids := map[string]bool{}
	for _, sid := range (*gone)[first:] {
		ids[sid] = true
		b := sessions.Bucket([]byte(sid))
		if b == nil {
			return removed, fmt.Errorf("%w: session %q is missing", ErrCorrupt, sid)
		}
		removed.Sessions++
		if err := b.Bucket(kCalls).ForEach(func(_, v []byte) error {
			np, blob, err := callSizes(v)
			if err != nil {
				return fmt.Errorf("%w: session %q: %v", ErrCorrupt, sid, err)
			}
			removed.Calls++
			removed.PromptIDs += int64(np)
			removed.CallBytes += int64(len(v))
			removed.JSONBytes += int64(blob)
			return nil
		}); err != nil {
			return removed, err
		}
		if err := sessions.DeleteBucket([]byte(sid)); err != nil {
			return removed, err
		}
		if err := bury(tx, tombSession, sid, fate); err != nil {
			return removed, err
		}
	}
	// The keys bucket holds the live sessions' keys only, so this scan is bounded by them.
	keys := tx.Bucket(bKeys)
	var dead [][]byte
	if err := keys.ForEach(func(k, v []byte) error {
		if ids[string(v)] {
			dead = append(dead, append([]byte{}, k...))
		}
		return nil
	}); err != nil {
		return removed, err
	}
	for _, k := range dead {
		if err := keys.Delete(k); err != nil {
			return removed, err
		}
	}
	return removed, nil
}

// dropCaches forgets the Record caches of sessions no longer in the store.
func (s *Store) dropCaches(gone []string) {
	for _, sid := range gone {
		s.mu.Lock()
		sc := s.cache[sid]
		s.mu.Unlock()
		if sc != nil {
			sc.mu.Lock()
			s.dropCache(sid, sc)
			sc.mu.Unlock()
		}
	}
}

// ForEachSession calls fn with every session in the store and its calls, by id, in one
// read transaction (floe export).
func (s *Store) ForEachSession(fn func(trace.Session) error) error {
	return s.view(func(tx *bolt.Tx) error {
		return tx.Bucket(bSessions).ForEachBucket(func(id []byte) error {
			sess, _, err := readSession(tx, string(id), true)
			if err != nil {
				return err
			}
			return fn(sess)
		})
	})
}
