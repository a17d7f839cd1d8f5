"""The real Qwen Code CLI (@qwen-code/qwen-code, `qwen`) through floe's OpenAI Chat
Completions API.

Qwen Code reads its provider from OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL and its
settings from $HOME/.qwen/settings.json; a positional prompt runs one-shot and --yolo
approves its tools. It streams chat completions (stream_options.include_usage) and reads
the file with its own `read_file` tool ({"file_path": absolute path})."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import BIN, QUESTION, Session, Stack, base_env
from scenario import Harness, run_read_task, run_weight_sync

MODEL = "qwen-floe"
SETTINGS = {
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "general": {"enableAutoUpdate": False},
    "security": {"auth": {"selectedType": "openai"}},
    # The served model's window. Qwen Code does not know "qwen-floe" and would otherwise ask
    # for max_tokens 32768 on top of a ~25k-token prompt, which the server refuses (400);
    # with the window known it clamps max_tokens to what fits.
    "model": {"generationConfig": {"contextWindowSize": 32768}},
    # Managed auto-memory runs a background extractor subagent after a turn the model
    # answers without tools and persists what it finds under HOME: state carried from one
    # rollout to the next. Off, as for any RL rollout.
    "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False},
}


def launch(s: Session, home: Path, work: Path) -> tuple[list[str], dict[str, str]]:
    """Qwen Code's settings in $HOME/.qwen, and its provider pointing at floe."""
    (home / ".qwen").mkdir()
    (home / ".qwen" / "settings.json").write_text(json.dumps(SETTINGS, indent=2))
    env = base_env(home) | {
        "OPENAI_BASE_URL": s.base_urls["openai"],
        "OPENAI_API_KEY": s.key,
        "OPENAI_MODEL": MODEL,
    }
    return [str(BIN / "qwen"), "--yolo", "--output-format", "text", QUESTION], env


QWEN_CODE = Harness(
    name="Qwen Code",
    exe="qwen",
    task="qwen-code",
    api="openai_chat",
    tool="read_file",
    read_args=lambda work: {"file_path": str(work / "notes.txt")},
    launch=launch,
    size_call=(
        "run_shell_command",
        {"command": "wc -c notes.txt", "description": "Count the bytes of notes.txt"},
    ),
)


def test_qwen_code(stack: Stack) -> None:
    # The answer's prompt extends the read's token for token (checked by run_read_task):
    # Qwen Code sent back the reasoning (reasoning_content), the tool call and its result,
    # and floe rendered them exactly as sampled.
    run_read_task(stack, QWEN_CODE)


def test_qwen_code_weight_sync(stack: Stack) -> None:
    """Pause mid-task: the next call waits; resume under a new policy version and the run
    finishes, its later calls recording that version."""
    run_weight_sync(stack, QWEN_CODE)
