package proxy

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"
)

// readBody reads a request body of at most limit bytes: into one buffer of its
// Content-Length when it has one (io.ReadAll would grow a copy by doubling, up to twice
// the body), refusing a declared length over the limit before reading anything. With
// idle > 0, a body that stops arriving for idle fails with os.ErrDeadlineExceeded; with
// total > 0, so does one that has not arrived whole within total of the start, however
// steadily it trickles. The caller holds no -max-inflight slot while it reads.
func readBody(w http.ResponseWriter, r *http.Request, limit int64, idle, total time.Duration) (body []byte, err error) {
	if r.ContentLength > limit {
		return nil, &http.MaxBytesError{Limit: limit}
	}
	var rd io.Reader = http.MaxBytesReader(w, r.Body, limit)
	if idle > 0 || total > 0 {
		rc := http.NewResponseController(w)
		br := &deadlineReader{r: rd, rc: rc, idle: idle}
		if total > 0 {
			br.end = time.Now().Add(total)
		}
		if br.move(time.Now()) == nil {
			// Cleared once the body is in: net/http's read of the connection while the
			// handler runs (to see the caller hang up) must not time out. After a
			// failure it stays, so that net/http drops the connection at once rather
			// than wait for the rest of the body.
			defer func() {
				if err == nil {
					_ = rc.SetReadDeadline(time.Time{})
				}
			}()
			rd = br
		}
	}
	if r.ContentLength <= 0 {
		return io.ReadAll(rd)
	}
	buf := make([]byte, r.ContentLength)
	n, err := io.ReadFull(rd, buf)
	return buf[:n], err
}

// bodyReadError is the answer to a body that could not be read: 413 past the limit, 408
// for one that stalled or ran past its total deadline, else 400.
func bodyReadError(err error, limit int64, lim Limits, started time.Time) *Error {
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		return &Error{Status: http.StatusRequestEntityTooLarge, Kind: ErrTooLarge,
			Message: fmt.Sprintf("request body is larger than the limit of %d bytes", limit)}
	case errors.Is(err, os.ErrDeadlineExceeded) && lim.BodyTimeout > 0 && time.Since(started) >= lim.BodyTimeout:
		return &Error{Status: http.StatusRequestTimeout, Kind: ErrInvalidRequest,
			Message: fmt.Sprintf("the request body did not arrive whole within %s (floe's -client-body-timeout)", lim.BodyTimeout)}
	case errors.Is(err, os.ErrDeadlineExceeded):
		return &Error{Status: http.StatusRequestTimeout, Kind: ErrInvalidRequest,
			Message: fmt.Sprintf("the request body stopped arriving for %s (floe's -client-idle-timeout)", lim.ClientIdle)}
	}
	return &Error{Status: http.StatusBadRequest, Kind: ErrInvalidRequest, Message: "reading the request body: " + err.Error()}
}

// deadlineReader moves the read deadline forward as data arrives (at most every eighth
// of idle), never past end (the body's total deadline; zero: none).
type deadlineReader struct {
	r    io.Reader
	rc   *http.ResponseController
	idle time.Duration
	end  time.Time
	next int64
}

// move sets the read deadline from now: idle ahead, or end if sooner.
func (d *deadlineReader) move(now time.Time) error {
	dl := d.end
	if d.idle > 0 && (dl.IsZero() || now.Add(d.idle).Before(dl)) {
		dl = now.Add(d.idle)
	}
	if d.idle > 0 {
		d.next = now.Add(d.idle / 8).UnixNano()
	} else {
		d.next = 1<<63 - 1 // a fixed total deadline: set once
	}
	return d.rc.SetReadDeadline(dl)
}

func (d *deadlineReader) Read(p []byte) (int, error) {
	n, err := d.r.Read(p)
	if n > 0 {
		if now := time.Now(); now.UnixNano() >= d.next {
			_ = d.move(now)
		}
	}
	return n, err
}
