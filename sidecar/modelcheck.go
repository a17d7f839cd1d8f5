package sidecar

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/floe-rl/floe/proxy"
)

// modelCheckTimeout bounds the start-up look at each replica's model list: an upstream
// that is still loading must not hold floe's start.
const modelCheckTimeout = 5 * time.Second

// checkServedModel asks each -upstream replica which models it serves (GET /v1/models)
// and refuses a -model none of them serves, naming what they do serve: otherwise the
// mistake shows only at the first call, as a 404 to a harness. A replica that does not
// answer is logged as a warning and skipped (it may still be loading), as is the check
// when -model is not given (the engine then takes the first model listed).
func checkServedModel(ctx context.Context, cfg Config, client *http.Client, log *slog.Logger) error {
	if cfg.Model == "" {
		return nil
	}
	urls, err := ParseUpstreams(cfg.Upstream)
	if err != nil {
		return err
	}
	for _, u := range urls {
		served, err := servedModels(ctx, client, u)
		if err != nil {
			log.Warn("-model not checked: the upstream's model list did not answer", "upstream", proxy.ReplicaLabel(u),
				"model", cfg.Model, "err", err)
			continue
		}
		if !slices.Contains(served, cfg.Model) {
			return fmt.Errorf("-model %q: upstream %s serves %s; give one of them (or leave -model out to use the first)",
				cfg.Model, proxy.ReplicaLabel(u), quoteAll(served))
		}
	}
	return nil
}

func servedModels(ctx context.Context, client *http.Client, root string) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, modelCheckTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(root, "/")+"/v1/models", nil)
	if err != nil {
		return nil, fmt.Errorf("building the request: %w", err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer func() { _ = resp.Body.Close() }() // the body is read or abandoned; its Close error changes nothing
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, fmt.Errorf("reading GET /v1/models: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET /v1/models: status %d", resp.StatusCode)
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &list); err != nil {
		return nil, fmt.Errorf("GET /v1/models: %w", err)
	}
	out := make([]string, 0, len(list.Data))
	for _, m := range list.Data {
		out = append(out, m.ID)
	}
	return out, nil
}

func quoteAll(ss []string) string {
	if len(ss) == 0 {
		return "no model"
	}
	q := make([]string, len(ss))
	for i, s := range ss {
		q[i] = fmt.Sprintf("%q", s)
	}
	return strings.Join(q, ", ")
}
