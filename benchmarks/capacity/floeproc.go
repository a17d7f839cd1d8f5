package capacity

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// floeProc is the floe serve child process under measurement.
type floeProc struct {
	cmd     *exec.Cmd
	proxy   string
	control string
	flight  string // grpc+tcp://host:port
	logs    *os.File
	exited  chan struct{}
	waitErr error
}

// startFloe starts cmd (a floe serve command line, flags included) and waits for its
// address announcement. stderr goes to logPath.
func startFloe(ctx context.Context, cmd *exec.Cmd, logPath string) (*floeProc, error) {
	logs, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd.Stderr = logs
	out, err := cmd.StdoutPipe()
	if err != nil {
		_ = logs.Close() // the error above is the one to report
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		_ = logs.Close() // the error above is the one to report
		return nil, fmt.Errorf("starting floe serve: %w", err)
	}
	p := &floeProc{cmd: cmd, logs: logs, exited: make(chan struct{})}
	lines := make(chan string, 1)
	go func() {
		rd := bufio.NewReader(out)
		line, _ := rd.ReadString('\n')
		lines <- line
		_, _ = io.Copy(io.Discard, rd)
	}()
	go func() {
		p.waitErr = cmd.Wait()
		close(p.exited)
	}()
	select {
	case line := <-lines:
		var addrs struct{ Proxy, Control, Flight string }
		if err := json.Unmarshal([]byte(line), &addrs); err != nil || addrs.Proxy == "" {
			p.stop()
			return nil, fmt.Errorf("floe serve announced %q, not its addresses (log: %s)", line, logPath)
		}
		p.proxy, p.control, p.flight = addrs.Proxy, addrs.Control, addrs.Flight
		return p, nil
	case <-time.After(60 * time.Second):
		p.stop()
		return nil, fmt.Errorf("floe serve announced nothing in 60 s (log: %s)", logPath)
	case <-ctx.Done():
		p.stop()
		return nil, ctx.Err()
	}
}

// stop ends floe with SIGTERM (as an operator would), then SIGKILL after 10 s.
func (p *floeProc) stop() {
	defer func() { _ = p.logs.Close() }() // the log only: losing its tail on Close must not hide the result
	select {
	case <-p.exited:
		return
	default:
	}
	_ = p.cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
}

// procMemory is a process's resident memory from /proc/<pid>/status, in bytes.
type procMemory struct {
	RSS  int64 `json:"rss"`      // VmRSS
	Anon int64 `json:"rss_anon"` // RssAnon: heap and stacks, without the store's mapped file
}

func readMemory(pid int) (procMemory, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return procMemory{}, err
	}
	var m procMemory
	for _, line := range strings.Split(string(raw), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		n, _ := strconv.ParseInt(f[0], 10, 64)
		switch k {
		case "VmRSS":
			m.RSS = n * 1024
		case "RssAnon":
			m.Anon = n * 1024
		}
	}
	return m, nil
}

// clockTicks is USER_HZ, 100 on every Linux floe runs on.
const clockTicks = 100

// readCPU is a process's user + system CPU time so far, from /proc/<pid>/stat.
func readCPU(pid int) (time.Duration, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name may hold spaces; the fields after it are fixed.
	s := string(raw)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("unexpected /proc/%d/stat", pid)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, fmt.Errorf("unexpected /proc/%d/stat", pid)
	}
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * time.Second / clockTicks, nil
}

// metrics is floe's /metrics: each metric summed over its labels under its name, and
// each series under its name with its labels, as floe_groups{state="open"}.
type metrics map[string]float64

func scrape(ctx context.Context, c *http.Client, control string) (metrics, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, control+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scraping floe's metrics: %w", err)
	}
	defer func() { _ = resp.Body.Close() }() // the body is read or abandoned; its Close error changes nothing
	return parseMetrics(resp.Body)
}

// parseMetrics reads Prometheus' text format, summing each name over its label sets.
func parseMetrics(r io.Reader) (metrics, error) {
	m := metrics{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		name, rest, ok := strings.Cut(line, " ")
		if i := strings.IndexByte(line, '{'); i >= 0 {
			j := strings.LastIndexByte(line, '}')
			if j < i {
				continue
			}
			name, rest, ok = line[:i], strings.TrimSpace(line[j+1:]), true
		}
		if !ok {
			continue
		}
		fs := strings.Fields(rest)
		if len(fs) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(fs[0], 64)
		if err != nil {
			continue
		}
		m[name] += v
		if series := strings.TrimSpace(line[:len(line)-len(rest)]); series != name {
			m[series] += v
		}
	}
	return m, sc.Err()
}
