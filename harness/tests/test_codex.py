"""The real Codex CLI (@openai/codex, `codex exec`) through floe's OpenAI Responses API.

Codex is a Rust binary shipped in the npm package. It is pointed at floe by a custom model
provider in $CODEX_HOME/config.toml (wire_api = "responses", the key read from
FLOE_API_KEY) and runs its own command tool, `exec_command` ({"cmd": "..."}), without
approvals or a sandbox. It streams Responses SSE and echoes every reasoning item with its
encrypted_content on the next call (store: false, include reasoning.encrypted_content)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import BIN, QUESTION, Session, Stack, base_env
from scenario import Harness, run_read_task, run_weight_sync

MODEL = "gpt-floe"
KEY_ENV = "FLOE_API_KEY"
TOOL = "exec_command"


def launch(s: Session, home: Path, work: Path) -> tuple[list[str], dict[str, str]]:
    """Codex's config pointing at floe, in $CODEX_HOME."""
    codex_home = home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        f'''model = "{MODEL}"
model_provider = "floe"
model_context_window = 32768
check_for_update_on_startup = false

[model_providers.floe]
name = "floe"
base_url = "{s.base_urls["openai"]}"
env_key = "{KEY_ENV}"
wire_api = "responses"

[analytics]
enabled = false

[otel]
exporter = "none"
log_user_prompt = false

[features]
plugins = false
remote_plugin = false
'''
    )
    env = base_env(home) | {"CODEX_HOME": str(codex_home), KEY_ENV: s.key}
    # --strict-config: a config key this version does not know fails the run instead of
    # being ignored (so analytics/otel/plugins really are off).
    return [str(BIN / "codex"), "exec", "--skip-git-repo-check", "--strict-config",
            "--dangerously-bypass-approvals-and-sandbox", "--color", "never", QUESTION], env


CODEX = Harness(
    name="Codex", exe="codex", task="codex", api="openai_responses", tool=TOOL,
    read_args=lambda work: {"cmd": "cat notes.txt"}, launch=launch,
    size_call=(TOOL, {"cmd": "wc -c notes.txt"}))


def test_codex(stack: Stack) -> None:
    run = run_read_task(stack, CODEX)
    # The answer's prompt extends the read's token for token (checked by run_read_task):
    # Codex echoed the reasoning item (floe's encrypted_content), the function_call and its
    # output, and floe rendered them back exactly.
    sent = json.dumps(run.last["request"]["input"])
    assert "encrypted_content" in sent and "floe1." in sent, "Codex did not echo the reasoning item"


def test_codex_weight_sync(stack: Stack) -> None:
    """Pause mid-task: the next call waits; resume under a new policy version and the run
    finishes, its later calls recording that version."""
    run_weight_sync(stack, CODEX)
