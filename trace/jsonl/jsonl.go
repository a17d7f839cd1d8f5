// Package jsonl is the recorded-calls file: one trace.Call a line, as JSON with trace's
// field tags (the wire format in docs/trace.md), appended by floe proxy -record FILE and
// read back by floe corpus-serve -calls FILE.
//
// The file is append-only and has one writer: a Recorder. Each line is fsynced before
// Record returns, so a call is on disk before its answer reaches the harness, as in the
// durable store.
package jsonl

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"

	"github.com/floe-rl/floe/trace"
)

// Recorder appends recorded calls to a file (trace.CallRecorder). It knows no sessions:
// it takes the calls of any session and assigns their indexes itself, per session, as
// the stores do. Its methods are safe for concurrent use.
type Recorder struct {
	path string

	mu     sync.Mutex
	f      *os.File
	size   int64          // bytes of whole lines in the file
	next   map[string]int // next call index per session
	closed bool
}

var _ trace.CallRecorder = (*Recorder)(nil)

// NewRecorder opens the recorded-calls file at path for appending, creating it when there
// is none. An existing file is read first, so that each session's call indexes go on
// after its last recorded call; a line in it that does not parse is an error, except a
// last line cut short without its newline (a crash while writing it, before Record
// returned): that is removed, as its call was never acknowledged.
func NewRecorder(path string) (*Recorder, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("recorded calls: %w", err)
	}
	r := &Recorder{path: path, f: f, next: map[string]int{}}
	if err := r.load(); err != nil {
		_ = f.Close() // the load error is the one to report
		return nil, err
	}
	// A new file's directory entry must be durable too, or the first call is not.
	if err := syncDir(filepath.Dir(path)); err != nil {
		_ = f.Close() // the sync error is the one to report
		return nil, fmt.Errorf("recorded calls %s: %w", path, err)
	}
	return r, nil
}

// load reads the existing file's calls into r.next and removes a torn last line.
func (r *Recorder) load() error {
	err := scan(r.f, r.path, func(c *trace.Call) error {
		r.next[c.SessionID] = max(r.next[c.SessionID], c.Index+1)
		return nil
	})
	var torn *tornError
	switch {
	case errors.As(err, &torn):
		if err := r.f.Truncate(torn.offset); err != nil {
			return fmt.Errorf("recorded calls %s: removing a torn last line: %w", r.path, err)
		}
	case err != nil:
		return err
	}
	fi, err := r.f.Stat()
	if err != nil {
		return fmt.Errorf("recorded calls %s: %w", r.path, err)
	}
	r.size = fi.Size()
	if r.size > 0 {
		// A last line that parses but lacks its newline (edited by hand): end it, or the
		// next call would be appended to it.
		last := make([]byte, 1)
		if _, err := r.f.ReadAt(last, r.size-1); err != nil {
			return fmt.Errorf("recorded calls %s: %w", r.path, err)
		}
		if last[0] != '\n' {
			if err := r.append([]byte{'\n'}); err != nil {
				return fmt.Errorf("recorded calls %s: %w", r.path, err)
			}
		}
	}
	if err := r.f.Sync(); err != nil {
		return fmt.Errorf("recorded calls %s: %w", r.path, err)
	}
	return nil
}

// Path is the file the recorder appends to.
func (r *Recorder) Path() string { return r.path }

