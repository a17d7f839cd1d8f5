"""The two scenarios every harness CLI runs through floe, and the checks they share.

A harness is described by a `Harness`: how to launch it against a session (its command
line, environment and config files), the API kind floe records its calls under, and its
file-reading tool. `run_read_task` scripts a read-then-answer conversation and checks it;
`run_weight_sync` pauses floe mid-task and resumes it under a new policy version. Each
returns what a harness's own test needs for the checks only that harness calls for."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from conftest import (
    ANSWER,
    QUESTION,
    Session,
    Stack,
    check_token_faithful,
    check_tree_over_flight,
    extends,
    main_chain,
    run_harness,
    wait_for,
)

REASONING = "The user wants the launch code from notes.txt. I should read that file first."
FINAL = f"The file says the launch code is {ANSWER}."
# What `wc -c notes.txt` prints: the size_call's result.
SIZE = "39 notes.txt"

Call = dict[str, Any]
# (session, HOME, working directory) -> (command line, environment); writes its config under HOME.
Launch = Callable[[Session, Path, Path], tuple[list[str], dict[str, str]]]


@dataclass(frozen=True)
class Harness:
    """What sets one harness CLI apart in the shared scenarios."""

    name: str  # in messages: "Claude Code"
    exe: str  # its command, in messages: "claude"
    task: str  # the session's task id and the working directory's name
    api: str  # the API kind floe records its calls under: "anthropic", "openai_chat", …
    tool: str  # its file-reading tool
    read_args: Callable[[Path], dict[str, Any]]  # that tool's arguments reading notes.txt in this directory
    launch: Launch
    timeout: float = 90  # seconds one run, or the wait for its first call, may take
    # A tool call that runs `wc -c notes.txt` (printing SIZE), the weight-sync run's second
    # step; None: that step reads the file again.
    size_call: tuple[str, dict[str, Any]] | None = None


def tool_names(c: Call) -> list[str]:
    return [tc["function"]["name"] for tc in (c.get("response") or {}).get("tool_calls") or []]


def content(c: Call) -> str:
    return (c.get("response") or {}).get("content") or ""


def reasoning(c: Call) -> str:
    return ((c.get("response") or {}).get("reasoning_content") or "").strip()


def describe(calls: list[Call]) -> str:
    return "\n".join(
        f"call {c['index']}: api {c['api']} prompt {len(c['prompt_ids'])} response {len(c['response_ids'])} "
        f"finish {c['finish_reason']} tools {tool_names(c)} v{c['policy_version']} trainable {c['trainable']}"
        for c in calls)


def seconds(ts: str) -> float:
    """A Go RFC 3339 timestamp (nanoseconds) as Unix seconds."""
    ts = re.sub(r"\.(\d+)", lambda m: "." + m[1][:6].ljust(6, "0"), ts).replace("Z", "+00:00")
    return datetime.fromisoformat(ts).timestamp()


def only(calls: list[Call], what: str, pred: Callable[[Call], bool]) -> Call:
    hits = [c for c in calls if pred(c)]
    assert len(hits) == 1, f"{len(hits)} calls {what}\n{describe(calls)}"
    return hits[0]


def read(h: Harness, work: Path, why: str, contains: str) -> dict[str, Any]:
    """A scripted read of notes.txt with the harness's own tool. Matched to that tool, so
    any other request (a side call) samples freely instead."""
    return {"reasoning": why, "tool_calls": [{"name": h.tool, "arguments": h.read_args(work)}],
            "match": {"tool": h.tool, "contains": contains}}


def answer(h: Harness, why: str, contains: str) -> dict[str, Any]:
    return {"reasoning": why, "content": ANSWER, "match": {"tool": h.tool, "contains": contains}}


def prepare(stack: Stack, h: Harness, task: str) -> tuple[Session, Path, list[str], dict[str, str]]:
    """A session, a fresh HOME and working directory, and the harness launched at floe."""
    s = stack.session(task)
    home, work = stack.workdir(task)
    cmd, env = h.launch(s, home, work)
    return s, work, cmd, env


def exited(h: Harness, rc: int | None, out: str, err: str, calls: list[Call]) -> str:
    return f"{h.exe} exited {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}\n{describe(calls)}"


@dataclass
class ReadTask:
    """A finished read-then-answer run: the session's calls, the read and the answer (both
    on the main chain), and the tree's rows against the per-request rows."""

    session: Session
    proc: subprocess.CompletedProcess[str]
    calls: list[Call]
    chain: list[Call]
    first: Call
    last: Call
    tree_rows: int
    per_request_rows: int


