package sidecar

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow/memory"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/archive"
	"github.com/floe-rl/floe/trace/bolt"
)

// The workload of the retention bound (docs/archive.md): each step is one group of
// boundSessions sessions of boundCalls calls; a call's prompt starts at 300 tokens and
// grows by its answer (100-200 tokens) and a tool result (50), and its request is
// several KB of JSON that grows with the conversation.
const (
	boundSteps    = 100
	boundSessions = 4
	boundCalls    = 6
	// storeBound is the bbolt file's bound with archiving over that workload: the
	// compaction floor (trace.CompactPolicy's 1 MiB), above twice what the store holds at
	// once (one step, here) in a fresh file. Without archiving the file passes it within
	// the first dozen steps.
	storeBound = 1 << 20
)

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func checkedMem(t *testing.T) memory.Allocator {
	mem := memory.NewCheckedAllocator(memory.NewGoAllocator())
	t.Cleanup(func() { mem.AssertSize(t, 0) })
	return mem
}

func toks(rng *rand.Rand, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = rng.Int32N(151_000)
	}
	return out
}

// callKey names a recorded call.
type callKey struct {
	session       string
	index, choice int
}

// recordStep records step k's group (sessions concurrently, as harnesses do), finishes
// its sessions with rewards, saves and commits the step. It returns the calls recorded
// and the sessions' API keys.
func recordStep(t *testing.T, s *bolt.Store, k int) (map[callKey]trace.Call, []string) {
	t.Helper()
	gid := fmt.Sprintf("g%03d", k)
	var mu sync.Mutex
	out := map[callKey]trace.Call{}
	var keys []string
	var wg sync.WaitGroup
	errs := make(chan error, boundSessions)
	for i := range boundSessions {
		sid := fmt.Sprintf("%s-s%d", gid, i)
		key := "key-" + sid
		keys = append(keys, key)
		if err := s.CreateSession(trace.Session{ID: sid, TaskID: "task-" + gid, GroupID: gid}, key, boundSessions); err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(k), uint64(i)))
			prompt := toks(rng, 300)
			msgs := []string{fmt.Sprintf(`{"role":"system","content":%q}`, strings.Repeat("You are a coding agent. ", 120))}
			for c := range boundCalls {
				resp := toks(rng, 100+rng.IntN(100))
				lp := make([]float32, len(resp))
				for j := range lp {
					lp[j] = -rng.Float32() * 4
				}
				msgs = append(msgs, fmt.Sprintf(`{"role":"user","content":"tool result %d: %s"}`, c, strings.Repeat("ok ", 150)))
				req := `{"model":"qwen","messages":[` + strings.Join(msgs, ",") + `]}`
				temp := 0.8
				call := trace.Call{SessionID: sid, PromptIDs: prompt, ResponseIDs: resp, Logprobs: lp, FinishReason: "tool_calls",
					PolicyVersion: int64(k), Trainable: true, API: "openai_chat", Started: time.Now().UTC(), Finished: time.Now().UTC(),
					Request: []byte(req), UpstreamRequest: []byte(req), Response: []byte(`{"role":"assistant","content":"` + strings.Repeat("x", 400) + `"}`),
					Sampling: &trace.Sampling{Temperature: &temp}}
				if err := s.Record(context.Background(), &call); err != nil {
					errs <- err
					return
				}
				mu.Lock()
				out[callKey{sid, call.Index, call.Choice}] = call
				mu.Unlock()
				msgs = append(msgs, `{"role":"assistant","content":"`+strings.Repeat("x", 400)+`"}`)
				prompt = slices.Concat(prompt, resp, toks(rng, 50))
			}
			errs <- s.FinishSession(sid, float64(i%3), trace.StatusCompleted)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	saveDecided(t, s, trace.StepRecord{N: int64(k), Groups: []string{gid}, TokenBudget: 8192, MinPolicyVersion: int64(k)}, DefaultConfig())
	if err := s.CommitStep(int64(k)); err != nil {
		t.Fatal(err)
	}
	return out, keys
}