// Record assigns c its index within its session (a call with Choice > 0 takes the index
// of the call before it, as the choices of one n>1 request share an index), appends it
// as one JSON line and fsyncs the file before returning. When it fails, the file is as
// it was and c.Index unchanged.
func (r *Recorder) Record(ctx context.Context, c *trace.Call) error {
	if c.SessionID == "" {
		return errors.New("record: call has no session")
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("record: %w", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return fmt.Errorf("record: %w", trace.ErrClosed)
	}
	n := r.next[c.SessionID]
	index, next := n, n+1
	if c.Choice > 0 {
		if n == 0 {
			return fmt.Errorf("record: session %q: choice %d with no call before it", c.SessionID, c.Choice)
		}
		index, next = n-1, n
	}
	saved := c.Index
	c.Index = index
	line, err := json.Marshal(c)
	if err != nil {
		c.Index = saved
		return fmt.Errorf("record: encoding call: %w", err)
	}
	if err := r.append(append(line, '\n')); err != nil {
		c.Index = saved
		return fmt.Errorf("record: %s: %w", r.path, err)
	}
	r.next[c.SessionID] = next
	return nil
}

// append writes line and fsyncs it; on failure it cuts the file back to its last whole
// line, so that a later line does not follow a torn one.
func (r *Recorder) append(line []byte) error {
	_, err := r.f.Write(line)
	if err == nil {
		err = r.f.Sync()
	}
	if err != nil {
		if terr := r.f.Truncate(r.size); terr != nil {
			return fmt.Errorf("%w (and cutting back the partial line: %v)", err, terr)
		}
		return err
	}
	r.size += int64(len(line))
	return nil
}

// Close closes the file. Record after Close fails with trace.ErrClosed.
func (r *Recorder) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	if err := r.f.Close(); err != nil {
		return fmt.Errorf("recorded calls %s: %w", r.path, err)
	}
	return nil
}

// ReadCalls reads every call of the recorded-calls file at path, in file order. Errors
// name the file and the line.
func ReadCalls(path string) ([]trace.Call, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("recorded calls: %w", err)
	}
	defer func() { _ = f.Close() }() // read only: a Close error loses nothing
	var calls []trace.Call
	err = scan(f, path, func(c *trace.Call) error {
		calls = append(calls, *c)
		return nil
	})
	var torn *tornError
	if errors.As(err, &torn) {
		return nil, torn.err
	}
	return calls, err
}

// ReadGroups reads the recorded-calls file at path as one group, "recorded" (its task
// "recorded" too), of every session in the file in order of first appearance, each with
// its calls in file order and status completed, reward 0: the file keeps calls, not
// outcomes or groups, so this is what corpus-serve replays. A file with no calls is an
// error, as are a line that does not parse or a call without a session (errors name the
// file and line).
func ReadGroups(path string) ([]trace.Group, error) {
	calls, err := ReadCalls(path)
	if err != nil {
		return nil, err
	}
	if len(calls) == 0 {
		return nil, fmt.Errorf("recorded calls %s: no calls", path)
	}
	g := trace.Group{ID: "recorded", TaskID: "recorded"}
	index := map[string]int{}
	for _, c := range calls {
		i, ok := index[c.SessionID]
		if !ok {
			i = len(g.Sessions)
			index[c.SessionID] = i
			g.Sessions = append(g.Sessions, trace.Session{ID: c.SessionID, TaskID: g.TaskID, GroupID: g.ID, Status: trace.StatusCompleted})
		}
		g.Sessions[i].Calls = append(g.Sessions[i].Calls, c)
	}
	return []trace.Group{g}, nil
}

// tornError is a last line without its newline that does not parse: a write cut short.
type tornError struct {
	offset int64 // where the line starts
	err    error
}

func (e *tornError) Error() string { return e.err.Error() }

// scan decodes r line by line (blank lines skipped), calling fn with each call. A last
// line without its newline that does not parse is a *tornError.
func scan(r io.Reader, path string, fn func(c *trace.Call) error) error {
	br := bufio.NewReaderSize(r, 1<<16)
	var off int64
	for n := 1; ; n++ {
		line, err := br.ReadBytes('\n')
		if err != nil && !errors.Is(err, io.EOF) {
			return fmt.Errorf("recorded calls %s: line %d: %w", path, n, err)
		}
		if len(line) == 0 {
			return nil
		}
		start := off
		off += int64(len(line))
		whole := line[len(line)-1] == '\n'
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		var c trace.Call
		if derr := json.Unmarshal(line, &c); derr != nil {
			derr = fmt.Errorf("recorded calls %s: line %d: %w", path, n, derr)
			if !whole {
				return &tornError{offset: start, err: derr}
			}
			return derr
		}
		if c.SessionID == "" {
			// Also what a file in the format before snake_case names reads as.
			return fmt.Errorf("recorded calls %s: line %d: no session_id", path, n)
		}
		if err := fn(&c); err != nil {
			return err
		}
	}
}

// syncDir fsyncs directory dir, so that a file created in it is durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer func() { _ = d.Close() }() // opened only to fsync, checked below
	return d.Sync()
}
