package proxy

import (
	"container/list"
	"context"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// ConnLimiter bounds the proxy's connections so that harnesses cannot take every file
// descriptor of the process, which the control and Flight listeners, the store and the
// upstream connections share. Past Max, accepting a connection closes the oldest one that
// is not serving a call with a live session's key: a stranger's first (one that never
// showed a key), else an idle keep-alive one. Only when every connection serves a call
// (at most -max-inflight do) is the new one closed instead. A connection that has not yet
// sent a request with a live key is closed Unauthenticated after its accept, whatever
// deadlines net/http or the handler set, so strangers' connections cycle quickly.
//
// Wire it into an http.Server with Listener, ConnContext and ConnState; the proxy's
// Server marks each call that authenticates.
type ConnLimiter struct {
	// Max is the most connections open at once; 0 or negative: no cap.
	Max int
	// Unauthenticated bounds a connection from its accept to its first authenticated
	// request; 0 or negative: no bound.
	Unauthenticated time.Duration
	Log             *slog.Logger

	mu        sync.Mutex
	strangers list.List // *limitedConn that never authenticated, oldest first
	known     list.List // *limitedConn that authenticated once, oldest first
	evicted   atomic.Int64
	refused   atomic.Int64
}

// Listener wraps l: its connections are counted and bounded.
func (c *ConnLimiter) Listener(l net.Listener) net.Listener {
	return &limitedListener{Listener: l, c: c}
}

// Open is the number of connections open now.
func (c *ConnLimiter) Open() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.strangers.Len() + c.known.Len()
}

// Evicted is how many connections were closed to make room for a new one; Refused how
// many new ones were closed because every open one was serving a call.
func (c *ConnLimiter) Evicted() int64 { return c.evicted.Load() }
func (c *ConnLimiter) Refused() int64 { return c.refused.Load() }

type connKey struct{}

// ConnContext is http.Server.ConnContext: it lets the handler mark the connection.
func (c *ConnLimiter) ConnContext(ctx context.Context, conn net.Conn) context.Context {
	if lc, ok := conn.(*limitedConn); ok {
		return context.WithValue(ctx, connKey{}, lc)
	}
	return ctx
}

// ConnState is http.Server.ConnState: a connection between requests serves no call.
func (c *ConnLimiter) ConnState(conn net.Conn, st http.ConnState) {
	lc, ok := conn.(*limitedConn)
	if !ok {
		return
	}
	switch st {
	case http.StateIdle, http.StateClosed, http.StateHijacked:
		c.mu.Lock()
		lc.serving = false
		c.mu.Unlock()
	}
}

// markAuthenticated tells the connection of ctx's request (if it is a ConnLimiter's)
// that it serves a call with a live key: it is not evicted while the call lasts, and it
// loses the stranger's deadline.
func markAuthenticated(ctx context.Context) {
	if lc, ok := ctx.Value(connKey{}).(*limitedConn); ok {
		lc.authenticate()
	}
}

type limitedListener struct {
	net.Listener
	c *ConnLimiter
}

func (l *limitedListener) Accept() (net.Conn, error) {
	c := l.c
	for {
		conn, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		lc := &limitedConn{Conn: conn, c: c}
		if c.Unauthenticated > 0 {
			lc.strangerEnd = time.Now().Add(c.Unauthenticated)
			_ = conn.SetDeadline(lc.strangerEnd)
		}
		c.mu.Lock()
		var victim *limitedConn
		if c.Max > 0 && c.strangers.Len()+c.known.Len() >= c.Max {
			victim = c.evictable()
			if victim == nil {
				c.mu.Unlock()
				c.refused.Add(1)
				_ = conn.Close()
				continue
			}
			victim.remove()
		}
		lc.elem = c.strangers.PushBack(lc)
		c.mu.Unlock()
		if victim != nil {
			c.evicted.Add(1)
			_ = victim.Conn.Close()
		}
		return lc, nil
	}
}

// evictable is the oldest connection serving no call: a stranger's first; c.mu is held.
func (c *ConnLimiter) evictable() *limitedConn {
	if e := c.strangers.Front(); e != nil {
		return e.Value.(*limitedConn)
	}
	for e := c.known.Front(); e != nil; e = e.Next() {
		if lc := e.Value.(*limitedConn); !lc.serving {
			return lc
		}
	}
	return nil
}

// limitedConn is one counted connection. Until it authenticates, every deadline set on
// it is capped at strangerEnd.
type limitedConn struct {
	net.Conn
	c           *ConnLimiter
	strangerEnd time.Time // zero: none, or authenticated

	// Under c.mu:
	elem    *list.Element // nil once removed
	authed  bool
	serving bool
	// The deadlines last asked for, applied whole once the connection authenticates.
	wantRead, wantWrite time.Time
}

// remove takes the connection out of its list; c.mu is held.
func (lc *limitedConn) remove() {
	if lc.elem == nil {
		return
	}
	if lc.authed {
		lc.c.known.Remove(lc.elem)
	} else {
		lc.c.strangers.Remove(lc.elem)
	}
	lc.elem = nil
}

func (lc *limitedConn) authenticate() {
	c := lc.c
	c.mu.Lock()
	defer c.mu.Unlock()
	lc.serving = true
	if lc.authed {
		return
	}
	lc.authed = true
	if lc.elem != nil {
		c.strangers.Remove(lc.elem)
		lc.elem = c.known.PushBack(lc)
	}
	if !lc.strangerEnd.IsZero() {
		lc.strangerEnd = time.Time{}
		_ = lc.Conn.SetReadDeadline(lc.wantRead)
		_ = lc.Conn.SetWriteDeadline(lc.wantWrite)
	}
}

// capped is t, or the stranger's deadline when that is sooner; c.mu is held.
func (lc *limitedConn) capped(t time.Time) time.Time {
	if lc.strangerEnd.IsZero() || (!t.IsZero() && t.Before(lc.strangerEnd)) {
		return t
	}
	return lc.strangerEnd
}

func (lc *limitedConn) SetDeadline(t time.Time) error {
	lc.c.mu.Lock()
	defer lc.c.mu.Unlock()
	lc.wantRead, lc.wantWrite = t, t
	return lc.Conn.SetDeadline(lc.capped(t))
}

func (lc *limitedConn) SetReadDeadline(t time.Time) error {
	lc.c.mu.Lock()
	defer lc.c.mu.Unlock()
	lc.wantRead = t
	return lc.Conn.SetReadDeadline(lc.capped(t))
}

func (lc *limitedConn) SetWriteDeadline(t time.Time) error {
	lc.c.mu.Lock()
	defer lc.c.mu.Unlock()
	lc.wantWrite = t
	return lc.Conn.SetWriteDeadline(lc.capped(t))
}

func (lc *limitedConn) Close() error {
	lc.c.mu.Lock()
	lc.remove()
	lc.c.mu.Unlock()
	return lc.Conn.Close()
}
