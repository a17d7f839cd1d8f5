package arrowflight

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/flight"
	"github.com/apache/arrow-go/v18/arrow/memory"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// Server is the Flight service over a Source. Zero values of the optional fields mean:
// no authentication, the default Go allocator, slog.Default, waits bounded only by the
// client's deadline and MaxWait.
type Server[S any] struct {
	Source  Source
	Control Control[S]
	// Token, when set, is required as "authorization: Bearer <Token>" on every call.
	Token string
	Mem   memory.Allocator
	Log   *slog.Logger
	// MaxWait bounds how long a call waits for a step that is not READY when the client
	// set no deadline (default 10 minutes), so that a forgotten client never hangs forever.
	MaxWait time.Duration
	// Observer, when set, is told of every micro-batch sent; nil observes nothing.
	Observer Observer

	closing context.Context // done once Serve is stopping
	flight.BaseFlightServer
}

// Observer watches what the service sends (floe serve: Flight metrics and the start of
// each step's GPU window). Served is called after micro-batch data of step for rank was
// handed to gRPC: rows of the record batch and the bytes of its FlightData message. It is
// called concurrently and must not block.
type Observer interface {
	Served(step int64, rank, rows, bytes int)
}

// maxMessageBytes lets a single micro-batch of many millions of rows through gRPC.
const maxMessageBytes = 1 << 30

// Serve serves on lis until ctx is done, then stops gracefully.
func (s *Server[S]) Serve(ctx context.Context, lis net.Listener) error {
	if s.Source == nil || s.Control == nil {
		return errors.New("arrowflight: Server needs a Source and a Control")
	}
	if s.Mem == nil {
		s.Mem = memory.NewGoAllocator()
	}
	if s.Log == nil {
		s.Log = slog.Default()
	}
	if s.MaxWait <= 0 {
		s.MaxWait = 10 * time.Minute
	}
	srv := flight.NewServerWithMiddleware(nil,
		grpc.ChainUnaryInterceptor(s.authUnary),
		grpc.ChainStreamInterceptor(s.authStream),
		grpc.MaxSendMsgSize(maxMessageBytes),
		grpc.MaxRecvMsgSize(maxMessageBytes),
		grpc.ForceServerCodecV2(newCodec()),
	)
	srv.RegisterFlightService(s)
	srv.InitListener(lis)
	var stop context.CancelFunc
	s.closing, stop = context.WithCancel(context.Background())
	defer stop()
	done := make(chan error, 1)
	go func() { done <- srv.Serve() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		// A graceful stop waits for calls in flight, and a call waiting for a step would
		// hold it until the client's deadline: end those waits first.
		stop()
		srv.Shutdown()
		<-done //nolint:errcheck // nil, or grpc.ErrServerStopped when the stop came before Serve began
		return nil
	}
}

// Listen opens addr: "host:port" for TCP, "unix:/path" for a Unix socket.
func Listen(addr string) (net.Listener, error) {
	if path, ok := strings.CutPrefix(addr, "unix:"); ok {
		return net.Listen("unix", path)
	}
	return net.Listen("tcp", addr)
}

// Location is the URI a Flight client connects to for lis.
func Location(lis net.Listener) string {
	if lis.Addr().Network() == "unix" {
		return "grpc+unix://" + lis.Addr().String()
	}
	return "grpc+tcp://" + lis.Addr().String()
}

func (s *Server[S]) authorized(ctx context.Context) error {
	if s.Token == "" {
		return nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	want := "Bearer " + s.Token
	for _, got := range md.Get("authorization") {
		if subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1 {
			return nil
		}
	}
	return status.Error(codes.Unauthenticated, "floe: missing or wrong bearer token (send header authorization: Bearer <token>)")
}

func (s *Server[S]) authUnary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if err := s.authorized(ctx); err != nil {
		return nil, err
	}
	return h(ctx, req)
}

func (s *Server[S]) authStream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if err := s.authorized(ss.Context()); err != nil {
		return err
	}
	return h(srv, ss)
}

