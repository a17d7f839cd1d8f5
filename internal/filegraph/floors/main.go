// Command floors prints the floors of the Go package in the current directory (or the one
// named): its files from the top floor to the bottom, what each uses, and the references
// running back up (internal/filegraph).
//
//	go run ./internal/filegraph/floors ./sidecar
package main

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/floe-rl/floe/internal/filegraph"
)

func main() {
	dir := "."
	if len(os.Args) > 1 {
		dir = os.Args[1]
	}
	g, err := filegraph.Load(context.Background(), dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fl := g.Stack()
	bound := ""
	if !fl.Exact {
		bound = " (at most: stacked greedily)"
	}
	fmt.Printf("%d files, %d references running back up%s\n", len(g.Files), len(fl.BackRefs), bound)
	for _, f := range fl.Order {
		fmt.Printf("  %-20s uses %v\n", f, g.Uses[f])
	}
	if os.Getenv("FLOORS_ALL") != "" {
		for _, f := range fl.Order {
			for _, to := range g.Uses[f] {
				fmt.Printf("  %s -> %s (%s)\n", f, to, strings.Join(g.Names[[2]string{f, to}], ", "))
			}
		}
	}
	for _, r := range fl.BackRefs {
		fmt.Printf("  up: %s -> %s (%s)\n", r[0], r[1], strings.Join(g.Names[r], ", "))
	}
}
