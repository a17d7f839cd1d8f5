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

import json
import re
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from conftest import (
    ANSWER,
    BIN,
    QUESTION,
    Session,
    Stack,
    base_env,
    check_token_faithful,
    check_tree_over_flight,
    main_chain,
    run_harness,
    wait_for,
)

MODEL = "claude-floe"
TOOL = "Read"
REASONING = "The user wants the launch code from notes.txt. I should read that file first."


def setup(stack: Stack, name: str) -> tuple[Session, dict[str, str], Path]:
    """A session, a fresh HOME and working directory, and Claude Code's environment."""
    s = stack.session(name)
    home, work = stack.workdir(name)
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
    return s, env, work


def command() -> list[str]:
    return [str(BIN / "claude"), "-p", QUESTION, "--output-format", "text"]


def read(work: Path, reasoning: str, contains: str) -> dict[str, Any]:
    """A scripted Read of notes.txt (Read wants an absolute path)."""
    call = {"name": TOOL, "arguments": {"file_path": str(work / "notes.txt")}}
    return {"reasoning": reasoning, "tool_calls": [call], "match": {"tool": TOOL, "contains": contains}}


def answer(reasoning: str, contains: str) -> dict[str, Any]:
    return {"reasoning": reasoning, "content": ANSWER, "match": {"tool": TOOL, "contains": contains}}


def recorded(stack: Stack, session: str) -> list[dict[str, Any]]:
    return stack.calls(session) or []


def extends(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """b's prompt starts with a's prompt + response, token for token."""
    h = a["PromptIDs"] + a["ResponseIDs"]
    return bool(b["PromptIDs"][: len(h)] == h)


def tool_names(c: dict[str, Any]) -> list[str]:
    return [tc["function"]["name"] for tc in c["Response"].get("tool_calls") or []]


def describe(calls: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"call {c['Index']}: prompt {len(c['PromptIDs'])} response {len(c['ResponseIDs'])} "
        f"finish {c['FinishReason']} tools {tool_names(c)} v{c['PolicyVersion']} trainable {c['Trainable']}"
        for c in calls)


def seconds(ts: str) -> float:
    """A Go RFC 3339 timestamp (nanoseconds) as Unix seconds."""
    ts = re.sub(r"\.(\d+)", lambda m: "." + m[1][:6].ljust(6, "0"), ts).replace("Z", "+00:00")
    return datetime.fromisoformat(ts).timestamp()


def test_claude_code_reads_file(stack: Stack) -> None:
    s, env, work = setup(stack, "claude-code")
    stack.script([
        read(work, REASONING, QUESTION),
        answer("The file states the launch code; the user wants only the code.", ANSWER),
    ])
    t0 = time.monotonic()
    p = run_harness(command(), env, work, timeout=150)
    took = time.monotonic() - t0
    calls = recorded(stack, s.id)
    print(f"claude -p took {took:.1f} s\n{describe(calls)}")
    assert p.returncode == 0, (
        f"claude exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}")
    assert ANSWER in p.stdout, p.stdout[-3000:]

    # 1. every call carries exactly the server's prompt ids, response ids and log-probs
    check_token_faithful(stack, calls)
    for c in calls:
        assert c["API"] == "anthropic"
        assert len(c["PromptIDs"]) + len(c["ResponseIDs"]) <= 32768

    # 2. the two scripted calls form the main chain; anything else is a side call of its own
    first = [c for c in calls if TOOL in tool_names(c)]
    last = [c for c in calls if ANSWER in (c["Response"].get("content") or "")]
    assert len(first) == 1 and len(last) == 1, describe(calls)
    chain = main_chain(calls)
    assert first[0] in chain and last[0] in chain, describe(calls)
    # The answer's prompt extends the tool call's prompt + response token for token: the
    # thinking block came back with floe's signature and the tool_use input unchanged.
    assert extends(first[0], last[0]), describe(calls)
    assert first[0]["Response"].get("reasoning_content"), "the scripted reasoning was not parsed"
    echoed = last[0]["Request"]["messages"]
    thinking = [b for m in echoed if m["role"] == "assistant" and isinstance(m["content"], list)
                for b in m["content"] if b.get("type") == "thinking"]
    assert thinking and all(b.get("signature", "").startswith("floe1.") for b in thinking), thinking
    for side in (c for c in calls if c not in chain):
        assert not extends(side, last[0]), f"side call {side['Index']} in the conversation's prefix"

    # 3. tree micro-batches over Flight decode to the per-request loss terms, fewer rows
    rows, per_request = check_tree_over_flight(stack, s.id, calls)
    assert rows < per_request, (rows, per_request)


def test_claude_code_weight_sync(stack: Stack) -> None:
    """Pause mid-task: Claude Code's next call waits; resume under a new policy version and
    the run finishes, its later calls recording that version."""
    s, env, work = setup(stack, "claude-code-sync")
    # A max_tokens that fits, so that the call held by the pause is the one recorded (with
    # the default, the held request is answered by the overflow error after the resume,
    # and Claude Code's retry arrives later).
    env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = "8192"
    stack.script([
        read(work, REASONING, QUESTION),
        read(work, "Let me read it once more to be sure of the exact code.", ANSWER),
        answer("Both reads agree on the code.", ANSWER),
    ])
    proc = subprocess.Popen(command(), env=env, cwd=work, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(recorded(stack, s.id)) >= 1, 90, "Claude Code's first call")
        version = stack.pause()["policy_version"]  # waits for any call in flight
        try:
            held = len(recorded(stack, s.id))
            assert held < 3, "the whole task finished before the pause"
            time.sleep(1.5)
            assert len(recorded(stack, s.id)) == held, "a call went upstream while paused"
            assert proc.poll() is None, "Claude Code exited while paused"
        finally:
            resumed = time.time()
            stack.resume(version + 1)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    calls = recorded(stack, s.id)
    print(describe(calls))
    assert proc.returncode == 0, (
        f"claude exited {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    assert ANSWER in out
    assert len(calls) == 3, describe(calls)
    assert [c["PolicyVersion"] for c in calls[:held]] == [version] * held
    assert [c["PolicyVersion"] for c in calls[held:]] == [version + 1] * (3 - held)
    # The first call after the pause reached floe while it was paused, and was held there.
    assert seconds(calls[held]["Started"]) < resumed < seconds(calls[held]["Finished"]), json.dumps(
        {k: calls[held][k] for k in ("Started", "Finished")})
    check_token_faithful(stack, calls)
    assert len(main_chain(calls)) == 3 and extends(calls[0], calls[1]) and extends(calls[1], calls[2])
