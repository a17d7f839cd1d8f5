package sidecar

import "testing"

// Commit consumes step n with nothing durable behind it: Node.Commit without a store,
// for the buffer's own tests.
func (r *Ready) Commit(n int64) error {
	if err := r.claim(n); err != nil {
		return err
	}
	return r.settle(n, nil)
}

// newTestNode is NewNode for a test: a failure ends the test.
func newTestNode(t *testing.T, cfg NodeConfig) *Node {
	t.Helper()
	n, err := NewNode(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return n
}