def run_read_task(stack: Stack, h: Harness) -> ReadTask:
    """The harness asked to read notes.txt and answer with the code in it: the model reads
    it with the harness's tool, then answers. Checks the run and its recorded calls."""
    s, work, cmd, env = prepare(stack, h, h.task)
    stack.script([read(h, work, REASONING, QUESTION), answer(h, FINAL, ANSWER)])
    t0 = time.monotonic()
    p = run_harness(cmd, env, work, timeout=h.timeout)
    took = time.monotonic() - t0
    calls = stack.calls(s.id)
    print(f"\n{h.task}: {h.exe} took {took:.1f} s\n{describe(calls)}")
    assert p.returncode == 0, exited(h, p.returncode, p.stdout, p.stderr, calls)
    assert ANSWER in p.stdout, exited(h, p.returncode, p.stdout, p.stderr, calls)
    left = stack.script_left()
    assert left == 0, f"{h.name} left {left} scripted outputs untaken\n{describe(calls)}"

    # 1. every call carries exactly the server's prompt ids, response ids and log-probs
    check_token_faithful(stack, calls)
    assert all(c["api"] == h.api for c in calls), describe(calls)

    # 2. the two scripted calls form the main chain; anything else is a side call of its own
    first = only(calls, f"called {h.tool}", lambda c: h.tool in tool_names(c))
    last = only(calls, "answered", lambda c: ANSWER in content(c))
    assert tool_names(first) == [h.tool], describe(calls)
    assert first["finish_reason"] == "tool_calls" and last["finish_reason"] == "stop", describe(calls)
    assert reasoning(first) == REASONING and reasoning(last) == FINAL, "the scripted reasoning was not parsed"
    chain = main_chain(calls)
    assert len(chain) == 2 and first in chain and last in chain, describe(calls)
    # The answer's prompt extends the read's prompt + response token for token: the
    # harness echoed the reasoning and the tool call unchanged and floe rendered them back
    # exactly as sampled, followed by the tool's result.
    assert extends(first, last), describe(calls)
    assert len(last["prompt_ids"]) > len(first["prompt_ids"]) + len(first["response_ids"]), describe(calls)
    for side in (c for c in calls if c not in chain):
        assert not extends(side, last), f"side call {side['index']} in the conversation's prefix"

    # 3. tree micro-batches over Flight decode to the per-request loss terms, fewer rows
    rows, per_request = check_tree_over_flight(stack, s.id, calls)
    assert rows < per_request, (rows, per_request)
    print(f"{h.task}: tree rows {rows} < per-request rows {per_request}")
    return ReadTask(s, p, calls, chain, first, last, rows, per_request)


@dataclass
class WeightSync:
    """A finished weight-sync run: its three calls, the policy version before the pause and
    how many calls were recorded under it."""

    session: Session
    calls: list[Call]
    version: int
    held: int


def run_weight_sync(stack: Stack, h: Harness, env: dict[str, str] | None = None) -> WeightSync:
    """Pause mid-task: the harness's next call waits; resume under a new policy version and
    the run finishes, its later calls recording that version. `env` is added to the
    harness's environment for this run."""
    s, work, cmd, base = prepare(stack, h, h.task + "-sync")
    if h.size_call is None:
        second = read(h, work, "Let me read it once more to be sure of the exact code.", ANSWER)
        last = answer(h, "Both reads agree on the code.", ANSWER)
    else:
        tool, args = h.size_call
        second = {
            "reasoning": "Let me check the file's size too.",
            "tool_calls": [{"name": tool, "arguments": args}],
            "match": {"tool": tool, "contains": ANSWER},
        }
        last = answer(h, "The file is short; the code is all it says.", SIZE)
    # The first answer is held upstream until floe is paused: the pause then lands between
    # the first call and the second whatever the machine's speed (a harness makes its next
    # call within milliseconds of an answer, sooner than a pause can follow).
    stack.script([read(h, work, REASONING, QUESTION) | {"hold": True}, second, last])
    proc = subprocess.Popen(cmd, env=base | (env or {}), cwd=work, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: stack.script_held() >= 1, h.timeout, f"{h.name}'s first call upstream")
        with ThreadPoolExecutor(1) as pool:
            pausing = pool.submit(stack.pause)  # returns once the call in flight has ended
            wait_for(stack.paused, h.timeout, "floe to close its gate")
            stack.release()
            version: int = pausing.result()["policy_version"]
        try:
            held = len(stack.calls(s.id))
            assert 1 <= held < 3, f"{held} calls recorded before the pause"
            time.sleep(1.5)
            assert len(stack.calls(s.id)) == held, "a call went upstream while paused"
            assert proc.poll() is None, f"{h.name} exited while paused"
        finally:
            resumed = time.time()
            stack.resume(version + 1)
        out, err = proc.communicate(timeout=h.timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    calls = stack.calls(s.id)
    print(f"\n{h.task}-sync: paused at v{version} after {held} calls\n{describe(calls)}")
    assert proc.returncode == 0, exited(h, proc.returncode, out, err, calls)
    assert ANSWER in out, exited(h, proc.returncode, out, err, calls)
    assert len(calls) == 3, describe(calls)
    assert stack.script_left() == 0, describe(calls)
    assert [c["policy_version"] for c in calls[:held]] == [version] * held
    assert [c["policy_version"] for c in calls[held:]] == [version + 1] * (3 - held)
    # The first call after the pause reached floe while it was paused, and was held there.
    assert seconds(calls[held]["started"]) < resumed < seconds(calls[held]["finished"]), json.dumps(
        {k: calls[held][k] for k in ("started", "finished")})
    check_token_faithful(stack, calls)
    assert all(c["api"] == h.api for c in calls), describe(calls)
    assert len(main_chain(calls)) == 3 and extends(calls[0], calls[1]) and extends(calls[1], calls[2])
    return WeightSync(s, calls, version, held)
