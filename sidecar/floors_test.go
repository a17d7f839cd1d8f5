package sidecar

import (
	"context"
	"strings"
	"testing"

	"github.com/floe-rl/floe/internal/filegraph"
)

// sidecar reads bottom-up: its files stack in floors (docs/architecture.md, "sidecar's
// floors"), each using only the files below it. A file that uses one above it ties the
// two together; move the shared declaration down instead.
func TestFilesStackInFloors(t *testing.T) {
	g, err := filegraph.Load(context.Background(), ".")
	if err != nil {
		t.Fatal(err)
	}
	fl := g.Stack()
	for _, f := range fl.Order {
		t.Logf("%-18s uses %s", f, strings.Join(g.Uses[f], " "))
	}
	for _, r := range fl.BackRefs {
		t.Errorf("%s uses %s, which sits above it: %s", r[0], r[1], strings.Join(g.Names[r], ", "))
	}
}
