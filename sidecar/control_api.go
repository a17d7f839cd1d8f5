package sidecar

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"path/filepath"

	"github.com/floe-rl/floe/arrowflight"
	"github.com/floe-rl/floe/proxy"
	"github.com/floe-rl/floe/proxy/providers"
	"github.com/floe-rl/floe/trace"
	"github.com/floe-rl/floe/trace/archive"
)

// ControlAPI is the session and control HTTP API under /floe/v1 (docs/control.md):
// harness runners create sessions, finish them with their reward and read what was
// recorded; a trainer without Flight can pause and resume rollouts. It is served on its
// own listener (-control-addr), never on the proxy's: the harness, which holds the proxy
// address, must reach none of it (docs/security.md).
type ControlAPI struct {
	// Node is what every call acts on: the sessions' store, the gate, the status. The
	// API only decodes, checks and answers.
	Node *Node
	// Token, when set, is required on every call (and on /metrics) as
	// "Authorization: Bearer <Token>"; a call without it is answered 401.
	Token string
	// MaxAbsReward bounds |reward| of a finish (0: DefaultMaxAbsReward); a reward that is
	// not finite or beyond it is answered 400.
	MaxAbsReward float64
	// BaseURL is the proxy's address as harnesses reach it, for the base_urls of a new
	// session: one per provider of Dialects (nil: providers.Dialects(), all of them).
	BaseURL  string
	Dialects proxy.Dialects
	// DefaultGroupSize completes a named group that gave no group_size (0: no size).
	DefaultGroupSize int
	// Metrics, when set, is served at GET /metrics.
	Metrics http.Handler
	// MinGroupSize is -min-group-size: a finish whose group cannot reach it says so.
	MinGroupSize int
	// ArchiveDir is where archived steps go; with a Store that remembers forgotten
	// sessions (trace.Tombstones), GET of an archived session names its partition there.
	ArchiveDir string
}

type sessionInfo struct {
	TaskID    string         `json:"task_id"`
	GroupID   string         `json:"group_id,omitempty"`
	GroupSize int            `json:"group_size,omitempty"`
	Metadata  map[string]any `json:"metadata,omitempty"`
}

func (c *ControlAPI) error(w http.ResponseWriter, status int, format string, args ...any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": fmt.Sprintf(format, args...)})
}