// waitContext bounds a wait by MaxWait when the client set no deadline, and otherwise
// ends it a little before the client's deadline, so that the client receives floe's
// "not READY" answer (which names the READY steps) rather than its own bare timeout.
// The margin is a tenth of the time left, up to a second: on a loaded machine the answer
// can take tens of milliseconds to reach the client, and a fixed 50 ms was not enough.
func (s *Server[S]) waitContext(ctx context.Context) (context.Context, context.CancelFunc) {
	d, ok := ctx.Deadline()
	if !ok {
		return context.WithTimeout(ctx, s.MaxWait)
	}
	margin := min(time.Second, time.Until(d)/10)
	return context.WithDeadline(ctx, d.Add(-margin))
}

// step fetches step n (or the next one when n < 0), mapping the source's errors to
// gRPC statuses a user can act on.
func (s *Server[S]) step(ctx context.Context, n int64) (Step, error) {
	wctx, cancel := s.waitContext(ctx)
	defer cancel()
	if s.closing != nil {
		defer context.AfterFunc(s.closing, cancel)()
	}
	var st Step
	var err error
	if n < 0 {
		st, err = s.Source.Next(wctx)
	} else {
		st, err = s.Source.Step(wctx, n)
	}
	if err == nil {
		return st, nil
	}
	what := "the next step"
	if n >= 0 {
		what = fmt.Sprintf("step %d", n)
	}
	return nil, s.statusOf(err, what)
}

func (s *Server[S]) statusOf(err error, what string) error {
	status := func() string {
		b, _ := json.Marshal(s.Control.Status(context.Background()))
		return string(b)
	}
	switch {
	case s.closing != nil && s.closing.Err() != nil:
		return grpcError(codes.Unavailable, "floe is shutting down while %s was awaited", what)
	case errors.Is(err, ErrCommitted):
		return grpcError(codes.FailedPrecondition, "%v", err)
	case errors.Is(err, ErrNoSuchStep):
		return grpcError(codes.NotFound, "%v", err)
	case errors.Is(err, context.DeadlineExceeded):
		return grpcError(codes.DeadlineExceeded, "%s is not READY yet (status %s)", what, status())
	case errors.Is(err, context.Canceled):
		return grpcError(codes.Canceled, "waiting for %s: %v", what, err)
	default:
		return grpcError(codes.Internal, "%s: %v", what, err)
	}
}

// controlError maps a Control's error to its gRPC code by its class (source.go); the
// control API maps the same classes to HTTP statuses.
func controlError(err error) error {
	code := codes.Internal
	switch {
	case errors.Is(err, ErrInvalid):
		code = codes.InvalidArgument
	case errors.Is(err, ErrRefused):
		code = codes.FailedPrecondition
	case errors.Is(err, ErrUnavailable):
		code = codes.Unavailable
	}
	return grpcError(code, "%v", err)
}

func grpcError(code codes.Code, format string, args ...any) error {
	return status.Errorf(code, "floe: "+format, args...)
}

// infoMeta is the FlightInfo app_metadata: what a trainer needs before fetching.
func (s *Server[S]) flightInfo(st Step, desc *flight.FlightDescriptor) *flight.FlightInfo {
	n := st.Number()
	var endpoints []*flight.FlightEndpoint
	var total int64
	for r := 0; r < st.NumRanks(); r++ {
		t, _ := json.Marshal(rankTicket{Step: &n, Rank: &r})
		endpoints = append(endpoints, &flight.FlightEndpoint{Ticket: &flight.Ticket{Ticket: t}})
		total += int64(st.NumMicroBatches(r))
	}
	t, _ := json.Marshal(rankTicket{Step: &n, Kind: "samples"})
	endpoints = append(endpoints, &flight.FlightEndpoint{Ticket: &flight.Ticket{Ticket: t}})
	return &flight.FlightInfo{
		Schema:           flight.SerializeSchema(st.Schema(), s.Mem),
		FlightDescriptor: desc,
		Endpoint:         endpoints,
		TotalRecords:     total,
		TotalBytes:       -1,
		AppMetadata:      st.Info(),
	}
}

