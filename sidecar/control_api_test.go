package sidecar

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/mem"
)

func TestControlAPISessionsAndPause(t *testing.T) {
	store, gate := &mem.Store{}, &proxy.Gate{}
	api := &ControlAPI{Node: newTestNode(t, NodeConfig{Store: store, Gate: gate}), BaseURL: "http://floe.test"}
	srv := httptest.NewServer(api.Handler())
	defer srv.Close()
	do := func(method, path, body string) (int, map[string]any) {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&out)
		return resp.StatusCode, out
	}
	code, s := do("POST", "/floe/v1/sessions", `{"task_id": "t1", "group_id": "g1", "group_size": 4}`)
	if code != 200 || s["session_id"] == nil || !strings.HasPrefix(s["api_key"].(string), "sk-floe-") {
		t.Fatalf("create: %d %v", code, s)
	}
	id, key := s["session_id"].(string), s["api_key"].(string)
	if got, err := store.Resolve(key); err != nil || got.ID != id {
		t.Fatalf("the new key resolves to %+v %v", got, err)
	}
	if urls := s["base_urls"].(map[string]any); urls["openai"] != "http://floe.test/v1" {
		t.Errorf("base_urls %v", urls)
	}
	_ = store.Record(context.Background(), &trace.Call{SessionID: id, PromptIDs: []int32{1}})
	if code, got := do("GET", "/floe/v1/sessions/"+id, ""); code != 200 || got["task_id"] != "t1" || got["group_id"] != "g1" ||
		got["status"] != "running" || len(got["calls"].([]any)) != 1 {
		t.Errorf("get: %d %v", code, got)
	}
	// A finish wakes the Node's step former: its group may be complete.
	api.Node.former = &stepFormer{wake: make(chan struct{}, 1)}
	if code, got := do("POST", "/floe/v1/sessions/"+id+"/finish", `{"reward": 0.5, "status": "failed"}`); code != 200 || len(api.Node.former.wake) != 1 {
		t.Errorf("finish: %d %v (former woken: %d)", code, got, len(api.Node.former.wake))
	}
	if code, got := do("GET", "/floe/v1/sessions/"+id, ""); got["status"] != "failed" || got["reward"] != 0.5 {
		t.Errorf("after finish: %d %v", code, got)
	}
	for _, tt := range []struct {
		method, path, body string
		code               int
	}{
		{"POST", "/floe/v1/sessions", `{"group_id": "g"}`, 400},
		{"POST", "/floe/v1/sessions", `nope`, 400},
		{"GET", "/floe/v1/sessions/nope", "", 404},
		{"POST", "/floe/v1/resume", `{}`, 400},
		{"POST", "/floe/v1/sessions/" + id + "/finish", `{"reward": 1}`, 409},
		{"POST", "/floe/v1/sessions/nope/finish", `{"reward": 1}`, 409},
		{"POST", "/floe/v1/sessions/" + id + "/finish", `{"status": "completed"}`, 400},
		{"POST", "/floe/v1/sessions/" + id + "/finish", `{"reward": 1, "status": "won"}`, 400},
		{"GET", "/floe/v1/frobnicate", "", 404},
	} {
		if code, got := do(tt.method, tt.path, tt.body); code != tt.code || got["error"] == nil {
			t.Errorf("%s %s: %d %v, want %d with an error", tt.method, tt.path, code, got, tt.code)
		}
	}
	if code, got := do("POST", "/floe/v1/pause", ""); code != 200 || got["paused"] != true {
		t.Fatalf("pause: %d %v", code, got)
	}
	entered := make(chan int64)
	go func() {
		_, v, leave, _ := gate.Admit(context.Background())
		leave()
		entered <- v
	}()
	select {
	case <-entered:
		t.Fatal("a call entered while paused")
	case <-time.After(50 * time.Millisecond):
	}
	if code, got := do("POST", "/floe/v1/resume", `{"policy_version": 3}`); code != 200 || got["policy_version"] != 3.0 {
		t.Fatalf("resume: %d %v", code, got)
	}
	if v := <-entered; v != 3 {
		t.Errorf("released under version %d", v)
	}
	if code, got := do("POST", "/floe/v1/resume", `{"policy_version": 1}`); code != 409 {
		t.Errorf("resume backwards: %d %v", code, got)
	}
	// The control listener serves no provider API: those are the proxy's, on its own
	// listener.
	for _, p := range []string{"/v1/models", "/v1/chat/completions", "/healthz"} {
		resp, _ := http.Post(srv.URL+p, "application/json", strings.NewReader(`{}`))
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound {
			t.Errorf("%s on the control listener: %d %s, want 404", p, resp.StatusCode, b)
		}
	}
}

