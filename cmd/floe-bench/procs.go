package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/floe-rl/floe/benchmarks/e2e"
	"github.com/floe-rl/floe/sidecar"
)

// benchProcs starts what the replaying benchmarks (e2e, replay) run: the reference
// inference server as a child process and floe serve in-process, their logs in work.
type benchProcs struct {
	work, python string
	tokenizer    string // the reference server's -tokenizer directory; "" for its own BPE
	progress     func(format string, a ...any)
}

// record starts a floe that records without forming steps, against ref, and replays the
// sessions through its proxy with the driver d (its addresses are filled in) into dataDir.
func (b benchProcs) record(ctx context.Context, ref *refServer, sessions []e2e.Session, dataDir, name string, d *e2e.Driver) error {
	cfg := sidecar.DefaultConfig()
	cfg.DataDir, cfg.ProxyAddr, cfg.ControlAddr, cfg.FlightAddr, cfg.Upstream = dataDir, "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0", ref.base
	// Record only: no step is formed, so every strategy later forms its steps from the
	// same complete groups.
	cfg.GroupsPerStep, cfg.MinGroupSize, cfg.GroupTimeout = 1<<30, 1, 0
	f, err := b.startFloe(ctx, cfg, name)
	if err != nil {
		return err
	}
	defer f.stop()
	d.Proxy, d.Control, d.RefServer = f.addrs.Proxy, f.addrs.Control, ref.base
	calls := 0
	for _, s := range sessions {
		calls += len(s.Calls)
	}
	began := time.Now()
	last := time.Time{}
	d.Progress = func(n int) {
		if time.Since(last) > 2*time.Second || n == calls {
			last = time.Now()
			b.progress("%s: %d/%d calls, %.0fs", name, n, calls, time.Since(began).Seconds())
		}
	}
	return d.Run(ctx, sessions)
}

// floeRun is an in-process floe serve. done is closed when Serve returns, with its
// error in err.
type floeRun struct {
	addrs sidecar.Addrs
	log   string
	done  chan struct{}
	err   error
	stop  func()
}

func (b benchProcs) startFloe(ctx context.Context, cfg sidecar.Config, name string) (*floeRun, error) {
	logf, err := os.Create(filepath.Join(b.work, name+"-floe.log"))
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	f := &floeRun{log: logf.Name(), done: make(chan struct{})}
	addrs := make(chan sidecar.Addrs, 1)
	go func() {
		defer close(f.done)
		f.err = sidecar.Serve(ctx, cfg, slog.New(slog.NewTextHandler(logf, nil)), func(a sidecar.Addrs) { addrs <- a })
	}()
	f.stop = func() {
		cancel()
		<-f.done
		if f.err != nil {
			b.progress("floe (%s) stopped with: %v", name, f.err)
		}
		_ = logf.Close() // the log only: losing its tail on Close must not hide the result
	}
	select {
	case f.addrs = <-addrs:
		return f, nil
	case <-f.done:
		f.stop()
		if f.err == nil {
			return nil, fmt.Errorf("floe serve stopped before it was ready (log: %s)", f.log)
		}
		return nil, fmt.Errorf("floe serve: %w (log: %s)", f.err, f.log)
	}
}

// refServer is the reference inference server process.
type refServer struct {
	base string // http://host:port
	stop func()
}

func (b benchProcs) startRefServer(ctx context.Context, maxModelLen int) (*refServer, error) {
	args := []string{"-m", "floe_refserver", "--port", "0", "--max-model-len", strconv.Itoa(maxModelLen)}
	if b.tokenizer != "" {
		args = append(args, "--tokenizer", b.tokenizer)
	}
	cmd := exec.Command(b.python, args...)
	// Its own process group, so that stopping it stops anything it started too.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	logf, err := os.Create(filepath.Join(b.work, "refserver.log"))
	if err != nil {
		return nil, err
	}
	cmd.Stderr = logf
	out, err := cmd.StdoutPipe()
	if err != nil {
		_ = logf.Close() // the error above is the one to report
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		_ = logf.Close() // the error above is the one to report
		return nil, fmt.Errorf("starting the reference server (%s): %w", b.python, err)
	}
	stop := func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
		_ = logf.Close() // the log only: losing its tail on Close must not hide the result
	}
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		if sc.Scan() {
			line <- sc.Text()
		}
		close(line)
		_, _ = io.Copy(io.Discard, out)
	}()
	select {
	case l, ok := <-line:
		var a struct {
			BaseURL string `json:"base_url"`
		}
		if !ok || json.Unmarshal([]byte(l), &a) != nil || a.BaseURL == "" {
			stop()
			return nil, fmt.Errorf("the reference server did not start (log: %s)", logf.Name())
		}
		return &refServer{base: strings.TrimSuffix(a.BaseURL, "/v1"), stop: stop}, nil
	case <-ctx.Done():
		stop()
		return nil, ctx.Err()
	case <-time.After(5 * time.Minute):
		stop()
		return nil, fmt.Errorf("the reference server did not start in 5 minutes (log: %s)", logf.Name())
	}
}
