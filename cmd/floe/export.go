package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/internal/cli"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/archive"
	"github.com/floe-rl/floe/trace/bolt"
)

const exportUsage = `usage: floe export -data-dir DIR -out OUT

Writes every call held in a data dir's store to OUT/calls/part-0.parquet, in the
archive's calls schema (docs/archive.md): token ids, log-probs, sampling, requests,
and the step each call's group is in (null when in none). Steps floe serve already
archived are under DIR/archive, not in the store. The store is opened read-only; a
running floe holds it, so stop it first (or export a copy). Progress goes to stderr.

`

// errExportCanceled ends an export interrupted by a signal.
var errExportCanceled = errors.New("export interrupted")

func runExport(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := cli.NewFlagSet("floe export", exportUsage, stderr)
	dataDir := fs.String("data-dir", "", "the data dir whose store to export (required)")
	out := fs.String("out", "", "directory to write calls/part-0.parquet into (required)")
	lockTimeout := fs.Duration("lock-timeout", 2*time.Second, "how long to wait for a store another process holds")
	every := fs.Duration("progress", 2*time.Second, "how often to report progress on stderr (0: never)")
	if ok, err := cli.Parse(fs, args); !ok {
		return err
	}
	if *dataDir == "" || *out == "" {
		return errors.New("-data-dir and -out are required")
	}
	store, err := bolt.New(*dataDir, bolt.Options{ReadOnly: true, LockTimeout: *lockTimeout})
	if err != nil {
		return fmt.Errorf("export %s: %w", *dataDir, err)
	}
	defer func() { _ = store.Close() }() // read only: a Close error loses nothing
	u, err := store.Usage()
	if err != nil {
		return err
	}
	groups, err := store.Groups()
	if err != nil {
		return err
	}
	byID := make(map[string]trace.GroupState, len(groups))
	for _, g := range groups {
		byID[g.ID] = g
	}
	path := filepath.Join(*out, archive.CallsTable, archive.PartFile)
	began, last := time.Now(), time.Now()
	calls, sessions := 0, 0
	err = archive.WriteCalls(path, memory.NewGoAllocator(), func(add archive.AddCall) error {
		return store.ForEachSession(func(s trace.Session) error {
			if err := ctx.Err(); err != nil {
				return errExportCanceled
			}
			var step *int64
			task := s.TaskID
			if g, ok := byID[s.GroupID]; ok && g.Step >= 0 {
				n := g.Step
				step = &n
			}
			for i := range s.Calls {
				if err := add(step, s.GroupID, task, &s.Calls[i]); err != nil {
					return err
				}
			}
			calls += len(s.Calls)
			sessions++
			if *every > 0 && time.Since(last) >= *every {
				last = time.Now()
				// A progress line: a closed stderr must not stop the export.
				_, _ = fmt.Fprintf(stderr, "floe export: %d of %d calls, %d of %d sessions, %s\n", calls, u.Calls, sessions, u.Sessions,
					time.Since(began).Round(time.Second))
			}
			return nil
		})
	})
	if err != nil {
		return fmt.Errorf("export %s: %w", *dataDir, err)
	}
	// The export is written; a closed stderr must not fail it.
	_, _ = fmt.Fprintf(stderr, "floe export: wrote %d calls of %d sessions to %s in %s\n", calls, sessions, path,
		time.Since(began).Round(time.Millisecond))
	return nil
}
