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

MODEL = "gemini-floe"
TOOL = "read_file"
REASONING = "The user wants the launch code from notes.txt. I should read that file first."
SETTINGS = {
    "telemetry": {"enabled": False},
    "privacy": {"usageStatisticsEnabled": False},
    "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
    "security": {"auth": {"selectedType": "gemini-api-key"}},
}


def setup(stack: Stack, name: str) -> tuple[Session, dict[str, str], Path]:
    """A session, a fresh HOME and working directory, and Gemini CLI's settings."""
    s = stack.session(name)
    home, work = stack.workdir(name)
    (home / ".gemini").mkdir()
    (home / ".gemini" / "settings.json").write_text(json.dumps(SETTINGS, indent=2))
    env = base_env(home) | {
        "GOOGLE_GEMINI_BASE_URL": s.base_urls["gemini"],
        "GEMINI_API_KEY": s.key,
        "GEMINI_CLI_TRUST_WORKSPACE": "true",
        "GEMINI_TELEMETRY_ENABLED": "false",
    }
    return s, env, work


def command() -> list[str]:
    return [str(BIN / "gemini"), "-m", MODEL, "-p", QUESTION]


def read(reasoning: str, contains: str) -> dict[str, Any]:
    return {"reasoning": reasoning, "tool_calls": [{"name": TOOL, "arguments": {"file_path": "notes.txt"}}],
            "match": {"tool": TOOL, "contains": contains}}


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


def test_gemini_cli_reads_file(stack: Stack) -> None:
    s, env, work = setup(stack, "gemini-cli")
    stack.script([
        read(REASONING, QUESTION),
        answer("The file states the launch code; the user wants only the code.", ANSWER),
    ])
    t0 = time.monotonic()
    p = run_harness(command(), env, work, timeout=150)
    took = time.monotonic() - t0
    calls = recorded(stack, s.id)
    print(f"gemini -p took {took:.1f} s\n{describe(calls)}")
    assert p.returncode == 0, (
        f"gemini exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}")
    assert ANSWER in p.stdout, p.stdout[-3000:]

    # 1. every call carries exactly the server's prompt ids, response ids and log-probs
    check_token_faithful(stack, calls)
    assert all(c["API"] == "gemini" for c in calls)

    # 2. the two scripted calls form the main chain; anything else is a side call of its own
    first = [c for c in calls if TOOL in tool_names(c)]
    last = [c for c in calls if ANSWER in (c["Response"].get("content") or "")]
    assert len(first) == 1 and len(last) == 1, describe(calls)
    chain = main_chain(calls)
    assert first[0] in chain and last[0] in chain, describe(calls)
    # The answer's prompt extends the tool call's prompt + response token for token: the
    # reasoning came back in the thoughtSignature and the functionCall args unchanged.
    assert extends(first[0], last[0]), describe(calls)
    assert first[0]["Response"].get("reasoning_content"), "the scripted reasoning was not parsed"
    echoed = last[0]["Request"]["contents"]
    signatures = [part["thoughtSignature"] for content in echoed if content.get("role") == "model"
                  for part in content["parts"] if "thoughtSignature" in part]
    # base64("floe1.") = "ZmxvZTEu": floe's own signature
    assert signatures and all(sig.startswith("ZmxvZTEu") for sig in signatures), signatures
    for side in (c for c in calls if c not in chain):
        assert not extends(side, last[0]), f"side call {side['Index']} in the conversation's prefix"

    # 3. tree micro-batches over Flight decode to the per-request loss terms, fewer rows
    rows, per_request = check_tree_over_flight(stack, s.id, calls)
    assert rows < per_request, (rows, per_request)


def test_gemini_cli_weight_sync(stack: Stack) -> None:
    """Pause mid-task: Gemini CLI's next call waits; resume under a new policy version and
    the run finishes, its later calls recording that version."""
    s, env, work = setup(stack, "gemini-cli-sync")
    stack.script([
        read(REASONING, QUESTION),
        read("Let me read it once more to be sure of the exact code.", ANSWER),
        answer("Both reads agree on the code.", ANSWER),
    ])
    proc = subprocess.Popen(command(), env=env, cwd=work, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(recorded(stack, s.id)) >= 1, 90, "Gemini CLI's first call")
        version = stack.pause()["policy_version"]  # waits for any call in flight
        try:
            held = len(recorded(stack, s.id))
            assert held < 3, "the whole task finished before the pause"
            time.sleep(1.5)
            assert len(recorded(stack, s.id)) == held, "a call went upstream while paused"
            assert proc.poll() is None, "Gemini CLI exited while paused"
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
        f"gemini exited {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    assert ANSWER in out
    assert len(calls) == 3, describe(calls)
    assert [c["PolicyVersion"] for c in calls[:held]] == [version] * held
    assert [c["PolicyVersion"] for c in calls[held:]] == [version + 1] * (3 - held)
    # The first call after the pause reached floe while it was paused, and was held there.
    assert seconds(calls[held]["Started"]) < resumed < seconds(calls[held]["Finished"]), json.dumps(
        {k: calls[held][k] for k in ("Started", "Finished")})
    check_token_faithful(stack, calls)
    assert len(main_chain(calls)) == 3 and extends(calls[0], calls[1]) and extends(calls[1], calls[2])
