package archive

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/memory"
	"github.com/apache/arrow-go/v18/parquet/file"

	"github.com/floe-rl/floe/trace"
)

// peakAllocator counts the bytes allocated through it, and the most held at once.
type peakAllocator struct {
	memory.Allocator
	cur, peak atomic.Int64
}

func (p *peakAllocator) add(n int64) {
	c := p.cur.Add(n)
	for {
		pk := p.peak.Load()
		if c <= pk || p.peak.CompareAndSwap(pk, c) {
			return
		}
	}
}

func (p *peakAllocator) Allocate(n int) []byte {
	b := p.Allocator.Allocate(n)
	p.add(int64(len(b)))
	return b
}

func (p *peakAllocator) Reallocate(n int, old []byte) []byte {
	b := p.Allocator.Reallocate(n, old)
	p.add(int64(len(b) - len(old)))
	return b
}

func (p *peakAllocator) Free(b []byte) {
	p.add(-int64(len(b)))
	p.Allocator.Free(b)
}

// bigStep is a step of groups sessions × calls, each call with a request of reqBytes of
// JSON no two calls share.
func bigStep(groups, sessions, calls, reqBytes int) *Step {
	st := &Step{Record: trace.StepRecord{N: 7, Committed: true}, Sessions: map[string]SessionInfo{}}
	for g := range groups {
		gid := fmt.Sprintf("g%d", g)
		st.Record.Groups = append(st.Record.Groups, gid)
		grp := trace.Group{ID: gid, TaskID: "t"}
		for s := range sessions {
			sid := fmt.Sprintf("%s-s%d", gid, s)
			sess := trace.Session{ID: sid, TaskID: "t", GroupID: gid, Status: trace.StatusCompleted}
			for c := range calls {
				body := fmt.Sprintf(`{"id":%q,"pad":%q}`, fmt.Sprintf("%s-%d", sid, c), strings.Repeat(fmt.Sprintf("%x", c*7919+s), reqBytes/8))
				sess.Calls = append(sess.Calls, trace.Call{SessionID: sid, Index: c, API: "openai_chat",
					PromptIDs: []int32{1, 2, 3}, ResponseIDs: []int32{4}, Logprobs: []float32{-1}, FinishReason: "stop",
					Trainable: true, Request: json.RawMessage(body)})
			}
			grp.Sessions = append(grp.Sessions, sess)
		}
		st.Groups = append(st.Groups, grp)
	}
	return st
}

// TestWriteStepStreamsBounded: a step whose calls hold far more JSON than the write's
// bound is written in several row groups, never with the whole step in Arrow memory,
// and reads back call for call. (A step past 2 GiB, where a whole-step batch's String
// offsets wrapped and WriteStep panicked, is too big for a test; the bound is what
// keeps any step's batch small.)
func TestWriteStepStreamsBounded(t *testing.T) {
	const reqBytes = 64 << 10
	st := bigStep(4, 4, 12, reqBytes) // 192 calls, about 6 MiB of requests
	total := int64(0)
	for _, g := range st.Groups {
		for _, s := range g.Sessions {
			for _, c := range s.Calls {
				total += int64(len(c.Request))
			}
		}
	}
	tests := []struct {
		name      string
		opt       WriteOptions
		minGroups int
		maxPeak   int64 // bytes of Arrow memory: the batch's bound, with the builder's doubling and the writer's buffers
	}{
		{"by bytes", WriteOptions{BatchBytes: 256 << 10}, 20, 2 << 20},
		{"by rows", WriteOptions{BatchRows: 5}, 38, 2 << 20},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checked := memory.NewCheckedAllocator(memory.NewGoAllocator())
			defer checked.AssertSize(t, 0)
			mem := &peakAllocator{Allocator: checked}
			root := t.TempDir()
			if err := WriteStepGroups(root, StepHead{Record: st.Record}, func(yield func(*trace.Group, map[string]SessionInfo) error) error {
				for gi := range st.Groups {
					if err := yield(&st.Groups[gi], st.Sessions); err != nil {
						return err
					}
				}
				return nil
			}, mem, tt.opt); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(PartitionDir(root, CallsTable, 7), PartFile)
			rgs := rowGroups(t, path)
			peak := mem.peak.Load()
			t.Logf("%s: %d bytes of requests, %d row groups, peak Arrow memory %d bytes", tt.name, total, rgs, peak)
			if rgs < tt.minGroups {
				t.Errorf("%d row groups, want at least %d", rgs, tt.minGroups)
			}
			if peak > tt.maxPeak || peak > total/3 {
				t.Errorf("peak Arrow memory %d bytes, want at most %d (the step holds %d bytes of JSON)", peak, tt.maxPeak, total)
			}
			rows, err := ReadCallsFile(path, checked)
			if err != nil {
				t.Fatal(err)
			}
			i := 0
			for _, g := range st.Groups {
				for _, s := range g.Sessions {
					for _, c := range s.Calls {
						if i >= len(rows) || rows[i].SessionID != c.SessionID || rows[i].Index != c.Index || string(rows[i].Request) != string(c.Request) {
							t.Fatalf("row %d differs from call %s/%d", i, c.SessionID, c.Index)
						}
						i++
					}
				}
			}
			if i != len(rows) {
				t.Fatalf("%d rows, want %d", len(rows), i)
			}
		})
	}
}

func rowGroups(t *testing.T, path string) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }() // read only
	r, err := file.NewParquetReader(f)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Close() }() // read only
	return r.NumRowGroups()
}

// TestJSONColumnsAreLarge: the JSON columns have 64-bit offsets, so a row group's JSON
// may pass 2 GiB.
func TestJSONColumnsAreLarge(t *testing.T) {
	for _, name := range []string{"request", "upstream_request", "response"} {
		f, ok := CallsSchema.FieldsByName(name)
		if !ok || f[0].Type.ID() != arrow.LARGE_STRING {
			t.Errorf("%s: %v, want large_string", name, f)
		}
	}
}
