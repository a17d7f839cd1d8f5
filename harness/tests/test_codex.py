"""The real Codex CLI (@openai/codex, `codex exec`) through floe's OpenAI Responses API.

Codex is a Rust binary shipped in the npm package. It is pointed at floe by a custom model
provider in $CODEX_HOME/config.toml (wire_api = "responses", the key read from
FLOE_API_KEY) and runs its own command tool, `exec_command` ({"cmd": "..."}), without
approvals or a sandbox. It streams Responses SSE and echoes every reasoning item with its
encrypted_content on the next call (store: false, include reasoning.encrypted_content)."""

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

MODEL = "gpt-floe"
KEY_ENV = "FLOE_API_KEY"
TOOL = "exec_command"
REASONING = "The user wants the launch code from notes.txt. I should read that file first."


def setup(stack: Stack, name: str) -> tuple[Session, dict[str, str], Path]:
    """A session, a fresh HOME and working directory, and Codex's config pointing at floe."""
    s = stack.session(name)
    home, work = stack.workdir(name)
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
    return s, env, work


def command() -> list[str]:
    # --strict-config: a config key this version does not know fails the run instead of
    # being ignored (so analytics/otel/plugins really are off).
    return [str(BIN / "codex"), "exec", "--skip-git-repo-check", "--strict-config",
            "--dangerously-bypass-approvals-and-sandbox", "--color", "never", QUESTION]


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


def test_codex(stack: Stack) -> None:
    s, env, work = setup(stack, "codex")
    stack.script([
        {"reasoning": REASONING, "tool_calls": [{"name": TOOL, "arguments": {"cmd": "cat notes.txt"}}],
         "match": {"tool": TOOL, "contains": QUESTION}},
        {"reasoning": f"The file says the launch code is {ANSWER}.", "content": ANSWER,
         "match": {"tool": TOOL, "contains": ANSWER}},
    ])
    t0 = time.monotonic()
    p = run_harness(command(), env, work, timeout=90)
    took = time.monotonic() - t0
    calls = recorded(stack, s.id)
    print(f"codex took {took:.1f} s\n{describe(calls)}")
    assert p.returncode == 0, f"codex exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    assert ANSWER in p.stdout, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"

    # 1. every call carries exactly what the server generated
    check_token_faithful(stack, calls)
    assert all(c["API"] == "openai_responses" for c in calls)

    # 2. the scripted calls are the main chain; the second prompt extends the first call
    # token for token: Codex echoed the reasoning item (floe's encrypted_content), the
    # function_call and its output, and floe rendered them back exactly
    first = scripted(calls, REASONING)
    second = scripted(calls, f"The file says the launch code is {ANSWER}.")
    assert first["FinishReason"] == "tool_calls" and second["FinishReason"] == "stop"
    chain = main_chain(calls)
    assert first in chain and second in chain, describe(calls)
    assert extends(first, second), describe(calls)
    sent = json.dumps(second["Request"]["input"])
    assert "encrypted_content" in sent and "floe1." in sent, "Codex did not echo the reasoning item"

    # 3. tree micro-batches over Flight decode to the per-request loss terms, fewer rows
    rows, per_request = check_tree_over_flight(stack, s.id, calls)
    assert rows < per_request, (rows, per_request)


def test_codex_weight_sync(stack: Stack) -> None:
    """Pause mid-task: the next call waits; resume under a new policy version and the run
    finishes, its later calls recording that version."""
    s, env, work = setup(stack, "codex-sync")
    stack.script([
        {"reasoning": REASONING, "tool_calls": [{"name": TOOL, "arguments": {"cmd": "cat notes.txt"}}],
         "match": {"tool": TOOL, "contains": QUESTION}},
        {"reasoning": "Let me check the file's size too.", "tool_calls": [{"name": TOOL, "arguments": {"cmd": "wc -c notes.txt"}}],
         "match": {"tool": TOOL, "contains": ANSWER}},
        {"reasoning": "The file is short; the code is all it says.", "content": ANSWER,
         "match": {"tool": TOOL, "contains": "39 notes.txt"}},
    ])
    proc = subprocess.Popen(command(), env=env, cwd=work, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(recorded(stack, s.id)) >= 1, 60, "Codex's first call")
        version = stack.pause()["policy_version"]  # waits for any call in flight
        try:
            held = len(recorded(stack, s.id))
            assert held < 3, "the whole task finished before the pause"
            time.sleep(1.5)
            assert len(recorded(stack, s.id)) == held, "a call went upstream while paused"
            assert proc.poll() is None, "Codex exited while paused"
        finally:
            stack.resume(version + 1)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    calls = recorded(stack, s.id)
    print(describe(calls))
    assert proc.returncode == 0, f"codex exited {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert ANSWER in out
    assert len(calls) == 3, describe(calls)
    assert [c["PolicyVersion"] for c in calls[:held]] == [version] * held
    assert [c["PolicyVersion"] for c in calls[held:]] == [version + 1] * (3 - held)
    check_token_faithful(stack, calls)
    assert len(main_chain(calls)) == 3 and extends(calls[0], calls[1]) and extends(calls[1], calls[2])
