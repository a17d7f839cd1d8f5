package bolt

import (
	"context"
	"fmt"
	"os"
	"sync/atomic"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/floe-rl/floe/internal/corpus"
	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
)

// benchCalls is one corpus group (corpus.Default, Groups=1: 8 SWE-style sessions) as the
// proxy would see it: each session's calls in order, sessions interleaved.
func benchCalls(b *testing.B) [][]trace.Call {
	cfg := corpus.Default()
	cfg.Groups = 1
	groups, err := corpus.Generate(cfg, 1)
	if err != nil {
		b.Fatal(err)
	}
	var out [][]trace.Call
	for _, s := range groups[0].Sessions {
		out = append(out, s.Calls)
	}
	return out
}

// BenchmarkRecord records a realistic group, every session from its own goroutine, and
// reports bytes on disk per call next to what full int32 prompts would take: disk-B is
// bbolt's page high-water mark, file-B the file size (bbolt preallocates it in steps),
// enc-B the stored call values alone.
// Sub-benchmarks compare the commit modes; "serial" is one session at a time (the
// latency a single harness sees), "parallel" the group's 8 sessions at once.
func BenchmarkRecord(b *testing.B) {
	sessions := benchCalls(b)
	for _, mode := range []struct {
		name string
		mode CommitMode
	}{{"group", CommitGroup}, {"update", CommitUpdate}, {"batch", CommitBatch}} {
		for _, par := range []bool{false, true} {
			name := mode.name + "/serial"
			if par {
				name = mode.name + "/parallel"
			}
			b.Run(name, func(b *testing.B) {
				dir := b.TempDir()
				s := open(b, dir, Options{Commit: mode.mode})
				defer testutil.Close(b, s)
				var round atomic.Int64
				var promptBytes atomic.Int64
				var calls atomic.Int64
				// Each worker records whole sessions (renamed per round) until b.N calls.
				work := func(si int, budget *atomic.Int64) {
					for {
						r := round.Add(1)
						src := sessions[(si+int(r))%len(sessions)]
						id := fmt.Sprintf("s%d-%d", si, r)
						if err := s.CreateSession(trace.Session{ID: id, TaskID: "t"}, "", 0); err != nil {
							b.Error(err)
							return
						}
						for i := range src {
							if budget.Add(-1) < 0 {
								return
							}
							c := src[i]
							c.SessionID = id
							if err := s.Record(context.Background(), &c); err != nil {
								b.Error(err)
								return
							}
							promptBytes.Add(4 * int64(len(c.PromptIDs)))
							calls.Add(1)
						}
					}
				}
				var budget atomic.Int64
				budget.Store(int64(b.N))
				b.ResetTimer()
				if !par {
					work(0, &budget)
				} else {
					done := make(chan struct{})
					for w := range len(sessions) {
						go func() { work(w, &budget); done <- struct{}{} }()
					}
					for range len(sessions) {
						<-done
					}
				}
				b.StopTimer()
				fi, err := os.Stat(s.Path())
				if err != nil {
					b.Fatal(err)
				}
				var encoded, used int64 // the call values; bbolt's pages in use (file high-water)
				err = s.db.View(func(tx *bolt.Tx) error {
					used = tx.Size()
					return tx.Bucket(bSessions).ForEachBucket(func(id []byte) error {
						return tx.Bucket(bSessions).Bucket(id).Bucket(kCalls).ForEach(func(_, v []byte) error {
							encoded += int64(len(v))
							return nil
						})
					})
				})
				if err != nil {
					b.Fatal(err)
				}
				if n := calls.Load(); n > 0 {
					b.ReportMetric(float64(used)/float64(n), "disk-B/call")
					b.ReportMetric(float64(fi.Size())/float64(n), "file-B/call")
					b.ReportMetric(float64(encoded)/float64(n), "enc-B/call")
					b.ReportMetric(float64(promptBytes.Load())/float64(n), "prompt-B/call")
				}
			})
		}
	}
}

// BenchmarkResolve is the proxy's key lookup before every call: the key's session with
// its status (so a finished session's key is refused before upstream), from a store of
// 1000 sessions.
func BenchmarkResolve(b *testing.B) {
	s, err := New(b.TempDir(), Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer testutil.Close(b, s)
	for i := range 1000 {
		if err := s.CreateSession(trace.Session{ID: fmt.Sprintf("s%d", i), TaskID: "t", GroupID: fmt.Sprintf("g%d", i/8)}, fmt.Sprintf("k%d", i), 8); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		if sess, err := s.Resolve(fmt.Sprintf("k%d", i%1000)); err != nil || !sess.Running() {
			b.Fatal(sess, err)
		}
	}
}
