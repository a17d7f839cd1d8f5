package bolt

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/floe-rl/floe/internal/corpus"
	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace"
)

// The proxy's interfaces, copied: the store satisfies them structurally without
// importing the proxy.
var (
	_ interface {
		Resolve(key string) (trace.Session, error)
		Open(key string) (string, error)
	} = (*Store)(nil)
	_ interface {
		Record(ctx context.Context, c *trace.Call) error
	} = (*Store)(nil)
)

func open(t testing.TB, dir string, opt Options) *Store {
	t.Helper()
	s, err := New(dir, opt)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func reopen(t testing.TB, s *Store, dir string) *Store {
	t.Helper()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	return open(t, dir, s.opt)
}

// equalCall compares every recorded field: token slices by content (an empty slice reads
// back as nil), log-probabilities bit for bit, JSON bytes with their nil-ness, times as
// instants.
func jsonOf(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func equalCall(a, b *trace.Call) error {
	switch {
	case a.SessionID != b.SessionID || a.Index != b.Index || a.Choice != b.Choice:
		return fmt.Errorf("identity %s/%d/%d != %s/%d/%d", a.SessionID, a.Index, a.Choice, b.SessionID, b.Index, b.Choice)
	case !slices.Equal(a.PromptIDs, b.PromptIDs):
		return fmt.Errorf("prompt_ids differ (%d vs %d tokens)", len(a.PromptIDs), len(b.PromptIDs))
	case !slices.Equal(a.ResponseIDs, b.ResponseIDs):
		return fmt.Errorf("response_ids differ")
	case len(a.Logprobs) != len(b.Logprobs):
		return fmt.Errorf("%d logprobs vs %d", len(a.Logprobs), len(b.Logprobs))
	case a.FinishReason != b.FinishReason || a.PolicyVersion != b.PolicyVersion || a.API != b.API:
		return fmt.Errorf("finish/policy/api differ: %q %d %q vs %q %d %q", a.FinishReason, a.PolicyVersion, a.API, b.FinishReason, b.PolicyVersion, b.API)
	case a.Trainable != b.Trainable || a.UntrainableReason != b.UntrainableReason:
		return fmt.Errorf("trainable %v %q vs %v %q", a.Trainable, a.UntrainableReason, b.Trainable, b.UntrainableReason)
	case !a.Started.Equal(b.Started) || !a.Finished.Equal(b.Finished) || a.UpstreamLatency != b.UpstreamLatency:
		return fmt.Errorf("times differ")
	case !reflect.DeepEqual(a.Sampling, b.Sampling):
		return fmt.Errorf("sampling %s vs %s", jsonOf(a.Sampling), jsonOf(b.Sampling))
	}
	for i := range a.Logprobs {
		if math.Float32bits(a.Logprobs[i]) != math.Float32bits(b.Logprobs[i]) {
			return fmt.Errorf("logprobs[%d] %v vs %v", i, a.Logprobs[i], b.Logprobs[i])
		}
	}
	for i, p := range [][2]json.RawMessage{{a.Request, b.Request}, {a.UpstreamRequest, b.UpstreamRequest}, {a.Response, b.Response}} {
		if !bytes.Equal(p[0], p[1]) || (p[0] == nil) != (p[1] == nil) {
			return fmt.Errorf("json field %d: %q vs %q", i, p[0], p[1])
		}
	}
	return nil
}

func toks(rng *rand.Rand, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = rng.Int32N(151_000)
	}
	return out
}

func lps(rng *rand.Rand, n int) []float32 {
	out := make([]float32, n)
	for i := range out {
		out[i] = -rng.Float32() * 5
	}
	return out
}

func cat(parts ...[]int32) []int32 { return slices.Concat(parts...) }

func call(sess string, prompt, resp []int32, rng *rand.Rand) trace.Call {
	return trace.Call{SessionID: sess, PromptIDs: prompt, ResponseIDs: resp, Logprobs: lps(rng, len(resp)),
		FinishReason: "tool_calls", PolicyVersion: 3, Trainable: true}
}

// scenarios builds sessions of calls with the events that break a plain chain. Index is
// the index Record must assign.
func scenarios() map[string][]trace.Call {
	rng := rand.New(rand.NewPCG(1, 2))
	sys, task := toks(rng, 300), toks(rng, 40)
	out := map[string][]trace.Call{}

	// chain: each prompt is the previous prompt + response + tool output.
	{
		p := cat(sys, task)
		var cs []trace.Call
		for i := range 6 {
			r := toks(rng, 20+i)
			c := call("chain", p, r, rng)
			c.Index = i
			cs = append(cs, c)
			p = cat(p, r, toks(rng, 30))
		}
		out["chain"] = cs
	}
	// drift: the next prompt re-tokenizes the last response (shares up to the drift point).
	{
		p0 := cat(sys, task)
		r0 := toks(rng, 30)
		drifted := cat(r0[:10], []int32{7, 8}, r0[12:])
		p1 := cat(p0, drifted, toks(rng, 20))
		r1 := toks(rng, 15)
		out["drift"] = []trace.Call{call("drift", p0, r0, rng), call("drift", p1, r1, rng), call("drift", cat(p1, r1), toks(rng, 5), rng)}
		for i := range out["drift"] {
			out["drift"][i].Index = i
		}
	}
	// compaction: the history is replaced by a summary; only the system prompt is shared.
	{
		p0 := cat(sys, task, toks(rng, 200))
		r0 := toks(rng, 40)
		p1 := cat(sys, toks(rng, 25))
		cs := []trace.Call{call("compact", p0, r0, rng), call("compact", cat(p0, r0, toks(rng, 10)), toks(rng, 8), rng), call("compact", p1, toks(rng, 9), rng)}
		for i := range cs {
			cs[i].Index = i
		}
		out["compact"] = cs
	}
	// n>1: three choices of one request share its index and prompt; the chain continues
	// from choice 0; a sub-agent call with an unrelated prompt sits in between.
	{
		p0 := cat(sys, task)
		ch := []trace.Call{call("multi", p0, toks(rng, 12), rng), call("multi", p0, toks(rng, 11), rng), call("multi", p0, toks(rng, 13), rng)}
		for i := range ch {
			ch[i].Choice = i
		}
		sub := call("multi", toks(rng, 50), toks(rng, 6), rng)
		sub.Index = 1
		next := call("multi", cat(p0, ch[0].ResponseIDs, toks(rng, 7)), toks(rng, 4), rng)
		next.Index = 2
		n2 := []trace.Call{call("multi", next.PromptIDs, toks(rng, 3), rng), call("multi", next.PromptIDs, toks(rng, 3), rng)}
		n2[0].Index, n2[1].Index, n2[1].Choice = 3, 3, 1
		out["multi"] = append(append(ch, sub, next), n2...)
	}
	// untrainable: broken token data kept with its reason; odd ids kept exactly.
	{
		p := cat(sys, task)
		a := call("broken", p, toks(rng, 10), rng)
		a.Logprobs = a.Logprobs[:4]
		a.MarkUntrainable("logprobs length 4 != response_ids length 10")
		b := call("broken", cat(p, a.ResponseIDs), nil, rng)
		b.MarkUntrainable("upstream returned no token ids")
		c := call("broken", cat(p, a.ResponseIDs, []int32{-1, math.MaxInt32, math.MinInt32}), []int32{0, 1}, rng)
		c.Logprobs = []float32{float32(math.Inf(-1)), float32(math.Copysign(0, -1))}
		c.MarkUntrainable("odd")
		d := call("broken", nil, toks(rng, 3), rng)
		d.MarkUntrainable("empty prompt")
		for i, x := range []*trace.Call{&a, &b, &c, &d} {
			x.Index = i
		}
		out["broken"] = []trace.Call{a, b, c, d}
	}
	// recording fields: timestamps with zones, latency, JSON bodies that grow in the middle.
	{
		zone := time.FixedZone("X", 5*3600+30*60)
		p := cat(sys, task)
		var cs []trace.Call
		msgs := []string{`{"role":"user","content":"fix the bug"}`}
		tools := `"tools":[` + strings.Repeat(`{"name":"bash","description":"run a command"},`, 20) + `{"name":"edit"}]`
		for i := range 4 {
			r := toks(rng, 10)
			c := call("rec", p, r, rng)
			c.Index = i
			c.API = []string{"anthropic", "openai_chat", "openai_responses", "gemini"}[i]
			c.Started = time.Date(2026, 5, 1, 12, 0, i, 123456789, zone)
			c.Finished = c.Started.Add(1500 * time.Millisecond)
			c.UpstreamLatency = 1234567 * time.Microsecond
			c.Request = json.RawMessage(`{"model":"claude","messages":[` + strings.Join(msgs, ",") + `],` + tools + `}`)
			c.UpstreamRequest = json.RawMessage(`{"model":"qwen","logprobs":true,"messages":[` + strings.Join(msgs, ",") + `]}`)
			c.Response = json.RawMessage(fmt.Sprintf(`{"role":"assistant","content":"step %d"}`, i))
			// sampling: all three fields, temperature alone, none (a record from before
			// floe kept it decodes as nil), and an explicit zero temperature and top_k
			temp, topP, topK, zero, none := 0.7, 0.95, 20, 0.0, 0
			c.Sampling = []*trace.Sampling{{Temperature: &temp, TopP: &topP, TopK: &topK}, {Temperature: &temp}, nil,
				{Temperature: &zero, TopK: &none}}[i]
			if i == 2 {
				c.Response = nil
				c.Request = json.RawMessage{}
			}
			cs = append(cs, c)
			msgs = append(msgs, fmt.Sprintf(`{"role":"assistant","content":"step %d"}`, i), `{"role":"tool","content":"ok"}`)
			p = cat(p, r, toks(rng, 5))
		}
		out["rec"] = cs
	}
	return out
}

func TestRoundTrip(t *testing.T) {
	for _, mode := range []CommitMode{CommitGroup, CommitUpdate, CommitBatch} {
		for name, calls := range scenarios() {
			t.Run(fmt.Sprintf("%s/mode%d", name, mode), func(t *testing.T) {
				dir := t.TempDir()
				s := open(t, dir, Options{Commit: mode})
				defer func() { testutil.Close(t, s) }()
				if err := s.CreateSession(trace.Session{ID: name, TaskID: "task", GroupID: "g"}, "key-"+name, 0); err != nil {
					t.Fatal(err)
				}
				if got, err := s.Resolve("key-" + name); err != nil || got.ID != name {
					t.Fatalf("Resolve = %+v %v", got, err)
				}
				// Half before a restart, half after: the references resume from disk.
				for i := range calls {
					if i == len(calls)/2 {
						s = reopen(t, s, dir)
					}
					c := calls[i]
					c.Index = -7
					c.PromptIDs = slices.Clone(c.PromptIDs)
					if err := s.Record(context.Background(), &c); err != nil {
						t.Fatal(err)
					}
					if c.Index != calls[i].Index {
						t.Fatalf("call %d: index %d, want %d", i, c.Index, calls[i].Index)
					}
					clear(c.PromptIDs) // the store keeps no reference to the caller's slices
				}
				if err := s.FinishSession(name, 0.75, trace.StatusCompleted); err != nil {
					t.Fatal(err)
				}
				for _, reopened := range []bool{false, true} {
					if reopened {
						s = reopen(t, s, dir)
					}
					got, err := s.Session(name)
					if err != nil {
						t.Fatal(err)
					}
					if got.TaskID != "task" || got.GroupID != "g" || got.Reward != 0.75 || got.Status != trace.StatusCompleted || len(got.Calls) != len(calls) {
						t.Fatalf("session %+v", got)
					}
					for i := range calls {
						if err := equalCall(&got.Calls[i], &calls[i]); err != nil {
							t.Fatalf("reopened %v call %d: %v", reopened, i, err)
						}
					}
				}
			})
		}
	}
}

// TestCorpusGroups records a whole synthetic corpus (drift, stripped reasoning,
// compaction, sub-agents, retries, n>1, untrainable calls) and reads every group back
// exactly.
func TestCorpusGroups(t *testing.T) {
	groups, err := corpus.Generate(corpus.Small(), 7)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	s := open(t, dir, Options{})
	defer testutil.Close(t, s)
	for _, g := range groups {
		for _, sess := range g.Sessions {
			if err := s.CreateSession(trace.Session{ID: sess.ID, TaskID: g.TaskID, GroupID: g.ID}, "k"+sess.ID, 0); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.SetGroupSize(g.ID, len(g.Sessions)); err != nil {
			t.Fatal(err)
		}
	}
	// Interleave sessions as concurrent harnesses would, recording from goroutines.
	errs := make(chan error, 64)
	n := 0
	for _, g := range groups {
		for _, sess := range g.Sessions {
			n++
			go func() {
				for i := range sess.Calls {
					c := sess.Calls[i]
					if err := s.Record(context.Background(), &c); err != nil {
						errs <- err
						return
					}
					if c.Index != sess.Calls[i].Index {
						errs <- fmt.Errorf("%s call %d: index %d, want %d", sess.ID, i, c.Index, sess.Calls[i].Index)
						return
					}
				}
				errs <- s.FinishSession(sess.ID, sess.Reward, sess.Status)
			}()
		}
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	s = reopen(t, s, dir)
	fin, err := s.FinishedGroups()
	if err != nil || len(fin) != len(groups) {
		t.Fatalf("FinishedGroups = %v, %v", fin, err)
	}
	for _, want := range groups {
		got, err := s.Group(want.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.TaskID != want.TaskID || len(got.Sessions) != len(want.Sessions) {
			t.Fatalf("group %s: %d sessions, want %d", want.ID, len(got.Sessions), len(want.Sessions))
		}
		for si, ws := range want.Sessions {
			gs := got.Sessions[si]
			if gs.ID != ws.ID || gs.Reward != ws.Reward || gs.Status != ws.Status || len(gs.Calls) != len(ws.Calls) {
				t.Fatalf("session %s: got %s %v %s %d calls", ws.ID, gs.ID, gs.Reward, gs.Status, len(gs.Calls))
			}
			for ci := range ws.Calls {
				if err := equalCall(&gs.Calls[ci], &ws.Calls[ci]); err != nil {
					t.Fatalf("session %s call %d: %v", ws.ID, ci, err)
				}
			}
		}
		if err := got.Validate(); err != nil {
			t.Fatal(err)
		}
	}
}

func TestSessionLifecycle(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{})
	defer func() { testutil.Close(t, s) }()
	ctx := context.Background()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(s.CreateSession(trace.Session{ID: "a", TaskID: "t", GroupID: "g"}, "ka", 0))
	must(s.CreateSession(trace.Session{ID: "b", TaskID: "t", GroupID: "g"}, "", 0))
	must(s.AddKey("kb", "b"))
	must(s.SetGroupSize("g", 3))
	for _, tc := range []struct {
		name string
		err  error
		is   error
	}{
		{"duplicate session", s.CreateSession(trace.Session{ID: "a", TaskID: "t"}, "", 0), ErrSessionExists},
		{"key of another session", s.AddKey("ka", "b"), nil},
		{"key of unknown session", s.AddKey("kz", "zz"), ErrUnknownSession},
		{"group of another task", s.CreateSession(trace.Session{ID: "c", TaskID: "u", GroupID: "g"}, "", 0), nil},
		{"record unknown session", s.Record(ctx, &trace.Call{SessionID: "nope"}), ErrUnknownSession},
		{"record no session", s.Record(ctx, &trace.Call{}), nil},
		{"finish unknown", s.FinishSession("nope", 1, trace.StatusCompleted), ErrUnknownSession},
		{"finish bad status", s.FinishSession("a", 1, trace.StatusRunning), nil},
		{"finish NaN", s.FinishSession("a", math.NaN(), trace.StatusCompleted), nil},
		{"choice without call", s.Record(ctx, &trace.Call{SessionID: "a", Choice: 1}), nil},
	} {
		if tc.err == nil || (tc.is != nil && !errors.Is(tc.err, tc.is)) {
			t.Errorf("%s: err %v, want %v", tc.name, tc.err, tc.is)
		}
	}
	if got, err := s.Resolve("kb"); err != nil || got.ID != "b" {
		t.Fatalf("Resolve(kb) = %+v %v", got, err)
	}
	if _, err := s.Resolve("unknown"); !errors.Is(err, ErrUnknownSession) {
		t.Fatalf("unknown key resolved: %v", err)
	}
	// Open: an unknown key makes a session; a known key resolves.
	id, err := s.Open("open-key")
	must(err)
	if id != "open-key" {
		t.Fatalf("Open = %q", id)
	}
	if id, err := s.Open("ka"); err != nil || id != "a" {
		t.Fatalf("Open(ka) = %q %v", id, err)
	}
	must(s.Record(ctx, &trace.Call{SessionID: "open-key", PromptIDs: []int32{1}, ResponseIDs: []int32{2}, Logprobs: []float32{-1}}))

	must(s.Record(ctx, &trace.Call{SessionID: "a", PromptIDs: []int32{1, 2}, ResponseIDs: []int32{3}, Logprobs: []float32{-0.5}}))
	must(s.FinishSession("a", 1, trace.StatusFailed))
	if err := s.FinishSession("a", 1, trace.StatusCompleted); !errors.Is(err, ErrSessionFinished) {
		t.Fatalf("second finish: %v", err)
	}
	if err := s.Record(ctx, &trace.Call{SessionID: "a", PromptIDs: []int32{1}}); !errors.Is(err, ErrSessionFinished) {
		t.Fatalf("record after finish: %v", err)
	}
	s = reopen(t, s, dir)
	if err := s.FinishSession("a", 1, trace.StatusCompleted); !errors.Is(err, ErrSessionFinished) {
		t.Fatalf("second finish after restart: %v", err)
	}
	un, err := s.UnfinishedSessions()
	must(err)
	if len(un) != 2 || un[0].ID != "b" || un[1].ID != "open-key" {
		t.Fatalf("UnfinishedSessions = %+v", un)
	}
	gs, err := s.Groups()
	must(err)
	if len(gs) != 1 || gs[0].Created.IsZero() {
		t.Fatalf("Groups = %+v", gs)
	}
	gs[0].Created = time.Time{}
	if gs[0] != (trace.GroupState{ID: "g", TaskID: "t", Size: 3, Sessions: 2, Finished: 1, Step: -1}) {
		t.Fatalf("Groups = %+v", gs)
	}
	must(s.FinishSession("b", 0, trace.StatusTimeout))
	if fin, _ := s.FinishedGroups(); len(fin) != 0 {
		t.Fatalf("group of size 3 with 2 sessions listed finished: %v", fin)
	}
	// The first size is kept: another fails, the same again is a no-op.
	if err := s.SetGroupSize("g", 2); !errors.Is(err, trace.ErrGroupSize) {
		t.Fatalf("SetGroupSize with another size: %v", err)
	}
	must(s.SetGroupSize("g", 3))
	if err := s.SetGroupSize("nope", 3); !errors.Is(err, trace.ErrUnknownGroup) {
		t.Fatalf("SetGroupSize of an unknown group: %v", err)
	}
	must(s.CreateSession(trace.Session{ID: "c", TaskID: "t", GroupID: "g"}, "", 0))
	must(s.FinishSession("c", 1, trace.StatusCompleted))
	if fin, _ := s.FinishedGroups(); !slices.Equal(fin, []string{"g"}) {
		t.Fatalf("FinishedGroups = %v", fin)
	}
	g, err := s.Group("g")
	must(err)
	if len(g.Sessions) != 3 || g.Sessions[0].ID != "a" || len(g.Sessions[0].Calls) != 1 || g.Sessions[1].Status != trace.StatusTimeout {
		t.Fatalf("Group = %+v", g)
	}
	if _, err := s.Group("nope"); !errors.Is(err, ErrUnknownGroup) {
		t.Fatalf("unknown group: %v", err)
	}
}

func TestSteps(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{})
	defer func() { testutil.Close(t, s) }()
	for _, g := range []string{"g0", "g1", "g2", "g3", "g4"} {
		if err := s.CreateSession(trace.Session{ID: g + "-s", TaskID: "t" + g, GroupID: g}, "", 0); err != nil {
			t.Fatal(err)
		}
		if err := s.FinishSession(g+"-s", 1, trace.StatusCompleted); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.SaveStep(0, []string{"g0", "g1"}); err != nil {
		t.Fatal(err)
	}
	if err := s.SaveStep(1, []string{"g2"}); err != nil {
		t.Fatal(err)
	}
	if err := s.SaveStep(1, []string{"g2"}); err != nil {
		t.Fatalf("idempotent save: %v", err)
	}
	for _, tt := range []struct {
		name string
		err  error
		want error // nil: any error
	}{
		{"other groups", s.SaveStep(1, []string{"g3"}), ErrStepConflict},
		{"other budget", s.SaveStepRecord(trace.StepRecord{N: 1, Groups: []string{"g2"}, TokenBudget: 64}), ErrStepConflict},
		{"other cut-off", s.SaveStepRecord(trace.StepRecord{N: 1, Groups: []string{"g2"}, MinPolicyVersion: 3}), ErrStepConflict},
		{"group reused", s.SaveStep(2, []string{"g3", "g1"}), ErrStepConflict},
		{"unknown group", s.SaveStep(2, []string{"zz"}), ErrUnknownGroup},
		{"no groups", s.SaveStep(2, nil), nil},
		{"negative", s.SaveStep(-1, []string{"g3"}), nil},
	} {
		if tt.err == nil || (tt.want != nil && !errors.Is(tt.err, tt.want)) {
			t.Errorf("%s: %v, want %v", tt.name, tt.err, tt.want)
		}
	}
	if fin, _ := s.FinishedGroups(); !slices.Equal(fin, []string{"g3", "g4"}) {
		t.Fatalf("FinishedGroups = %v (groups in steps must not be listed; a failed save must not claim g3)", fin)
	}
	if err := s.CommitStep(0); err != nil {
		t.Fatal(err)
	}
	if err := s.CommitStep(0); !errors.Is(err, ErrCommitted) {
		t.Fatalf("second commit: %v", err)
	}
	if err := s.CommitStep(9); !errors.Is(err, ErrUnknownStep) {
		t.Fatalf("unknown step: %v", err)
	}
	s = reopen(t, s, dir)
	if err := s.CommitStep(0); !errors.Is(err, ErrCommitted) {
		t.Fatalf("commit after restart: %v", err)
	}
	if err := s.SaveStep(0, []string{"g0", "g1"}); !errors.Is(err, ErrCommitted) {
		t.Fatalf("save of a committed step: %v", err)
	}
	un, last, err := s.Steps()
	if err != nil || last != 0 || len(un) != 1 || un[0].N != 1 || !slices.Equal(un[0].Groups, []string{"g2"}) {
		t.Fatalf("Steps = %+v %d %v", un, last, err)
	}
	if c, err := s.StepCommitted(0); !c || err != nil {
		t.Fatalf("StepCommitted(0) = %v %v", c, err)
	}
	if err := s.DropGroup("g4", "too few"); err != nil {
		t.Fatal(err)
	}
	if fin, _ := s.FinishedGroups(); !slices.Equal(fin, []string{"g3"}) {
		t.Fatalf("FinishedGroups = %v", fin)
	}
	if err := s.CommitStep(1); err != nil {
		t.Fatal(err)
	}
	if un, last, _ := s.Steps(); len(un) != 0 || last != 1 {
		t.Fatalf("Steps = %+v %d", un, last)
	}
}

// TestGroupTimeout ends a group that is short of sessions and has one still running.
func TestGroupTimeout(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{})
	defer func() { testutil.Close(t, s) }()
	ctx := context.Background()
	for _, id := range []string{"a", "b", "c"} {
		if err := s.CreateSession(trace.Session{ID: id, TaskID: "t", GroupID: "g"}, id, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.SetGroupSize("g", 4); err != nil {
		t.Fatal(err)
	}
	if err := s.FinishSession("a", 1, trace.StatusCompleted); err != nil {
		t.Fatal(err)
	}
	if err := s.Record(ctx, &trace.Call{SessionID: "b", PromptIDs: []int32{1}, ResponseIDs: []int32{2}, Logprobs: []float32{-1}}); err != nil {
		t.Fatal(err)
	}
	ended, err := s.TimeOutGroup("g")
	if err != nil || !slices.Equal(ended, []string{"b", "c"}) {
		t.Fatalf("TimeOutGroup = %v %v", ended, err)
	}
	s = reopen(t, s, dir)
	if fin, _ := s.FinishedGroups(); !slices.Equal(fin, []string{"g"}) {
		t.Fatalf("a timed-out group with 3 of 4 sessions is complete: FinishedGroups = %v", fin)
	}
	g, err := s.Group("g")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, sess := range g.Sessions {
		got = append(got, fmt.Sprintf("%s:%s:%g:%d", sess.ID, sess.Status, sess.Reward, len(sess.Calls)))
	}
	if want := []string{"a:completed:1:0", "b:timeout:0:1", "c:timeout:0:0"}; !slices.Equal(got, want) {
		t.Fatalf("sessions %v, want %v", got, want)
	}
	if err := s.Record(ctx, &trace.Call{SessionID: "b", PromptIDs: []int32{1}}); !errors.Is(err, ErrSessionFinished) {
		t.Fatalf("a call after the timeout: %v", err)
	}
	if err := s.CreateSession(trace.Session{ID: "d", TaskID: "t", GroupID: "g"}, "", 0); err == nil {
		t.Fatal("a session joined a timed-out group")
	}
	if ended, err := s.TimeOutGroup("g"); err != nil || len(ended) != 0 {
		t.Fatalf("repeated TimeOutGroup = %v %v", ended, err)
	}
	if _, err := s.TimeOutGroup("nope"); !errors.Is(err, ErrUnknownGroup) {
		t.Fatalf("unknown group: %v", err)
	}
	// The step keeps its staleness cut-off across a restart.
	if err := s.SaveStepRecord(trace.StepRecord{N: 0, Groups: []string{"g"}, MinPolicyVersion: 3}); err != nil {
		t.Fatal(err)
	}
	if err := s.SaveStepRecord(trace.StepRecord{N: 0, Groups: []string{"g"}, MinPolicyVersion: 2}); err == nil {
		t.Fatal("step saved again with another cut-off")
	}
	s = reopen(t, s, dir)
	if un, _, err := s.Steps(); err != nil || len(un) != 1 || un[0].MinPolicyVersion != 3 {
		t.Fatalf("Steps = %+v %v", un, err)
	}
}

// callBytes sums the stored call values of a session: the encoded size on disk before
// bbolt's page overhead.
func callBytes(t *testing.T, s *Store, session string) []int {
	var sizes []int
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bSessions).Bucket([]byte(session)).Bucket(kCalls).ForEach(func(_, v []byte) error {
			sizes = append(sizes, len(v))
			return nil
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	return sizes
}

// TestPrefixByReference records a 40-call chain whose prompts grow and checks that what
// is stored grows with the distinct tokens, not with the sum of prompt lengths.
func TestPrefixByReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	dir := t.TempDir()
	s := open(t, dir, Options{})
	defer func() { testutil.Close(t, s) }()
	if err := s.CreateSession(trace.Session{ID: "s"}, "", 0); err != nil {
		t.Fatal(err)
	}
	prompt := toks(rng, 4000)
	distinct, sumPrompt, respTokens := len(prompt), 0, 0
	for range 40 {
		resp := toks(rng, 150)
		c := call("s", prompt, resp, rng)
		if err := s.Record(context.Background(), &c); err != nil {
			t.Fatal(err)
		}
		sumPrompt += len(prompt)
		respTokens += len(resp)
		tool := toks(rng, 250)
		distinct += len(resp) + len(tool)
		prompt = cat(prompt, resp, tool)
	}
	sizes := callBytes(t, s, "s")
	total := 0
	for _, n := range sizes {
		total += n
	}
	fi, err := os.Stat(s.Path())
	if err != nil {
		t.Fatal(err)
	}
	u, err := s.Usage()
	if err != nil {
		t.Fatal(err)
	}
	if u.Calls != 40 || u.Sessions != 1 || u.PromptIDs != int64(sumPrompt) || u.CallBytes != int64(total) || u.FileBytes != fi.Size() || u.DiskBytes <= 0 {
		t.Fatalf("Usage = %+v, want 40 calls, %d prompt ids, %d call bytes, file %d B", u, sumPrompt, total, fi.Size())
	}
	// A format 1 store (no totals) is refused read-only, and upgraded in place when opened
	// read-write: the totals counted once, the format version raised.
	if err := s.db.Update(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bMeta).Delete(kUsage); err != nil {
			return err
		}
		return tx.Bucket(bMeta).Put(kFormat, binary.BigEndian.AppendUint32(nil, 1))
	}); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := New(dir, Options{ReadOnly: true}); !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), "read-write once") {
		t.Fatalf("a format 1 store opened read-only: %v", err)
	}
	s = open(t, dir, Options{})
	if again, err := s.Usage(); err != nil || again.Calls != u.Calls || again.PromptIDs != u.PromptIDs || again.CallBytes != u.CallBytes || again.JSONBytes != u.JSONBytes {
		t.Fatalf("Usage after the upgrade = %+v %v, want %+v", again, err, u)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	ro, err := New(dir, Options{ReadOnly: true})
	if err != nil {
		t.Fatalf("the upgraded store read-only: %v", err)
	}
	if got, err := ro.Usage(); err != nil || got.Calls != 40 {
		t.Fatalf("read-only Usage = %+v %v", got, err)
	}
	if err := ro.CreateSession(trace.Session{ID: "x"}, "", 0); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("a write to a read-only store: %v", err)
	}
	s = ro
	rawPrompt := 4 * sumPrompt // int32 prompts stored in full
	t.Logf("Σ prompt tokens %d (%d B as int32), distinct tokens %d; encoded calls %d B (%.2f B/distinct token, %.1f%% of full prompts); file %d B",
		sumPrompt, rawPrompt, distinct, total, float64(total)/float64(distinct), 100*float64(total)/float64(rawPrompt), fi.Size())
	// Tokens take ≤ 3 bytes as varints, logprobs 4: bound by distinct tokens.
	if limit := 3*distinct + 4*respTokens + 64*len(sizes); total > limit {
		t.Errorf("encoded %d B > %d B: not linear in distinct tokens", total, limit)
	}
	if ratio := float64(total) / float64(rawPrompt); ratio > 0.1 {
		t.Errorf("encoded / full prompts = %.3f, want < 0.1", ratio)
	}
	if fi.Size() > int64(rawPrompt)/4 {
		t.Errorf("file %d B not far below Σ prompt bytes %d", fi.Size(), rawPrompt)
	}
	// Every call after the first stores a tail of the same size: a late call costs what an
	// early one does.
	if sizes[39] > sizes[1]*5/4 {
		t.Errorf("call 39 stores %d B, call 1 %d B: grows with the prompt", sizes[39], sizes[1])
	}
}

