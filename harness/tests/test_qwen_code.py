"""The real Qwen Code CLI (@qwen-code/qwen-code, `qwen`) through floe's OpenAI Chat
Completions API.

Qwen Code reads its provider from OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL and its
settings from $HOME/.qwen/settings.json; a positional prompt runs one-shot and --yolo
approves its tools. It streams chat completions (stream_options.include_usage) and reads
the file with its own `read_file` tool ({"file_path": absolute path})."""

from __future__ import annotations

import json
import subprocess
import time
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

MODEL = "qwen-floe"
TOOL = "read_file"
SHELL = "run_shell_command"
REASONING = "The user wants the launch code from notes.txt. I should read that file first."
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


def setup(stack: Stack, name: str) -> tuple[Session, dict[str, str], Path]:
    """A session, a fresh HOME and working directory, and Qwen Code pointed at floe."""
    s = stack.session(name)
    home, work = stack.workdir(name)
    (home / ".qwen").mkdir()
    (home / ".qwen" / "settings.json").write_text(json.dumps(SETTINGS, indent=2))
    env = base_env(home) | {"OPENAI_BASE_URL": s.base_urls["openai"], "OPENAI_API_KEY": s.key, "OPENAI_MODEL": MODEL}
    return s, env, work


def command() -> list[str]:
    return [str(BIN / "qwen"), "--yolo", "--output-format", "text", QUESTION]


def recorded(stack: Stack, session: str) -> list[dict[str, Any]]:
    return stack.calls(session) or []  # null until the session's first call


def describe(calls: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"call {c['Index']}: prompt {len(c['PromptIDs'])} response {len(c['ResponseIDs'])} "
        f"finish {c['FinishReason']} v{c['PolicyVersion']} trainable {c['Trainable']}"
        for c in calls
    )


def scripted(calls: list[dict[str, Any]], reasoning: str) -> dict[str, Any]:
    """The call that answered with the scripted output carrying this reasoning."""
    hits = [c for c in calls if (c["Response"] or {}).get("reasoning_content", "").strip() == reasoning]
    assert len(hits) == 1, f"{len(hits)} calls answered with reasoning {reasoning!r}\n{describe(calls)}"
    return hits[0]


def extends(a: dict[str, Any], b: dict[str, Any]) -> bool:
    h = a["PromptIDs"] + a["ResponseIDs"]
    return b["PromptIDs"][: len(h)] == h


def test_qwen_code(stack: Stack) -> None:
    s, env, work = setup(stack, "qwen-code")
    final = f"The file says the launch code is {ANSWER}."
    stack.script([
        {"reasoning": REASONING, "tool_calls": [{"name": TOOL, "arguments": {"file_path": str(work / "notes.txt")}}],
         "match": {"tool": TOOL, "contains": QUESTION}},
        {"reasoning": final, "content": ANSWER, "match": {"tool": TOOL, "contains": ANSWER}},
    ])
    t0 = time.monotonic()
    p = run_harness(command(), env, work, timeout=90)
    took = time.monotonic() - t0
    calls = recorded(stack, s.id)
    print(f"qwen took {took:.1f} s\n{describe(calls)}")
    assert p.returncode == 0, f"qwen exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    assert ANSWER in p.stdout, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"

    # 1. every call carries exactly what the server generated
    check_token_faithful(stack, calls)
    assert all(c["API"] == "openai_chat" for c in calls)

    # 2. the scripted calls are the main chain; the second prompt extends the first call
    # token for token: Qwen Code sent back the reasoning (reasoning_content), the tool call
    # and its result, and floe rendered them exactly as sampled
    first, second = scripted(calls, REASONING), scripted(calls, final)
    assert first["FinishReason"] == "tool_calls" and second["FinishReason"] == "stop"
    chain = main_chain(calls)
    assert first in chain and second in chain, describe(calls)
    assert extends(first, second), describe(calls)

    # 3. tree micro-batches over Flight decode to the per-request loss terms, fewer rows
    rows, per_request = check_tree_over_flight(stack, s.id, calls)
    assert rows < per_request, (rows, per_request)


def test_qwen_code_weight_sync(stack: Stack) -> None:
    """Pause mid-task: the next call waits; resume under a new policy version and the run
    finishes, its later calls recording that version."""
    s, env, work = setup(stack, "qwen-code-sync")
    stack.script([
        {"reasoning": REASONING, "tool_calls": [{"name": TOOL, "arguments": {"file_path": str(work / "notes.txt")}}],
         "match": {"tool": TOOL, "contains": QUESTION}},
        {"reasoning": "Let me check the file's size too.",
         "tool_calls": [{"name": SHELL, "arguments": {"command": "wc -c notes.txt", "description": "Count the bytes of notes.txt"}}],
         "match": {"tool": SHELL, "contains": ANSWER}},
        {"reasoning": "The file is short; the code is all it says.", "content": ANSWER,
         "match": {"tool": TOOL, "contains": "39 notes.txt"}},
    ])
    proc = subprocess.Popen(command(), env=env, cwd=work, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(recorded(stack, s.id)) >= 1, 60, "Qwen Code's first call")
        version = stack.pause()["policy_version"]  # waits for any call in flight
        try:
            held = len(recorded(stack, s.id))
            assert held < 3, "the whole task finished before the pause"
            time.sleep(1.5)
            assert len(recorded(stack, s.id)) == held, "a call went upstream while paused"
            assert proc.poll() is None, "Qwen Code exited while paused"
        finally:
            stack.resume(version + 1)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    calls = recorded(stack, s.id)
    print(describe(calls))
    assert proc.returncode == 0, f"qwen exited {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert ANSWER in out
    assert len(calls) == 3, describe(calls)
    assert [c["PolicyVersion"] for c in calls[:held]] == [version] * held
    assert [c["PolicyVersion"] for c in calls[held:]] == [version + 1] * (3 - held)
    check_token_faithful(stack, calls)
    assert len(main_chain(calls)) == 3 and extends(calls[0], calls[1]) and extends(calls[1], calls[2])
