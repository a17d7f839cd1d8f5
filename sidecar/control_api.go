package sidecar

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"

	"github.com/floe-rl/floe/proxy"
)

// ControlAPI is the session and control HTTP API under /floe/v1 (docs/control.md):
// harness runners create sessions and read what was recorded; a trainer without Flight
// can pause and resume rollouts. The proxy serves every other path.
type ControlAPI struct {
	Store *proxy.MemStore
	Gate  *proxy.Gate
	// BaseURL is the proxy's address as harnesses reach it, for the base_urls of a new
	// session.
	BaseURL string

	mu       sync.Mutex
	sessions map[string]sessionInfo
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

// Handler routes /floe/v1/... to the control API and everything else to next.
func (c *ControlAPI) Handler(next http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /floe/v1/sessions", c.createSession)
	mux.HandleFunc("GET /floe/v1/sessions/{id}", c.getSession)
	mux.HandleFunc("POST /floe/v1/pause", c.pause)
	mux.HandleFunc("POST /floe/v1/resume", c.resume)
	mux.HandleFunc("GET /floe/v1/status", c.status)
	mux.HandleFunc("/floe/v1/", func(w http.ResponseWriter, r *http.Request) {
		c.error(w, http.StatusNotFound, "no control endpoint %s %s", r.Method, r.URL.Path)
	})
	mux.Handle("/", next)
	return mux
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
	id, key := "sess-"+token(8), "sk-floe-"+token(16)
	c.mu.Lock()
	if c.sessions == nil {
		c.sessions = map[string]sessionInfo{}
	}
	c.sessions[id] = req
	c.mu.Unlock()
	c.Store.AddSession(key, id)
	c.Store.AddSession(id, id) // x-floe-session: <id> works too
	c.reply(w, map[string]any{"session_id": id, "api_key": key, "base_urls": map[string]string{
		"anthropic": c.BaseURL, "openai": c.BaseURL + "/v1", "gemini": c.BaseURL,
	}})
}

func (c *ControlAPI) getSession(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	c.mu.Lock()
	info, ok := c.sessions[id]
	c.mu.Unlock()
	if !ok {
		c.error(w, http.StatusNotFound, "no session %q", id)
		return
	}
	c.reply(w, map[string]any{"session_id": id, "task_id": info.TaskID, "group_id": info.GroupID,
		"metadata": info.Metadata, "calls": c.Store.Calls(id)})
}

func (c *ControlAPI) pause(w http.ResponseWriter, r *http.Request) {
	v, err := c.Gate.Pause(r.Context())
	if err != nil {
		c.error(w, http.StatusServiceUnavailable, "pause: %v", err)
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
	if err := c.Gate.Resume(*req.PolicyVersion); err != nil {
		c.error(w, http.StatusConflict, "resume: %v", err)
		return
	}
	c.reply(w, map[string]any{"paused": false, "policy_version": *req.PolicyVersion})
}

func (c *ControlAPI) status(w http.ResponseWriter, _ *http.Request) {
	paused, version, inflight := c.Gate.State()
	c.mu.Lock()
	n := len(c.sessions)
	c.mu.Unlock()
	c.reply(w, map[string]any{"paused": paused, "policy_version": version, "inflight": inflight, "sessions": n})
}

func token(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
