"""The official SDKs through `floe serve` in front of a real vLLM serving SmolLM2.

Two `floe serve` instances, one per strategy (tree, per_request), each take 4 GRPO groups
of 2 sessions of 2 turns: one group per API (OpenAI chat, OpenAI Responses, Anthropic
Messages, Gemini), one session of each group streamed and one not, with a tool call and
its result in the history and the tools declared, reasoning on where the API can turn it
on, at temperature 1.0 or 0.7 (each strategy sees both). The checks:

- every call floe recorded carries exactly the prompt ids, sampled ids and log-probs
  vLLM sent (read from the recording relay's bytes), and the SDK got vLLM's answer;
- the steps floe serves over Flight, rescored by SmolLM2 in fp32 through floe_bridge,
  are within 1e-4 of vLLM's log-probs, per strategy and temperature.
"""

from __future__ import annotations

import concurrent.futures
import json
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from vllmstack import Floe, Relay, Session, log, vllm_tokens

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
genai = pytest.importorskip("google.genai")
from google.genai import types as gtypes  # noqa: E402

TURNS = 2
SESSIONS = 2  # per group: one not streamed, one streamed
MAX_TOKENS = 24
RESCORE_ATOL = 1e-4
APIS = ("chat", "responses", "anthropic", "gemini")
# Each strategy sees both temperatures; the two strategies see each API at the other one.
TEMPS = {"tree": (1.0, 0.7, 1.0, 0.7), "per_request": (0.7, 1.0, 0.7, 1.0)}
SYSTEM = "You are a coding agent. Answer briefly."
QUESTION = "What does notes.txt say?"
FILE_TEXT = "The launch code is PURPLE-ELEPHANT-42."
FOLLOW_UP = "Thanks. Is there anything else in the file?"
PARAMS = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
READ = {"path": "notes.txt"}


@dataclass
class Answer:
    """What the caller got, through its SDK."""

    text: str
    reasoning: str
    tools: list[str]


@dataclass
class Run:
    api: str
    stream: bool
    temperature: float
    session: Session
    answers: list[Answer] = field(default_factory=list)
    error: str = ""
    # floe's record of the session's calls, read when it finished (a committed step's
    # sessions leave floe's store for the archive)
    calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Rollout:
    floe: Floe
    runs: list[Run]
    steps: list[Any]  # floe_bridge Step, one per group


# --- one conversation per API, in the shape each SDK takes --------------------------------


def converse_chat(s: Session, stream: bool, temp: float) -> list[Answer]:
    client = openai.OpenAI(base_url=s.base_urls["openai"], api_key=s.key, max_retries=0)
    tools = [
        {
            "type": "function",
            "function": {"name": "read_file", "description": "Read a file", "parameters": PARAMS},
        }
    ]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": json.dumps(READ)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": FILE_TEXT},
    ]
    out = []
    for _ in range(TURNS):
        kw: dict[str, Any] = dict(
            model="gpt-floe",
            messages=msgs,
            tools=tools,
            max_tokens=MAX_TOKENS,
            temperature=temp,
            reasoning_effort="low",
        )
        if not stream:
            m = client.chat.completions.create(**kw).choices[0].message
            msg = m.model_dump(exclude_none=True)
            reasoning = str(getattr(m, "reasoning_content", None) or getattr(m, "reasoning", None) or "")
        else:
            msg = {"role": "assistant", "content": ""}
            reasoning = ""
            calls: dict[int, dict[str, Any]] = {}
            for chunk in client.chat.completions.create(**kw, stream=True):
                if not chunk.choices:
                    continue
                d = chunk.choices[0].delta
                msg["content"] += d.content or ""
                reasoning += str(getattr(d, "reasoning_content", None) or getattr(d, "reasoning", None) or "")
                for tc in d.tool_calls or []:
                    c = calls.setdefault(
                        tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                    )
                    c["id"] += tc.id or ""
                    if tc.function:
                        c["function"]["name"] += tc.function.name or ""
                        c["function"]["arguments"] += tc.function.arguments or ""
            if calls:
                msg["tool_calls"] = [calls[i] for i in sorted(calls)]
            if reasoning:
                msg["reasoning_content"] = reasoning
        tcs = msg.get("tool_calls") or []
        out.append(Answer(msg.get("content") or "", reasoning, [tc["function"]["name"] for tc in tcs]))
        msgs.append(msg)
        msgs += [{"role": "tool", "tool_call_id": tc["id"], "content": FILE_TEXT} for tc in tcs]
        if not tcs:
            msgs.append({"role": "user", "content": FOLLOW_UP})
    return out


