package proxybench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// liteLLMConfig serves the fake vLLM as LiteLLM's vLLM provider (OpenAI-compatible)
// under the model name the requests use, without the cool-down that would refuse every
// dialect for a while after one failed.
const liteLLMConfig = `model_list:
  - model_name: m
    litellm_params:
      model: hosted_vllm/m
      api_base: %s/v1
      api_key: none
general_settings:
  master_key: %s
router_settings:
  disable_cooldowns: true
  num_retries: 0
litellm_settings:
  drop_params: true
  turn_off_message_logging: true
`

// startLiteLLM starts LiteLLM's proxy (the litellm command of its venv) in front of the
// fake upstream, with one worker, and waits until it answers. It returns the proxy and
// LiteLLM's version.
func startLiteLLM(ctx context.Context, bin, upURL string, progress io.Writer) (*child, string, error) {
	dir, err := os.MkdirTemp("", "floe-litellm-")
	if err != nil {
		return nil, "", err
	}
	defer func() { _ = os.RemoveAll(dir) }() // a temporary directory: best effort
	// LiteLLM refuses to start without a master key; every caller sends it.
	kb := make([]byte, 32)
	_, _ = rand.Read(kb)
	key := "sk-" + hex.EncodeToString(kb)
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(liteLLMConfig, upURL, key)), 0o600); err != nil {
		return nil, "", err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", err
	}
	port := lis.Addr().(*net.TCPAddr).Port
	_ = lis.Close() // only to learn a free port
	version := "unknown version"
	py := filepath.Join(filepath.Dir(bin), "python")
	if out, err := exec.CommandContext(ctx, py, "-c", "import importlib.metadata as m; print(m.version('litellm'))").Output(); err == nil {
		version = strings.TrimSpace(string(out))
	}
	cmd := exec.CommandContext(ctx, bin, "--config", cfg, "--host", "127.0.0.1", "--port", fmt.Sprint(port), "--num_workers", "1")
	// No network here: LiteLLM's bundled model prices, not a download, and no telemetry.
	cmd.Env = append(os.Environ(), "LITELLM_LOCAL_MODEL_COST_MAP=True", "LITELLM_TELEMETRY=False", "LITELLM_LOG=ERROR")
	if progress != nil {
		cmd.Stderr = progress
	}
	c, err := launch(cmd, nil)
	if err != nil {
		return nil, "", err
	}
	c.url, c.masterKey = fmt.Sprintf("http://127.0.0.1:%d", port), key
	// Its start-up imports much of Python's ecosystem: on a busy machine, a minute or more.
	if err := waitHealthy(ctx, c.url+"/health/liveliness", c.done, 5*time.Minute); err != nil {
		c.stop()
		return nil, "", err
	}
	return c, version, nil
}

// waitHealthy polls url until it answers 200, or wait passes.
func waitHealthy(ctx context.Context, url string, done <-chan struct{}, wait time.Duration) error {
	deadline := time.Now().Add(wait)
	for time.Now().Before(deadline) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			_ = resp.Body.Close() // only the status is wanted
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-done:
			return fmt.Errorf("exited before serving")
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
	return fmt.Errorf("did not answer %s within %s", url, wait)
}
