package sidecar

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow/flight"
	bbolt "go.etcd.io/bbolt"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/internal/testutil"
	"github.com/floe-rl/floe/trace/archive"
	"github.com/floe-rl/floe/trace/bolt"
)

// serving is a floe serve started in-process with a Flight client, stopped by stop
// (which waits for Serve to return) so that the test can restart it on the same data dir.
func serving(t *testing.T, cfg Config) (*running, func()) {
	t.Helper()
	a, stopServe := serveUntil(t, cfg)
	c, err := flight.NewClientWithMiddleware(strings.TrimPrefix(a.Flight, "grpc+tcp://"), nil, nil,
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		stopServe()
		t.Fatal(err)
	}
	return &running{t: t, proxy: a.Proxy, control: a.Control, flight: c}, func() { _ = c.Close(); stopServe() }
}

// servedStep is everything the trainer receives of step n over Flight, as the bytes on
// the wire: the FlightInfo's app_metadata and schema, then for each endpoint (every rank,
// then the sample table) each FlightData message's header, app_metadata and body.
func servedStep(t *testing.T, c flight.Client, n int) [][]byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := c.GetFlightInfo(ctx, &flight.FlightDescriptor{Type: flight.DescriptorPATH, Path: []string{"step", fmt.Sprint(n)}})
	if err != nil {
		t.Fatalf("step %d: %v", n, err)
	}
	out := [][]byte{info.AppMetadata, info.Schema}
	for _, ep := range info.Endpoint {
		stream, err := c.DoGet(ctx, ep.Ticket)
		if err != nil {
			t.Fatalf("step %d, ticket %s: %v", n, ep.Ticket.Ticket, err)
		}
		for {
			m, err := stream.Recv()
			if err != nil {
				break // io.EOF: the stream's end; anything else fails the comparison
			}
			out = append(out, m.DataHeader, m.AppMetadata, m.DataBody)
		}
	}
	return out
}

// sameBytes reports where two servings of a step first differ ("" when they do not).
func sameBytes(a, b [][]byte) string {
	if len(a) != len(b) {
		return fmt.Sprintf("%d parts, then %d", len(a), len(b))
	}
	for i := range a {
		if !bytes.Equal(a[i], b[i]) {
			return fmt.Sprintf("part %d: %d bytes, then %d other bytes", i, len(a[i]), len(b[i]))
		}
	}
	return ""
}

// session creates a session of group g (of size) and returns its id and API key.
func (r *running) session(g string, size int) (id, key string) {
	r.t.Helper()
	s := r.post("/floe/v1/sessions", "", fmt.Sprintf(`{"task_id": "t-%s", "group_id": %q, "group_size": %d}`, g, g, size), 200)
	return s["session_id"].(string), s["api_key"].(string)
}

func (r *running) call(key, text string) {
	r.t.Helper()
	r.post("/v1/chat/completions", key, fmt.Sprintf(`{"model":"x","messages":[{"role":"user","content":%q}]}`, text), 200)
}

// TestRestartReplaysTheStepsDecisions forms a step with a session out of date (its calls
// sampled a policy version before the staleness cut-off) and a failed one, restarts floe
// serve with every setting that decides a step changed (-strategy, -advantage,
// -pad-multiple, -pass-cost, -token-budget, -drop-failed, -max-staleness), and checks
// that the re-formed step the trainer receives is the same, byte for byte on the wire,
// and that once committed the archive holds the advantages and the trained calls the
// step trained with, not the ones the new settings would give.
func TestRestartReplaysTheStepsDecisions(t *testing.T) {
	cfg := testConfig(t)
	cfg.Batcher.Strategy, cfg.Batcher.Advantage = batcher.Tree, batcher.GRPO
	cfg.Batcher.PadMultiple, cfg.Batcher.TokenBudget, cfg.Batcher.PassCost = 16, 4096, 1024
	cfg.DropFailed, cfg.MaxStaleness = false, 0

	r, stop := serving(t, cfg)
	stale, staleKey := r.session("g0", 3)
	r.call(staleKey, "a")
	r.call(staleKey, "b")
	r.action("pause", `{}`)
	r.action("resume", `{"policy_version": 1}`)
	fresh, freshKey := r.session("g0", 3)
	r.call(freshKey, "c")
	r.call(freshKey, "d")
	failed, failedKey := r.session("g0", 3)
	r.call(failedKey, "e")
	r.post("/floe/v1/sessions/"+stale+"/finish", "", `{"reward": 0, "status": "completed"}`, 200)
	r.post("/floe/v1/sessions/"+fresh+"/finish", "", `{"reward": 1, "status": "completed"}`, 200)
	r.post("/floe/v1/sessions/"+failed+"/finish", "", `{"reward": 0.5, "status": "failed"}`, 200)
	served := servedStep(t, r.flight, 0)
	stop()

	changed := cfg
	changed.Batcher.Strategy, changed.Batcher.Advantage = batcher.PerRequest, batcher.RLOO
	changed.Batcher.PadMultiple, changed.Batcher.TokenBudget, changed.Batcher.PassCost = 32, 2048, 0
	changed.DropFailed, changed.MaxStaleness = true, -1
	r, stop = serving(t, changed)
	defer stop()
	if where := sameBytes(served, servedStep(t, r.flight, 0)); where != "" {
		t.Errorf("step 0 served again after a restart with other settings differs from the step first served: %s", where)
	}
	r.action("commit", `{"step": 0}`)
	dir := changed.archiveDir()
	waitFor(t, "step 0 archived", func() bool {
		_, err := os.Stat(filepath.Join(archive.PartitionDir(dir, archive.StepsTable, 0), archive.PartFile))
		return err == nil
	})

	mem := checkedMem(t)
	grpo := batcher.Advantages(batcher.GRPO, []float64{0, 1}) // the failed session is out of the baseline
	wantAdvantage := map[string]float64{stale: grpo[0], fresh: grpo[1], failed: 0}
	sessions, err := archive.ReadSessions(dir, mem)
	if err != nil {
		t.Fatal(err)
	}
	if len(sessions) != 3 {
		t.Fatalf("%d sessions archived, want 3", len(sessions))
	}
	for _, s := range sessions {
		want := wantAdvantage[s.Session.ID]
		if s.Advantage == nil || math.Abs(*s.Advantage-want) > 1e-12 {
			t.Errorf("session %s archived with advantage %s, want %v (grpo, the failed session kept with 0)", s.Session.ID, advantageOf(s), want)
		}
	}
	calls, err := archive.ReadCalls(dir, mem)
	if err != nil {
		t.Fatal(err)
	}
	wantReason := map[string]string{stale: "stale: policy version 0, older than 1", fresh: "", failed: "session failed"}
	for _, c := range calls {
		if want := wantReason[c.SessionID]; c.UntrainableReason != want || c.Trainable != (want == "") {
			t.Errorf("call %d of %s archived trainable %v (%q), want the reason %q", c.Index, c.SessionID, c.Trainable, c.UntrainableReason, want)
		}
	}
	if len(calls) != 5 {
		t.Errorf("%d calls archived, want 5", len(calls))
	}
}

