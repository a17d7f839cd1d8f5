package capacity

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/apache/arrow-go/v18/arrow/array"
	"github.com/apache/arrow-go/v18/arrow/flight"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// RunRank is one trainer rank's process (floe-bench capacity-rank): it reads step numbers
// on in, one a line, fetches its rank's micro-batches of that step from floe's Flight
// service, decoding them into Arrow records as a trainer does, and answers on out
// "<step> <bytes> <rows> <micro-batches>" or "<step> error <message>". It returns at the
// end of in. The step is committed by whoever drives the ranks, once all have it.
func RunRank(ctx context.Context, location string, rank int, in io.Reader, out io.Writer) error {
	c, err := dialFlight(location)
	if err != nil {
		return err
	}
	defer func() { _ = c.Close() }() // a Flight client: nothing to flush
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		step, err := strconv.ParseInt(strings.TrimSpace(sc.Text()), 10, 64)
		if err != nil {
			return fmt.Errorf("rank %d: step %q is not a number", rank, sc.Text())
		}
		bytes, rows, batches, err := fetchRank(ctx, c, step, rank)
		if err != nil {
			if _, err := fmt.Fprintf(out, "%d error %s\n", step, strings.ReplaceAll(err.Error(), "\n", " ")); err != nil {
				return fmt.Errorf("rank %d: reporting step %d: %w", rank, step, err)
			}
			continue
		}
		if _, err := fmt.Fprintf(out, "%d %d %d %d\n", step, bytes, rows, batches); err != nil {
			return fmt.Errorf("rank %d: reporting step %d: %w", rank, step, err)
		}
	}
	return sc.Err()
}

func dialFlight(location string) (flight.Client, error) {
	c, err := flight.NewClientWithMiddleware(strings.TrimPrefix(location, "grpc+tcp://"), nil, nil,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(1<<30)))
	if err != nil {
		return nil, fmt.Errorf("dialing floe's Flight service %s: %w", location, err)
	}
	return c, nil
}

// countingStream counts the Flight messages' bytes as they arrive.
type countingStream struct {
	flight.FlightService_DoGetClient
	bytes int64
}

func (s *countingStream) Recv() (*flight.FlightData, error) {
	d, err := s.FlightService_DoGetClient.Recv()
	if d != nil {
		s.bytes += int64(len(d.DataHeader) + len(d.DataBody) + len(d.AppMetadata))
	}
	return d, err
}

func fetchRank(ctx context.Context, c flight.Client, step int64, rank int) (bytes, rows int64, batches int, err error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	stream, err := c.DoGet(ctx, &flight.Ticket{Ticket: fmt.Appendf(nil, `{"step": %d, "rank": %d}`, step, rank)})
	if err != nil {
		return 0, 0, 0, err
	}
	cs := &countingStream{FlightService_DoGetClient: stream}
	rd, err := flight.NewRecordReader(cs)
	if err != nil {
		return 0, 0, 0, err
	}
	defer rd.Release()
	for rd.Next() {
		rows += rd.RecordBatch().NumRows()
		batches++
	}
	if err := rd.Err(); err != nil {
		return 0, 0, 0, err
	}
	return cs.bytes, rows, batches, nil
}

// ranks drives T rank processes and commits each step once all have fetched it.
type ranks struct {
	procs  []*rankProc
	flight flight.Client
}

type rankProc struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Scanner
}

// startRanks starts T rank processes; command(rank) is rank's command line.
func startRanks(location string, t int, command func(location string, rank int) *exec.Cmd) (*ranks, error) {
	c, err := dialFlight(location)
	if err != nil {
		return nil, err
	}
	rs := &ranks{flight: c}
	for r := 0; r < t; r++ {
		cmd := command(location, r)
		in, err := cmd.StdinPipe()
		if err != nil {
			rs.stop()
			return nil, err
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			rs.stop()
			return nil, err
		}
		if err := cmd.Start(); err != nil {
			rs.stop()
			return nil, fmt.Errorf("starting rank %d: %w", r, err)
		}
		rs.procs = append(rs.procs, &rankProc{cmd: cmd, in: in, out: bufio.NewScanner(out)})
	}
	return rs, nil
}

