package filegraph

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// writeModule writes a one-package module whose files are given by name.
func writeModule(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	files["go.mod"] = "module example.com/p\n\ngo 1.22\n"
	for name, src := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestLoadAndStack(t *testing.T) {
	for _, tc := range []struct {
		name     string
		files    map[string]string
		uses     map[string][]string
		backRefs int
	}{
		{
			name: "floors",
			files: map[string]string{
				"top.go":    "package p\n\nfunc Top() int { return Mid{}.Get() + base }\n",
				"mid.go":    "package p\n\ntype Mid struct{ n int }\n\nfunc (m Mid) Get() int { return m.n + base }\n",
				"base.go":   "package p\n\nconst base = 1\n",
				"alone.go":  "package p\n\nimport \"strings\"\n\nvar Alone = strings.ToUpper(\"x\")\n",
				"x_test.go": "package p\n\nvar _ = Top\n",
			},
			uses: map[string][]string{"top.go": {"base.go", "mid.go"}, "mid.go": {"base.go"}},
		},
		{
			// a method and a field reached through a value count, not only names
			name: "a knot through a method and a field",
			files: map[string]string{
				"a.go": "package p\n\ntype A struct{ B *B }\n\nfunc (a A) Run() int { return a.B.Size }\n",
				"b.go": "package p\n\ntype B struct{ Size int }\n\nfunc (b *B) Owner(a A) { a.Run() }\n",
			},
			uses:     map[string][]string{"a.go": {"b.go"}, "b.go": {"a.go"}},
			backRefs: 1,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, err := Load(context.Background(), writeModule(t, tc.files))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(g.Uses, tc.uses) {
				t.Errorf("uses = %v, want %v", g.Uses, tc.uses)
			}
			fl := g.Stack()
			if len(fl.Order) != len(g.Files) {
				t.Fatalf("order %v does not hold every file of %v", fl.Order, g.Files)
			}
			if len(fl.BackRefs) != tc.backRefs {
				t.Errorf("back references = %v, want %d", fl.BackRefs, tc.backRefs)
			}
			// every other use runs down the order
			floor := map[string]int{}
			for i, f := range fl.Order {
				floor[f] = i
			}
			back := map[[2]string]bool{}
			for _, r := range fl.BackRefs {
				back[r] = true
			}
			for from, tos := range g.Uses {
				for _, to := range tos {
					if up := floor[to] < floor[from]; up != back[[2]string{from, to}] {
						t.Errorf("%s uses %s: above it %v, named a back reference %v (order %v)", from, to, up, back[[2]string{from, to}], fl.Order)
					}
				}
			}
		})
	}
}

func TestLoadRefusesABrokenPackage(t *testing.T) {
	dir := writeModule(t, map[string]string{"a.go": "package p\n\nvar X = undefined\n"})
	if _, err := Load(context.Background(), dir); err == nil {
		t.Fatal("Load of a package that does not type-check returned no error")
	}
}

// ring is n files, each using the next, the last the first: one knot, broken by one
// back reference whichever way it is stacked.
func ring(n int) Graph {
	g := Graph{Uses: map[string][]string{}}
	for i := range n {
		g.Files = append(g.Files, fmt.Sprintf("f%02d.go", i))
	}
	for i, f := range g.Files {
		g.Uses[f] = []string{g.Files[(i+1)%n]}
	}
	return g
}

func TestStackSizes(t *testing.T) {
	for _, tc := range []struct {
		name     string
		g        Graph
		backRefs int
		exact    bool
	}{
		{"no knot", Graph{Files: []string{"a.go", "b.go", "c.go"}, Uses: map[string][]string{"a.go": {"b.go", "c.go"}, "b.go": {"c.go"}}}, 0, true},
		{"a ring within the exact search", ring(exactLimit), 1, true},
		// greedy above it: the count is a bound, here the minimum too
		{"a ring beyond it", ring(exactLimit + 5), 1, false},
		{"two rings beyond it", func() Graph {
			g := ring(exactLimit + 2)
			g.Uses["f00.go"] = append(g.Uses["f00.go"], "f05.go")
			g.Uses["f05.go"] = append(g.Uses["f05.go"], "f00.go")
			return g
		}(), 2, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fl := tc.g.Stack()
			if len(fl.BackRefs) != tc.backRefs || fl.Exact != tc.exact {
				t.Errorf("back references %v (exact %v), want %d (exact %v)", fl.BackRefs, fl.Exact, tc.backRefs, tc.exact)
			}
			if len(fl.Order) != len(tc.g.Files) {
				t.Errorf("order %v does not hold the %d files", fl.Order, len(tc.g.Files))
			}
		})
	}
}
