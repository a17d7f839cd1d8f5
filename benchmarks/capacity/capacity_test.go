package capacity

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/floe-rl/floe/batcher"
	"github.com/floe-rl/floe/internal/cli"
	"github.com/floe-rl/floe/sidecar"
)

// The test binary plays both child processes the benchmark starts: floe serve (the
// sidecar's Serve with floe serve's flags, as cmd/floe runs it) and a trainer rank, chosen
// by $CAPACITY_TEST_CHILD, so the test needs no go build.
const childEnv = "CAPACITY_TEST_CHILD"

func TestMain(m *testing.M) {
	switch os.Getenv(childEnv) {
	case "serve":
		os.Exit(childServe(os.Args[1:]))
	case "rank":
		loc, rank := os.Args[1], os.Args[2]
		r, _ := strconv.Atoi(rank)
		if err := RunRank(context.Background(), loc, r, os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func childServe(args []string) int {
	fs := cli.NewFlagSet("floe serve", "", os.Stderr)
	cfg := sidecar.DefaultConfig()
	cfg.RegisterFlags(fs)
	if ok, err := cli.Parse(fs, args); !ok {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := sidecar.Serve(ctx, cfg, slog.New(slog.NewTextHandler(os.Stderr, nil)), sidecar.AnnounceJSON(os.Stdout)); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

func child(kind string, args ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), childEnv+"="+kind)
	return cmd
}

// tinyOptions: sessions of more turns than the load has time for, so that all are open
// when it ends; their groups complete in the drain.
func tinyOptions(t *testing.T) Options {
	return Options{
		Sessions: []int{8}, Ranks: []int{2},
		Workload:      Workload{GroupSize: 4, Turns: 1000, SystemBytes: 256, TaskBytes: 64, ToolBytes: 128, AnswerTokens: 16},
		GroupsPerStep: 1, LoadFor: time.Second, ProbeFor: 500 * time.Millisecond, ProbeLoad: 0.5, DrainFor: 10 * time.Second, Seed: 1,
		Floe: func(args []string) *exec.Cmd { return child("serve", args...) },
		Rank: func(loc string, r int) *exec.Cmd { return child("rank", loc, strconv.Itoa(r)) },
		Work: t.TempDir(), Progress: testWriter{t},
	}
}

// TestTinySweep runs one small point against a real floe serve process and two rank
// processes: every call the agents made is recorded, durable, and steps reach both ranks
// and are committed; each committed step's calls are in the archive, and the store holds
// none of them.
func TestTinySweep(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := Run(ctx, tinyOptions(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Points) != 1 {
		t.Fatalf("%d points, want 1", len(rep.Points))
	}
	p := rep.Points[0]
	if p.Errors != 0 {
		t.Fatalf("%d calls failed: %s", p.Errors, p.FirstError)
	}
	if p.Calls == 0 || p.Recorded != p.Calls {
		t.Errorf("calls made %d, floe recorded %d: want every call recorded", p.Calls, p.Recorded)
	}
	if p.ProbeErrors != 0 {
		t.Fatalf("%d probe calls failed: %s", p.ProbeErrors, p.FirstError)
	}
	if p.ProbeCalls == 0 || p.ProxyP50 <= 0 || p.DirectP50 <= 0 || p.SaturatedP50 <= 0 {
		t.Errorf("latencies not measured: %d probe calls, p50 %.3f ms through floe, %.3f ms direct, %.3f ms saturated",
			p.ProbeCalls, p.ProxyP50, p.DirectP50, p.SaturatedP50)
	}
	if p.StoreBytes <= 0 || p.StoreFileBytes < p.StoreBytes {
		t.Errorf("store after the run: %d bytes in use, file %d bytes", p.StoreBytes, p.StoreFileBytes)
	}
	// The archive's invariant, asserted here too so that the test fails if Run ever
	// stops checking it. With GroupsPerStep 1 and every group finished, every group is in
	// a committed step, so every call is archived and the store holds none.
	if p.ArchivedSteps != p.StepsCommitted {
		t.Errorf("%d steps archived, %d committed: want every committed step archived", p.ArchivedSteps, p.StepsCommitted)
	}
	if p.CommittedCalls == 0 || p.ArchivedCalls != p.CommittedCalls {
		t.Errorf("%d calls archived, %d calls in committed steps: want > 0 and equal", p.ArchivedCalls, p.CommittedCalls)
	}
	if p.CommittedCalls != p.RecordedAll || p.StoreCalls != 0 {
		t.Errorf("%d of %d calls recorded are in committed steps, the store holds %d: want all, and none held",
			p.CommittedCalls, p.RecordedAll, p.StoreCalls)
	}
	if p.ArchivedSessions != int64(p.Sessions) {
		t.Errorf("%d sessions archived, want the %d the agents ran", p.ArchivedSessions, p.Sessions)
	}
	// Parquet of byte-token prompts: more than nothing, less than the prompts as int32s.
	if perCall := p.ArchiveBytesPerCall(); perCall < 100 || perCall > 4*float64(tinyOptions(t).Workload.LongestPrompt()) {
		t.Errorf("archive: %d bytes for %d calls (%.0f bytes a call)", p.ArchiveBytes, p.ArchivedCalls, perCall)
	}
	if p.RecordedAll != p.Calls+p.ProbeCalls {
		t.Errorf("floe recorded %d calls in all, the agents made %d + %d in the probe", p.RecordedAll, p.Calls, p.ProbeCalls)
	}
	if p.StepsCommitted == 0 || p.StepsCommitted != int64(len(p.Fetched)) {
		t.Errorf("%d steps committed, %d fetched by the ranks: want > 0 and equal", p.StepsCommitted, len(p.Fetched))
	}
	if p.StepsFormed != p.StepsCommitted {
		t.Errorf("%d steps formed, %d committed: the drain should take every formed step", p.StepsFormed, p.StepsCommitted)
	}
	for _, f := range p.Fetched {
		if f.Bytes == 0 || f.Rows == 0 || f.Batches < 2 {
			t.Errorf("step %d reached the ranks as %d bytes, %d rows, %d micro-batches: want both ranks to get data", f.Step, f.Bytes, f.Rows, f.Batches)
		}
	}
	if p.OpenSessions != int64(p.Sessions) || p.OpenRSS <= 0 || p.IdleRSS <= 0 {
		t.Errorf("memory: %d sessions open of %d, RSS idle %d open %d", p.OpenSessions, p.Sessions, p.IdleRSS, p.OpenRSS)
	}
	if p.FloeCPU <= 0 {
		t.Errorf("floe's CPU over the load: %v s", p.FloeCPU)
	}
}

// TestTinySweepFailsWithoutArchive: the point's archive check is real. With floe serve's
// archiving off, committed steps stay in the store, and the point fails saying so.
func TestTinySweepFailsWithoutArchive(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	opt := tinyOptions(t)
	opt.DrainFor = 3 * time.Second // the drain waits for archiving that never comes
	opt.Floe = func(args []string) *exec.Cmd { return child("serve", append(args, "-archive=false")...) }
	_, err := Run(ctx, opt)
	if err == nil {
		t.Fatal("Run passed with floe serve's archiving off: want the archive check to fail the point")
	}
	if !strings.Contains(err.Error(), "want every committed step archived") || !strings.Contains(err.Error(), "must leave it") {
		t.Errorf("Run failed with %v, want it to name the unarchived steps and the calls left in the store", err)
	}
}

// TestFormingGrowsWithSize: bigger steps hold more rows and calls, and every phase is
// timed.
func TestFormingGrowsWithSize(t *testing.T) {
	w := Workload{GroupSize: 4, Turns: 3, SystemBytes: 256, TaskBytes: 64, ToolBytes: 128, AnswerTokens: 16}
	cfg := batcher.DefaultConfig()
	cfg.TokenBudget, cfg.DPSize = 4096, 2
	costs, err := MeasureForming(w, cfg, []int{1, 4}, 1, 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(costs) != 2 {
		t.Fatalf("%d sizes measured, want 2", len(costs))
	}
	if costs[0].Calls != 4*3 || costs[1].Calls != 4*4*3 {
		t.Errorf("calls %d and %d, want 12 and 48", costs[0].Calls, costs[1].Calls)
	}
	if costs[1].Rows <= costs[0].Rows {
		t.Errorf("rows %d for 4 groups, %d for 1: want more", costs[1].Rows, costs[0].Rows)
	}
	for _, c := range costs {
		if c.ReconstructS <= 0 || c.PackS <= 0 || c.EncodeS <= 0 {
			t.Errorf("%d groups: a phase untimed: %+v", c.Groups, c)
		}
	}
}

// TestUpstreamStreamsTheHistory: the fake's prompt ids are the messages' bytes, and the
// answer is the one the agents append to their history.
func TestUpstreamStreamsTheHistory(t *testing.T) {
	w := Workload{GroupSize: 1, Turns: 2, SystemBytes: 8, TaskBytes: 4, ToolBytes: 4, AnswerTokens: 6}
	h := newHistory(w, "sys", 1, 1, 0)
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(h.body()))
	Upstream(w.AnswerTokens).ServeHTTP(rec, req)
	body := rec.Body.String()
	var first struct {
		PromptTokenIDs []int32 `json:"prompt_token_ids"`
	}
	line, _, _ := strings.Cut(strings.TrimPrefix(body, "data: "), "\n")
	if err := json.Unmarshal([]byte(line), &first); err != nil {
		t.Fatalf("first chunk %q: %v", line, err)
	}
	want := len("sys") + 1 + w.TaskBytes + 1
	if len(first.PromptTokenIDs) != want || first.PromptTokenIDs[0] != 's' {
		t.Errorf("prompt ids %v, want the bytes of the 2 messages (%d)", first.PromptTokenIDs, want)
	}
	var text strings.Builder
	for _, l := range strings.Split(body, "\n") {
		var c struct {
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
		}
		if d, ok := strings.CutPrefix(l, "data: "); ok && d != "[DONE]" && json.Unmarshal([]byte(d), &c) == nil && len(c.Choices) > 0 {
			text.WriteString(c.Choices[0].Delta.Content)
		}
	}
	if got, want := text.String(), answer(2, w.AnswerTokens); got != want || len(got) != w.AnswerTokens {
		t.Errorf("streamed %q, want %q", got, want)
	}
	if !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Errorf("the stream does not end with [DONE]: %q", body[max(len(body)-40, 0):])
	}
}

func TestParseMetrics(t *testing.T) {
	m, err := parseMetrics(strings.NewReader(`# HELP floe_groups x
floe_groups{state="open"} 3
floe_groups{state="complete"} 2
floe_calls_recorded_total{api="openai_chat",trainable="true"} 7
floe_calls_recorded_total{api="anthropic",trainable="false"} 1
floe_step_formation_seconds_sum 0.5
`))
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]float64{"floe_groups": 5, `floe_groups{state="open"}`: 3, "floe_calls_recorded_total": 8, "floe_step_formation_seconds_sum": 0.5} {
		if m[k] != want {
			t.Errorf("%s = %v, want %v", k, m[k], want)
		}
	}
}

// testWriter sends progress lines to the test's log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