func TestFormatRefusal(t *testing.T) {
	t.Run("newer version", func(t *testing.T) {
		dir := t.TempDir()
		testutil.Close(t, open(t, dir, Options{}))
		db, err := bolt.Open(filepath.Join(dir, FileName), 0o600, nil)
		if err != nil {
			t.Fatal(err)
		}
		err = db.Update(func(tx *bolt.Tx) error {
			return tx.Bucket(bMeta).Put(kFormat, binary.BigEndian.AppendUint32(nil, FormatVersion+1))
		})
		if err != nil {
			t.Fatal(err)
		}
		testutil.Close(t, db)
		_, err = New(dir, Options{})
		if !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), fmt.Sprintf("format version %d", FormatVersion+1)) ||
			!strings.Contains(err.Error(), fmt.Sprintf("reads format version %d", FormatVersion)) {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("foreign bbolt file", func(t *testing.T) {
		dir := t.TempDir()
		db, err := bolt.Open(filepath.Join(dir, FileName), 0o600, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := db.Update(func(tx *bolt.Tx) error { _, err := tx.CreateBucket([]byte("other")); return err }); err != nil {
			t.Fatal(err)
		}
		testutil.Close(t, db)
		if _, err := New(dir, Options{}); !errors.Is(err, ErrFormat) {
			t.Fatalf("err = %v", err)
		}
	})
	corrupt := map[string]func(valid []byte) []byte{
		"garbage": func([]byte) []byte {
			b := make([]byte, 64<<10)
			_, _ = rand.NewChaCha8([32]byte{5}).Read(b) // never fails (math/rand/v2)
			return b
		},
		"empty":     func([]byte) []byte { return []byte{} },
		"truncated": func(v []byte) []byte { return v[:100] },
		"meta pages zeroed": func(v []byte) []byte {
			b := slices.Clone(v)
			clear(b[:2*os.Getpagesize()])
			return b
		},
	}
	for name, mk := range corrupt {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			s := open(t, dir, Options{})
			if err := s.CreateSession(trace.Session{ID: "x"}, "", 0); err != nil {
				t.Fatal(err)
			}
			testutil.Close(t, s)
			path := filepath.Join(dir, FileName)
			valid, _ := os.ReadFile(path)
			content := mk(valid)
			if err := os.WriteFile(path, content, 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := New(dir, Options{})
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("err = %v", err)
			}
			t.Log(err)
			after, _ := os.ReadFile(path)
			if !bytes.Equal(after, content) {
				t.Fatal("the refused file was changed")
			}
		})
	}
	t.Run("corrupt call record", func(t *testing.T) {
		dir := t.TempDir()
		s := open(t, dir, Options{})
		if err := s.CreateSession(trace.Session{ID: "x"}, "", 0); err != nil {
			t.Fatal(err)
		}
		if err := s.Record(context.Background(), &trace.Call{SessionID: "x", PromptIDs: []int32{1, 2, 3}, ResponseIDs: []int32{4}, Logprobs: []float32{-1}}); err != nil {
			t.Fatal(err)
		}
		err := s.db.Update(func(tx *bolt.Tx) error {
			cb := tx.Bucket(bSessions).Bucket([]byte("x")).Bucket(kCalls)
			return cb.Put(seqKey(0), []byte{0xff, 0xff, 0xff})
		})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Session("x"); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("err = %v", err)
		}
		testutil.Close(t, s)
	})
	t.Run("locked", func(t *testing.T) {
		dir := t.TempDir()
		s := open(t, dir, Options{})
		defer testutil.Close(t, s)
		if _, err := New(dir, Options{LockTimeout: 50 * time.Millisecond}); err == nil || !strings.Contains(err.Error(), "locked") {
			t.Fatalf("err = %v", err)
		}
	})
}

