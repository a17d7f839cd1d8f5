package bolt

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
)

// formatTwoStore writes a store with steps 0 (committed), 1 and 2 (uncommitted), no
// budgets in their records, marks it format 2 and closes it.
func formatTwoStore(t *testing.T, dir string) {
	t.Helper()
	s := open(t, dir, Options{})
	for _, g := range []string{"g0", "g1", "g2"} {
		if err := s.CreateSession(trace.Session{ID: g + "-s", TaskID: "t", GroupID: g}, "", 0); err != nil {
			t.Fatal(err)
		}
		if err := s.FinishSession(g+"-s", 1, trace.StatusCompleted); err != nil {
			t.Fatal(err)
		}
	}
	for n, g := range []string{"g0", "g1", "g2"} {
		if err := s.SaveStepRecord(trace.StepRecord{N: int64(n), Groups: []string{g}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.CommitStep(0); err != nil {
		t.Fatal(err)
	}
	if err := s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bMeta).Put(kFormat, binary.BigEndian.AppendUint32(nil, 2))
	}); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}

func storedBudget(t *testing.T, s *Store, n int64) int {
	t.Helper()
	var sv stepValue
	if err := s.db.View(func(tx *bolt.Tx) error {
		return json.Unmarshal(tx.Bucket(bSteps).Get(seqKey(uint64(n))), &sv)
	}); err != nil {
		t.Fatal(err)
	}
	return sv.TokenBudget
}

