// Package mem is floe's trace store in memory: for tests and for runs that need no
// durability (floe proxy). It plays the roles of trace's store contract that it can.
package mem

import (
	"context"
	"fmt"
	"sync"

	"github.com/floe-rl/floe/trace"
)

// Store is an in-memory trace.SessionKeys, CallRecorder and SessionStore; it keeps
// sessions' task, group and outcome.
type Store struct {
	mu       sync.Mutex
	keys     map[string]string
	calls    map[string][]trace.Call
	next     map[string]int
	sessions map[string]*trace.Session
}

var (
	_ trace.SessionKeys  = (*Store)(nil)
	_ trace.CallRecorder = (*Store)(nil)
	_ trace.SessionStore = (*Store)(nil)
)

// AddSession registers key as the API key of session.
func (m *Store) AddSession(key, session string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.keys == nil {
		m.keys = map[string]string{}
	}
	m.keys[key] = session
}

func (m *Store) Resolve(key string) (string, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.keys[key]
	return s, ok
}

func (m *Store) Open(key string) (string, error) {
	m.AddSession(key, key)
	return key, nil
}

// Record stores c. Choices of one n>1 request share one index: a call with Choice > 0
// takes the index of the call before it.
func (m *Store) Record(_ context.Context, c *trace.Call) error {
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
func (m *Store) CreateSession(s trace.Session, key string) error {
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

// SetGroupSize is a no-op: Store forms no groups.
func (m *Store) SetGroupSize(string, int) error { return nil }

// FinishSession records the session's reward and outcome, once.
func (m *Store) FinishSession(id string, reward float64, status trace.Status) error {
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
func (m *Store) Session(id string) (trace.Session, error) {
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
func (m *Store) Calls(session string) []trace.Call {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]trace.Call(nil), m.calls[session]...)
}