// GetFlightInfo resolves ["step", "<n>"] or ["next"] to the step's endpoints.
func (s *Server[S]) GetFlightInfo(ctx context.Context, desc *flight.FlightDescriptor) (*flight.FlightInfo, error) {
	if desc.GetType() != flight.DescriptorPATH {
		return nil, grpcError(codes.InvalidArgument, `descriptor must be a path: ["step", "<n>"] or ["next"]`)
	}
	n := int64(-1)
	switch p := desc.GetPath(); {
	case len(p) == 1 && p[0] == "next":
	case len(p) == 2 && p[0] == "step":
		v, err := strconv.ParseInt(p[1], 10, 64)
		if err != nil || v < 0 {
			return nil, grpcError(codes.InvalidArgument, "step %q in descriptor path is not a non-negative integer", p[1])
		}
		n = v
	default:
		return nil, grpcError(codes.InvalidArgument, `descriptor path %q: want ["step", "<n>"] or ["next"]`, p)
	}
	st, err := s.step(ctx, n)
	if err != nil {
		return nil, err
	}
	return s.flightInfo(st, desc), nil
}

// rankTicket is the JSON of a DoGet ticket.
type rankTicket struct {
	Step *int64 `json:"step"`
	Rank *int   `json:"rank,omitempty"`
	Kind string `json:"kind,omitempty"`
}

func parseTicket(raw []byte) (rankTicket, error) {
	var t rankTicket
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&t); err != nil {
		return t, grpcError(codes.InvalidArgument, `ticket %q is not JSON like {"step": 3, "rank": 0} or {"step": 3, "kind": "samples"}: %v`, raw, err)
	}
	switch {
	case t.Step == nil || *t.Step < 0:
		return t, grpcError(codes.InvalidArgument, `ticket %q: "step" must be a non-negative integer`, raw)
	case t.Kind != "" && t.Kind != "samples":
		return t, grpcError(codes.InvalidArgument, `ticket %q: unknown kind %q (want "samples" or a "rank")`, raw, t.Kind)
	case t.Kind == "" && t.Rank == nil:
		return t, grpcError(codes.InvalidArgument, `ticket %q: needs a "rank" or "kind": "samples"`, raw)
	}
	return t, nil
}

// DoGet streams one rank's micro-batches of a step, or the step's sample table.
func (s *Server[S]) DoGet(tkt *flight.Ticket, stream flight.FlightService_DoGetServer) error {
	t, err := parseTicket(tkt.GetTicket())
	if err != nil {
		return err
	}
	ctx := stream.Context()
	st, err := s.step(ctx, *t.Step)
	if err != nil {
		return err
	}
	if t.Kind == "samples" {
		rec, err := st.Samples(s.Mem)
		if err != nil {
			return grpcError(codes.Internal, "step %d sample table: %v", st.Number(), err)
		}
		defer rec.Release()
		w := &streamWriter{stream: stream, mem: s.Mem, schema: rec.Schema()}
		_, err = w.write(rec, nil)
		return err
	}
	rank := *t.Rank
	if rank < 0 || rank >= st.NumRanks() {
		return grpcError(codes.InvalidArgument, "rank %d out of range: step %d has %d ranks (0..%d)", rank, st.Number(), st.NumRanks(), st.NumRanks()-1)
	}
	w := &streamWriter{stream: stream, mem: s.Mem, schema: st.Schema()}
	if err := w.start(); err != nil {
		return err
	}
	// Encode the next micro-batch while the current one is being sent.
	ctx, cancel := context.WithCancel(ctx)
	batches := encodeAhead(ctx, st, s.Mem, rank)
	defer func() {
		cancel()
		for b := range batches { // drain, so the encoder stops and nothing leaks
			b.release()
		}
	}()
	for b := range batches {
		if b.err != nil {
			return grpcError(codes.Internal, "step %d rank %d micro-batch %d: %v", st.Number(), rank, b.index, b.err)
		}
		n, err := w.write(b.rec, b.meta)
		rows := int(b.rec.NumRows())
		b.release()
		if err != nil {
			return err
		}
		if s.Observer != nil {
			s.Observer.Served(st.Number(), rank, rows, n)
		}
	}
	if err := ctx.Err(); err != nil {
		return status.FromContextError(err).Err()
	}
	return nil
}

// encoded is one micro-batch from encodeAhead.
type encoded struct {
	index int
	rec   arrow.RecordBatch
	meta  []byte
	err   error
}

func (e encoded) release() {
	if e.rec != nil {
		e.rec.Release()
	}
}

