"""The real Gemini CLI (@google/gemini-cli, `gemini -p`) through floe's Gemini API.

Gemini CLI is pointed at floe by GOOGLE_GEMINI_BASE_URL and GEMINI_API_KEY (the session's
key, sent as x-goog-api-key); telemetry, usage statistics and update checks are off in
$HOME/.gemini/settings.json, and GEMINI_CLI_TRUST_WORKSPACE trusts the working directory.
It streams :streamGenerateContent?alt=sse with includeThoughts, drops thought parts from
its history but keeps their thoughtSignature, which carries floe's reasoning back. Its file
tool is `read_file` ({"file_path": path, relative to the workspace or absolute}), which
the default approval mode runs without asking in non-interactive mode.

With `-m` naming the model there is no model routing, and its next-speaker check is off by
default (model.skipNextSpeakerCheck), so no side calls are made. (Turned on, that check
sends a JSON-schema request without tools that a freely sampling model answers with
invalid JSON, and Gemini CLI retries it with backoff for minutes.)"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import BIN, QUESTION, Session, Stack, base_env
from scenario import Harness, run_read_task, run_weight_sync

MODEL = "gemini-floe"
SETTINGS = {
    "telemetry": {"enabled": False},
    "privacy": {"usageStatisticsEnabled": False},
    "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
    "security": {"auth": {"selectedType": "gemini-api-key"}},
}


def launch(s: Session, home: Path, work: Path) -> tuple[list[str], dict[str, str]]:
    """Gemini CLI's settings in $HOME/.gemini, and its environment pointing at floe."""
    (home / ".gemini").mkdir()
    (home / ".gemini" / "settings.json").write_text(json.dumps(SETTINGS, indent=2))
    env = base_env(home) | {
        "GOOGLE_GEMINI_BASE_URL": s.base_urls["gemini"],
        "GEMINI_API_KEY": s.key,
        "GEMINI_CLI_TRUST_WORKSPACE": "true",
        "GEMINI_TELEMETRY_ENABLED": "false",
    }
    return [str(BIN / "gemini"), "-m", MODEL, "-p", QUESTION], env


GEMINI_CLI = Harness(
    name="Gemini CLI", exe="gemini", task="gemini-cli", api="gemini", tool="read_file",
    read_args=lambda work: {"file_path": "notes.txt"}, launch=launch, timeout=150)


def test_gemini_cli_reads_file(stack: Stack) -> None:
    run = run_read_task(stack, GEMINI_CLI)
    # The answer's prompt extends the read's token for token (checked by run_read_task):
    # the reasoning came back in the thoughtSignature and the functionCall args unchanged.
    echoed = run.last["request"]["contents"]
    signatures = [part["thoughtSignature"] for content in echoed if content.get("role") == "model"
                  for part in content["parts"] if "thoughtSignature" in part]
    # base64("floe1.") = "ZmxvZTEu": floe's own signature
    assert signatures and all(sig.startswith("ZmxvZTEu") for sig in signatures), signatures
    # Gemini CLI samples with topP 0.95 of its own accord: under -sampling force (the stack's)
    # floe sent top_p 1 and no top_k upstream, so the call is trainable; under the default
    # (record) it would be recorded untrainable, its log-probs those of a truncated
    # distribution.
    for c in run.calls:
        asked = c["request"].get("generationConfig") or {}
        assert asked.get("topP") == 0.95, asked
        sent = c["upstream_request"]
        assert sent["top_p"] == 1 and sent.get("top_k", -1) == -1 and c["trainable"], (
            sent,
            c.get("untrainable_reason"),
        )


def test_gemini_cli_weight_sync(stack: Stack) -> None:
    """Pause mid-task: Gemini CLI's next call waits; resume under a new policy version and
    the run finishes, its later calls recording that version."""
    run_weight_sync(stack, GEMINI_CLI)
