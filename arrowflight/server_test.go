package arrowflight_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/flight"
	"github.com/apache/arrow-go/v18/arrow/memory"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/floe-rl/floe/arrowflight"
	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/internal/corpus"
	"github.com/floe-rl/floe/sidecar"
)

// fixture is a Flight server on loopback over a READY buffer, with a client.
type fixture struct {
	ready   *sidecar.Ready
	control *sidecar.Node
	client  flight.Client
	steps   []*batcher.Step
	mem     *memory.CheckedAllocator
}

// start forms steps (4 groups of the small corpus, two per step, over dp ranks) and
// serves them; only the first ahead steps go into the buffer, the rest are handed to put.
func start(t *testing.T, dp, ahead int, token string) *fixture {
	t.Helper()
	cc := corpus.Small()
	groups, err := corpus.Generate(cc, 3)
	if err != nil {
		t.Fatal(err)
	}
	cfg := batcher.DefaultConfig()
	cfg.DPSize, cfg.TokenBudget, cfg.PadMultiple = dp, 1024, 16
	ready := sidecar.NewReady(ahead, 0)
	node, err := sidecar.NewNode(sidecar.NodeConfig{Log: slog.New(slog.DiscardHandler), Ready: ready})
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{ready: ready, control: node,
		mem: memory.NewCheckedAllocator(memory.NewGoAllocator())}
	for i := 0; i < len(groups); i += 2 {
		st, err := batcher.FormStep(int64(i/2), groups[i:i+2], cfg)
		if err != nil {
			t.Fatal(err)
		}
		f.steps = append(f.steps, st)
	}
	lis, err := arrowflight.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &arrowflight.Server[sidecar.Status]{Source: f.control.Flight(), Control: f.control.Flight(), Token: token, Mem: f.mem,
		Log: slog.New(slog.DiscardHandler), MaxWait: 5 * time.Second}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	f.client, err = flight.NewClientWithMiddleware(lis.Addr().String(), nil, nil, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = f.client.Close() // a gRPC client: nothing of the test's in it
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
		f.ready.Shutdown()
		f.mem.AssertSize(t, 0)
	})
	return f
}

func (f *fixture) put(t *testing.T, n int) {
	t.Helper()
	fs, err := sidecar.FlightStep(f.steps[n], f.mem)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.ready.Put(context.Background(), fs); err != nil {
		t.Fatal(err)
	}
}

func withToken(ctx context.Context, token string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
}

func ticket(step int64, rank int) *flight.Ticket {
	return &flight.Ticket{Ticket: fmt.Appendf(nil, `{"step": %d, "rank": %d}`, step, rank)}
}

// readAll fetches a ticket's records and their app metadata.
func readAll(ctx context.Context, c flight.Client, tkt *flight.Ticket) ([]arrow.RecordBatch, [][]byte, error) {
	stream, err := c.DoGet(ctx, tkt)
	if err != nil {
		return nil, nil, err
	}
	rd, err := flight.NewRecordReader(stream)
	if err != nil {
		return nil, nil, err
	}
	defer rd.Release()
	var recs []arrow.RecordBatch
	var metas [][]byte
	for rd.Next() {
		rec := rd.RecordBatch()
		rec.Retain()
		recs = append(recs, rec)
		metas = append(metas, append([]byte(nil), rd.LatestAppMetadata()...))
	}
	return recs, metas, rd.Err()
}

func release(recs []arrow.RecordBatch) {
	for _, r := range recs {
		r.Release()
	}
}

func wantCode(t *testing.T, err error, code codes.Code, text string) {
	t.Helper()
	st, _ := status.FromError(err)
	if err == nil || st.Code() != code || !strings.Contains(st.Message(), text) {
		t.Fatalf("error %v, want %s mentioning %q", err, code, text)
	}
}