// TestUsageSeparatesTheRecordedJSON: a call's recorded request and answer are counted as
// JSON bytes, its token data as the rest.
func TestUsageSeparatesTheRecordedJSON(t *testing.T) {
	ctx := context.Background()
	usage := func(withJSON bool) Usage {
		rng := rand.New(rand.NewPCG(5, 6)) // the same tokens either way
		s := open(t, t.TempDir(), Options{})
		defer testutil.Close(t, s)
		if err := s.CreateSession(trace.Session{ID: "s"}, "", 0); err != nil {
			t.Fatal(err)
		}
		c := call("s", toks(rng, 100), toks(rng, 20), rng)
		if withJSON {
			c.Request = json.RawMessage(`{"messages":[{"role":"user","content":"` + strings.Repeat("x", 500) + `"}]}`)
			c.Response = json.RawMessage(`{"role":"assistant","content":"ok"}`)
		}
		if err := s.Record(ctx, &c); err != nil {
			t.Fatal(err)
		}
		u, err := s.Usage()
		if err != nil {
			t.Fatal(err)
		}
		return u
	}
	plain, rich := usage(false), usage(true)
	if plain.JSONBytes != 3 { // three empty blob tags
		t.Fatalf("a call without JSON: %d JSON bytes", plain.JSONBytes)
	}
	if rich.JSONBytes-plain.JSONBytes != rich.CallBytes-plain.CallBytes || rich.JSONBytes < 500 {
		t.Fatalf("with JSON %+v, without %+v: the difference is not all JSON", rich, plain)
	}
}

