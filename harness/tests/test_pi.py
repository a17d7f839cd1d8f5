"""The real Pi coding agent (@mariozechner/pi-coding-agent, CLI `pi`) through floe, once per
API kind Pi speaks: anthropic-messages, openai-completions, openai-responses and
google-generative-ai.

Pi takes a custom provider from ~/.pi/agent/models.json ({"providers": {name: {baseUrl,
api, apiKey, models: [{id, ...}]}}}; apiKey names an environment variable or is the key
itself) and runs one prompt non-interactively with `pi -p --provider NAME --model ID
PROMPT`. PI_OFFLINE=1 skips its startup network calls. Its file tool is `read` with
{"path", "offset"?, "limit"?}. In -p mode Pi makes no side calls (no titles, no
summaries): each run is exactly the two scripted calls."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import (ANSWER, BIN, QUESTION, LossTerm, Session, Stack, base_env, check_token_faithful, http,
                      main_chain, run_harness, serve_recorded)

PROVIDER = "floe"
MODEL = "floe-model"
KEY_ENV = "FLOE_API_KEY"
APIS = ["anthropic-messages", "openai-completions", "openai-responses", "google-generative-ai"]


def base_url(api: str, s: Session) -> str:
    if api == "anthropic-messages":
        return s.base_urls["anthropic"]  # the Anthropic SDK appends /v1/messages
    if api in ("openai-completions", "openai-responses"):
        return s.base_urls["openai"]  # …/v1: the OpenAI SDK appends /chat/completions, /responses
    # pi-ai's google client sets apiVersion "" when the model has a baseUrl, so the
    # version segment is the baseUrl's: …/v1beta/models/{id}:streamGenerateContent
    return s.base_urls["gemini"] + "/v1beta"


def write_models(home: Path, api: str, s: Session) -> dict[str, Any]:
    """~/.pi/agent/models.json with one provider of this API kind, keyed by $FLOE_API_KEY.
    reasoning: true makes Pi ask for thinking (Anthropic thinking, reasoning_effort,
    Responses reasoning + encrypted_content, Gemini includeThoughts) and echo it back."""
    cfg = {"providers": {PROVIDER: {
        "baseUrl": base_url(api, s), "api": api, "apiKey": KEY_ENV,
        "models": [{"id": MODEL, "reasoning": True, "input": ["text"],
                    "contextWindow": 32768, "maxTokens": 4096}],
    }}}
    d = home / ".pi" / "agent"
    d.mkdir(parents=True)
    (d / "models.json").write_text(json.dumps(cfg, indent=2))
    return cfg


def check_tree_over_flight(stack: Stack, session: str, calls: list[dict[str, Any]]) -> tuple[int, int]:
    """conftest.check_tree_over_flight, with log-probs compared as the float32 they are.

    Recorded log-probs are float32, written to JSON in their shortest decimal form
    (-12.051725); Flight carries the float32 itself (-12.051725387573242 as a double).
    conftest rounds both to 5 decimals, and a 6th decimal of 5 rounds them apart: a few of
    the ~95 terms of every session here. Both sides are the same float32, compared exactly."""
    from floe_bridge import FloeClient

    proc, location, _ = serve_recorded(stack, session, "tree")
    try:
        with FloeClient(location, rank=0, world_size=1, timeout=60) as client:
            step = client.read_step(0)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
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
            got[(tuple(reversed(ctx)), int(ids[q]), float(np.float32(lp[q])))] += 1
    want: collections.Counter[LossTerm] = collections.Counter()
    for c in calls:
        if not c["Trainable"]:
            continue
        seq = c["PromptIDs"] + c["ResponseIDs"]
        for t, tok in enumerate(c["ResponseIDs"]):
            n = len(c["PromptIDs"]) + t
            want[(tuple(seq[:n]), tok, float(np.float32(c["Logprobs"][t])))] += 1
    extra, missing = sum((got - want).values()), sum((want - got).values())
    assert got == want, f"{extra} extra and {missing} missing loss terms"
    per_request_rows = sum(len(c["PromptIDs"]) + len(c["ResponseIDs"]) for c in calls if c["Trainable"])
    return rows, per_request_rows


def describe(calls: list[dict[str, Any]]) -> str:
    return "\n".join(f"call {c['Index']} api={c['API']} trainable={c['Trainable']} "
                     f"prompt={len(c['PromptIDs'])} response={len(c['ResponseIDs'])} "
                     f"finish={c['FinishReason']}" for c in calls)


@pytest.mark.parametrize("api", APIS)
def test_pi(stack: Stack, api: str) -> None:
    s = stack.session(f"pi-{api}")
    home, work = stack.workdir(f"pi-{api}")
    write_models(home, api, s)
    # Matched to Pi's `read` tool, so any other request samples freely instead.
    stack.script([
        {"reasoning": "The user wants the launch code from notes.txt. I should read that file first.",
         "tool_calls": [{"name": "read", "arguments": {"path": "notes.txt"}}],
         "match": {"tool": "read", "contains": "notes.txt"}},
        {"reasoning": f"The file says the launch code is {ANSWER}.", "content": ANSWER,
         "match": {"tool": "read", "contains": ANSWER}},
    ])
    env = base_env(home) | {KEY_ENV: s.key, "PI_OFFLINE": "1"}
    t0 = time.monotonic()
    cmd = [str(BIN / "pi"), "-p", "--provider", PROVIDER, "--model", MODEL, QUESTION]
    p = run_harness(cmd, env, work, timeout=90)
    took = time.monotonic() - t0
    calls = stack.calls(s.id) or []
    print(f"\n{api}: pi took {took:.1f} s\n{describe(calls)}")
    out = (f"pi exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}\n"
           + describe(calls))
    assert p.returncode == 0, out
    assert ANSWER in p.stdout, out
    left = http("GET", stack.upstream + "/script")["remaining"]
    assert left == 0, f"Pi left {left} scripted outputs untaken\n" + out

    check_token_faithful(stack, calls)

    # The conversation is the two scripted calls: the read, then the answer, the second's
    # prompt extending the first's prompt + response token for token (reasoning included).
    chain = main_chain(calls)
    assert len(chain) == 2, describe(calls)
    first, second = chain
    assert [tc["function"]["name"] for tc in first["Response"].get("tool_calls") or []] == ["read"]
    assert ANSWER in (second["Response"].get("content") or "")
    h = first["PromptIDs"] + first["ResponseIDs"]
    assert second["PromptIDs"][: len(h)] == h
    assert len(second["PromptIDs"]) > len(h)  # + the tool result

    rows, per_request = check_tree_over_flight(stack, s.id, calls)
    assert rows < per_request, (rows, per_request)
    print(f"{api}: tree rows {rows} < per-request rows {per_request}")
