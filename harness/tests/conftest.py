"""Shared machinery of the harness tests: the reference inference server in script mode,
floe's proxy with its control API in front of it, a fresh HOME and working directory per
harness run, and the checks every harness must pass. The scenarios every harness runs
(a read-then-answer task, a weight sync mid-task) are in scenario.py.

The harness CLIs come from npm (harness/package.json, installed into harness/node_modules
by `make test`)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import floe_stack
from floe_stack import build_floe, refserver_argv

HARNESS = Path(__file__).resolve().parents[1]
REPO = HARNESS.parent
BIN = HARNESS / "node_modules" / ".bin"
FILE_TEXT = "The launch code is PURPLE-ELEPHANT-42."
QUESTION = (
    "Read the file notes.txt in the current directory and tell me the launch code it contains. "
    "Answer with the code only."
)
ANSWER = "PURPLE-ELEPHANT-42"


def http(method: str, url: str, body: Any = None, timeout: float = 30) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


@dataclass
class Session:
    id: str
    key: str
    base_urls: dict[str, str]


@dataclass
class Stack:
    """The reference server and floe's proxy, and where calls are recorded."""

    upstream: str  # http://127.0.0.1:PORT (the reference server, without /v1)
    proxy: str  # http://127.0.0.1:PORT: the provider APIs, what harnesses reach
    control: str  # http://127.0.0.1:PORT: /floe/v1, what only the test reaches
    calls_path: Path
    floe: Path
    tmp: Path
    _n: int = field(default=0)

    def session(self, task: str) -> Session:
        s = http("POST", self.control + "/floe/v1/sessions", {"task_id": task})
        return Session(s["session_id"], s["api_key"], s["base_urls"])

    def script(self, outputs: list[dict[str, Any]]) -> None:
        http("DELETE", self.upstream + "/script")
        http("POST", self.upstream + "/script", {"outputs": outputs})

    def script_left(self) -> int:
        """How many scripted outputs no request has taken."""
        return http("GET", self.upstream + "/script")["remaining"]  # type: ignore[no-any-return]

    def script_held(self) -> int:
        """How many requests wait upstream on a scripted output that holds them."""
        return http("GET", self.upstream + "/script")["held"]  # type: ignore[no-any-return]

    def release(self) -> int:
        """Let the requests held upstream answer."""
        return http("POST", self.upstream + "/script/release", {})["released"]  # type: ignore[no-any-return]

    def paused(self) -> bool:
        return bool(http("GET", self.control + "/floe/v1/status")["paused"])

    def calls(self, session: str) -> list[dict[str, Any]]:
        calls: list[dict[str, Any]] | None = http("GET", f"{self.control}/floe/v1/sessions/{session}")[
            "calls"
        ]
        return calls or []  # null until the session's first call

    def generations(self) -> list[dict[str, Any]]:
        return http("GET", self.upstream + "/generations")["generations"]  # type: ignore[no-any-return]

    def pause(self) -> dict[str, Any]:
        return http("POST", self.control + "/floe/v1/pause", {}, timeout=60)  # type: ignore[no-any-return]

    def resume(self, version: int) -> dict[str, Any]:
        return http("POST", self.control + "/floe/v1/resume", {"policy_version": version})  # type: ignore[no-any-return]

    def workdir(self, name: str) -> tuple[Path, Path]:
        """A fresh (HOME, working directory) with notes.txt in the working directory."""
        self._n += 1
        root = self.tmp / f"{name}-{self._n}"
        home, work = root / "home", root / "work"
        home.mkdir(parents=True)
        work.mkdir()
        (work / "notes.txt").write_text(FILE_TEXT + "\n")
        return home, work