// TestServeDecidesAnOlderStoresSteps: a data dir an older floe left (bolt format 3, step
// records without decisions) with a committed step not yet archived and an uncommitted
// one: floe serve upgrades it, decides both once from its settings (the ones that formed
// them), serves the uncommitted step byte for byte as it was served before, archives
// the committed one with its advantages, and records the decisions in the store.
func TestServeDecidesAnOlderStoresSteps(t *testing.T) {
	cfg := testConfig(t)
	cfg.Retention.Archive = false // the committed step stays in the store, as -archive=false left it
	r, stop := serving(t, cfg)
	r.group(0)
	servedStep(t, r.flight, 0)
	r.action("commit", `{"step": 0}`)
	r.group(1)
	served := servedStep(t, r.flight, 1)
	stop()
	writeFormatThree(t, cfg.DataDir)

	cfg.Retention.Archive = true
	r, stop = serving(t, cfg)
	if where := sameBytes(served, servedStep(t, r.flight, 1)); where != "" {
		t.Errorf("step 1 of a format 3 store served again differs from the step first served: %s", where)
	}
	dir := cfg.archiveDir()
	waitFor(t, "step 0 archived", func() bool {
		_, err := os.Stat(filepath.Join(archive.PartitionDir(dir, archive.StepsTable, 0), archive.PartFile))
		return err == nil
	})
	stop()
	sessions, err := archive.ReadSessions(dir, checkedMem(t))
	if err != nil {
		t.Fatal(err)
	}
	grpo := batcher.Advantages(batcher.GRPO, []float64{0, 1})
	if len(sessions) != 2 {
		t.Fatalf("%d sessions archived, want 2", len(sessions))
	}
	for _, s := range sessions {
		if s.Advantage == nil || math.Abs(*s.Advantage-grpo[int(s.Session.Reward)]) > 1e-12 {
			t.Errorf("session %s (reward %v) archived with advantage %s, want %v", s.Session.ID, s.Session.Reward, advantageOf(s), grpo[int(s.Session.Reward)])
		}
	}
	st, err := bolt.New(cfg.DataDir, bolt.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer testutil.Close(t, st)
	un, _, err := st.Steps()
	if err != nil || len(un) != 1 || un[0].N != 1 || un[0].Decisions == nil || un[0].Decisions.Strategy != string(cfg.Batcher.Strategy) {
		t.Fatalf("uncommitted steps %+v %v, want step 1 with its decisions recorded", un, err)
	}
}

// advantageOf is an archived session's advantage as text ("none" when null).
func advantageOf(s archive.SessionRow) string {
	if s.Advantage == nil {
		return "none"
	}
	return fmt.Sprint(*s.Advantage)
}

// writeFormatThree rewrites the store in dir as floe wrote format 3: its step records
// without their decisions, its format 3.
func writeFormatThree(t *testing.T, dir string) {
	t.Helper()
	db, err := bbolt.Open(filepath.Join(dir, bolt.FileName), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer testutil.Close(t, db)
	err = db.Update(func(tx *bbolt.Tx) error {
		steps := tx.Bucket([]byte("steps"))
		old := map[string][]byte{}
		err := steps.ForEach(func(k, v []byte) error {
			var rec map[string]json.RawMessage
			if err := json.Unmarshal(v, &rec); err != nil {
				return err
			}
			if _, ok := rec["decisions"]; !ok {
				return fmt.Errorf("step %x has no decisions to remove", k)
			}
			delete(rec, "decisions")
			b, err := json.Marshal(rec)
			old[string(k)] = b
			return err
		})
		if err != nil {
			return err
		}
		for k, v := range old {
			if err := steps.Put([]byte(k), v); err != nil {
				return err
			}
		}
		return tx.Bucket([]byte("meta")).Put([]byte("format"), binary.BigEndian.AppendUint32(nil, 3))
	})
	if err != nil {
		t.Fatal(err)
	}
}
