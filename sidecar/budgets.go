package sidecar

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"sync"
)

// budgetsFile, in the data dir, holds the token budget each uncommitted step was formed
// with when it differs from the fixed one (--token-budget auto), so that a restart forms
// such a step again with the same budget, byte for byte.
const budgetsFile = "step-budgets.json"

// stepBudgets is the durable step -> budget record. Every write replaces the file
// atomically (temporary file, fsync, rename, fsync of the directory).
type stepBudgets struct {
	path string

	mu sync.Mutex
	m  map[int64]int
}

// loadStepBudgets reads dir's record; a missing file is an empty record, an unreadable
// one an error (never silently ignored: steps formed from it would differ).
func loadStepBudgets(dir string) (*stepBudgets, error) {
	b := &stepBudgets{path: filepath.Join(dir, budgetsFile), m: map[int64]int{}}
	raw, err := os.ReadFile(b.path)
	if errors.Is(err, fs.ErrNotExist) {
		return b, nil
	}
	if err != nil {
		return nil, err
	}
	var m map[string]int
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, fmt.Errorf("%s is corrupt: %w", b.path, err)
	}
	for k, v := range m {
		n, err := strconv.ParseInt(k, 10, 64)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("%s is corrupt: entry %q: %d", b.path, k, v)
		}
		b.m[n] = v
	}
	return b, nil
}

// get returns the budget step n was formed with, if recorded.
func (b *stepBudgets) get(n int64) (int, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	v, ok := b.m[n]
	return v, ok
}

// set records budget for step n durably.
func (b *stepBudgets) set(n int64, budget int) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if v, ok := b.m[n]; ok && v == budget {
		return nil
	}
	b.m[n] = budget
	return b.writeLocked()
}

// forget drops the records of step n and of every step before keepFrom (committed
// steps, never formed again); it writes only when something was dropped.
func (b *stepBudgets) forget(n, keepFrom int64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	changed := false
	for k := range b.m {
		if k == n || k < keepFrom {
			delete(b.m, k)
			changed = true
		}
	}
	if !changed {
		return nil
	}
	return b.writeLocked()
}

func (b *stepBudgets) writeLocked() error {
	m := make(map[string]int, len(b.m))
	for k, v := range b.m {
		m[strconv.FormatInt(k, 10)] = v
	}
	raw, _ := json.Marshal(m)
	tmp := b.path + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	if _, err := f.Write(raw); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, b.path); err != nil {
		return err
	}
	d, err := os.Open(filepath.Dir(b.path))
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