def converse_responses(s: Session, stream: bool, temp: float) -> list[Answer]:
    client = openai.OpenAI(base_url=s.base_urls["openai"], api_key=s.key, max_retries=0)
    tools = [{"type": "function", "name": "read_file", "description": "Read a file", "parameters": PARAMS}]
    items: list[Any] = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": json.dumps(READ)},
        {"type": "function_call_output", "call_id": "call_1", "output": FILE_TEXT},
    ]
    out = []
    for _ in range(TURNS):
        kw: dict[str, Any] = dict(
            model="gpt-floe",
            instructions=SYSTEM,
            input=items,
            tools=tools,
            store=False,
            max_output_tokens=MAX_TOKENS,
            temperature=temp,
            reasoning={"effort": "low"},
        )
        if not stream:
            r = client.responses.create(**kw)
        else:
            # An answer cut by max_output_tokens ends with response.incomplete, as OpenAI's
            # does; the SDK's get_final_response takes only response.completed.
            final = None
            with client.responses.stream(**kw) as st:
                for ev in st:
                    if ev.type in ("response.completed", "response.incomplete"):
                        final = ev.response
            assert final is not None, "the stream ended without response.completed or response.incomplete"
            r = final
        reasoning = "".join(
            p.text
            for o in r.output
            if o.type == "reasoning"
            for p in [*(o.summary or []), *(o.content or [])]
        )
        calls = [o for o in r.output if o.type == "function_call"]
        out.append(Answer(r.output_text, reasoning, [c.name for c in calls]))
        items += [o.model_dump(exclude_none=True) for o in r.output]
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": FILE_TEXT} for c in calls]
        if not calls:
            items.append({"role": "user", "content": FOLLOW_UP})
    return out


def converse_anthropic(s: Session, stream: bool, temp: float) -> list[Answer]:
    client = anthropic.Anthropic(base_url=s.base_urls["anthropic"], api_key=s.key, max_retries=0)
    tools = [{"name": "read_file", "description": "Read a file", "input_schema": PARAMS}]
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": READ}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": FILE_TEXT}],
        },
    ]
    out = []
    for _ in range(TURNS):
        kw: dict[str, Any] = dict(
            model="claude-floe",
            max_tokens=MAX_TOKENS,
            system=SYSTEM,
            tools=tools,
            messages=msgs,
            thinking={"type": "enabled", "budget_tokens": 16},
            # this SDK version takes no temperature parameter; floe reads it from the body
            extra_body={"temperature": temp},
        )
        if not stream:
            m = client.messages.create(**kw)
        else:
            with client.messages.stream(**kw) as st:
                m = st.get_final_message()
        uses = [b for b in m.content if b.type == "tool_use"]
        out.append(
            Answer(
                "".join(b.text for b in m.content if b.type == "text"),
                "".join(b.thinking for b in m.content if b.type == "thinking"),
                [b.name for b in uses],
            )
        )
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        if uses:
            msgs.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": b.id, "content": FILE_TEXT} for b in uses
                    ],
                }
            )
        else:
            msgs.append({"role": "user", "content": FOLLOW_UP})
    return out


def converse_gemini(s: Session, stream: bool, temp: float) -> list[Answer]:
    client = genai.Client(
        api_key=s.key,
        http_options=gtypes.HttpOptions(
            base_url=s.base_urls["gemini"], retry_options=gtypes.HttpRetryOptions(attempts=1)
        ),
    )
    decl = gtypes.FunctionDeclaration(
        name="read_file", description="Read a file", parameters_json_schema=PARAMS
    )
    config = gtypes.GenerateContentConfig(
        system_instruction=SYSTEM,
        tools=[gtypes.Tool(function_declarations=[decl])],
        temperature=temp,
        max_output_tokens=MAX_TOKENS,
        thinking_config=gtypes.ThinkingConfig(include_thoughts=True),
        automatic_function_calling=gtypes.AutomaticFunctionCallingConfig(disable=True),
    )
    contents: list[Any] = [
        gtypes.Content(role="user", parts=[gtypes.Part(text=QUESTION)]),
        gtypes.Content(
            role="model", parts=[gtypes.Part(function_call=gtypes.FunctionCall(name="read_file", args=READ))]
        ),
        gtypes.Content(
            role="user",
            parts=[
                gtypes.Part(
                    function_response=gtypes.FunctionResponse(
                        name="read_file", response={"output": FILE_TEXT}
                    )
                )
            ],
        ),
    ]
    out = []
    for _ in range(TURNS):
        if not stream:
            parts = list(
                client.models.generate_content(model="gemini-floe", contents=contents, config=config)
                .candidates[0]
                .content.parts
                or []
            )
        else:
            parts = []
            for chunk in client.models.generate_content_stream(
                model="gemini-floe", contents=contents, config=config
            ):
                if chunk.candidates and chunk.candidates[0].content:
                    parts += chunk.candidates[0].content.parts or []
        calls = [p.function_call for p in parts if p.function_call]
        out.append(
            Answer(
                "".join(p.text or "" for p in parts if not p.thought and p.text),
                "".join(p.text or "" for p in parts if p.thought),
                [c.name or "" for c in calls],
            )
        )
        contents.append(gtypes.Content(role="model", parts=parts))
        if calls:
            contents.append(
                gtypes.Content(
                    role="user",
                    parts=[
                        gtypes.Part(
                            function_response=gtypes.FunctionResponse(
                                name=c.name, response={"output": FILE_TEXT}
                            )
                        )
                        for c in calls
                    ],
                )
            )
        else:
            contents.append(gtypes.Content(role="user", parts=[gtypes.Part(text=FOLLOW_UP)]))
    return out