// saveDecided saves rec with the decisions floe serve with cfg takes on its groups, as
// the step former does when it forms the step.
func saveDecided(t *testing.T, s *bolt.Store, rec trace.StepRecord, cfg Config) {
	t.Helper()
	var groups []*decidedGroup
	for _, id := range rec.Groups {
		g, err := s.Group(id)
		if err != nil {
			t.Fatal(err)
		}
		d, err := cfg.decide(g, rec.MinPolicyVersion)
		if err != nil {
			t.Fatal(err)
		}
		groups = append(groups, d)
	}
	rec.Decisions = cfg.stepDecisions(groups)
	if err := s.SaveStepRecord(rec); err != nil {
		t.Fatal(err)
	}
}

// checkArchive reads the archive under dir back and checks it holds every call of
// recorded exactly once (dropped groups' rows aside), token for token, and one session and step row per session and
// step, with the advantages the batcher computes.
func checkArchive(t *testing.T, dir string, recorded map[callKey]trace.Call, steps int, mem memory.Allocator) {
	t.Helper()
	rows, err := archive.ReadCalls(dir, mem)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[callKey]bool{}
	for _, r := range rows {
		if r.Step == nil {
			continue // a dropped group's (checkDropped)
		}
		k := callKey{r.SessionID, r.Index, r.Choice}
		if seen[k] {
			t.Fatalf("call %+v archived twice", k)
		}
		seen[k] = true
		want, ok := recorded[k]
		if !ok {
			t.Fatalf("archived call %+v was never recorded", k)
		}
		if !slices.Equal(r.PromptIDs, want.PromptIDs) || !slices.Equal(r.ResponseIDs, want.ResponseIDs) ||
			!slices.Equal(r.Logprobs, want.Logprobs) || string(r.Request) != string(want.Request) ||
			r.Sampling == nil || *r.Sampling.Temperature != *want.Sampling.Temperature || r.Step == nil ||
			fmt.Sprintf("g%03d", *r.Step) != r.GroupID || r.PolicyVersion != want.PolicyVersion {
			t.Fatalf("archived call %+v differs from the one recorded", k)
		}
	}
	if len(seen) != len(recorded) {
		t.Fatalf("%d calls archived, %d recorded", len(seen), len(recorded))
	}
	sess, err := archive.ReadSessions(dir, mem)
	if err != nil {
		t.Fatal(err)
	}
	sess = slices.DeleteFunc(sess, func(r archive.SessionRow) bool { return r.Step == nil })
	if len(sess) != steps*boundSessions {
		t.Fatalf("%d sessions archived, want %d", len(sess), steps*boundSessions)
	}
	rewards := make([]float64, boundSessions)
	for i := range rewards {
		rewards[i] = float64(i % 3)
	}
	adv := batcher.Advantages(batcher.GRPO, rewards)
	for _, s := range sess {
		i := int(s.Session.ID[len(s.Session.ID)-1] - '0')
		if s.Advantage == nil || math.Abs(*s.Advantage-adv[i]) > 1e-12 || s.Calls != boundCalls || s.Finished.IsZero() {
			t.Fatalf("session row %+v, want advantage %v and %d calls", s, adv[i], boundCalls)
		}
	}
	st, err := archive.ReadSteps(dir, mem)
	if err != nil {
		t.Fatal(err)
	}
	if len(st) != steps {
		t.Fatalf("%d step rows, want %d", len(st), steps)
	}
	for i, r := range st {
		if r.Record.N != int64(i) || r.Calls != boundSessions*boundCalls || r.Record.TokenBudget != 8192 || r.Committed.IsZero() {
			t.Fatalf("step row %+v", r)
		}
	}
}

