package bolt

import (
	"bufio"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
)

const (
	compactCrashEnv = "FLOE_BOLT_COMPACT_CRASH_DIR"
	compactStageEnv = "FLOE_BOLT_COMPACT_STAGE"
)

// compactCrashChild compacts the store in dir, printing each stage it reaches; at stage
// it stops there until killed. Another stage name ("compact-opened+") is printed and
// passed, so the kill lands somewhere in the copy after it.
func compactCrashChild(dir, stage string) {
	s, err := New(dir, Options{})
	if err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	s.stageHook = func(at string) {
		fmt.Println("AT", at)
		if at == stage {
			time.Sleep(time.Hour) // until killed; select{} here would be a deadlock the runtime kills
		}
	}
	if _, err := s.Compact(); err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	fmt.Println("DONE")
	time.Sleep(time.Hour)
}

// TestCompactCrash kills a compacting process with SIGKILL at each point of the
// compaction (and during the copy) and checks that the reopened store holds exactly what
// it held: every kept call, no forgotten session, the steps committed, no leftover copy.
func TestCompactCrash(t *testing.T) {
	for _, tt := range []struct{ stage, killAfter string }{
		{"", "AT compact-opened"}, // during the copy
		{"compact-copied", "AT compact-copied"},
		{"compact-renamed", "AT compact-renamed"},
		{"", "DONE"},
	} {
		t.Run(strings.TrimPrefix(tt.killAfter, "AT "), func(t *testing.T) {
			dir := t.TempDir()
			s := open(t, dir, Options{})
			rng := rand.New(rand.NewPCG(5, 6))
			for i := range 10 {
				gid := fmt.Sprintf("g%d", i)
				fillGroup(t, s, gid, 4, 8, rng)
				if err := s.SaveStep(int64(i), []string{gid}); err != nil {
					t.Fatal(err)
				}
				if err := s.CommitStep(int64(i)); err != nil {
					t.Fatal(err)
				}
				if i < 9 {
					if err := s.ForgetStep(int64(i)); err != nil {
						t.Fatal(err)
					}
				}
			}
			kept := fillGroup(t, s, "live", 3, 20, rng)
			testutil.Close(t, s)

			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), compactCrashEnv+"="+dir, compactStageEnv+"="+tt.stage)
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			sc := bufio.NewScanner(out)
			reached := false
			for sc.Scan() {
				if strings.HasPrefix(sc.Text(), "ERR") {
					t.Fatalf("child: %s", sc.Text())
				}
				if sc.Text() == tt.killAfter {
					reached = true
					break
				}
			}
			_ = cmd.Process.Signal(syscall.SIGKILL) // it may have died already; Wait reaps it either way
			_ = cmd.Wait()                          // "signal: killed"
			if !reached {
				t.Fatalf("child never reached %q", tt.killAfter)
			}

			s = open(t, dir, Options{})
			defer testutil.Close(t, s)
			if _, err := os.Stat(s.Path() + compactSuffix); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("compaction copy left after reopening: %v", err)
			}
			for sid, calls := range kept {
				got, err := s.Session(sid)
				if err != nil || len(got.Calls) != len(calls) {
					t.Fatalf("session %s: %d calls, want %d (%v)", sid, len(got.Calls), len(calls), err)
				}
				for k := range calls {
					if err := equalCall(&got.Calls[k], &calls[k]); err != nil {
						t.Fatal(err)
					}
				}
			}
			if _, err := s.Resolve("key-g0-s0"); !errors.Is(err, ErrUnknownSession) {
				t.Fatalf("forgotten key resolves: %v", err)
			}
			if g, err := s.Group("g9"); err != nil || len(g.Sessions) != 4 {
				t.Fatalf("committed, unforgotten group g9: %v", err)
			}
			if got, err := s.ArchivableSteps(); err != nil || len(got) != 1 || got[0] != 9 {
				t.Fatalf("archivable %v %v, want [9]", got, err)
			}
			if _, last, err := s.Steps(); err != nil || last != 9 {
				t.Fatalf("last committed %d %v", last, err)
			}
			// The store takes writes again.
			if err := s.CreateSession(trace.Session{ID: "after", TaskID: "t", GroupID: "ga"}, "", 0); err != nil {
				t.Fatal(err)
			}
		})
	}
}
