"""Three real harness CLIs of `make test-harness` (Claude Code over Anthropic Messages,
Codex over OpenAI Responses, Gemini CLI over Gemini) run once each through `floe serve`
against the real vLLM serving SmolLM2, on the harness tests' read-the-file task.

A 135M model answers such a task poorly, and its context is stretched past what it was
trained on to hold the CLIs' 7-13k-token prompts; that is allowed. What is tested is
the plumbing: the CLI finishes, and every call it made reached vLLM, was answered and was
recorded, trainable, with vLLM's own token ids and log-probs.

The CLIs' launch settings are the harness tests' own (harness/tests/test_*.py), imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllmstack import REPO, Floe, Relay, log, vllm_tokens

HARNESS_TESTS = REPO / "harness" / "tests"
BIN = REPO / "harness" / "node_modules" / ".bin"


def harness_modules(names: list[str]) -> dict[str, Any]:
    """Modules of harness/tests, imported as those tests import each other: by plain name,
    with their conftest as `conftest`. pytest has already put this suite's conftest under
    that name, so the harness tests' one takes it only while they are imported."""
    if str(HARNESS_TESTS) not in sys.path:
        sys.path.insert(0, str(HARNESS_TESTS))
    ours = sys.modules.get("conftest")
    spec = importlib.util.spec_from_file_location("conftest", HARNESS_TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    theirs = importlib.util.module_from_spec(spec)
    sys.modules["conftest"] = theirs
    try:
        spec.loader.exec_module(theirs)
        return {"conftest": theirs} | {n: importlib.import_module(n) for n in names}
    finally:
        if ours is not None:
            sys.modules["conftest"] = ours


# What a CLI prints when it gives up on an answer that ended at the token limit.
GIVES_UP_ON_CUT_ANSWER = {
    "codex": "Incomplete response returned, reason: max_output_tokens",
    "claude-code": "response exceeded the 32000 output token maximum",
}
# floe's own policy may keep a call out of training (docs/proxy.md): Gemini CLI samples
# with top_p 0.95, whose log-probs the trainer cannot reproduce. Such a call is still
# recorded with vLLM's token data, which is what is checked here.
POLICY_UNTRAINABLE = ("truncated sampling",)
HARNESSES = {
    "claude-code": ("test_claude_code", "CLAUDE_CODE"),
    "codex": ("test_codex", "CODEX"),
    "gemini-cli": ("test_gemini_cli", "GEMINI_CLI"),
}


@pytest.fixture(scope="module")
def floe(floe_serve: Callable[..., Floe]) -> Floe:
    # One session is a group of one here: nothing trains, the calls are what is checked.
    return floe_serve("tree", group_size=1, min_group_size=1)


@pytest.mark.parametrize("name", list(HARNESSES))
def test_harness_against_vllm(name: str, floe: Floe, relay: Relay, tmp_path: Path) -> None:
    if not (BIN / "claude").exists():
        pytest.fail(f"the harness CLIs are not installed: run npm install in {BIN.parents[1]} (make does)")
    module, attr = HARNESSES[name]
    mods = harness_modules([module])
    conf, h = mods["conftest"], getattr(mods[module], attr)
    s = floe.session(h.task, f"harness-{name}", 1)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "notes.txt").write_text(conf.FILE_TEXT + "\n")
    argv, env = h.launch(conf.Session(s.id, s.key, s.base_urls), home, work)
    # The CLIs' own retries of a failed call are part of what is checked: none are expected.
    p = conf.run_harness(argv, env, work, timeout=float(os.environ.get("FLOE_VLLM_HARNESS_TIMEOUT", "900")))
    relay.wait_done()
    floe.finish(s, 0.0)
    sent = relay.chats(s.id)
    calls = sorted(floe.calls(s.id), key=lambda c: int(c["index"]))
    log(
        f"{h.name}: exit {p.returncode}, {len(sent)} calls to vLLM, {len(calls)} recorded; prompt tokens "
        f"{[len(c['prompt_ids'] or []) for c in calls]}"
    )
    out = f"exit {p.returncode}\nstdout:\n{p.stdout[-2000:]}\nstderr:\n{p.stderr[-3000:]}"
    # A call vLLM refused (Claude Code's first asks for more tokens than the window) is
    # answered by floe with the provider's error, which the CLI acts on, and recorded by
    # no one; every call vLLM answered is recorded, in order, with vLLM's token data.
    answered = [ex for ex in sent if ex.status == 200]
    assert answered, f"{h.name}: no call answered by vLLM ({len(sent)} sent)\n{out}"
    assert len(calls) == len(answered), (
        f"{h.name}: vLLM answered {len(answered)} calls, {len(calls)} recorded\n{out}"
    )
    for c, ex in zip(calls, answered, strict=True):
        prompt, ids, lps, _ = vllm_tokens(ex)
        reason = c.get("untrainable_reason") or ""
        assert c["trainable"] or reason.startswith(POLICY_UNTRAINABLE), (
            f"call {c['index']} untrainable: {reason}"
        )
        assert c["prompt_ids"] == prompt and c["response_ids"] == ids, (
            f"call {c['index']}: ids differ from vLLM's"
        )
        assert np.array_equal(np.asarray(c["logprobs"], np.float32), np.asarray(lps, np.float32))
    if p.returncode != 0 and (cut := GIVES_UP_ON_CUT_ANSWER.get(name)) and cut in p.stdout + p.stderr:
        # The model's answer, not floe: vLLM's token cap (vllmstack.MAX_NEW_TOKENS) cut it,
        # floe passed that on as the API says (an incomplete response), and this CLI stops
        # on an incomplete response. A 135M model often writes to the cap.
        log(f"{h.name} stopped on an answer cut by the server's token cap")
        return
    assert p.returncode == 0, f"{h.name} failed\n{out}"
