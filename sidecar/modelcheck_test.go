package sidecar

import (
	"bytes"
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/floe-rl/floe/internal/fakevllm"
)

func TestCheckServedModel(t *testing.T) {
	up := httptest.NewServer(fakevllm.Handler()) // serves the model "m"
	defer up.Close()
	down := httptest.NewServer(http.NotFoundHandler())
	defer down.Close()
	for _, tc := range []struct {
		name, upstream, model string
		wantErr, wantWarn     string
	}{
		{name: "served", upstream: up.URL, model: "m"},
		{name: "no -model: the first listed is used", upstream: up.URL},
		{name: "not served", upstream: up.URL, model: "Qwen/Qwen3-8B",
			wantErr: `-model "Qwen/Qwen3-8B": upstream ` + up.URL + ` serves "m"`},
		{name: "given with /v1", upstream: up.URL + "/v1", model: "m"},
		{name: "no model list: a warning, not a failure", upstream: down.URL, model: "m",
			wantWarn: `-model not checked: the upstream's model list did not answer`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs bytes.Buffer
			cfg := DefaultConfig()
			cfg.Upstream, cfg.Model = tc.upstream, tc.model
			err := checkServedModel(context.Background(), cfg, http.DefaultClient, slog.New(slog.NewTextHandler(&logs, nil)))
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("err = %v", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("err = %v, want %s", err, tc.wantErr)
			}
			if tc.wantWarn != "" && !strings.Contains(logs.String(), tc.wantWarn) {
				t.Errorf("log %q lacks %q", logs.String(), tc.wantWarn)
			}
		})
	}
}