def base_env(home: Path) -> dict[str, str]:
    """A clean environment: no real provider keys, no telemetry, this HOME."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "SSL_CERT_FILE")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"),
               XDG_DATA_HOME=str(home / ".local/share"), NO_COLOR="1", CI="1", DO_NOT_TRACK="1")
    env["PATH"] = f"{BIN}:{os.path.dirname(sys.executable)}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def run_harness(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(
        args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    return p


@pytest.fixture(scope="session")
def floe_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return build_floe(tmp_path_factory.mktemp("bin"), REPO)
    except RuntimeError as e:
        pytest.fail(f"the harness tests need floe: {e}")


@pytest.fixture(scope="session")
def stack(floe_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not (BIN / "claude").exists():
        pytest.fail(f"the harness CLIs are not installed: run `npm install` in {HARNESS} (make test does)")
    tmp = tmp_path_factory.mktemp("harness")
    with floe_stack.Stack(tmp / "logs", grace=20) as procs:  # logs: refserver.log, proxy.log
        _, hello = procs.start_server("refserver", refserver_argv(
            "--port", "0", "--max-model-len", "32768", "--cache-dir", str(tmp / "tokenizer")))
        upstream = hello["base_url"].removesuffix("/v1")
        calls = tmp / "calls.jsonl"
        # -sampling force, as docs/harnesses.md tells a user: a harness picks its own
        # sampling (Gemini CLI sends topP 0.95), and a call sampled from a truncated
        # distribution is recorded untrainable; forced, every call samples at T = 1.
        _, phello = procs.start_server("proxy", [str(floe_bin), "proxy", "-proxy-addr", "127.0.0.1:0",
                                                 "-control-addr", "127.0.0.1:0", "-sampling", "force",
                                                 "-upstream", upstream, "-record", str(calls)], timeout=60)
        yield Stack(upstream, phello["proxy"], phello["control"], calls, floe_bin, tmp)


# --- checks every harness must pass ---------------------------------------------------


def check_token_faithful(stack: Stack, calls: list[dict[str, Any]]) -> None:
    """Every recorded call carries exactly what the reference server generated."""
    gens = stack.generations()
    assert calls, "the session recorded no calls"
    for c in calls:
        assert c["trainable"], f"call {c['index']} untrainable: {c['untrainable_reason']}"
        match = [
            g
            for g in gens
            if g["prompt_token_ids"] == c["prompt_ids"] and g["token_ids"] == c["response_ids"]
        ]
        assert match, f"call {c['index']}: no generation of the server has these prompt and response ids"
        assert c["logprobs"] == pytest.approx(match[-1]["logprobs"], rel=1e-6, abs=1e-6)


def extends(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """b's prompt starts with a's prompt + response, token for token."""
    h = a["prompt_ids"] + a["response_ids"]
    return bool(b["prompt_ids"][: len(h)] == h)


def main_chain(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls of the conversation proper: those whose prompt extends an earlier call's
    prompt + response, plus the first call they start from. Side calls (titles, routing,
    summaries) stand apart."""
    chained: set[int] = set()
    for j, b in enumerate(calls):
        for i in range(j):
            if extends(calls[i], b):
                chained |= {i, j}
    return [c for k, c in enumerate(calls) if k in chained]


@contextlib.contextmanager
def serve_recorded(stack: Stack, session: str, strategy: str) -> Iterator[tuple[str, Path]]:
    """floe corpus-serve over this session's recorded calls: (its Flight location, the
    calls file), stopped on leaving the block."""
    path = stack.tmp / f"{session}-{strategy}.jsonl"
    with stack.calls_path.open() as src, path.open("w") as dst:
        for line in src:
            if json.loads(line)["session_id"] == session:
                dst.write(line)
    with floe_stack.Stack(stack.tmp / f"serve-{session}-{strategy}", grace=20) as procs:
        _, hello = procs.start_server("corpus-serve", [
            str(stack.floe), "corpus-serve", "-calls", str(path), "-strategy", strategy,
            "-flight-addr", "127.0.0.1:0", "-token-budget", "65536", "-pad-multiple", "16"], timeout=60)
        yield hello["flight"], path


LossTerm = tuple[tuple[int, ...], int, float]


def per_request_terms(calls: list[dict[str, Any]]) -> collections.Counter[LossTerm]:
    out: collections.Counter[LossTerm] = collections.Counter()
    for c in calls:
        if not c["trainable"]:
            continue
        seq = c["prompt_ids"] + c["response_ids"]
        for t, tok in enumerate(c["response_ids"]):
            n = len(c["prompt_ids"]) + t
            # Flight carries log-probs as float32; compare exactly at that precision.
            out[(tuple(seq[:n]), tok, float(np.float32(c["logprobs"][t])))] += 1
    return out


def check_tree_over_flight(stack: Stack, session: str, calls: list[dict[str, Any]]) -> tuple[int, int]:
    """The tree micro-batches of the session, fetched over Flight, decode to exactly the
    per-request loss terms and forward fewer rows. Returns (tree rows, per-request rows)."""
    from floe_bridge import FloeClient

    with serve_recorded(stack, session, "tree") as (location, _), \
            FloeClient(location, rank=0, world_size=1, timeout=60) as client:
        step = client.read_step(0)
    got: collections.Counter[LossTerm] = collections.Counter()
    rows = 0
    for mb in step.micro_batches:
        ids, pred, mask, lp = mb.input_ids, mb.pred_idx, mb.loss_mask, mb.old_logprobs
        rows += int(mb.meta.rows) if mb.meta and mb.meta.rows is not None else len(ids)
        for q in range(len(ids)):
            if not mask[q]:
                continue
            ctx = []
            k = int(pred[q])
            while k != -1:
                ctx.append(int(ids[k]))
                k = int(pred[k])
            got[(tuple(reversed(ctx)), int(ids[q]), float(lp[q]))] += 1
    want = per_request_terms(calls)
    assert got == want, (
        f"{sum((got - want).values())} extra and {sum((want - got).values())} missing loss terms"
    )
    per_request_rows = sum(len(c["prompt_ids"]) + len(c["response_ids"]) for c in calls if c["trainable"])
    return rows, per_request_rows


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
