package bolt

import (
	"context"
	"encoding/binary"
	"fmt"
	"sync"

	bolt "go.etcd.io/bbolt"

	"github.com/floe-rl/floe/trace"
)

// maxTips bounds the full sequences a session keeps in memory as prompt references.
const maxTips = 16

// tip is a full sequence (prompt ++ response) of a stored call that no later call's full
// sequence extends: the candidates a new prompt is stored against.
type tip struct {
	seq int
	ids []int32
}

// sessCache is what Record needs of a running session, loaded from disk on first use
// after a restart. mu serialises the session's writes.
type sessCache struct {
	mu       sync.Mutex
	loaded   bool
	finished bool
	stored   int       // next storage seq
	next     int       // next call index
	tips     []tip     // most recent last
	blobs    [3][]byte // JSON fields of the last stored call
	orphaned bool      // removed from the map; a holder must re-fetch
}

// addTip makes the full sequence of seq a reference candidate, dropping candidates it
// extends. promptLen is the length of its prompt: a candidate that is a prefix of the
// prompt is a prefix of full.
func (sc *sessCache) addTip(seq int, full []int32, promptLen int) {
	kept := sc.tips[:0]
	for _, t := range sc.tips {
		if len(t.ids) > promptLen || lcp(t.ids, full[:promptLen]) < len(t.ids) {
			kept = append(kept, t)
		}
	}
	sc.tips = append(kept, tip{seq: seq, ids: full})
	if len(sc.tips) > maxTips {
		sc.tips = append(sc.tips[:0], sc.tips[len(sc.tips)-maxTips:]...)
	}
}

// ref picks the candidate sharing the longest prefix with prompt.
func (sc *sessCache) ref(prompt []int32) promptRef {
	best := promptRef{ref: -1}
	for i := len(sc.tips) - 1; i >= 0; i-- {
		if n := lcp(sc.tips[i].ids, prompt); n > best.shared {
			best = promptRef{ref: sc.tips[i].seq, shared: n}
		}
	}
	return best
}

func lcp(a, b []int32) int {
	n := min(len(a), len(b))
	for i := 0; i < n; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

func (s *Store) sessionCache(id string) *sessCache {
	s.mu.Lock()
	defer s.mu.Unlock()
	sc := s.cache[id]
	if sc == nil {
		sc = &sessCache{}
		s.cache[id] = sc
	}
	return sc
}

func (s *Store) dropCache(id string, sc *sessCache) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cache[id] == sc {
		delete(s.cache, id)
	}
	sc.orphaned = true
}

// Record assigns c its index within its session and stores it (trace.CallRecorder): a call
// with Choice > 0 takes the index of the call before it, as the choices of one n>1
// request share an index. It returns once the call is on disk. The session must exist
// and be running. The call's slices are not retained.
func (s *Store) Record(ctx context.Context, c *trace.Call) error {
	if c.SessionID == "" {
		return fmt.Errorf("record: call has no session")
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("record: %w", err)
	}
	var sc *sessCache
	for {
		sc = s.sessionCache(c.SessionID)
		sc.mu.Lock()
		if !sc.orphaned {
			break
		}
		sc.mu.Unlock()
	}
	defer sc.mu.Unlock()
	if !sc.loaded {
		var loaded *sessCache
		err := s.view(func(tx *bolt.Tx) error {
			var err error
			_, loaded, err = readSession(tx, c.SessionID, true)
			return err
		})
		if err != nil {
			s.dropCache(c.SessionID, sc)
			return fmt.Errorf("record: %w", err)
		}
		sc.loaded, sc.finished, sc.stored, sc.next, sc.tips, sc.blobs =
			true, loaded.finished, loaded.stored, loaded.next, loaded.tips, loaded.blobs
	}
	if sc.finished {
		return fmt.Errorf("record: session %q: %w", c.SessionID, ErrSessionFinished)
	}
	index, next := sc.next, sc.next+1
	if c.Choice > 0 {
		if sc.next == 0 {
			return fmt.Errorf("record: session %q: choice %d with no call before it", c.SessionID, c.Choice)
		}
		index, next = sc.next-1, sc.next
	}
	seq := sc.stored
	saved := c.Index
	c.Index = index
	pr := sc.ref(c.PromptIDs)
	val, jsonBytes := encodeCall(c, pr, &sc.blobs)
	err := s.write(func(tx *bolt.Tx) error {
		b, info, err := sessionBucket(tx, c.SessionID)
		if err != nil {
			return err
		}
		if info.Status != trace.StatusRunning {
			return fmt.Errorf("session %q: %w", c.SessionID, ErrSessionFinished)
		}
		if info.Stored != seq {
			return fmt.Errorf("session %q: %d calls on disk, %d expected", c.SessionID, info.Stored, seq)
		}
		if err := b.Bucket(kCalls).Put(binary.BigEndian.AppendUint64(nil, uint64(seq)), val); err != nil {
			return err
		}
		if err := updateTotals(tx, func(t *Totals) {
			t.Calls++
			t.PromptIDs += int64(len(c.PromptIDs))
			t.CallBytes += int64(len(val))
			t.JSONBytes += int64(jsonBytes)
		}); err != nil {
			return err
		}
		info.Stored, info.Next = seq+1, next
		return putJSON(b, kInfo, info)
	})
	if err != nil {
		c.Index = saved
		s.dropCache(c.SessionID, sc) // reload from disk next time
		return fmt.Errorf("record: %w", err)
	}
	sc.stored, sc.next = seq+1, next
	full := make([]int32, 0, len(c.PromptIDs)+len(c.ResponseIDs))
	full = append(append(full, c.PromptIDs...), c.ResponseIDs...)
	sc.addTip(seq, full, len(c.PromptIDs))
	sc.blobs = [3][]byte{clone(c.Request), clone(c.UpstreamRequest), clone(c.Response)}
	return nil
}

func clone(b []byte) []byte {
	if b == nil {
		return nil
	}
	return append([]byte{}, b...)
}