// TestControlAPIGroupSizeFirstKept: the first group_size given to a group is kept; a
// session asking for another is refused with 409 and is never created, so it cannot hold
// the group open; the default size applies only to a group that has none.
func TestControlAPIGroupSizeFirstKept(t *testing.T) {
	store := &mem.Store{}
	api := &ControlAPI{Node: newTestNode(t, NodeConfig{Store: store, Gate: &proxy.Gate{}}), BaseURL: "http://floe.test", DefaultGroupSize: 8}
	srv := httptest.NewServer(api.Handler())
	defer srv.Close()
	create := func(body string) int {
		t.Helper()
		resp, err := http.Post(srv.URL+"/floe/v1/sessions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, tc := range []struct {
		body string
		want int
	}{
		{`{"task_id": "t", "group_id": "g", "group_size": 2}`, 200},
		{`{"task_id": "t", "group_id": "g"}`, 200}, // the default does not override 2
		{`{"task_id": "t", "group_id": "g", "group_size": 1000}`, 409},
		{`{"task_id": "t", "group_id": "h"}`, 200}, // h takes the default, 8
		{`{"task_id": "t", "group_id": "h", "group_size": 8}`, 200},
		{`{"task_id": "t", "group_id": "h", "group_size": 2}`, 409},
	} {
		if got := create(tc.body); got != tc.want {
			t.Errorf("create %s: %d, want %d", tc.body, got, tc.want)
		}
	}
	gs, err := store.Groups()
	if err != nil {
		t.Fatal(err)
	}
	want := []trace.GroupState{{ID: "g", TaskID: "t", Size: 2, Sessions: 2}, {ID: "h", TaskID: "t", Size: 8, Sessions: 2}}
	if len(gs) != 2 {
		t.Fatalf("groups %+v", gs)
	}
	for i := range want {
		if gs[i].ID != want[i].ID || gs[i].Size != want[i].Size || gs[i].Sessions != want[i].Sessions {
			t.Errorf("group %+v, want %+v", gs[i], want[i])
		}
	}
}

// TestControlAPIToken: with a token, every control call and /metrics needs it as a
// bearer token; without it, or with another, the answer is 401 and nothing changes.
func TestControlAPIToken(t *testing.T) {
	store, gate := &mem.Store{}, &proxy.Gate{}
	metrics := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "m 1\n") })
	api := &ControlAPI{Node: newTestNode(t, NodeConfig{Store: store, Gate: gate}), BaseURL: "http://floe.test", Token: "s3cret", Metrics: metrics}
	srv := httptest.NewServer(api.Handler())
	defer srv.Close()
	do := func(method, path, body, auth string) int {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, auth := range []string{"", "Bearer wrong", "s3cret", "Bearer s3cret2", "Basic czNjcmV0"} {
		for _, c := range []struct{ method, path, body string }{
			{"POST", "/floe/v1/sessions", `{"task_id": "t"}`},
			{"POST", "/floe/v1/pause", ""},
			{"POST", "/floe/v1/resume", `{"policy_version": 9223372036854775807}`},
			{"GET", "/floe/v1/status", ""},
			{"GET", "/metrics", ""},
		} {
			if got := do(c.method, c.path, c.body, auth); got != http.StatusUnauthorized {
				t.Errorf("%s %s with authorization %q: %d, want 401", c.method, c.path, auth, got)
			}
		}
	}
	if paused, v, _ := gate.State(); paused || v != 0 {
		t.Errorf("the gate changed without the token: paused %v version %d", paused, v)
	}
	if gs, _ := store.Groups(); len(gs) != 0 {
		t.Errorf("sessions were created without the token: %+v", gs)
	}
	if got := do("POST", "/floe/v1/sessions", `{"task_id": "t"}`, "Bearer s3cret"); got != 200 {
		t.Errorf("create with the token: %d", got)
	}
	if got := do("GET", "/metrics", "", "Bearer s3cret"); got != 200 {
		t.Errorf("metrics with the token: %d", got)
	}
}