// TestTimeOutGroupRacesCreateSession: a session created while its group times out either
// joins before (and is timed out with it) or is refused; a timed-out group never keeps a
// running session.
func TestTimeOutGroupRacesCreateSession(t *testing.T) {
	s := open(t, t.TempDir(), Options{})
	defer testutil.Close(t, s)
	for i := range 100 {
		g := fmt.Sprintf("g%03d", i)
		if err := s.CreateSession(trace.Session{ID: g + "-a", TaskID: "t", GroupID: g}, "", 0); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = s.CreateSession(trace.Session{ID: g + "-b", TaskID: "t", GroupID: g}, "", 0) // may be refused
		}()
		if _, err := s.TimeOutGroup(g); err != nil {
			t.Fatal(err)
		}
		<-done
	}
	gs, err := s.Groups()
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range gs {
		if !g.TimedOut || g.Finished != g.Sessions || !g.Complete() {
			t.Fatalf("group %+v: timed out with a running session", g)
		}
	}
}

func TestPolicyVersionSurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{})
	defer func() { testutil.Close(t, s) }()
	if v, err := s.PolicyVersion(); err != nil || v != 0 {
		t.Fatalf("a new store's policy version: %d %v", v, err)
	}
	if err := s.SetPolicyVersion(7); err != nil {
		t.Fatal(err)
	}
	s = reopen(t, s, dir)
	if v, err := s.PolicyVersion(); err != nil || v != 7 {
		t.Fatalf("policy version after a restart: %d %v", v, err)
	}
}
