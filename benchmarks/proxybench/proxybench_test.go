package proxybench

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// TestMain serves floe's proxy when the test binary is started as the benchmark's child.
func TestMain(m *testing.M) {
	if served, err := ServeFromEnv(context.Background(), os.Stdout); served {
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestRunReportsEveryDialectAndNoErrors: every dialect is served through the child proxy
// at a size, in both modes, with more concurrent callers than one session may have calls
// in flight (the proxy's per-session default, 32): each caller is its own session, as
// harnesses are, so none is refused. Its memory phase keeps the stored calls bounded.
func TestRunReportsEveryDialectAndNoErrors(t *testing.T) {
	rep, err := Run(context.Background(), Options{Sizes: []int{64 << 10}, Requests: 10, StreamChunks: 16, Concurrency: 40,
		Duration: 300 * time.Millisecond, ProxyCommand: []string{os.Args[0]}, Memory: 1500 * time.Millisecond, MaxStoredBytes: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Latencies) != 2*len(AllDialects) || len(rep.Throughputs) != len(AllDialects) {
		t.Fatalf("%d latencies, %d throughputs", len(rep.Latencies), len(rep.Throughputs))
	}
	for _, l := range rep.Latencies {
		if l.Err != "" || l.DirectP50 <= 0 || l.ProxyP50 <= 0 || l.ProxyP99 < l.ProxyP50 {
			t.Errorf("%s %v: %+v", l.Dialect, l.Stream, l)
		}
	}
	for _, tp := range rep.Throughputs {
		if tp.Err != "" || tp.Requests == 0 || tp.Errors != 0 || tp.CPUPerCall <= 0 {
			t.Errorf("%s: %+v", tp.Dialect, tp)
		}
	}
	if len(rep.Memory) != 2 || rep.Memory[0].MaxStoredBytes != 0 || rep.Memory[1].MaxStoredBytes != 8<<20 || rep.Memory[1].Peak <= 0 {
		t.Errorf("memory %+v", rep.Memory)
	}
	table := rep.Table()
	for _, d := range AllDialects {
		if !strings.Contains(table, "| floe | "+d.Label()+" | 64 KiB |") {
			t.Errorf("no row for %s:\n%s", d, table)
		}
	}
}

// TestBodiesAreAgentHistoriesOfTheSize: each dialect's body is valid JSON, at least the
// size asked and within one turn of it, with tool calls and results.
func TestBodiesAreAgentHistoriesOfTheSize(t *testing.T) {
	for _, d := range AllDialects {
		for _, size := range []int{64 << 10, 512 << 10} {
			b := Body(d, size, true)
			if !json.Valid(b) || len(b) < size || len(b) > size+4<<10 {
				t.Errorf("%s %d: %d bytes, valid %v", d, size, len(b), json.Valid(b))
			}
			if s := string(b); !strings.Contains(s, "read_file") || !strings.Contains(s, "step_3.go") {
				t.Errorf("%s: no tool calls in the history", d)
			}
		}
	}
}

// TestRunSideBySide: with BeforeCommand (here the same build, under another name) both
// proxies are measured in one run, sample for sample, each under its own name, and the
// report compares them row by row.
func TestRunSideBySide(t *testing.T) {
	rep, err := Run(context.Background(), Options{Dialects: []Dialect{Chat, Gemini}, Sizes: []int{16 << 10}, Requests: 5, StreamChunks: 8,
		Concurrency: 4, Duration: 200 * time.Millisecond, ProxyCommand: []string{os.Args[0]}, BeforeCommand: []string{os.Args[0]}, BeforeName: "earlier"})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Latencies) != 2*2*2 || len(rep.Throughputs) != 2*2 {
		t.Fatalf("%d latencies, %d throughputs; want both builds' rows", len(rep.Latencies), len(rep.Throughputs))
	}
	for _, name := range []string{"earlier", "floe"} {
		for _, d := range []Dialect{Chat, Gemini} {
			for _, stream := range []bool{false, true} {
				if l := rep.latency(name, d, 16<<10, stream); l == nil || l.Err != "" || l.ProxyP50 <= 0 || l.DirectP50 <= 0 {
					t.Errorf("%s %s stream=%v: %+v", name, d, stream, l)
				}
			}
			if tp := rep.throughput(name, d, 16<<10); tp == nil || tp.Requests == 0 || tp.Errors != 0 {
				t.Errorf("%s %s throughput: %+v", name, d, tp)
			}
		}
	}
	table := rep.Table()
	for _, want := range []string{"| dialect | request | mode | added p50 ms, earlier / now |", "| Gemini → chat | 16 KiB | streaming |", "| earlier | OpenAI chat | 16 KiB |"} {
		if !strings.Contains(table, want) {
			t.Errorf("no %q in the report:\n%s", want, table)
		}
	}
	if _, err := Run(context.Background(), Options{ProxyCommand: []string{os.Args[0]}, BeforeCommand: []string{os.Args[0]}, BeforeName: "floe"}); err == nil {
		t.Error("a before build named floe: no error")
	}
}