func (c *ControlAPI) reply(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// Handler serves the control API: /floe/v1/... and, when Metrics is set, /metrics; every
// other path is 404. With a Token, every call must carry it.
func (c *ControlAPI) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /floe/v1/sessions", c.createSession)
	mux.HandleFunc("GET /floe/v1/sessions/{id}", c.getSession)
	mux.HandleFunc("POST /floe/v1/sessions/{id}/finish", c.finishSession)
	mux.HandleFunc("POST /floe/v1/pause", c.pause)
	mux.HandleFunc("POST /floe/v1/resume", c.resume)
	mux.HandleFunc("GET /floe/v1/status", c.status)
	mux.HandleFunc("/floe/v1/", func(w http.ResponseWriter, r *http.Request) {
		c.error(w, http.StatusNotFound, "no control endpoint %s %s", r.Method, r.URL.Path)
	})
	if c.Metrics != nil {
		mux.Handle("GET /metrics", c.Metrics)
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		c.error(w, http.StatusNotFound, "the control listener serves /floe/v1/ and /metrics only; the provider APIs are on the proxy address")
	})
	if c.Token == "" {
		return mux
	}
	want := []byte("Bearer " + c.Token)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="floe control"`)
			c.error(w, http.StatusUnauthorized, "missing or wrong control token: send Authorization: Bearer <token>")
			return
		}
		mux.ServeHTTP(w, r)
	})
}

func (c *ControlAPI) createSession(w http.ResponseWriter, r *http.Request) {
	var req sessionInfo
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&req); err != nil {
		c.error(w, http.StatusBadRequest, "body must be JSON like {\"task_id\": \"...\"}: %v", err)
		return
	}
	if req.TaskID == "" {
		c.error(w, http.StatusBadRequest, "task_id is required")
		return
	}
	if req.GroupSize < 0 {
		c.error(w, http.StatusBadRequest, "group_size %d must not be negative", req.GroupSize)
		return
	}
	id, key := "sess-"+token(8), "sk-floe-"+token(16)
	group := req.GroupID
	if group == "" {
		group = id // a session alone is a group of one
	}
	if err := c.Node.store.CreateSession(trace.Session{ID: id, TaskID: req.TaskID, GroupID: group}, key, req.GroupSize); err != nil {
		c.error(w, http.StatusConflict, "create session: %v", err)
		return
	}
	// The default size applies to a named group that no session gave a size: a group
	// that has one keeps it.
	if req.GroupSize == 0 && req.GroupID != "" && c.DefaultGroupSize > 0 {
		if err := c.Node.store.SetGroupSize(group, c.DefaultGroupSize); err != nil && !errors.Is(err, trace.ErrGroupSize) {
			c.error(w, http.StatusInternalServerError, "group %q: %v", group, err)
			return
		}
	}
	c.Node.sessionCreated()
	dialects := c.Dialects
	if dialects == nil {
		dialects = providers.Dialects()
	}
	c.reply(w, map[string]any{"session_id": id, "api_key": key, "group_id": group, "base_urls": dialects.BaseURLs(c.BaseURL)})
}

func (c *ControlAPI) getSession(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	s, err := c.Node.store.Session(id)
	if err != nil {
		if c.answerArchived(w, id) {
			return
		}
		c.error(w, http.StatusNotFound, "%v", err)
		return
	}
	calls := s.Calls
	if calls == nil {
		calls = []trace.Call{}
	}
	c.reply(w, map[string]any{"session_id": id, "task_id": s.TaskID, "group_id": s.GroupID,
		"status": s.Status, "reward": s.Reward, "calls": calls})
}

func (c *ControlAPI) finishSession(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Reward *float64     `json:"reward"`
		Status trace.Status `json:"status"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&req); err != nil || req.Reward == nil {
		c.error(w, http.StatusBadRequest, `body must be {"reward": number, "status": "completed"|"failed"|"timeout"}`)
		return
	}
	limit := c.MaxAbsReward
	if limit <= 0 {
		limit = DefaultMaxAbsReward
	}
	if r := *req.Reward; math.IsNaN(r) || math.IsInf(r, 0) || math.Abs(r) > limit {
		c.error(w, http.StatusBadRequest, "reward %v must be a finite number within ±%g (-max-abs-reward)", r, limit)
		return
	}
	switch req.Status {
	case "":
		req.Status = trace.StatusCompleted
	case trace.StatusCompleted, trace.StatusFailed, trace.StatusTimeout:
	default:
		c.error(w, http.StatusBadRequest, "status %q is not completed, failed or timeout", req.Status)
		return
	}
	id := r.PathValue("id")
	g, known, err := c.Node.FinishSession(r.Context(), id, *req.Reward, req.Status)
	if err != nil {
		c.error(w, httpStatusOf(err), "%v", err)
		return
	}
	out := map[string]any{"session_id": id, "status": req.Status, "reward": *req.Reward}
	if known {
		c.reportGroup(out, g)
	}
	c.reply(w, out)
}

// reportGroup adds the finished session's group to a finish's reply and logs it, with a
// warning when the group cannot reach -min-group-size: such a group is dropped without
// training, which a runner that created sessions without group_id and group_size (a
// group of one) otherwise learns only from floe's log.
func (c *ControlAPI) reportGroup(out map[string]any, g trace.GroupState) {
	fate := groupFate(g)
	out["group"] = map[string]any{"id": g.ID, "size": g.Size, "sessions": g.Sessions, "finished": g.Finished, "state": fate}
	var warning string
	switch {
	case c.MinGroupSize <= 1 || fate == "dropped" || fate == "in_step":
	case fate == "complete" && g.Sessions < c.MinGroupSize:
		warning = fmt.Sprintf("group %s is complete with %d session(s), fewer than -min-group-size %d: it will be dropped without training; "+
			"create a group's sessions with the same group_id and a group_size of at least %d", g.ID, g.Sessions, c.MinGroupSize, c.MinGroupSize)
	case g.Size > 0 && g.Size < c.MinGroupSize:
		warning = fmt.Sprintf("group %s has group_size %d, fewer than -min-group-size %d: it will be dropped without training",
			g.ID, g.Size, c.MinGroupSize)
	}
	log := c.log()
	if warning != "" {
		out["warning"] = warning
		log.Warn("group cannot train", "group", g.ID, "reason", warning)
		return
	}
	switch fate {
	case "waiting":
		log.Info("group waiting", "group", g.ID, "finished", g.Finished, "sessions", g.Sessions, "size", g.Size)
	case "complete":
		log.Info("group complete: waits for a step", "group", g.ID, "sessions", g.Sessions)
	}
}