// TestArchiveKeepsStoreBounded records 100 steps of calls and archives each as it is
// committed: the bbolt file stays under storeBound at every step, and the archive holds
// every call exactly once. The same workload without archiving passes the bound (the
// test's figures are in docs/archive.md: go test ./sidecar -run StoreBounded -v).
func TestArchiveKeepsStoreBounded(t *testing.T) {
	for _, archiving := range []bool{true, false} {
		t.Run(fmt.Sprintf("archive=%v", archiving), func(t *testing.T) {
			mem := checkedMem(t)
			dir := t.TempDir()
			s, err := bolt.New(dir, bolt.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer testutil.Close(t, s)
			a := NewArchiver(s, dir+"/archive", mem, quietLog())
			recorded := map[callKey]trace.Call{}
			var peak int64
			for k := range boundSteps {
				calls, keys := recordStep(t, s, k)
				for ck, c := range calls {
					recorded[ck] = c
				}
				if archiving {
					done, err := a.ArchiveCommitted(context.Background())
					if err != nil || !slices.Equal(done, []int64{int64(k)}) {
						t.Fatalf("step %d: archived %v, %v", k, done, err)
					}
					if _, err := s.Resolve(keys[0]); !errors.Is(err, trace.ErrUnknownSession) {
						t.Fatalf("archived session's key resolves: %v", err)
					}
				}
				u, err := s.Usage()
				if err != nil {
					t.Fatal(err)
				}
				peak = max(peak, u.FileBytes)
			}
			u, _ := s.Usage()
			t.Logf("archive=%v: %d steps, %d calls: bbolt file %d bytes at the end, %d at most; store holds %d calls",
				archiving, boundSteps, len(recorded), u.FileBytes, peak, u.Calls)
			if !archiving {
				if peak <= storeBound {
					t.Fatalf("without archiving the file stayed at %d bytes, within the bound %d: the bound shows nothing", peak, storeBound)
				}
				// Archiving turned on for a store that grew without it: everything goes to
				// the archive and the file is compacted under the bound.
				done, err := a.ArchiveCommitted(context.Background())
				if err != nil || len(done) != boundSteps {
					t.Fatalf("archived %d steps, %v", len(done), err)
				}
				if u, _ = s.Usage(); u.FileBytes > storeBound {
					t.Fatalf("after archiving a grown store the file is %d bytes, over the bound %d", u.FileBytes, storeBound)
				}
				t.Logf("archiving it afterwards: bbolt file %d bytes", u.FileBytes)
			} else if peak > storeBound {
				t.Fatalf("bbolt file reached %d bytes, over the bound %d", peak, storeBound)
			}
			if u.Calls != 0 || u.ArchivedCalls != len(recorded) || u.ArchivedSteps != boundSteps {
				t.Fatalf("usage %+v after archiving everything", u)
			}
			if _, last, err := s.Steps(); err != nil || last != boundSteps-1 {
				t.Fatalf("last committed %d %v", last, err)
			}
			checkArchive(t, dir+"/archive", recorded, boundSteps, mem)
			var archived int64
			err = filepath.WalkDir(dir+"/archive", func(_ string, d fs.DirEntry, err error) error {
				if err == nil && !d.IsDir() {
					fi, _ := d.Info()
					archived += fi.Size()
				}
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("archive: %d bytes for %d calls (%d bytes of requests, answers and tokens recorded)", archived, len(recorded), recordedBytes(recorded))
			if ents, _ := os.ReadDir(dir + "/archive/calls"); len(ents) != boundSteps {
				t.Fatalf("%d call partitions, want %d", len(ents), boundSteps)
			}
		})
	}
}

// TestServeArchivesCommittedSteps runs floe serve: once the trainer commits a step, its
// calls are in the archive, its sessions' keys get 401 from the proxy, and the store
// holds them no more; after a restart the step is not served again and the numbering
// goes on.
func TestServeArchivesCommittedSteps(t *testing.T) {
	cfg := testConfig(t)
	mem := checkedMem(t)
	var keys, ids []string
	t.Run("serve", func(t *testing.T) {
		r := startServe(t, cfg)
		for i := range 2 {
			s := r.post("/floe/v1/sessions", "", `{"task_id": "t0", "group_id": "g0"}`, 200)
			key := s["api_key"].(string)
			keys = append(keys, key)
			ids = append(ids, s["session_id"].(string))
			r.post("/v1/chat/completions", key, fmt.Sprintf(`{"model":"x","messages":[{"role":"user","content":"session %d"}]}`, i), 200)
			r.post("/floe/v1/sessions/"+s["session_id"].(string)+"/finish", "", fmt.Sprintf(`{"reward": %d, "status": "completed"}`, i), 200)
		}
		r.fetch(0)
		r.action("commit", `{"step": 0}`)
		stepFile := archive.PartitionDir(cfg.DataDir+"/archive", archive.StepsTable, 0) + "/" + archive.PartFile
		waitFor(t, "step 0 archived", func() bool { _, err := os.Stat(stepFile); return err == nil })
		waitFor(t, "the store to forget step 0", func() bool {
			st := r.action("status", `{}`)
			store, _ := st["store"].(map[string]any)
			return store != nil && store["archived_steps"] == float64(1)
		})
		for _, k := range keys {
			r.post("/v1/chat/completions", k, `{"model":"x","messages":[{"role":"user","content":"again"}]}`, 401)
		}
		// Reading an archived session says where it went, not "unknown session".
		resp, err := http.Get(r.control + "/floe/v1/sessions/" + ids[0])
		if err != nil {
			t.Fatal(err)
		}
		var gone map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&gone)
		resp.Body.Close()
		calls := archive.PartitionDir(cfg.DataDir+"/archive", archive.CallsTable, 0)
		if msg, _ := gone["error"].(string); resp.StatusCode != http.StatusGone || gone["archived_step"] != float64(0) ||
			gone["calls"] != calls || !strings.Contains(msg, "was archived with step 0") {
			t.Fatalf("GET of an archived session: %d %v; want 410 naming step 0 and %s", resp.StatusCode, gone, calls)
		}
		if _, err := os.Stat(filepath.Join(calls, archive.PartFile)); err != nil {
			t.Fatalf("the partition named: %v", err)
		}
	})
	rows, err := archive.ReadCalls(cfg.DataDir+"/archive", mem)
	if err != nil || len(rows) != 2 {
		t.Fatalf("%d calls archived, want 2 (%v)", len(rows), err)
	}
	for _, r := range rows {
		if r.Step == nil || *r.Step != 0 || r.GroupID != "g0" || len(r.PromptIDs) == 0 || len(r.ResponseIDs) == 0 ||
			len(r.Logprobs) != len(r.ResponseIDs) || len(r.Request) == 0 {
			t.Fatalf("archived call %+v", r)
		}
	}
	t.Run("restart", func(t *testing.T) {
		r := startServe(t, cfg)
		for _, k := range keys {
			r.post("/v1/chat/completions", k, `{"model":"x","messages":[{"role":"user","content":"again"}]}`, 401)
		}
		r.group(1)
		r.fetch(1)
		r.action("commit", `{"step": 1}`)
		waitFor(t, "step 1 archived", func() bool {
			_, err := os.Stat(archive.PartitionDir(cfg.DataDir+"/archive", archive.StepsTable, 1) + "/" + archive.PartFile)
			return err == nil
		})
	})
	st, err := archive.ReadSteps(cfg.DataDir+"/archive", mem)
	if err != nil || len(st) != 2 || st[0].Record.N != 0 || st[1].Record.N != 1 {
		t.Fatalf("steps archived %+v %v", st, err)
	}
}

// TestArchiveDroppedGroups: a group dropped before any step is archived with a null step
// and its reason, and leaves the store; archiving stopped after either of its files (as
// a crash would stop it; TestArchiveCrash kills real processes) archives it again at
// restart, once.
func TestArchiveDroppedGroups(t *testing.T) {
	for _, killAt := range []string{"", "dropped-" + string(archive.StageCalls), "dropped-" + string(archive.StageSessions)} {
		t.Run("stopped at "+killAt, func(t *testing.T) {
			mem := checkedMem(t)
			dir := t.TempDir()
			s, err := bolt.New(dir, bolt.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { testutil.Close(t, s) }()
			calls, keys := recordStep(t, s, 0) // step 0, committed
			// A second group, dropped instead of trained.
			for i := range 2 {
				sid := fmt.Sprintf("d-s%d", i)
				if err := s.CreateSession(trace.Session{ID: sid, TaskID: "td", GroupID: "gd"}, "key-"+sid, 2); err != nil {
					t.Fatal(err)
				}
				c := trace.Call{SessionID: sid, PromptIDs: []int32{1, 2}, ResponseIDs: []int32{3}, Logprobs: []float32{-1}, Trainable: true}
				if err := s.Record(context.Background(), &c); err != nil {
					t.Fatal(err)
				}
				calls[callKey{sid, 0, 0}] = c
				if err := s.FinishSession(sid, 0, trace.StatusFailed); err != nil {
					t.Fatal(err)
				}
			}
			if err := s.DropGroup("gd", "0 usable sessions, fewer than 2"); err != nil {
				t.Fatal(err)
			}
			if killAt != "" {
				// The crash, in process: the stage hook stops archiving where a kill would.
				a := NewArchiver(s, dir+"/archive", mem, quietLog())
				a.at = func(st string) {
					if st == killAt {
						panic(errCrash)
					}
				}
				// The archiver turns the panic into the pass's error (as it does any panic).
				if _, err := a.ArchiveCommitted(context.Background()); err == nil || !strings.Contains(err.Error(), "panic: "+errCrash.Error()) {
					t.Fatalf("archiving did not reach %s: %v", killAt, err)
				}
				if err := s.Close(); err != nil {
					t.Fatal(err)
				}
				if s, err = bolt.New(dir, bolt.Options{}); err != nil {
					t.Fatal(err)
				}
			}
			a := NewArchiver(s, dir+"/archive", mem, quietLog())
			if _, err := a.ArchiveCommitted(context.Background()); err != nil {
				t.Fatal(err)
			}
			rows, err := archive.ReadCalls(dir+"/archive", mem)
			if err != nil || len(rows) != len(calls) {
				t.Fatalf("%d calls archived, want %d (%v)", len(rows), len(calls), err)
			}
			seen := map[callKey]bool{}
			for _, r := range rows {
				k := callKey{r.SessionID, r.Index, r.Choice}
				if seen[k] || (r.GroupID == "gd") != (r.Step == nil) {
					t.Fatalf("call %+v: twice %v, step %v", k, seen[k], r.Step)
				}
				if r.GroupID == "gd" && (r.Trainable || r.UntrainableReason != "group dropped: 0 usable sessions, fewer than 2") {
					t.Fatalf("dropped group's call %+v: trainable %v (%q), but no step trained on it", k, r.Trainable, r.UntrainableReason)
				}
				seen[k] = true
			}
			sess, err := archive.ReadSessions(dir+"/archive", mem)
			if err != nil || len(sess) != boundSessions+2 {
				t.Fatalf("%d sessions archived (%v)", len(sess), err)
			}
			for _, r := range sess {
				if (r.GroupID == "gd") != (r.Step == nil && r.DropReason == "0 usable sessions, fewer than 2" && r.Advantage == nil) {
					t.Fatalf("session row %+v", r)
				}
			}
			if gs, err := s.Groups(); err != nil || len(gs) != 0 {
				t.Fatalf("groups left in the store: %+v %v", gs, err)
			}
			for _, k := range append(keys, "key-d-s0") {
				if _, err := s.Resolve(k); !errors.Is(err, trace.ErrUnknownSession) {
					t.Fatalf("archived key %s: %v", k, err)
				}
			}
		})
	}
}

var errCrash = errors.New("crash")

// recordedBytes is the size of the calls' JSON fields and token data as recorded.
func recordedBytes(calls map[callKey]trace.Call) int64 {
	var n int64
	for _, c := range calls {
		n += int64(len(c.Request)+len(c.UpstreamRequest)+len(c.Response)) + 4*int64(len(c.PromptIDs)+2*len(c.ResponseIDs))
	}
	return n
}

// TestArchiveSaysWhichCallsTrained: a call of a failed session, and one sampled by a
// policy older than its step's cut-off, were recorded trainable but trained on by no loss
// term; the archive marks them so, with the reason, and the others trainable.
func TestArchiveSaysWhichCallsTrained(t *testing.T) {
	mem := checkedMem(t)
	dir := t.TempDir()
	s, err := bolt.New(dir, bolt.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer testutil.Close(t, s)
	// session: status, policy versions of its calls
	sessions := []struct {
		id       string
		status   trace.Status
		versions []int64
	}{
		{"ok", trace.StatusCompleted, []int64{3, 3}},
		{"stale", trace.StatusCompleted, []int64{2, 3}},
		{"failed", trace.StatusFailed, []int64{3}},
	}
	for _, ss := range sessions {
		if err := s.CreateSession(trace.Session{ID: ss.id, TaskID: "t", GroupID: "g"}, "key-"+ss.id, len(sessions)); err != nil {
			t.Fatal(err)
		}
		for _, v := range ss.versions {
			c := trace.Call{SessionID: ss.id, PromptIDs: []int32{1, 2}, ResponseIDs: []int32{3}, Logprobs: []float32{-1},
				PolicyVersion: v, Trainable: true}
			if err := s.Record(context.Background(), &c); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.FinishSession(ss.id, 1, ss.status); err != nil {
			t.Fatal(err)
		}
	}
	cfg := DefaultConfig()
	cfg.DropFailed = true // the failed session leaves the group, and is archived all the same
	saveDecided(t, s, trace.StepRecord{N: 0, Groups: []string{"g"}, MinPolicyVersion: 3}, cfg)
	if err := s.CommitStep(0); err != nil {
		t.Fatal(err)
	}
	a := NewArchiver(s, dir+"/archive", mem, quietLog())
	if _, err := a.ArchiveCommitted(context.Background()); err != nil {
		t.Fatal(err)
	}
	rows, err := archive.ReadCalls(dir+"/archive", mem)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, r := range rows {
		k := fmt.Sprintf("%s/%d", r.SessionID, r.Index)
		if r.Trainable != (r.UntrainableReason == "") {
			t.Fatalf("call %s: trainable %v with reason %q", k, r.Trainable, r.UntrainableReason)
		}
		got[k] = r.UntrainableReason
	}
	want := map[string]string{
		"ok/0": "", "ok/1": "",
		"stale/0": "stale: policy version 2, older than 3", "stale/1": "",
		"failed/0": "session failed",
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("archived calls' untrainable reasons\n got %v\nwant %v", got, want)
	}
	sess, err := archive.ReadSessions(dir+"/archive", mem)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range sess {
		if (r.Session.ID == "failed") != (r.Advantage == nil) {
			t.Fatalf("session %s: advantage %v (only the session -drop-failed dropped has none)", r.Session.ID, r.Advantage)
		}
	}
}

// recordDroppedGroup records group gid of two failed sessions of one call each and drops
// it, as the step former does; it returns the calls.
func recordDroppedGroup(t *testing.T, s *bolt.Store, gid string) map[callKey]trace.Call {
	t.Helper()
	out := map[callKey]trace.Call{}
	for i := range 2 {
		sid := fmt.Sprintf("%s-s%d", gid, i)
		if err := s.CreateSession(trace.Session{ID: sid, TaskID: "t" + gid, GroupID: gid}, "key-"+sid, 2); err != nil {
			t.Fatal(err)
		}
		c := trace.Call{SessionID: sid, PromptIDs: []int32{1, 2}, ResponseIDs: []int32{3}, Logprobs: []float32{-1}, Trainable: true}
		if err := s.Record(context.Background(), &c); err != nil {
			t.Fatal(err)
		}
		out[callKey{sid, 0, 0}] = c
		if err := s.FinishSession(sid, 0, trace.StatusFailed); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.DropGroup(gid, "0 usable sessions, fewer than 2"); err != nil {
		t.Fatal(err)
	}
	return out
}

// checkDropped checks the archive under dir holds each call of dropped, once, with a
// null step, and one session row per session of them with the drop reason.
func checkDropped(t *testing.T, dir string, dropped map[callKey]trace.Call, mem memory.Allocator) {
	t.Helper()
	rows, err := archive.ReadCalls(dir, mem)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[callKey]bool{}
	for _, r := range rows {
		if r.Step != nil {
			continue
		}
		k := callKey{r.SessionID, r.Index, r.Choice}
		if _, ok := dropped[k]; !ok || seen[k] {
			t.Fatalf("dropped call %+v: recorded %v, seen before %v", k, ok, seen[k])
		}
		seen[k] = true
	}
	if len(seen) != len(dropped) {
		t.Fatalf("%d dropped calls archived, want %d", len(seen), len(dropped))
	}
	sess, err := archive.ReadSessions(dir, mem)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, r := range sess {
		if r.Step == nil {
			n++
			if r.DropReason == "" || r.Advantage != nil {
				t.Fatalf("dropped session row %+v", r)
			}
		}
	}
	if n != len(dropped) { // one call per session
		t.Fatalf("%d dropped session rows, want %d", n, len(dropped))
	}
}
