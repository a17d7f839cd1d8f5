package bolt

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
)

// BenchmarkCompact measures a compaction of a store holding about 64 MiB of live calls
// (their requests, mostly): writes wait this long while it runs (docs/archive.md).
// go test ./trace/bolt -run '^$' -bench Compact -benchtime 5x
func BenchmarkCompact(b *testing.B) {
	s := open(b, b.TempDir(), Options{Commit: CommitUpdate})
	defer testutil.Close(b, s)
	rng := rand.New(rand.NewPCG(1, 1))
	body := strings.Repeat("x", 96<<10)
	for i := range 8 {
		sid := fmt.Sprintf("s%d", i)
		if err := s.CreateSession(trace.Session{ID: sid, TaskID: "t", GroupID: "g"}, "", 0); err != nil {
			b.Fatal(err)
		}
		for k := range 85 {
			c := call(sid, toks(rng, 300), toks(rng, 100), rng)
			c.Request = []byte(fmt.Sprintf(`{"call":%d,"pad":%q}`, k, body+fmt.Sprint(rng.Int())))
			if err := s.Record(context.Background(), &c); err != nil {
				b.Fatal(err)
			}
		}
	}
	live, err := s.live()
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(live)
	b.ResetTimer()
	for range b.N {
		c, err := s.Compact()
		if err != nil || !c.Compacted {
			b.Fatal(c, err)
		}
	}
}