CONVERSE: dict[str, Callable[[Session, bool, float], list[Answer]]] = {
    "chat": converse_chat,
    "responses": converse_responses,
    "anthropic": converse_anthropic,
    "gemini": converse_gemini,
}


def run_session(run: Run) -> None:
    try:
        run.answers = CONVERSE[run.api](run.session, run.stream, run.temperature)
    except Exception:  # the checks report it; the other sessions go on
        run.error = traceback.format_exc(limit=3)


def rollout(floe: Floe) -> Rollout:
    """The strategy's 4 groups, the sessions of a group concurrently, then its steps."""
    from floe_bridge import FloeClient
    from floe_bridge.client import NotReady

    runs: list[Run] = []
    for g, api in enumerate(APIS):
        temp = TEMPS[floe.strategy][g]
        group = [
            Run(api, stream, temp, floe.session(f"sdk-{api}", f"{floe.strategy}-{g}-{api}", SESSIONS))
            for stream in (False, True)
        ]
        with concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool:
            list(pool.map(run_session, group))
        for i, r in enumerate(group):  # rewards differ within the group: advantages are not 0
            r.calls = sorted(floe.calls(r.session), key=lambda c: int(c["index"]))
            floe.finish(r.session, float(i))
        runs += group
        log(f"{floe.strategy}: group {api} at T={temp} done")
    # Each group completes as its last session finishes and is then put into a step of its
    # own, or dropped (with the reason in floe_groups_dropped_total): read and commit the
    # steps as they form (floe forms at most -steps-ahead uncommitted ones).
    steps: list[Any] = []
    with FloeClient(floe.flight, rank=0, world_size=1, timeout=120) as client:
        while len(steps) + sum(floe.metric("floe_groups_dropped_total").values()) < len(APIS):
            try:
                step = client.read_step(len(steps), timeout=5)
            except NotReady:
                continue
            client.commit(len(steps))
            steps.append(step)
    return Rollout(floe, runs, steps)


@pytest.fixture(scope="module", params=["tree", "per_request"])
def done(request: pytest.FixtureRequest, floe_serve: Callable[..., Floe], relay: Relay) -> Rollout:
    floe = floe_serve(request.param, group_size=SESSIONS, groups_per_step=1, sampling="record")
    r = rollout(floe)
    relay.wait_done()
    return r


def describe(run: Run) -> str:
    return f"{run.api} {'streamed' if run.stream else 'not streamed'} T={run.temperature} ({run.session.id})"


# --- the checks ----------------------------------------------------------------------------


def test_every_turn_answered(done: Rollout) -> None:
    failed = [f"{describe(r)}:\n{r.error}" for r in done.runs if r.error]
    assert not failed, "\n".join(failed)
    for r in done.runs:
        assert len(r.answers) == TURNS, describe(r)


def test_every_group_trained(done: Rollout) -> None:
    dropped = {k: v for k, v in done.floe.metric("floe_groups_dropped_total").items() if v}
    assert not dropped, f"groups dropped: {dropped}; floe's log:\n{done.floe.child.tail(15)}"
    assert len(done.steps) == len(APIS)


def test_recorded_calls_equal_vllm(done: Rollout, relay: Relay) -> None:
    """Prompt ids, sampled ids and log-probs of every recorded call are vLLM's, bit for bit
    (log-probs at float32, as floe stores them); every call is trainable."""
    n = 0
    for r in done.runs:
        calls, sent = r.calls, relay.chats(r.session.id)
        assert len(calls) == len(sent) >= 1, (
            f"{describe(r)}: {len(calls)} calls recorded, {len(sent)} sent to vLLM"
        )
        for c, ex in zip(calls, sent, strict=True):
            where = f"{describe(r)} call {c['index']}"
            assert ex.status == 200, f"{where}: vLLM answered {ex.status}: {ex.response[:300]!r}"
            prompt, ids, lps, _ = vllm_tokens(ex)
            assert c["trainable"], f"{where}: untrainable: {c.get('untrainable_reason')}"
            assert c["prompt_ids"] == prompt, f"{where}: prompt ids differ"
            assert c["response_ids"] == ids, f"{where}: response ids differ"
            assert len(ids) == len(lps) >= 1
            assert np.array_equal(np.asarray(c["logprobs"], np.float32), np.asarray(lps, np.float32)), where
            n += 1
    log(f"{done.floe.strategy}: {n} recorded calls equal vLLM's")
    assert n == len(APIS) * SESSIONS * TURNS


