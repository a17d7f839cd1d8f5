// Package mem is floe's trace store in memory: for tests and for runs that need no
// durability (floe proxy). It plays every role of trace's store contract but the
// archive's with the semantics of the durable store, trace/bolt, minus the durability:
// groups are formed from sessions' GroupID, a group's first size is kept, steps are
// saved and committed exactly once, and every error case wraps trace's sentinel. Nothing
// it holds is archived: its retention is the bound on the calls it keeps
// (Retention.MaxStoredBytes).
package mem

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/floe-rl/floe/trace"
)

// Store is an in-memory trace store. The zero value is an empty store ready to use; its
// methods are safe for concurrent use. Besides the contract, AddSession registers a key
// for a session that was never created (floe proxy -session KEY=SESSION). A session's id
// is never a key of it.
type Store struct {
	// Retention's MaxStoredBytes, when positive, bounds the calls kept: once their
	// payloads (requests, token ids, log-probs, answers) pass it, the oldest calls
	// recorded, of any session, are dropped until they fit again, so that a long-running
	// floe proxy stays bounded (its -record file keeps every call). Indexes go on as if
	// none were dropped. Zero keeps every call. Set it before the store's first use; the
	// archiving fields mean nothing here.
	Retention trace.Retention

	mu       sync.Mutex
	keys     map[string]string
	sessions map[string]*session
	groups   map[string]*group
	steps    map[int64]*trace.StepRecord
	policy   int64
	// retained is every kept call's session and size in the order recorded, oldest first,
	// when MaxStoredBytes is set; stored is their sum.
	retained []retainedCall
	stored   int64
	dropped  Dropped
}

// retainedCall is one kept call, in the order they were recorded.
type retainedCall struct {
	s    *session
	size int64
}

// Dropped counts the calls the retention limit dropped, and their payload bytes.
type Dropped struct {
	Calls, Bytes int64
}

// callOverhead is what a kept call costs besides its payloads: the Call struct, its
// strings and the bookkeeping (an estimate; the bound is what it is for).
const callOverhead = 512

var (
	_ trace.CallRecorder   = (*Store)(nil)
	_ trace.SessionKeys    = (*Store)(nil)
	_ trace.SessionStore   = (*Store)(nil)
	_ trace.GroupStore     = (*Store)(nil)
	_ trace.StepStore      = (*Store)(nil)
	_ trace.PolicyVersions = (*Store)(nil)
)

// session is a session's record: its outcome, its calls and the next call index.
type session struct {
	s       trace.Session
	created time.Time
	next    int
}

// group is a group's bookkeeping; members are its sessions in creation order.
type group struct {
	task       string
	size       int
	step       int64 // -1 until a step takes the group
	dropped    bool
	dropReason string
	created    time.Time
	timedOut   bool
	members    []string
}

// init makes the zero Store usable; m.mu is held.
func (m *Store) init() {
	if m.sessions == nil {
		m.keys = map[string]string{}
		m.sessions = map[string]*session{}
		m.groups = map[string]*group{}
		m.steps = map[int64]*trace.StepRecord{}
	}
}

// AddSession registers key as the API key of session, creating the session (running, no
// task, no group) when it does not exist yet, so that calls made with key are recorded.
func (m *Store) AddSession(key, session string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	m.keys[key] = session
	if m.sessions[session] == nil {
		m.addSessionLocked(trace.Session{ID: session})
	}
}

func (m *Store) addSessionLocked(s trace.Session) {
	m.sessions[s.ID] = &session{
		s:       trace.Session{ID: s.ID, TaskID: s.TaskID, GroupID: s.GroupID, Status: trace.StatusRunning},
		created: time.Now().UTC(),
	}
}