// stop closes the ranks' input, which ends them, and waits for them.
func (rs *ranks) stop() {
	for _, p := range rs.procs {
		_ = p.in.Close()
	}
	for _, p := range rs.procs {
		_ = p.cmd.Wait()
	}
	if rs.flight != nil {
		_ = rs.flight.Close() // a Flight client: nothing to flush
	}
}

// fetched is one step's delivery to every rank.
type fetched struct {
	Step    int64         `json:"step"`
	Bytes   int64         `json:"bytes"`
	Rows    int64         `json:"rows"`
	Batches int           `json:"micro_batches"`
	Took    time.Duration `json:"took_ns"` // from asking the ranks to the last one's answer
	// Groups are the step's groups, from its sample table (not timed): the point checks
	// the archive against them.
	Groups []string `json:"-"`
}

// waitReady waits at most wait for step n to be READY.
func (rs *ranks) waitReady(ctx context.Context, n int64, wait time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	_, err := rs.flight.GetFlightInfo(ctx, &flight.FlightDescriptor{Type: flight.DescriptorPATH, Path: []string{"step", strconv.FormatInt(n, 10)}})
	return err
}

// fetch has every rank fetch step n at once, then commits it.
func (rs *ranks) fetch(ctx context.Context, n int64) (fetched, error) {
	f := fetched{Step: n}
	t0 := time.Now()
	for _, p := range rs.procs {
		if _, err := fmt.Fprintf(p.in, "%d\n", n); err != nil {
			return f, fmt.Errorf("asking a rank for step %d: %w", n, err)
		}
	}
	var mu sync.Mutex
	var errs []error
	var wg sync.WaitGroup
	for r, p := range rs.procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			var b, rows int64
			var mb int
			if !p.out.Scan() {
				err = fmt.Errorf("rank %d ended: %v", r, p.out.Err())
			} else if fs := strings.Fields(p.out.Text()); len(fs) >= 2 && fs[1] == "error" {
				err = fmt.Errorf("rank %d: %s", r, strings.Join(fs[2:], " "))
			} else if _, e := fmt.Sscan(p.out.Text(), new(int64), &b, &rows, &mb); e != nil {
				err = fmt.Errorf("rank %d answered %q: %w", r, p.out.Text(), e)
			}
			mu.Lock()
			defer mu.Unlock()
			errs = append(errs, err)
			f.Bytes, f.Rows, f.Batches = f.Bytes+b, f.Rows+rows, f.Batches+mb
		}()
	}
	wg.Wait()
	f.Took = time.Since(t0)
	if err := errors.Join(errs...); err != nil {
		return f, fmt.Errorf("step %d: %w", n, err)
	}
	groups, err := stepGroups(ctx, rs.flight, n)
	if err != nil {
		return f, fmt.Errorf("step %d's sample table: %w", n, err)
	}
	f.Groups = groups
	s, err := rs.flight.DoAction(ctx, &flight.Action{Type: "commit", Body: fmt.Appendf(nil, `{"step": %d}`, n)})
	if err != nil {
		return f, fmt.Errorf("committing step %d: %w", n, err)
	}
	if _, err := s.Recv(); err != nil {
		return f, fmt.Errorf("committing step %d: %w", n, err)
	}
	return f, nil
}

// stepGroups reads step n's sample table over Flight, as a trainer does, and returns its
// distinct group ids.
func stepGroups(ctx context.Context, c flight.Client, n int64) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	stream, err := c.DoGet(ctx, &flight.Ticket{Ticket: fmt.Appendf(nil, `{"step": %d, "kind": "samples"}`, n)})
	if err != nil {
		return nil, err
	}
	rd, err := flight.NewRecordReader(stream)
	if err != nil {
		return nil, err
	}
	defer rd.Release()
	seen := map[string]bool{}
	var groups []string
	for rd.Next() {
		rec := rd.RecordBatch()
		idx := rec.Schema().FieldIndices("group_id")
		if len(idx) != 1 {
			return nil, errors.New("no group_id column")
		}
		col, ok := rec.Column(idx[0]).(*array.String)
		if !ok {
			return nil, fmt.Errorf("group_id is %s, not a string column", rec.Column(idx[0]).DataType())
		}
		for i := 0; i < col.Len(); i++ {
			if g := col.Value(i); !seen[g] {
				seen[g] = true
				groups = append(groups, g)
			}
		}
	}
	return groups, rd.Err()
}
