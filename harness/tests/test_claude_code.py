"""The real Claude Code CLI (@anthropic-ai/claude-code, `claude -p`) through floe's
Anthropic Messages API.

Claude Code is pointed at floe by ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY (the session's
key); its own model names are replaced by ANTHROPIC_MODEL and the small/fast ones. It
streams /v1/messages?beta=true with adaptive thinking and echoes every thinking block with
its signature on the next call. Its file tool is `Read` ({"file_path": absolute path}),
which print mode runs without asking. With CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC it makes
no side calls (no titles, no quota probe): every model call is the conversation's.

Claude Code asks for max_tokens 32000 (more than a 32k window leaves after its ~17k-token
system prompt and tools); it lowers max_tokens and retries only when the error reads
"input length and `max_tokens` exceed context limit: N + T > M", which floe must therefore
say instead of "prompt is too long" (then it gives up: "Prompt is too long"). The tests run
it with its default max_tokens, so they cover that."""

from __future__ import annotations

from pathlib import Path

from conftest import BIN, QUESTION, Session, Stack, base_env
from scenario import Harness, run_read_task, run_weight_sync

MODEL = "claude-floe"


def launch(s: Session, home: Path, work: Path) -> tuple[list[str], dict[str, str]]:
    env = base_env(home) | {
        "ANTHROPIC_BASE_URL": s.base_urls["anthropic"],
        "ANTHROPIC_API_KEY": s.key,
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        # Not CLAUDE_CODE_MAX_CONTEXT_TOKENS=32768 (the server's true window): with its
        # ~17k-token prompt Claude Code would then compact right after the first call. For
        # a model it does not know it assumes a 1M window (and says so on stderr).
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    return [str(BIN / "claude"), "-p", QUESTION, "--output-format", "text"], env


CLAUDE_CODE = Harness(
    name="Claude Code", exe="claude", task="claude-code", api="anthropic", tool="Read",
    read_args=lambda work: {"file_path": str(work / "notes.txt")},  # Read wants an absolute path
    launch=launch, timeout=150)


def test_claude_code_reads_file(stack: Stack) -> None:
    run = run_read_task(stack, CLAUDE_CODE)
    for c in run.calls:
        assert len(c["prompt_ids"]) + len(c["response_ids"]) <= 32768
    # The answer's prompt extends the read's token for token (checked by run_read_task):
    # the thinking block came back with floe's signature and the tool_use input unchanged.
    echoed = run.last["request"]["messages"]
    thinking = [b for m in echoed if m["role"] == "assistant" and isinstance(m["content"], list)
                for b in m["content"] if b.get("type") == "thinking"]
    assert thinking and all(b.get("signature", "").startswith("floe1.") for b in thinking), thinking


def test_claude_code_weight_sync(stack: Stack) -> None:
    """Pause mid-task: Claude Code's next call waits; resume under a new policy version and
    the run finishes, its later calls recording that version."""
    # A max_tokens that fits, so that the call held by the pause is the one recorded (with
    # the default, the held request is answered by the overflow error after the resume,
    # and Claude Code's retry arrives later).
    run_weight_sync(stack, CLAUDE_CODE, env={"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "8192"})