func TestFlightInfoAndConcurrentRanks(t *testing.T) {
	const dp = 3
	f := start(t, dp, 2, "")
	f.put(t, 0)
	ctx := context.Background()
	for _, desc := range [][]string{{"next"}, {"step", "0"}} {
		info, err := f.client.GetFlightInfo(ctx, &flight.FlightDescriptor{Type: flight.DescriptorPATH, Path: desc})
		if err != nil {
			t.Fatalf("GetFlightInfo(%v): %v", desc, err)
		}
		if len(info.Endpoint) != dp+1 {
			t.Fatalf("%v: %d endpoints, want one per rank and the sample table", desc, len(info.Endpoint))
		}
		var meta sidecar.StepInfo
		if err := json.Unmarshal(info.AppMetadata, &meta); err != nil || meta.Step != 0 || meta.NumRanks != dp ||
			meta.LossTokensGlobal != f.steps[0].Stats.LossRows {
			t.Fatalf("%v: app metadata %s (%v)", desc, info.AppMetadata, err)
		}
		if got := string(info.Endpoint[dp].Ticket.Ticket); got != `{"step":0,"kind":"samples"}` {
			t.Errorf("sample table ticket %s", got)
		}
		schema, err := flight.DeserializeSchema(info.Schema, memory.DefaultAllocator)
		if err != nil || !schema.Equal(batcher.MicroBatchSchema()) {
			t.Errorf("schema %v (%v)", schema, err)
		}
	}
	// All ranks at once, as a data-parallel trainer reads.
	var wg sync.WaitGroup
	errs := make([]error, dp)
	for r := 0; r < dp; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			recs, metas, err := readAll(ctx, f.client, ticket(0, r))
			defer release(recs)
			if err != nil {
				errs[r] = err
				return
			}
			if len(recs) != len(f.steps[0].Ranks[r]) {
				errs[r] = fmt.Errorf("rank %d: %d records, want %d", r, len(recs), len(f.steps[0].Ranks[r]))
				return
			}
			for i, rec := range recs {
				want, _ := f.steps[0].Record(memory.DefaultAllocator, r, i)
				same := array.RecordEqual(rec, want)
				want.Release()
				var meta batcher.MicroBatchMeta
				if err := json.Unmarshal(metas[i], &meta); err != nil || meta.Rank != r || meta.MicroBatch != i {
					errs[r] = fmt.Errorf("rank %d batch %d: app metadata %s (%v)", r, i, metas[i], err)
					return
				}
				if !same {
					errs[r] = fmt.Errorf("rank %d batch %d differs from the formed step", r, i)
					return
				}
				if md, ok := rec.(arrow.RecordBatchWithMetadata); !ok || md.Metadata().FindKey(batcher.MetadataKey) < 0 {
					errs[r] = fmt.Errorf("rank %d batch %d lost its record-batch metadata", r, i)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	recs, _, err := readAll(ctx, f.client, &flight.Ticket{Ticket: []byte(`{"step": 0, "kind": "samples"}`)})
	defer release(recs)
	if err != nil || len(recs) != 1 || int(recs[0].NumRows()) != len(f.steps[0].Samples) {
		t.Fatalf("sample table: %d records (%v)", len(recs), err)
	}
}

func TestCommitExactlyOnce(t *testing.T) {
	f := start(t, 1, 2, "")
	f.put(t, 0)
	ctx := context.Background()
	commit := func(n int) error {
		stream, err := f.client.DoAction(ctx, &flight.Action{Type: "commit", Body: fmt.Appendf(nil, `{"step": %d}`, n)})
		if err != nil {
			return err
		}
		_, err = stream.Recv()
		return err
	}
	if err := commit(0); err != nil {
		t.Fatal(err)
	}
	wantCode(t, commit(0), codes.FailedPrecondition, "step 0 is already committed")
	_, _, err := readAll(ctx, f.client, ticket(0, 0))
	wantCode(t, err, codes.FailedPrecondition, "step 0 was committed")
	wantCode(t, commit(1), codes.FailedPrecondition, "step 1 is not READY")
}

func TestWaitsForAStepThatBecomesReady(t *testing.T) {
	f := start(t, 1, 1, "")
	ctx := context.Background()
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	_, _, err := readAll(short, f.client, ticket(0, 0))
	wantCode(t, err, codes.DeadlineExceeded, "")

	got := make(chan error, 1)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		recs, _, err := readAll(wctx, f.client, ticket(0, 0))
		release(recs)
		if err == nil && len(recs) == 0 {
			err = errors.New("no records")
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("DoGet returned before step 0 was formed: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	f.put(t, 0)
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	f.ready.Close()
	_, _, err = readAll(ctx, f.client, ticket(5, 0))
	wantCode(t, err, codes.NotFound, "steps end at 0")
}

func TestBadRequests(t *testing.T) {
	f := start(t, 2, 2, "")
	f.put(t, 0)
	ctx := context.Background()
	tests := []struct {
		ticket string
		code   codes.Code
		want   string
	}{
		{`{nope`, codes.InvalidArgument, `ticket "{nope" is not JSON`},
		{`{"rank": 0}`, codes.InvalidArgument, `"step" must be a non-negative integer`},
		{`{"step": 0}`, codes.InvalidArgument, `needs a "rank"`},
		{`{"step": 0, "kind": "logits"}`, codes.InvalidArgument, `unknown kind "logits"`},
		{`{"step": 0, "rank": 2}`, codes.InvalidArgument, "rank 2 out of range: step 0 has 2 ranks"},
		{`{"step": 0, "rank": 0, "extra": 1}`, codes.InvalidArgument, `unknown field "extra"`},
	}
	for _, tt := range tests {
		_, _, err := readAll(ctx, f.client, &flight.Ticket{Ticket: []byte(tt.ticket)})
		wantCode(t, err, tt.code, tt.want)
	}
	_, err := f.client.GetFlightInfo(ctx, &flight.FlightDescriptor{Type: flight.DescriptorPATH, Path: []string{"step", "x"}})
	wantCode(t, err, codes.InvalidArgument, `step "x" in descriptor path`)
	stream, err := f.client.DoAction(ctx, &flight.Action{Type: "rewind"})
	if err == nil {
		_, err = stream.Recv()
	}
	wantCode(t, err, codes.InvalidArgument, `unknown action "rewind" (actions: commit, report, pause, resume, status)`)
}

func TestAuthentication(t *testing.T) {
	f := start(t, 1, 2, "s3cret")
	f.put(t, 0)
	ctx := context.Background()
	for _, c := range []context.Context{ctx, withToken(ctx, "guess")} {
		_, err := f.client.GetFlightInfo(c, &flight.FlightDescriptor{Type: flight.DescriptorPATH, Path: []string{"next"}})
		wantCode(t, err, codes.Unauthenticated, "bearer token")
		_, _, err = readAll(c, f.client, ticket(0, 0))
		wantCode(t, err, codes.Unauthenticated, "bearer token")
	}
	recs, _, err := readAll(withToken(ctx, "s3cret"), f.client, ticket(0, 0))
	release(recs)
	if err != nil {
		t.Fatal(err)
	}
}

func TestControlActions(t *testing.T) {
	f := start(t, 1, 2, "")
	ctx := context.Background()
	do := func(typ, body string) map[string]any {
		t.Helper()
		stream, err := f.client.DoAction(ctx, &flight.Action{Type: typ, Body: []byte(body)})
		if err != nil {
			t.Fatal(err)
		}
		res, err := stream.Recv()
		if err != nil {
			t.Fatalf("%s: %v", typ, err)
		}
		var out map[string]any
		if err := json.Unmarshal(res.Body, &out); err != nil {
			t.Fatal(err)
		}
		if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
			t.Fatalf("%s: more than one result (%v)", typ, err)
		}
		return out
	}
	if got := do("pause", ""); got["paused"] != true {
		t.Errorf("pause: %v", got)
	}
	if got := do("status", ""); got["paused"] != true || got["steps_ahead"] != 2.0 {
		t.Errorf("status while paused: %v", got)
	}
	if got := do("resume", `{"policy_version": 4}`); got["policy_version"] != 4.0 || !(f.control.Status(ctx).PolicyVersion == 4 && !f.control.Status(ctx).Paused) {
		t.Errorf("resume: %v", got)
	}
	do("report", `{"step": 0, "rank": 0, "peak_memory_bytes": 1024, "step_seconds": 1.5, "wait_seconds": 0.01}`)
	if r := f.control.Status(ctx).Reports[0]; r.StepSeconds != 1.5 || r.PeakMemoryBytes != 1024 {
		t.Errorf("report recorded as %+v", r)
	}
	stream, err := f.client.DoAction(ctx, &flight.Action{Type: "resume", Body: []byte(`{"policy_version": 2}`)})
	if err == nil {
		_, err = stream.Recv()
	}
	wantCode(t, err, codes.FailedPrecondition, "policy version 2 is older than the current 4")
	lst, err := f.client.ListActions(ctx, &flight.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for {
		a, err := lst.Recv()
		if err != nil {
			break
		}
		names = append(names, a.Type)
	}
	if strings.Join(names, ",") != "commit,report,pause,resume,status" {
		t.Errorf("ListActions = %v", names)
	}
}

// TestShutdownEndsWaits: stopping the server must not wait for a client that waits for a
// step, up to that client's deadline.
func TestShutdownEndsWaits(t *testing.T) {
	ready := sidecar.NewReady(1, 0)
	lis, err := arrowflight.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	node, err := sidecar.NewNode(sidecar.NodeConfig{Log: slog.New(slog.DiscardHandler), Ready: ready})
	if err != nil {
		t.Fatal(err)
	}
	srv := &arrowflight.Server[sidecar.Status]{Source: node.Flight(), Control: node.Flight(), Log: slog.New(slog.DiscardHandler)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	c, err := flight.NewClientWithMiddleware(lis.Addr().String(), nil, nil, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }() // a gRPC client: nothing of the test's in it
	waited := make(chan error, 1)
	go func() {
		wctx, wcancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer wcancel()
		_, err := c.GetFlightInfo(wctx, &flight.FlightDescriptor{Type: flight.DescriptorPATH, Path: []string{"step", "0"}})
		waited <- err
	}()
	time.Sleep(100 * time.Millisecond) // the client is waiting for step 0
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not return within 5 s of being stopped while a client waited")
	}
	if err := <-waited; status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "shutting down") {
		t.Errorf("the waiting client got %v, want Unavailable: shutting down", err)
	}
}
