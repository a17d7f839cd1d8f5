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

// MemStore is an in-memory Sessions and Recorder: for tests and for runs that need no
// durability. Keys are sessions: a key resolves to itself once added.
type MemStore struct {
	mu    sync.Mutex
	keys  map[string]string
	calls map[string][]trace.Call
	next  map[string]int
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

// Calls returns a copy of the calls recorded for session.
func (m *MemStore) Calls(session string) []trace.Call {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]trace.Call(nil), m.calls[session]...)
}