// encodeAhead encodes rank's micro-batches in order on a goroutine of its own, at most
// one ahead of the consumer. The channel closes after the last batch, after an error, or
// once ctx is done; the consumer drains it to stop the goroutine.
func encodeAhead(ctx context.Context, st Step, mem memory.Allocator, rank int) <-chan encoded {
	out := make(chan encoded, 1)
	go func() {
		defer close(out)
		for i := 0; i < st.NumMicroBatches(rank); i++ {
			rec, meta, err := st.MicroBatch(mem, rank, i)
			e := encoded{index: i, rec: rec, meta: meta, err: err}
			select {
			case out <- e:
			case <-ctx.Done():
				e.release()
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return out
}

// actions lists the DoAction types with their descriptions.
var actions = []*flight.ActionType{
	{Type: "commit", Description: `{"step": n}: the step is consumed; exactly once, never served again`},
	{Type: "report", Description: `{"step", "rank", "peak_memory_bytes", "step_seconds", "wait_seconds", "pid"?}: a rank finished a step`},
	{Type: "pause", Description: `{}: stop new rollout calls and wait for those in flight (weight sync)`},
	{Type: "resume", Description: `{"policy_version": v}: release paused calls under policy version v`},
	{Type: "status", Description: `{}: READY steps, commits, pause state, policy version`},
}

func (s *Server[S]) ListActions(_ *flight.Empty, stream flight.FlightService_ListActionsServer) error {
	for _, a := range actions {
		if err := stream.Send(a); err != nil {
			return err
		}
	}
	return nil
}

// DoAction runs one control action and answers with one JSON result.
func (s *Server[S]) DoAction(a *flight.Action, stream flight.FlightService_DoActionServer) error {
	ctx := stream.Context()
	body := a.GetBody()
	if len(body) == 0 {
		body = []byte("{}")
	}
	var result any
	switch a.GetType() {
	case "commit":
		var req struct {
			Step *int64 `json:"step"`
		}
		if err := decodeBody(a.GetType(), body, &req); err != nil {
			return err
		}
		if req.Step == nil {
			return grpcError(codes.InvalidArgument, `commit %s: needs "step"`, body)
		}
		if err := s.Source.Commit(ctx, *req.Step); err != nil {
			if errors.Is(err, ErrCommitted) {
				return grpcError(codes.FailedPrecondition, "%v", err)
			}
			return grpcError(codes.FailedPrecondition, "commit: %v", err)
		}
		s.Log.Info("step committed", "step", *req.Step)
		result = map[string]any{"step": *req.Step, "committed": true}
	case "report":
		var r Report
		if err := decodeBody(a.GetType(), body, &r); err != nil {
			return err
		}
		if err := s.Control.Report(ctx, r); err != nil {
			return controlError(err)
		}
		result = map[string]any{"ok": true}
	case "pause":
		v, err := s.Control.Pause(ctx)
		if err != nil {
			return controlError(err)
		}
		result = map[string]any{"paused": true, "policy_version": v}
	case "resume":
		var req struct {
			PolicyVersion *int64 `json:"policy_version"`
		}
		if err := decodeBody(a.GetType(), body, &req); err != nil {
			return err
		}
		if req.PolicyVersion == nil {
			return grpcError(codes.InvalidArgument, `resume %s: needs "policy_version"`, body)
		}
		if err := s.Control.Resume(ctx, *req.PolicyVersion); err != nil {
			return controlError(err)
		}
		result = map[string]any{"paused": false, "policy_version": *req.PolicyVersion}
	case "status":
		result = s.Control.Status(ctx)
	default:
		names := make([]string, len(actions))
		for i, x := range actions {
			names[i] = x.Type
		}
		return grpcError(codes.InvalidArgument, "unknown action %q (actions: %s)", a.GetType(), strings.Join(names, ", "))
	}
	out, err := json.Marshal(result)
	if err != nil {
		return grpcError(codes.Internal, "%s: encoding the result: %v", a.GetType(), err)
	}
	return stream.Send(&flight.Result{Body: out})
}

func decodeBody(action string, body []byte, v any) error {
	dec := json.NewDecoder(strings.NewReader(string(body)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return grpcError(codes.InvalidArgument, "%s: body %q is not the expected JSON: %v", action, body, err)
	}
	return nil
}
