// Package testutil holds helpers shared by floe's tests.
package testutil

import (
	"io"
	"testing"
)

// Close closes c and fails t when that errs: a store's Close flushes its last writes, so
// a test that closes one, deferred or not, checks it. Deferring it on a store the test
// may close itself is fine, as floe's stores return nil from a second Close.
func Close(t testing.TB, c io.Closer) {
	t.Helper()
	if err := c.Close(); err != nil {
		t.Error(err)
	}
}
