// Package filegraph measures how the files of one Go package depend on each other: file A
// depends on file B when A uses a name (a function, type, variable, constant, method or
// field) that B declares. A package whose files can be stacked in floors, each using only
// the floors below it, reads bottom-up; a reference that runs back up a floor is a knot in
// that reading. docs/architecture.md shows sidecar's floors; sidecar/floors_test.go keeps
// them free of references running back up.
package filegraph

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
)

// Graph is the file dependency graph of one package's non-test files.
type Graph struct {
	// Files are the package's non-test Go files for this platform, by base name, sorted.
	Files []string
	// Uses maps a file to the files whose declarations it uses (never itself).
	Uses map[string][]string
	// Names holds, for each use {from, to}, the names of to's declarations from uses, sorted.
	Names map[[2]string][]string
}

// Load type-checks the package in dir (its non-test files, as the go command selects them
// for this platform) against its dependencies' export data, which `go list -export`
// builds, and returns its file graph.
func Load(ctx context.Context, dir string) (Graph, error) {
	listing, err := goList(ctx, dir)
	if err != nil {
		return Graph{}, err
	}
	fset := token.NewFileSet()
	var files []*ast.File
	for _, name := range listing.GoFiles {
		f, err := parser.ParseFile(fset, filepath.Join(listing.Dir, name), nil, parser.SkipObjectResolution)
		if err != nil {
			return Graph{}, fmt.Errorf("filegraph: parse: %w", err)
		}
		files = append(files, f)
	}
	lookup := func(path string) (io.ReadCloser, error) {
		export, ok := listing.exports[path]
		if !ok || export == "" {
			return nil, fmt.Errorf("filegraph: no export data for %q", path)
		}
		return os.Open(export)
	}
	conf := types.Config{Importer: importer.ForCompiler(fset, "gc", lookup)}
	info := &types.Info{Uses: map[*ast.Ident]types.Object{}}
	pkg, err := conf.Check(listing.ImportPath, fset, files, info)
	if err != nil {
		return Graph{}, fmt.Errorf("filegraph: type-check %s: %w", listing.ImportPath, err)
	}
	uses := map[string]map[string]bool{}
	names := map[[2]string]map[string]bool{}
	for id, obj := range info.Uses {
		if obj.Pkg() != pkg || !obj.Pos().IsValid() || !declaredAtPackageLevel(pkg, obj) {
			continue
		}
		from := filepath.Base(fset.Position(id.Pos()).Filename)
		to := filepath.Base(fset.Position(obj.Pos()).Filename)
		if from == to {
			continue
		}
		if uses[from] == nil {
			uses[from] = map[string]bool{}
		}
		uses[from][to] = true
		edge := [2]string{from, to}
		if names[edge] == nil {
			names[edge] = map[string]bool{}
		}
		names[edge][qualifiedName(obj)] = true
	}
	g := Graph{Files: append([]string(nil), listing.GoFiles...), Uses: map[string][]string{}, Names: map[[2]string][]string{}}
	for edge, set := range names {
		for n := range set {
			g.Names[edge] = append(g.Names[edge], n)
		}
		sort.Strings(g.Names[edge])
	}
	sort.Strings(g.Files)
	for from, tos := range uses {
		for to := range tos {
			g.Uses[from] = append(g.Uses[from], to)
		}
		sort.Strings(g.Uses[from])
	}
	return g, nil
}

// declaredAtPackageLevel reports whether obj is one of the package's own declarations a
// file can lean on: a package-level name, or a method or field of a package-level type.
func declaredAtPackageLevel(pkg *types.Package, obj types.Object) bool {
	if obj.Parent() == pkg.Scope() {
		return true
	}
	switch o := obj.(type) {
	case *types.Func:
		sig, ok := o.Type().(*types.Signature)
		return ok && sig.Recv() != nil
	case *types.Var:
		return o.IsField()
	}
	return false
}

// qualifiedName names a declaration as a reader finds it: T.M for a method or field of T.
func qualifiedName(obj types.Object) string {
	if f, ok := obj.(*types.Func); ok {
		if recv := f.Type().(*types.Signature).Recv(); recv != nil {
			return typeName(recv.Type()) + "." + f.Name()
		}
	}
	return obj.Name()
}

func typeName(t types.Type) string {
	if p, ok := t.(*types.Pointer); ok {
		t = p.Elem()
	}
	if n, ok := t.(*types.Named); ok {
		return n.Obj().Name()
	}
	return t.String()
}

// Floors is the stacking of the files with the fewest references running back up: Order
// lists the files from the top floor (uses the most) to the bottom (uses the least), and
// BackRefs names each reference from a file to one above it. An acyclic graph stacks with
// none. Exact says the stacking is a proven minimum; above exactLimit files a knotted
// graph is stacked greedily and the count is an upper bound.
type Floors struct {
	Order    []string
	BackRefs [][2]string
	Exact    bool
}

// exactLimit bounds the exact search, which keeps two ints for each of the 2^n subsets of
// files: 16 MiB at 20 files, and a gigabyte by 26.
const exactLimit = 20