// Resolve returns the session of key, without its calls (trace.SessionKeys).
func (m *Store) Resolve(key string) (trace.Session, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	id, ok := m.keys[key]
	if !ok || m.sessions[id] == nil {
		return trace.Session{}, fmt.Errorf("resolve: %w (unknown key)", trace.ErrUnknownSession)
	}
	out := m.sessions[id].s
	out.Calls = nil
	return out, nil
}

// Open resolves key, creating a session with id key (no task, no group) and key as its key
// when the key is unknown (trace.SessionKeys, for open sessions).
func (m *Store) Open(key string) (string, error) {
	if key == "" {
		return "", errors.New("open session: empty key")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	if s, ok := m.keys[key]; ok {
		return s, nil
	}
	m.keys[key] = key
	if m.sessions[key] == nil {
		m.addSessionLocked(trace.Session{ID: key})
	}
	return key, nil
}

// Record assigns c its index within its session and stores a copy of it
// (trace.CallRecorder): a call with Choice > 0 takes the index of the call before it, as
// the choices of one n>1 request share an index. The session must exist and be running.
func (m *Store) Record(ctx context.Context, c *trace.Call) error {
	if c.SessionID == "" {
		return errors.New("record: call has no session")
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("record: %w", err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	s := m.sessions[c.SessionID]
	switch {
	case s == nil:
		return fmt.Errorf("record: %w: %q", trace.ErrUnknownSession, c.SessionID)
	case s.s.Status != trace.StatusRunning:
		return fmt.Errorf("record: session %q: %w", c.SessionID, trace.ErrSessionFinished)
	}
	index, next := s.next, s.next+1
	if c.Choice > 0 {
		if s.next == 0 {
			return fmt.Errorf("record: session %q: choice %d with no call before it", c.SessionID, c.Choice)
		}
		index, next = s.next-1, s.next
	}
	c.Index, s.next = index, next
	s.s.Calls = append(s.s.Calls, cloneCall(*c))
	if m.Retention.MaxStoredBytes > 0 {
		m.retainLocked(s, callSize(c))
	}
	return nil
}

// callSize is a call's weight against MaxStoredBytes.
func callSize(c *trace.Call) int64 {
	return int64(callOverhead + len(c.Request) + len(c.UpstreamRequest) + len(c.Response) +
		4*(len(c.PromptIDs)+len(c.ResponseIDs)+len(c.Logprobs)) + len(c.UntrainableReason))
}

// retainLocked counts s's newest call, of size bytes, and drops the oldest calls recorded
// until the kept ones fit MaxStoredBytes (the newest is always kept); m.mu is held.
// Calls are recorded in order within a session and retained in order across them, so
// the oldest retained call is its session's first kept call.
func (m *Store) retainLocked(s *session, size int64) {
	m.retained = append(m.retained, retainedCall{s: s, size: size})
	m.stored += size
	for m.stored > m.Retention.MaxStoredBytes && len(m.retained) > 1 {
		old := m.retained[0]
		m.retained[0] = retainedCall{}
		m.retained = m.retained[1:]
		// Zeroed before it is sliced off, so its payloads are garbage now, not when the
		// slice next grows.
		old.s.s.Calls[0] = trace.Call{}
		old.s.s.Calls = old.s.s.Calls[1:]
		m.stored -= old.size
		m.dropped.Calls++
		m.dropped.Bytes += old.size
	}
}

// Retained returns the bytes of the calls kept (counted only under MaxStoredBytes) and
// what the limit dropped so far.
func (m *Store) Retained() (stored int64, dropped Dropped) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.stored, m.dropped
}

// cloneCall copies c's slices, so that the caller may reuse its buffers (the store does
// not retain them, as bolt does not).
func cloneCall(c trace.Call) trace.Call {
	c.PromptIDs = slices.Clone(c.PromptIDs)
	c.ResponseIDs = slices.Clone(c.ResponseIDs)
	c.Logprobs = slices.Clone(c.Logprobs)
	c.Request = slices.Clone(c.Request)
	c.UpstreamRequest = slices.Clone(c.UpstreamRequest)
	c.Response = slices.Clone(c.Response)
	return c
}

// CreateSession stores a new running session s (its ID, TaskID and GroupID) with key as
// its API key (none when empty); its id is not a key. The session joins group
// s.GroupID, created on first use; every session of a group must have the group's task,
// and a group in a step, dropped or timed out takes no new session. A positive
// groupSize sets the group's size at once, or fails with trace.ErrGroupSize, creating
// nothing, when the group already has another.
func (m *Store) CreateSession(s trace.Session, key string, groupSize int) error {
	if s.ID == "" {
		return errors.New("create session: empty id")
	}
	if groupSize < 0 || (groupSize > 0 && s.GroupID == "") {
		return fmt.Errorf("create session %q: group size %d for group %q", s.ID, groupSize, s.GroupID)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	if m.sessions[s.ID] != nil {
		return fmt.Errorf("create session: %w: %q", trace.ErrSessionExists, s.ID)
	}
	if old, ok := m.keys[key]; key != "" && ok && old != s.ID {
		return fmt.Errorf("create session %q: key is already the key of session %q", s.ID, old)
	}
	if s.GroupID != "" {
		g := m.groups[s.GroupID]
		if g == nil {
			g = &group{task: s.TaskID, step: -1, created: time.Now().UTC()}
			m.groups[s.GroupID] = g
		}
		if g.task != s.TaskID {
			return fmt.Errorf("create session %q: group %q is for task %q, not %q", s.ID, s.GroupID, g.task, s.TaskID)
		}
		if g.step >= 0 || g.dropped || g.timedOut {
			return fmt.Errorf("create session %q: group %q is closed (in step %d, dropped %v, timed out %v)",
				s.ID, s.GroupID, g.step, g.dropped, g.timedOut)
		}
		if groupSize > 0 && g.size != 0 && g.size != groupSize {
			return fmt.Errorf("create session %q: group %q: %w to %d, not %d", s.ID, s.GroupID, trace.ErrGroupSize, g.size, groupSize)
		}
		if groupSize > 0 {
			g.size = groupSize
		}
		g.members = append(g.members, s.ID)
	}
	m.addSessionLocked(s)
	if key != "" {
		m.keys[key] = s.ID
	}
	return nil
}

// SetGroupSize records how many sessions make group id complete. The first size given is
// kept: the same size again is a no-op, another one fails with trace.ErrGroupSize.
func (m *Store) SetGroupSize(id string, size int) error {
	if size < 0 {
		return fmt.Errorf("group %q: negative size %d", id, size)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	g := m.groups[id]
	switch {
	case g == nil:
		return fmt.Errorf("set group size: %w: %q", trace.ErrUnknownGroup, id)
	case g.size == size:
		return nil
	case g.size != 0:
		return fmt.Errorf("group %q: %w to %d, not %d", id, trace.ErrGroupSize, g.size, size)
	}
	g.size = size
	return nil
}

// FinishSession records the outcome of a running session, once. It fails with
// trace.ErrUnknownSession or trace.ErrSessionFinished, and for a status other than
// completed, failed or timeout or a reward that is not finite.
func (m *Store) FinishSession(id string, reward float64, status trace.Status) error {
	switch status {
	case trace.StatusCompleted, trace.StatusFailed, trace.StatusTimeout:
	default:
		return fmt.Errorf("finish session %q: status %q is not completed, failed or timeout", id, status)
	}
	if math.IsNaN(reward) || math.IsInf(reward, 0) {
		return fmt.Errorf("finish session %q: reward %v is not finite", id, reward)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	return m.finishLocked(id, reward, status)
}

func (m *Store) finishLocked(id string, reward float64, status trace.Status) error {
	s := m.sessions[id]
	switch {
	case s == nil:
		return fmt.Errorf("finish session: %w: %q", trace.ErrUnknownSession, id)
	case s.s.Status != trace.StatusRunning:
		return fmt.Errorf("finish session %q: %w (%s)", id, trace.ErrSessionFinished, s.s.Status)
	}
	s.s.Reward, s.s.Status = reward, status
	return nil
}

// Session returns session id with its calls. trace.ErrUnknownSession.
func (m *Store) Session(id string) (trace.Session, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	s := m.sessions[id]
	if s == nil {
		return trace.Session{}, fmt.Errorf("%w: %q", trace.ErrUnknownSession, id)
	}
	return m.sessionLocked(s), nil
}

func (m *Store) sessionLocked(s *session) trace.Session {
	out := s.s
	out.Calls = slices.Clone(s.s.Calls)
	return out
}

// Calls returns a copy of the calls recorded for session (none for an unknown one).
func (m *Store) Calls(session string) []trace.Call {
	m.mu.Lock()
	defer m.mu.Unlock()
	if s := m.sessions[session]; s != nil {
		return slices.Clone(s.s.Calls)
	}
	return nil
}

// Groups lists every group's state, by id.
func (m *Store) Groups() ([]trace.GroupState, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	out := make([]trace.GroupState, 0, len(m.groups))
	for id := range m.groups {
		out = append(out, m.groupStateLocked(id))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// GroupState is group id's bookkeeping, without calls. trace.ErrUnknownGroup.
func (m *Store) GroupState(id string) (trace.GroupState, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	if m.groups[id] == nil {
		return trace.GroupState{}, fmt.Errorf("%w: %q", trace.ErrUnknownGroup, id)
	}
	return m.groupStateLocked(id), nil
}

// SessionGroupState is the bookkeeping of session id's group. trace.ErrUnknownSession.
func (m *Store) SessionGroupState(id string) (trace.GroupState, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	ss := m.sessions[id]
	if ss == nil {
		return trace.GroupState{}, fmt.Errorf("%w: %q", trace.ErrUnknownSession, id)
	}
	return m.groupStateLocked(ss.s.GroupID), nil
}

func (m *Store) groupStateLocked(id string) trace.GroupState {
	g := m.groups[id]
	st := trace.GroupState{ID: id, TaskID: g.task, Size: g.size, Sessions: len(g.members), Step: g.step,
		Dropped: g.dropped, DropReason: g.dropReason, Created: g.created, TimedOut: g.timedOut}
	for _, sid := range g.members {
		if m.sessions[sid].s.Status != trace.StatusRunning {
			st.Finished++
		}
	}
	return st
}

// Group returns group id with its sessions (in creation order) and their calls.
// trace.ErrUnknownGroup.
func (m *Store) Group(id string) (trace.Group, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	g := m.groups[id]
	if g == nil {
		return trace.Group{}, fmt.Errorf("%w: %q", trace.ErrUnknownGroup, id)
	}
	out := trace.Group{ID: id, TaskID: g.task}
	for _, sid := range g.members {
		out.Sessions = append(out.Sessions, m.sessionLocked(m.sessions[sid]))
	}
	return out, nil
}

// DropGroup marks group id dropped: it never goes into a step. trace.ErrUnknownGroup; a
// group already in a step cannot be dropped.
func (m *Store) DropGroup(id, reason string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	g := m.groups[id]
	switch {
	case g == nil:
		return fmt.Errorf("drop group: %w: %q", trace.ErrUnknownGroup, id)
	case g.step >= 0:
		return fmt.Errorf("drop group %q: it is in step %d", id, g.step)
	}
	g.dropped, g.dropReason = true, reason
	return nil
}

// TimeOutGroup ends group id at the group timeout: the group is marked timed out (closed
// to new sessions, complete with the sessions it has) and its running sessions finish as
// timeout with reward 0, all under one lock. It returns the sessions it finished; a group
// in a step or dropped is left alone. trace.ErrUnknownGroup.
func (m *Store) TimeOutGroup(id string) ([]string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	g := m.groups[id]
	if g == nil {
		return nil, fmt.Errorf("time out group: %w: %q", trace.ErrUnknownGroup, id)
	}
	if g.step >= 0 || g.dropped {
		return nil, nil
	}
	g.timedOut = true
	var ended []string
	for _, sid := range g.members {
		if m.sessions[sid].s.Status == trace.StatusRunning {
			if err := m.finishLocked(sid, 0, trace.StatusTimeout); err != nil {
				return ended, fmt.Errorf("time out group %q: %w", id, err)
			}
			ended = append(ended, sid)
		}
	}
	return ended, nil
}

// SaveStepRecord records step rec.N with its groups (trace.StepStore). The same record
// again is a no-op; another record under its number, or a group already in another step,
// fails with trace.ErrStepConflict; a committed step with trace.ErrCommitted; an unknown
// group with trace.ErrUnknownGroup. Nothing changes when it fails.
func (m *Store) SaveStepRecord(rec trace.StepRecord) error {
	n := rec.N
	if n < 0 {
		return fmt.Errorf("save step %d: negative step", n)
	}
	if len(rec.Groups) == 0 {
		return fmt.Errorf("save step %d: no groups", n)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	if old := m.steps[n]; old != nil {
		if old.Committed {
			return fmt.Errorf("save step %d: %w", n, trace.ErrCommitted)
		}
		if !old.Same(rec) {
			return fmt.Errorf("save step %d: %w: saved with groups %q (policy versions from %d, token budget %d) and its decisions, not %q (from %d, budget %d) or other decisions",
				n, trace.ErrStepConflict, old.Groups, old.MinPolicyVersion, old.TokenBudget, rec.Groups, rec.MinPolicyVersion, rec.TokenBudget)
		}
		return nil
	}
	// Check every group before taking any, so that a failed save claims none.
	seen := map[string]bool{}
	for _, gid := range rec.Groups {
		g := m.groups[gid]
		switch {
		case g == nil:
			return fmt.Errorf("save step %d: %w: %q", n, trace.ErrUnknownGroup, gid)
		case g.step >= 0 || seen[gid]:
			return fmt.Errorf("save step %d: %w: group %q is in step %d", n, trace.ErrStepConflict, gid, max(g.step, n))
		case g.dropped:
			return fmt.Errorf("save step %d: group %q was dropped (%s)", n, gid, g.dropReason)
		}
		seen[gid] = true
	}
	for _, gid := range rec.Groups {
		m.groups[gid].step = n
	}
	saved := rec.Clone()
	saved.Committed, saved.Saved = false, time.Now().UTC()
	m.steps[n] = &saved
	return nil
}

// CommitStep records that the trainer consumed step n, exactly once: trace.ErrCommitted
// on a second commit, trace.ErrUnknownStep for a step never saved.
func (m *Store) CommitStep(n int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	st := m.steps[n]
	switch {
	case st == nil:
		return fmt.Errorf("commit step %d: %w", n, trace.ErrUnknownStep)
	case st.Committed:
		return fmt.Errorf("commit step %d: %w", n, trace.ErrCommitted)
	}
	st.Committed = true
	return nil
}

// Steps returns the saved steps not yet committed, by number, and the highest committed
// step number (-1 when none).
func (m *Store) Steps() ([]trace.StepRecord, int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	var un []trace.StepRecord
	last := int64(-1)
	for n, st := range m.steps {
		if st.Committed {
			last = max(last, n)
			continue
		}
		un = append(un, st.Clone())
	}
	sort.Slice(un, func(i, j int) bool { return un[i].N < un[j].N })
	return un, last, nil
}

// SetPolicyVersion records the policy version rollouts run under.
func (m *Store) SetPolicyVersion(v int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.policy = v
	return nil
}

// PolicyVersion is the last version set; 0 when none.
func (m *Store) PolicyVersion() (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.policy, nil
}