func format(t *testing.T, s *Store) uint32 {
	t.Helper()
	var v uint32
	err := s.db.View(func(tx *bolt.Tx) error {
		v = binary.BigEndian.Uint32(tx.Bucket(bMeta).Get(kFormat))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestUpgradeMovesBudgetsFile: a format 2 store beside an older floe's step budgets file
// reads the budgets read-only without writing, and a read-write open moves them into the
// step records (committed ones too), removes the file and raises the format; the upgrade
// is idempotent when the file survives it (a crash before its removal).
func TestUpgradeMovesBudgetsFile(t *testing.T) {
	dir := t.TempDir()
	formatTwoStore(t, dir)
	file := filepath.Join(dir, BudgetsFile)
	// Step 1 kept the fixed budget (no entry); 7 was recorded but never saved.
	budgets := `{"0": 512, "2": 2048, "7": 999}`
	if err := os.WriteFile(file, []byte(budgets), 0o644); err != nil {
		t.Fatal(err)
	}
	wantSteps := func(s *Store, when string) {
		t.Helper()
		un, last, err := s.Steps()
		if err != nil || last != 0 || len(un) != 2 || un[0].N != 1 || un[0].TokenBudget != 0 || un[1].N != 2 || un[1].TokenBudget != 2048 {
			t.Fatalf("%s: Steps = %+v %d %v, want step 1 with budget 0 and 2 with 2048", when, un, last, err)
		}
	}

	ro := open(t, dir, Options{ReadOnly: true})
	wantSteps(ro, "read-only")
	if format(t, ro) != 2 {
		t.Fatalf("a read-only open changed the format to %d", format(t, ro))
	}
	testutil.Close(t, ro)
	if _, err := os.Stat(file); err != nil {
		t.Fatalf("a read-only open touched the budgets file: %v", err)
	}

	s := open(t, dir, Options{})
	wantSteps(s, "upgraded")
	if _, err := os.Stat(file); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("budgets file after the upgrade: %v", err)
	}
	if got := format(t, s); got != FormatVersion {
		t.Fatalf("format %d after the upgrade", got)
	}
	if got := storedBudget(t, s, 0); got != 512 {
		t.Fatalf("committed step 0 has budget %d, want 512", got)
	}
	s = reopen(t, s, dir)
	wantSteps(s, "reopened")
	testutil.Close(t, s)

	// A crash between the upgrade's commit and the file's removal: the next open applies
	// the same file again and removes it.
	if err := os.WriteFile(file, []byte(budgets), 0o644); err != nil {
		t.Fatal(err)
	}
	s = open(t, dir, Options{})
	wantSteps(s, "upgrade re-run")
	if _, err := os.Stat(file); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("budgets file after the re-run: %v", err)
	}
	// A budget saved with the step is returned as saved.
	if err := s.CreateSession(trace.Session{ID: "g3-s", TaskID: "t", GroupID: "g3"}, "", 0); err != nil {
		t.Fatal(err)
	}
	if err := s.SaveStepRecord(trace.StepRecord{N: 3, Groups: []string{"g3"}, TokenBudget: 4096}); err != nil {
		t.Fatal(err)
	}
	s = reopen(t, s, dir)
	defer testutil.Close(t, s)
	un, _, err := s.Steps()
	if err != nil || len(un) != 3 || un[2].N != 3 || un[2].TokenBudget != 4096 {
		t.Fatalf("Steps = %+v %v, want step 3 with budget 4096", un, err)
	}
}

// TestCorruptBudgetsFile: a budgets file that does not parse is an error naming it, on
// either open, and nothing is changed: never silently ignored.
func TestCorruptBudgetsFile(t *testing.T) {
	tests := []struct{ name, content string }{
		{"not JSON", "{"},
		{"not an object", "[512]"},
		{"step not a number", `{"one": 512}`},
		{"negative step", `{"-1": 512}`},
		{"zero budget", `{"1": 0}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			formatTwoStore(t, dir)
			file := filepath.Join(dir, BudgetsFile)
			if err := os.WriteFile(file, []byte(tt.content), 0o644); err != nil {
				t.Fatal(err)
			}
			for _, ro := range []bool{true, false} {
				s, err := New(dir, Options{ReadOnly: ro})
				if err == nil {
					testutil.Close(t, s)
					t.Fatalf("read-only %v: opened beside a corrupt budgets file", ro)
				}
				if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), file) {
					t.Fatalf("read-only %v: %v, want ErrCorrupt naming %s", ro, err, file)
				}
			}
			if _, err := os.Stat(file); err != nil {
				t.Fatalf("the corrupt file was removed: %v", err)
			}
			if err := os.Remove(file); err != nil {
				t.Fatal(err)
			}
			s := open(t, dir, Options{ReadOnly: true})
			defer testutil.Close(t, s)
			if got := format(t, s); got != 2 {
				t.Fatalf("the failed open changed the format to %d", got)
			}
		})
	}
}

// TestClosedStore: reads and writes after Close fail with ErrClosed.
func TestClosedStore(t *testing.T) {
	s := open(t, t.TempDir(), Options{})
	if err := s.CreateSession(trace.Session{ID: "s", TaskID: "t", GroupID: "g"}, "", 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	_, sessErr := s.Session("s")
	_, groupErr := s.Group("g")
	_, groupsErr := s.Groups()
	_, _, stepsErr := s.Steps()
	_, policyErr := s.PolicyVersion()
	for name, err := range map[string]error{
		"Record":        s.Record(t.Context(), &trace.Call{SessionID: "s"}),
		"CreateSession": s.CreateSession(trace.Session{ID: "x"}, "", 0),
		"CommitStep":    s.CommitStep(0),
		"Session":       sessErr,
		"Group":         groupErr,
		"Groups":        groupsErr,
		"Steps":         stepsErr,
		"PolicyVersion": policyErr,
	} {
		if !errors.Is(err, trace.ErrClosed) {
			t.Errorf("%s after Close: %v, want ErrClosed", name, err)
		}
	}
}

// formatThreeStore writes a store as floe wrote format 3, its step records without
// decisions: steps 0 (committed), 1 (uncommitted) and 2 (committed, archived and
// forgotten), then closes it.
func formatThreeStore(t *testing.T, dir string) {
	t.Helper()
	s := open(t, dir, Options{})
	for _, g := range []string{"g0", "g1", "g2"} {
		if err := s.CreateSession(trace.Session{ID: g + "-s", TaskID: "t", GroupID: g}, "", 0); err != nil {
			t.Fatal(err)
		}
		if err := s.FinishSession(g+"-s", 1, trace.StatusCompleted); err != nil {
			t.Fatal(err)
		}
	}
	for n, g := range []string{"g0", "g1", "g2"} {
		if err := s.SaveStepRecord(trace.StepRecord{N: int64(n), Groups: []string{g}, TokenBudget: 1024 * (n + 1)}); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range []int64{0, 2} {
		if err := s.CommitStep(n); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.ForgetStep(2); err != nil {
		t.Fatal(err)
	}
	if err := s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bMeta).Put(kFormat, binary.BigEndian.AppendUint32(nil, 3))
	}); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestUpgradeToDecidedSteps: a format 3 store opens read-only as it is (its steps without
// decisions); a read-write open raises the format to 4 and lists the steps whose groups
// are still in the store (committed or not, not the archived one) as undecided; DecideStep
// records a step's decisions once (the same again a no-op, others a conflict), and they
// survive a reopen and a commit; an archived step's tombstone keeps none.
func TestUpgradeToDecidedSteps(t *testing.T) {
	dir := t.TempDir()
	formatThreeStore(t, dir)

	ro := open(t, dir, Options{ReadOnly: true})
	if un, last, err := ro.Steps(); err != nil || len(un) != 1 || un[0].N != 1 || un[0].Decisions != nil || last != 2 {
		t.Fatalf("read-only Steps = %+v %d %v, want step 1 without decisions, last committed 2", un, last, err)
	}
	if got := format(t, ro); got != 3 {
		t.Fatalf("a read-only open changed the format to %d", got)
	}
	testutil.Close(t, ro)

	s := open(t, dir, Options{})
	if got := format(t, s); got != FormatVersion || FormatVersion != 4 {
		t.Fatalf("format %d after the upgrade, want 4", got)
	}
	undecided := func(when string) []int64 {
		t.Helper()
		recs, err := s.UndecidedSteps()
		if err != nil {
			t.Fatalf("%s: %v", when, err)
		}
		var ns []int64
		for _, r := range recs {
			ns = append(ns, r.N)
			if r.TokenBudget != 1024*int(r.N+1) {
				t.Fatalf("%s: undecided step %d with budget %d", when, r.N, r.TokenBudget)
			}
		}
		return ns
	}
	if got := undecided("upgraded"); fmt.Sprint(got) != "[0 1]" {
		t.Fatalf("undecided steps %v, want [0 1] (2 is archived)", got)
	}
	decided := func(n int64, adv float64) trace.StepRecord {
		return trace.StepRecord{N: n, Groups: []string{fmt.Sprintf("g%d", n)}, TokenBudget: 1024 * int(n+1),
			Decisions: &trace.StepDecisions{Strategy: "tree", Advantage: "grpo", PadMultiple: 128, PassCost: 1024,
				Sessions: []trace.SessionDecision{{ID: fmt.Sprintf("g%d-s", n), Advantage: adv}}}}
	}
	tests := []struct {
		name string
		rec  trace.StepRecord
		want error // nil: success; errAny: any error
	}{
		{"uncommitted", decided(1, 0.25), nil},
		{"the same again", decided(1, 0.25), nil},
		{"other decisions", decided(1, 0.5), ErrStepConflict},
		{"committed", decided(0, -0.25), nil},
		{"another budget", func() trace.StepRecord { r := decided(0, -0.25); r.TokenBudget = 64; return r }(), ErrStepConflict},
		{"archived", decided(2, 0), errAny},
		{"never saved", decided(9, 0), ErrUnknownStep},
		{"without decisions", trace.StepRecord{N: 1, Groups: []string{"g1"}, TokenBudget: 2048}, errAny},
	}
	for _, tt := range tests {
		err := s.DecideStep(tt.rec)
		switch {
		case tt.want == nil && err != nil, tt.want != nil && err == nil, tt.want != nil && !errors.Is(tt.want, errAny) && !errors.Is(err, tt.want):
			t.Errorf("%s: DecideStep = %v, want %v", tt.name, err, tt.want)
		}
	}
	if got := undecided("decided"); len(got) != 0 {
		t.Fatalf("undecided steps %v after deciding them", got)
	}
	s = reopen(t, s, dir)
	defer testutil.Close(t, s)
	un, _, err := s.Steps()
	if err != nil || len(un) != 1 || !un[0].Same(decided(1, 0.25)) {
		t.Fatalf("Steps after a reopen = %+v %v, want step 1 as decided", un, err)
	}
	if err := s.CommitStep(1); err != nil {
		t.Fatal(err)
	}
	for _, n := range []int64{0, 1} {
		head, err := s.CommittedStepHead(n)
		if want := decided(n, map[int64]float64{0: -0.25, 1: 0.25}[n]); err != nil || !head.Record.Same(want) {
			t.Fatalf("committed step %d = %+v %v, want its decisions", n, head.Record, err)
		}
	}
	if err := s.ForgetStep(1); err != nil {
		t.Fatal(err)
	}
	if sv := storedStep(t, s, 1); sv.Decisions != nil || !sv.Archived {
		t.Fatalf("archived step 1's tombstone %+v keeps its decisions", sv)
	}
}

// errAny stands for any error in a table of wanted errors.
var errAny = errors.New("any error")

func storedStep(t *testing.T, s *Store, n int64) stepValue {
	t.Helper()
	var sv stepValue
	if err := s.db.View(func(tx *bolt.Tx) error {
		return json.Unmarshal(tx.Bucket(bSteps).Get(seqKey(uint64(n))), &sv)
	}); err != nil {
		t.Fatal(err)
	}
	return sv
}