// Stack finds the order of the files that leaves the fewest references running back up. A
// graph without a knot stacks by peeling off, floor by floor, the files that use nothing
// unplaced; one with knots takes a minimum feedback arc set, exact by dynamic programming
// over subsets of files up to exactLimit files, and greedy above.
func (g Graph) Stack() Floors {
	n := len(g.Files)
	index := make(map[string]int, n)
	for i, f := range g.Files {
		index[f] = i
	}
	uses := make([][]int, n)
	for from, tos := range g.Uses {
		for _, to := range tos {
			uses[index[from]] = append(uses[index[from]], index[to])
		}
	}
	bottomUp, exact := peel(uses)
	if bottomUp == nil && n <= exactLimit {
		bottomUp, exact = minBackRefs(uses), true
	} else if bottomUp == nil {
		bottomUp = greedy(uses)
	}
	fl := Floors{Exact: exact}
	floor := make(map[string]int, n)
	for i := len(bottomUp) - 1; i >= 0; i-- {
		floor[g.Files[bottomUp[i]]] = i
		fl.Order = append(fl.Order, g.Files[bottomUp[i]])
	}
	for _, from := range g.Files {
		for _, to := range g.Uses[from] {
			if floor[to] > floor[from] {
				fl.BackRefs = append(fl.BackRefs, [2]string{from, to})
			}
		}
	}
	return fl
}

// peel orders an acyclic graph bottom-up (each file after every file it uses), and returns
// nil, false when a knot is left.
func peel(uses [][]int) ([]int, bool) {
	placed := make([]bool, len(uses))
	var order []int
	for len(order) < len(uses) {
		var floor []int
		for v := range uses {
			if !placed[v] && unplaced(uses[v], placed) == 0 {
				floor = append(floor, v)
			}
		}
		if len(floor) == 0 {
			return nil, false
		}
		for _, v := range floor {
			placed[v] = true
		}
		order = append(order, floor...)
	}
	return order, true
}

// greedy places bottom-up, each time the file with the fewest uses of files not yet placed
// (the first by name on a tie).
func greedy(uses [][]int) []int {
	placed := make([]bool, len(uses))
	var order []int
	for len(order) < len(uses) {
		best, bestCost := -1, 0
		for v := range uses {
			if c := unplaced(uses[v], placed); !placed[v] && (best < 0 || c < bestCost) {
				best, bestCost = v, c
			}
		}
		placed[best] = true
		order = append(order, best)
	}
	return order
}

func unplaced(tos []int, placed []bool) int {
	c := 0
	for _, t := range tos {
		if !placed[t] {
			c++
		}
	}
	return c
}

// minBackRefs is the exact bottom-up order: cost[s] is the fewest back references among
// the files of the set s placed at the bottom; a file placed on top of s pays for each
// file it uses that is not yet placed, since those will sit above it.
func minBackRefs(uses [][]int) []int {
	n := len(uses)
	refs := make([]uint64, n)
	for v, tos := range uses {
		for _, t := range tos {
			refs[v] |= 1 << uint(t)
		}
	}
	full := uint64(1)<<uint(n) - 1
	cost := make([]int32, full+1)
	last := make([]int8, full+1)
	for s := uint64(1); s <= full; s++ {
		cost[s] = 1<<31 - 1
	}
	for s := uint64(0); s < full; s++ {
		for v := 0; v < n; v++ {
			bit := uint64(1) << uint(v)
			if s&bit != 0 {
				continue
			}
			if c := cost[s] + int32(popcount(refs[v]&^(s|bit))); c < cost[s|bit] {
				cost[s|bit] = c
				last[s|bit] = int8(v)
			}
		}
	}
	order := make([]int, n)
	for s, i := full, n-1; s != 0; s, i = s&^(1<<uint(last[s])), i-1 {
		order[i] = int(last[s])
	}
	return order
}

func popcount(x uint64) int {
	c := 0
	for ; x != 0; x &= x - 1 {
		c++
	}
	return c
}

type listing struct {
	ImportPath string
	Dir        string
	GoFiles    []string
	exports    map[string]string
}

// goList asks the go command for the package's files and its dependencies' export data.
func goList(ctx context.Context, dir string) (listing, error) {
	cmd := exec.CommandContext(ctx, "go", "list", "-export", "-deps", "-json=ImportPath,Dir,GoFiles,Export", ".")
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return listing{}, fmt.Errorf("filegraph: go list in %s: %w: %s", dir, err, stderr.Bytes())
	}
	var l listing
	l.exports = map[string]string{}
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p struct {
			ImportPath, Dir, Export string
			GoFiles                 []string
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return listing{}, fmt.Errorf("filegraph: go list output: %w", err)
		}
		l.exports[p.ImportPath] = p.Export
		// -deps lists the named package last
		l.ImportPath, l.Dir, l.GoFiles = p.ImportPath, p.Dir, p.GoFiles
	}
	if l.ImportPath == "" {
		return listing{}, fmt.Errorf("filegraph: go list in %s named no package", dir)
	}
	return l, nil
}
