package proxy

import (
	"context"
	"fmt"
	"sync"

	"github.com/floe-rl/floe/trace"
)

// Sessions maps the key a harness presents to the session it belongs to.
type Sessions interface {
	// Resolve returns the session of key, ok false when the key is unknown.
	Resolve(key string) (session string, ok bool)
	// Open creates a session for an unknown key; used only with open sessions.
	Open(key string) (session string, err error)
}

// Recorder stores recorded calls.
type Recorder interface {
	// Record assigns c its call index within its session and stores it; it returns once
	// the call is durable, before the harness sees the answer.
	Record(ctx context.Context, c *trace.Call) error
}

// MemStore is an in-memory Sessions and Recorder, and keeps sessions' task, group and
// outcome: for tests and for runs that need no durability (floe proxy).
type MemStore struct {
	mu       sync.Mutex
	keys     map[string]string
	calls    map[string][]trace.Call
	next     map[string]int
	sessions map[string]*trace.Session
}

var (
	_ Sessions = (*MemStore)(nil)
	_ Recorder = (*MemStore)(nil)
)

// AddSession registers key as the API key of session.
func (m *MemStore) AddSession(key, session string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.keys == nil {
		m.keys = map[string]string{}
	}
	m.keys[key] = session
}

func (m *MemStore) Resolve(key string) (string, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.keys[key]
	return s, ok
}

func (m *MemStore) Open(key string) (string, error) {
	m.AddSession(key, key)
	return key, nil
}

// Record stores c. Choices of one n>1 request share one index: a call with Choice > 0
// takes the index of the call before it.
func (m *MemStore) Record(_ context.Context, c *trace.Call) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.calls == nil {
		m.calls, m.next = map[string][]trace.Call{}, map[string]int{}
	}
	if c.SessionID == "" {
		return fmt.Errorf("record: call has no session")
	}
	if c.Choice == 0 {
		c.Index = m.next[c.SessionID]
		m.next[c.SessionID]++
	} else {
		c.Index = m.next[c.SessionID] - 1
	}
	m.calls[c.SessionID] = append(m.calls[c.SessionID], *c)
	return nil
}

// CreateSession registers s (running) with its API key.
func (m *MemStore) CreateSession(s trace.Session, key string) error {
	m.mu.Lock()
	if m.sessions == nil {
		m.sessions = map[string]*trace.Session{}
	}
	if _, ok := m.sessions[s.ID]; ok {
		m.mu.Unlock()
		return fmt.Errorf("session %q exists", s.ID)
	}
	s.Status, s.Calls = trace.StatusRunning, nil
	m.sessions[s.ID] = &s
	m.mu.Unlock()
	m.AddSession(key, s.ID)
	m.AddSession(s.ID, s.ID) // x-floe-session: <id>
	return nil
}

// SetGroupSize is a no-op: MemStore forms no groups.
func (m *MemStore) SetGroupSize(string, int) error { return nil }

// FinishSession records the session's reward and outcome, once.
func (m *MemStore) FinishSession(id string, reward float64, status trace.Status) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.sessions[id]
	switch {
	case !ok:
		return fmt.Errorf("no session %q", id)
	case s.Status != trace.StatusRunning:
		return fmt.Errorf("session %q already finished (%s)", id, s.Status)
	}
	s.Reward, s.Status = reward, status
	return nil
}

// Session returns the session with its calls.
func (m *MemStore) Session(id string) (trace.Session, error) {
	m.mu.Lock()
	s, ok := m.sessions[id]
	m.mu.Unlock()
	if !ok {
		return trace.Session{}, fmt.Errorf("no session %q", id)
	}
	out := *s
	out.Calls = m.Calls(id)
	return out, nil
}

// Calls returns a copy of the calls recorded for session.
func (m *MemStore) Calls(session string) []trace.Call {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]trace.Call(nil), m.calls[session]...)
}
