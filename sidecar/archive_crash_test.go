package sidecar

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/archive"
	"github.com/floe-rl/floe/trace/bolt"
)

const (
	archiveCrashEnv   = "FLOE_ARCHIVE_CRASH_DIR"
	archiveCrashStage = "FLOE_ARCHIVE_CRASH_STAGE"
	archiveCrashNth   = "FLOE_ARCHIVE_CRASH_NTH"
)

// TestMain runs the archive crash child when asked to.
func TestMain(m *testing.M) {
	if dir := os.Getenv(archiveCrashEnv); dir != "" {
		nth, _ := strconv.Atoi(os.Getenv(archiveCrashNth))
		archiveCrashChild(dir, os.Getenv(archiveCrashStage), nth)
		os.Exit(3)
	}
	os.Exit(m.Run())
}

// archiveCrashChild archives the committed steps of the store in dir, printing each
// stage; at the nth time it reaches stage it stops there until killed.
func archiveCrashChild(dir, stage string, nth int) {
	s, err := bolt.New(dir, bolt.Options{})
	if err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	a := NewArchiver(s, dir+"/archive", memory.NewGoAllocator(), quietLog())
	seen := 0
	a.at = func(at string) {
		fmt.Println("AT", at)
		if at == stage {
			if seen++; seen == nth {
				fmt.Println("STOP")
				time.Sleep(time.Hour) // until killed
			}
		}
	}
	if _, err := a.ArchiveCommitted(context.Background()); err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	fmt.Println("STOP")
	time.Sleep(time.Hour)
}

// TestArchiveCrash kills an archiving process with SIGKILL at each stage of archiving a
// step (after its calls file, its sessions file, its step file, after the store marked
// its files written, after it forgot its group, after it forgot the step), at each stage
// of archiving a dropped group (after its calls file, its sessions file, after the store
// forgot it) and after compaction, restarts, and checks that the archive then holds every call
// exactly once, the store none, the archived keys are refused, and the committed steps
// stay committed.
func TestArchiveCrash(t *testing.T) {
	const steps = 3
	for _, stage := range []string{string(archive.StageCalls), string(archive.StageSessions), string(archive.StageSteps), "files-marked",
		"group-forgotten", "forgotten", "dropped-" + string(archive.StageCalls), "dropped-" + string(archive.StageSessions),
		"dropped-forgotten", "compacted"} {
		t.Run(stage, func(t *testing.T) {
			dir := t.TempDir()
			s, err := bolt.New(dir, bolt.Options{})
			if err != nil {
				t.Fatal(err)
			}
			recorded := map[callKey]trace.Call{}
			var keys []string
			for k := range steps {
				calls, ks := recordStep(t, s, k)
				for ck, c := range calls {
					recorded[ck] = c
				}
				keys = append(keys, ks...)
			}
			// Two dropped groups, archived after the steps.
			dropped := recordDroppedGroup(t, s, "gd0")
			maps.Copy(dropped, recordDroppedGroup(t, s, "gd1"))
			testutil.Close(t, s)

			nth := 2 // in the second step or dropped group: the first is archived whole before
			if stage == "compacted" {
				nth = 1 // once, after the last step
			}
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), archiveCrashEnv+"="+dir, archiveCrashStage+"="+stage, archiveCrashNth+"="+strconv.Itoa(nth))
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			var trail []string
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				if strings.HasPrefix(sc.Text(), "ERR") {
					t.Fatalf("child: %s", sc.Text())
				}
				if sc.Text() == "STOP" {
					break
				}
				trail = append(trail, sc.Text())
			}
			_ = cmd.Process.Signal(syscall.SIGKILL) // it may have died already; Wait reaps it either way
			_ = cmd.Wait()                          // "signal: killed"
			if len(trail) == 0 || trail[len(trail)-1] != "AT "+stage {
				t.Fatalf("child stopped after %v, not at %s", trail, stage)
			}

			mem := checkedMem(t)
			s, err = bolt.New(dir, bolt.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer testutil.Close(t, s)
			a := NewArchiver(s, dir+"/archive", mem, quietLog())
			if _, err := a.ArchiveCommitted(context.Background()); err != nil { // floe serve's start
				t.Fatal(err)
			}
			checkArchive(t, dir+"/archive", recorded, steps, mem)
			checkDropped(t, dir+"/archive", dropped, mem)
			u, err := s.Usage()
			if err != nil || u.Calls != 0 || u.Sessions != 0 || u.ArchivedCalls != len(recorded)+len(dropped) {
				t.Fatalf("store after restart: %+v %v", u, err)
			}
			for _, k := range keys {
				if _, err := s.Resolve(k); !errors.Is(err, trace.ErrUnknownSession) {
					t.Fatalf("archived key %s: %v", k, err)
				}
			}
			if un, last, err := s.Steps(); err != nil || len(un) != 0 || last != steps-1 {
				t.Fatalf("steps after restart: %v %d %v", un, last, err)
			}
			if err := s.CommitStep(1); !errors.Is(err, trace.ErrCommitted) {
				t.Fatalf("second commit of an archived step: %v", err)
			}
		})
	}
}