func (c *ControlAPI) pause(w http.ResponseWriter, r *http.Request) {
	v, err := c.Node.Pause(r.Context(), ViaControl)
	if err != nil {
		c.error(w, httpStatusOf(err), "%v", err)
		return
	}
	c.reply(w, map[string]any{"paused": true, "policy_version": v})
}

func (c *ControlAPI) resume(w http.ResponseWriter, r *http.Request) {
	var req struct {
		PolicyVersion *int64 `json:"policy_version"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&req); err != nil || req.PolicyVersion == nil {
		c.error(w, http.StatusBadRequest, `body must be {"policy_version": n}`)
		return
	}
	if err := c.Node.Resume(r.Context(), *req.PolicyVersion, ViaControl); err != nil {
		c.error(w, httpStatusOf(err), "%v", err)
		return
	}
	c.reply(w, map[string]any{"paused": false, "policy_version": *req.PolicyVersion})
}

func (c *ControlAPI) status(w http.ResponseWriter, r *http.Request) {
	c.reply(w, c.Node.Status(r.Context()))
}

// httpStatusOf maps a Node's error to its HTTP status by its class, as the Flight
// service maps the same classes to gRPC codes (arrowflight/source.go).
func httpStatusOf(err error) int {
	switch {
	case errors.Is(err, arrowflight.ErrInvalid):
		return http.StatusBadRequest
	case errors.Is(err, arrowflight.ErrRefused):
		return http.StatusConflict
	case errors.Is(err, arrowflight.ErrUnavailable):
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

func token(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// answerArchived answers GET of a session that was archived and left the store with 410
// Gone, naming the step it went with and its archive partitions; it reports false for an
// id the store never forgot.
func (c *ControlAPI) answerArchived(w http.ResponseWriter, id string) bool {
	fs, ok := c.Node.store.(trace.Tombstones)
	if !ok {
		return false
	}
	f, ok, err := fs.ForgottenSession(id)
	if err != nil || !ok {
		return false
	}
	out := map[string]any{"session_id": id}
	var where string
	switch {
	case !f.Known:
		where = "was archived and left the store (by a floe that did not record the step)"
	case f.Dropped:
		where = fmt.Sprintf("was archived with its dropped group (drop %d) and left the store", f.DropSeq)
		out["dropped_group_seq"] = f.DropSeq
	default:
		where = fmt.Sprintf("was archived with step %d and left the store", f.Step)
		out["archived_step"] = f.Step
	}
	msg := "session " + id + " " + where
	if c.ArchiveDir != "" && f.Known {
		out["archive"] = c.ArchiveDir
		if !f.Dropped {
			calls := archive.PartitionDir(c.ArchiveDir, archive.CallsTable, f.Step)
			sessions := archive.PartitionDir(c.ArchiveDir, archive.SessionsTable, f.Step)
			out["calls"], out["sessions"] = calls, sessions
			msg += fmt.Sprintf(": its calls are in %s, its record in %s", calls, sessions)
		} else {
			// Drops are numbered once per store, so the pattern names one partition.
			part := fmt.Sprintf("dropped-*-%06d", f.DropSeq)
			calls := filepath.Join(c.ArchiveDir, archive.CallsTable, part)
			sessions := filepath.Join(c.ArchiveDir, archive.SessionsTable, part)
			out["calls"], out["sessions"] = calls, sessions
			msg += fmt.Sprintf(": its calls are in %s, its record in %s", calls, sessions)
		}
	}
	out["error"] = msg + " (docs/archive.md)"
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusGone)
	_ = json.NewEncoder(w).Encode(out)
	return true
}

// log is the Node's: a group's state after a finish is logged beside the pauses and
// resumes.
func (c *ControlAPI) log() *slog.Logger { return c.Node.log }
