package bolt

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
)

const crashEnv = "FLOE_BOLT_CRASH_DIR"

// chainGen yields the calls of one deterministic growing session.
type chainGen struct {
	sess   string
	rng    *rand.Rand
	prompt []int32
}

func newChainGen(sess string, seed uint64) *chainGen {
	g := &chainGen{sess: sess, rng: rand.New(rand.NewPCG(seed, 99))}
	g.prompt = toks(g.rng, 500)
	return g
}

func (g *chainGen) next() trace.Call {
	c := call(g.sess, g.prompt, toks(g.rng, 20+g.rng.IntN(40)), g.rng)
	c.Started = time.Unix(1_700_000_000, 0)
	g.prompt = cat(g.prompt, c.ResponseIDs, toks(g.rng, 10+g.rng.IntN(60)))
	return c
}

const crashSessions = 4

// TestMain runs the crash child when asked to.
func TestMain(m *testing.M) {
	if dir := os.Getenv(crashEnv); dir != "" {
		crashChild(dir)
		os.Exit(3) // not reached: the parent kills the child
	}
	if dir := os.Getenv(compactCrashEnv); dir != "" {
		compactCrashChild(dir, os.Getenv(compactStageEnv))
	}
	os.Exit(m.Run())
}

// crashChild records calls from concurrent sessions, finishes sessions and commits a
// step, printing each operation after it returned, until it is killed.
func crashChild(dir string) {
	s, err := New(dir, Options{})
	if err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	var mu sync.Mutex
	say := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Printf(format+"\n", args...)
	}
	fail := func(err error) {
		say("ERR %v", err)
		os.Exit(2)
	}
	// A finished group with a committed step and one with an uncommitted step.
	for _, g := range []string{"done0", "done1"} {
		if err := s.CreateSession(trace.Session{ID: g + "-s", TaskID: g, GroupID: g}, "", 0); err != nil {
			fail(err)
		}
		if err := s.FinishSession(g+"-s", 1, trace.StatusCompleted); err != nil {
			fail(err)
		}
	}
	if err := s.SaveStep(0, []string{"done0"}); err != nil {
		fail(err)
	}
	if err := s.CommitStep(0); err != nil {
		fail(err)
	}
	if err := s.SaveStep(1, []string{"done1"}); err != nil {
		fail(err)
	}
	say("STEPS")
	for i := range crashSessions {
		id := fmt.Sprintf("s%d", i)
		if err := s.CreateSession(trace.Session{ID: id, TaskID: "t", GroupID: "g"}, "key-"+id, 0); err != nil {
			fail(err)
		}
	}
	for i := range crashSessions {
		go func() {
			id := fmt.Sprintf("s%d", i)
			g := newChainGen(id, uint64(i))
			for k := 0; ; k++ {
				c := g.next()
				if err := s.Record(context.Background(), &c); err != nil {
					fail(err)
				}
				say("R %s %d", id, c.Index)
				if i == 0 && k == 30 {
					if err := s.FinishSession(id, 0.5, trace.StatusCompleted); err != nil {
						fail(err)
					}
					say("F %s", id)
					return
				}
			}
		}()
	}
	select {}
}

// TestCrashDurability kills a recording process with SIGKILL and checks that every call,
// finished session and step whose write returned before the kill is there after reopening.
func TestCrashDurability(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a child process")
	}
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), crashEnv+"="+dir)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	recorded := map[string]int{} // session -> highest index acknowledged
	finished := map[string]bool{}
	steps := false
	sc := bufio.NewScanner(out)
	n := 0
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch f[0] {
		case "ERR":
			t.Fatalf("child: %s", sc.Text())
		case "STEPS":
			steps = true
		case "F":
			finished[f[1]] = true
		case "R":
			idx, _ := strconv.Atoi(f[2])
			if prev, ok := recorded[f[1]]; ok && idx != prev+1 {
				t.Fatalf("session %s: index %d after %d", f[1], idx, prev)
			}
			recorded[f[1]] = idx
			n++
		}
		if n == 300 {
			break
		}
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait() // "signal: killed"
	if !steps || n < 300 || !finished["s0"] {
		t.Fatalf("child stopped early: steps %v, %d calls, finished %v", steps, n, finished)
	}

	s := open(t, dir, Options{})
	defer testutil.Close(t, s)
	for i := range crashSessions {
		id := fmt.Sprintf("s%d", i)
		sess, err := s.Session(id)
		if err != nil {
			t.Fatal(err)
		}
		if len(sess.Calls) < recorded[id]+1 {
			t.Fatalf("session %s: %d calls on disk, %d acknowledged", id, len(sess.Calls), recorded[id]+1)
		}
		g := newChainGen(id, uint64(i))
		for k := range sess.Calls { // acknowledged ones and any in flight at the kill
			want := g.next()
			want.Index = k
			if err := equalCall(&sess.Calls[k], &want); err != nil {
				t.Fatalf("session %s call %d: %v", id, k, err)
			}
		}
		if finished[id] != (sess.Status == trace.StatusCompleted) {
			t.Fatalf("session %s: status %s, finished acknowledged %v", id, sess.Status, finished[id])
		}
		t.Logf("session %s: %d acknowledged, %d on disk", id, recorded[id]+1, len(sess.Calls))
		// A running session takes calls again after the restart, continuing its indices.
		if sess.Status == trace.StatusRunning {
			c := g.next()
			if err := s.Record(context.Background(), &c); err != nil || c.Index != len(sess.Calls) {
				t.Fatalf("record after restart: index %d, err %v", c.Index, err)
			}
		}
	}
	if err := s.CommitStep(0); !errors.Is(err, ErrCommitted) {
		t.Fatalf("committed step 0 after crash: %v", err)
	}
	un, last, err := s.Steps()
	if err != nil || last != 0 || len(un) != 1 || un[0].N != 1 {
		t.Fatalf("Steps after crash = %+v %d %v", un, last, err)
	}
}
