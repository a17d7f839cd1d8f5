package proxy

import (
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/floe-rl/floe/trace"
)

// guardState is what a Server keeps to bound one harness: the bodies each session is
// reading and the bytes each session has stored.
type guardState struct {
	reading sessionInflight
	mu      sync.Mutex
	stored  map[string]int64 // bytes recorded per session (since this process started)
	diskLow atomic.Bool      // the last measure was below MinFreeDisk: logged once per spell
}

// admit lets a call in: it refuses it at once when the store's disk is below its floor,
// its session has stored its quota, or a pause has outlasted -max-pause; then it reads the
// body, holding no -max-inflight slot while the body arrives (only one of its session's
// reading places, so a harness that trickles its bodies stalls no other session); then it
// takes the call's slots. release gives them back.
func (s *Server) admit(w, raw http.ResponseWriter, r *http.Request, d Dialect, op Op, session string, limit int64,
	lim Limits) (body []byte, release func(), ok bool) {
	if e := s.refuseEarly(op, session, lim); e != nil {
		if e.Kind == ErrCapacity {
			w.Header().Set("Retry-After", "5")
		}
		s.writeError(w, d, e)
		return nil, nil, false
	}
	if !s.guard.reading.acquire(session, lim.MaxInflightPerSession) {
		w.Header().Set("Retry-After", "1")
		s.writeError(w, d, sessionCapacityError(lim.MaxInflightPerSession))
		return nil, nil, false
	}
	started := time.Now()
	body, err := readBody(raw, r, limit, lim.ClientIdle, lim.BodyTimeout)
	s.guard.reading.release(session, lim.MaxInflightPerSession)
	if err != nil {
		s.writeError(w, d, bodyReadError(err, limit, lim, started))
		return nil, nil, false
	}
	// One session cannot take every slot: the others' calls still find room.
	if !s.sessionSlots.acquire(session, lim.MaxInflightPerSession) {
		w.Header().Set("Retry-After", "1")
		s.writeError(w, d, sessionCapacityError(lim.MaxInflightPerSession))
		return nil, nil, false
	}
	if !s.slots.acquire(lim.MaxInflight) {
		s.sessionSlots.release(session, lim.MaxInflightPerSession)
		w.Header().Set("Retry-After", "1")
		s.writeError(w, d, capacityError(lim.MaxInflight))
		return nil, nil, false
	}
	return body, func() {
		s.slots.release(lim.MaxInflight)
		s.sessionSlots.release(session, lim.MaxInflightPerSession)
	}, true
}

// refuseEarly says why a call must be refused before any of its body is read: nil when
// it may go on.
func (s *Server) refuseEarly(op Op, session string, lim Limits) *Error {
	if lim.MinFreeDisk > 0 && s.DiskFree != nil {
		free, err := s.DiskFree()
		if err != nil {
			s.log().Warn("measuring the store's free disk space", "err", err)
		} else if free < uint64(lim.MinFreeDisk) {
			if !s.guard.diskLow.Swap(true) {
				s.log().Error("refusing every call: the store's disk is below its free-space floor (-min-free-disk)",
					"free_bytes", free, "min_free_disk", lim.MinFreeDisk)
			}
			return &Error{Kind: ErrCapacity, Message: "floe is short of disk space and takes no calls now; retry later"}
		} else if s.guard.diskLow.Swap(false) {
			s.log().Info("serving calls again: the store's disk is above its free-space floor", "free_bytes", free)
		}
	}
	if lim.MaxSessionBytes > 0 && s.storedBytes(session) >= lim.MaxSessionBytes {
		return &Error{Kind: ErrCapacity, Message: fmt.Sprintf(
			"this API key's session has stored its maximum of %d bytes of calls (floe's -max-session-bytes) and takes no more", lim.MaxSessionBytes)}
	}
	if op == OpGenerate && s.Gate != nil && s.Gate.PauseExpired() {
		return pauseExpiredError()
	}
	return nil
}

// pauseExpiredError is what a call sees while a pause has outlasted -max-pause: the
// provider's overloaded shape, so that SDKs back off and retry.
func pauseExpiredError() *Error {
	return &Error{Kind: ErrCapacity, Message: "floe is paused for a weight sync that has not ended; retry later"}
}

// charge counts a recorded call's bytes against its session's -max-session-bytes.
func (s *Server) charge(session string, c *trace.Call) {
	n := int64(len(c.Request) + len(c.UpstreamRequest) + len(c.Response) +
		4*(len(c.PromptIDs)+len(c.ResponseIDs)+len(c.Logprobs)))
	s.guard.mu.Lock()
	defer s.guard.mu.Unlock()
	if s.guard.stored == nil {
		s.guard.stored = map[string]int64{}
	}
	s.guard.stored[session] += n
}

func (s *Server) storedBytes(session string) int64 {
	s.guard.mu.Lock()
	defer s.guard.mu.Unlock()
	return s.guard.stored[session]
}

// strangerBodyTimeout bounds reading the body of a request that has not shown a key (a
// path floe does not serve): the shorter of the body and the stranger deadlines.
func strangerBodyTimeout(lim Limits) time.Duration {
	switch {
	case lim.UnauthenticatedTimeout <= 0:
		return lim.BodyTimeout
	case lim.BodyTimeout <= 0:
		return lim.UnauthenticatedTimeout
	}
	return min(lim.BodyTimeout, lim.UnauthenticatedTimeout)
}