// TestControlAPIRewardBounds: a reward must be a finite number within MaxAbsReward; any
// other is answered 400 naming the field, and the session stays running.
func TestControlAPIRewardBounds(t *testing.T) {
	store := &mem.Store{}
	api := &ControlAPI{Node: newTestNode(t, NodeConfig{Store: store, Gate: &proxy.Gate{}}), BaseURL: "http://floe.test", MaxAbsReward: 100}
	srv := httptest.NewServer(api.Handler())
	defer srv.Close()
	resp, err := http.Post(srv.URL+"/floe/v1/sessions", "application/json", strings.NewReader(`{"task_id": "t"}`))
	if err != nil {
		t.Fatal(err)
	}
	var s map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&s)
	resp.Body.Close()
	id := s["session_id"].(string)
	for _, bad := range []string{`1e39`, `-101`, `100.5`, `NaN`, `Infinity`, `-Infinity`, `1e400`, `"1"`, `null`} {
		resp, err := http.Post(srv.URL+"/floe/v1/sessions/"+id+"/finish", "application/json", strings.NewReader(`{"reward": `+bad+`}`))
		if err != nil {
			t.Fatal(err)
		}
		var body map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if msg, _ := body["error"].(string); resp.StatusCode != 400 || !strings.Contains(msg, "reward") {
			t.Errorf("reward %s: %d %v, want 400 naming reward", bad, resp.StatusCode, body)
		}
	}
	if got, _ := store.Session(id); got.Status != trace.StatusRunning {
		t.Fatalf("a refused finish finished the session: %+v", got)
	}
	resp, err = http.Post(srv.URL+"/floe/v1/sessions/"+id+"/finish", "application/json", strings.NewReader(`{"reward": -100}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("reward -100 (at the bound): %d, want 200", resp.StatusCode)
	}
}

// TestFinishSaysWhatBecomesOfTheGroup: a finish's reply names its group's state, and
// warns when the group cannot reach -min-group-size (the README's old example, a session
// without group_id, made a group of one that was dropped while the reply said
// "completed"); the status counts the groups by state.
func TestFinishSaysWhatBecomesOfTheGroup(t *testing.T) {
	var logs strings.Builder
	store := &mem.Store{}
	api := &ControlAPI{MinGroupSize: 2, Node: newTestNode(t, NodeConfig{Store: store, Gate: &proxy.Gate{}, Log: slog.New(slog.NewTextHandler(&logs, nil))})}
	srv := httptest.NewServer(api.Handler())
	defer srv.Close()
	post := func(path, body string) map[string]any {
		t.Helper()
		resp, err := http.Post(srv.URL+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out map[string]any
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != 200 {
			t.Fatalf("POST %s: %d %v %v", path, resp.StatusCode, out, err)
		}
		return out
	}
	create := func(body string) string { return post("/floe/v1/sessions", body)["session_id"].(string) }
	finish := func(id string) map[string]any { return post("/floe/v1/sessions/"+id+"/finish", `{"reward": 1}`) }

	alone := create(`{"task_id": "demo"}`)
	g2a, g2b := create(`{"task_id": "t", "group_id": "g2", "group_size": 2}`), create(`{"task_id": "t", "group_id": "g2", "group_size": 2}`)
	small := create(`{"task_id": "t", "group_id": "g1", "group_size": 1}`)
	create(`{"task_id": "t", "group_id": "g3", "group_size": 3}`)
	for _, tc := range []struct {
		name, session, state, warning string
		finished                      float64
	}{
		{"a session without a group", alone, "complete", "is complete with 1 session(s), fewer than -min-group-size 2", 1},
		{"the first of a group of 2", g2a, "waiting", "", 1},
		{"the second of a group of 2", g2b, "complete", "", 2},
		{"a group whose size is below the minimum", small, "complete", "fewer than -min-group-size 2", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := finish(tc.session)
			g, _ := got["group"].(map[string]any)
			w, _ := got["warning"].(string)
			if g["state"] != tc.state || g["finished"] != tc.finished || (tc.warning == "") != (w == "") || !strings.Contains(w, tc.warning) {
				t.Errorf("finish = %v; want group state %s, %v finished, warning %q", got, tc.state, tc.finished, tc.warning)
			}
		})
	}
	resp, err := http.Get(srv.URL + "/floe/v1/status")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st Status
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	if want := (GroupCounts{Waiting: 1, Complete: 3}); st.Groups == nil || *st.Groups != want {
		t.Errorf("status groups = %+v, want %+v", st.Groups, want)
	}
	for _, want := range []string{`msg="group cannot train"`, `msg="group waiting" group=g2 finished=1`, `msg="group complete: waits for a step" group=g2`} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("no %s in the log:\n%s", want, logs.String())
		}
	}
}

// TestPauseAndResumeAreLogged: every pause and resume through the control API reaches
// the log, a resume at the same version (a manual one, or weights not pushed) included,
// and a refused resume says why.
func TestPauseAndResumeAreLogged(t *testing.T) {
	var logs strings.Builder
	api := &ControlAPI{Node: newTestNode(t, NodeConfig{Store: &mem.Store{}, Gate: &proxy.Gate{}, Log: slog.New(slog.NewTextHandler(&logs, nil))})}
	srv := httptest.NewServer(api.Handler())
	defer srv.Close()
	for _, c := range []struct {
		path, body string
		status     int
	}{
		{"/floe/v1/pause", "", 200},
		{"/floe/v1/resume", `{"policy_version": 0}`, 200},
		{"/floe/v1/resume", `{"policy_version": 2}`, 200},
		{"/floe/v1/resume", `{"policy_version": 1}`, 409},
	} {
		resp, err := http.Post(srv.URL+c.path, "application/json", strings.NewReader(c.body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.status {
			t.Fatalf("POST %s %s: %d, want %d", c.path, c.body, resp.StatusCode, c.status)
		}
	}
	for _, want := range []string{
		`msg="rollouts paused" policy_version=0 via=control`,
		`msg="rollouts resumed" policy_version=0 previous=0 same_version=true via=control`,
		`msg="rollouts resumed" policy_version=2 previous=0 same_version=false via=control`,
		`level=WARN msg="resume refused" policy_version=1 current=2 via=control`,
	} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("no %s in the log:\n%s", want, logs.String())
		}
	}
}