def test_answers_are_vllms(done: Rollout, relay: Relay) -> None:
    """What each SDK got is what vLLM answered: its text, its reasoning and its tool calls
    (whitespace at the ends aside, which some dialects trim)."""
    bad = []
    for r in done.runs:
        for t, (a, ex) in enumerate(zip(r.answers, relay.chats(r.session.id), strict=False)):
            _, _, _, m = vllm_tokens(ex)
            want_tools = [
                tc["name"] if "name" in tc else tc["function"]["name"] for tc in m.get("tool_calls") or []
            ]
            want = (
                (m.get("content") or "").strip(),
                (m.get("reasoning") or m.get("reasoning_content") or "").strip(),
                want_tools,
            )
            got = (a.text.strip(), a.reasoning.strip(), a.tools)
            if r.api == "gemini" and not want[1]:
                got = (got[0], "", got[2])
            if got != want:
                bad.append(f"{describe(r)} turn {t}: got {got!r}, vLLM said {want!r}")
    assert not bad, "\n".join(bad)


Sampled = dict[tuple[tuple[int, ...], int], list[float]]


def vllm_logprobs(relay: Relay, runs: list[Run]) -> tuple[Sampled, int]:
    """(context ids, sampled id) -> vLLM's log-probs over these sessions' calls, and how
    many tokens vLLM sampled in them. A key can come twice: two sessions that sampled the
    same token after the same context, whose log-probs vLLM computed in different batches
    and which may differ in the last bits."""
    out: Sampled = {}
    n = 0
    for r in runs:
        for ex in relay.chats(r.session.id):
            if ex.status != 200:
                continue
            prompt, ids, lps, _ = vllm_tokens(ex)
            seq = prompt + ids
            for t, (tok, lp) in enumerate(zip(ids, lps, strict=True)):
                out.setdefault((tuple(seq[: len(prompt) + t]), tok), []).append(lp)
                n += 1
    return out, n


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rescoring_within_1e4(done: Rollout, relay: Relay, smollm2: Any, temperature: float) -> None:
    """The micro-batches floe serves, scored by SmolLM2 in fp32 through floe_bridge (tree
    mask, depth positions, each row at its call's temperature), give vLLM's log-probs
    within 1e-4; every loss row is a token vLLM sampled, with vLLM's log-prob as
    old_logprobs."""
    from floe_bridge.hf import score_logprobs
    from floe_bridge.torch_ops import to_tensors

    runs = [r for r in done.runs if r.temperature == temperature]
    want, sampled = vllm_logprobs(relay, runs)
    errs: list[tuple[float, float]] = []  # (|rescored - vLLM|, vLLM's log-prob)
    rows_checked = 0
    for step in done.steps:
        for mb in step.micro_batches:
            tb = to_tensors(mb)
            rows = tb.loss_rows()
            temps = tb.temperature[rows] if tb.temperature is not None else None
            assert temps is not None
            at_t = (temps - temperature).abs() < 1e-6
            if not bool(at_t.any()):
                continue
            got = score_logprobs(smollm2, tb, attn="sdpa")
            ids, pred = mb.input_ids.tolist(), mb.pred_idx.tolist()
            for j, row in enumerate(rows.tolist()):
                if not bool(at_t[j]):
                    continue
                ctx, k = [], pred[row]
                while k != -1:
                    ctx.append(ids[k])
                    k = pred[k]
                key = (tuple(reversed(ctx)), ids[row])
                assert want.get(key), f"row {row}: not a token vLLM sampled (or more rows than samples)"
                # each of vLLM's samples accounts for one row: take the one whose log-prob
                # this row carries, exact at float32
                old = float(tb.old_logprobs[row])
                match = [i for i, lp in enumerate(want[key]) if float(np.float32(lp)) == old]
                assert match, f"row {row}: old_logprobs {old} is none of vLLM's {want[key]}"
                lp = want[key].pop(match[0])
                errs.append((abs(float(got[j]) - lp), lp))
                rows_checked += 1
    assert rows_checked == sampled, (
        f"{rows_checked} loss rows at T={temperature}, vLLM sampled {sampled} tokens"
    )
    worst, at = max(errs)
    log(
        f"{done.floe.strategy} T={temperature}: max |rescored - vLLM| {worst:.3g} "
        f"(at a log-prob of {at:.2f}) over {rows_checked} tokens"
    )
    assert worst < RESCORE_ATOL
