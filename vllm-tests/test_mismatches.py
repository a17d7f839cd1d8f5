"""The six places where floe and a real vLLM 0.32 were seen to disagree (issue 20, part
3), each through `floe serve` and the official SDKs against the real vLLM. The exact
bytes vLLM sent in each case are in vllm-tests/fixtures (capture.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from vllmstack import MAX_MODEL_LEN, Floe, Relay, Session, vllm_tokens

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

SYSTEM = "You are a coding agent. Answer briefly."
QUESTION = "What does notes.txt say?"
PARAMS = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "read_file", "description": "Read a file", "parameters": PARAMS},
    }
]
# " hello" is one SmolLM2 token: this many make a prompt longer than the window.
TOO_LONG = " hello" * (MAX_MODEL_LEN + 200)


@pytest.fixture(scope="module")
def floe(floe_serve: Callable[..., Floe]) -> Floe:
    return floe_serve("tree", group_size=1, min_group_size=1)


def chat_client(s: Session) -> Any:
    return openai.OpenAI(base_url=s.base_urls["openai"], api_key=s.key, max_retries=0)


def anthropic_client(s: Session) -> Any:
    return anthropic.Anthropic(base_url=s.base_urls["anthropic"], api_key=s.key, max_retries=0)


def only_call(floe: Floe, relay: Relay, s: Session) -> tuple[dict[str, Any], dict[str, Any]]:
    """The session's one recorded call and vLLM's answer to it (parsed)."""
    relay.wait_done()
    calls, sent = floe.calls(s), relay.chats(s.id)
    assert len(calls) == len(sent) == 1, f"{len(calls)} calls recorded, {len(sent)} sent to vLLM"
    return calls[0], json.loads(sent[0].response) if not sent[0].streamed else {"sse": sent[0].sse()}


# --- 1. non-streamed answers with reasoning ---------------------------------------------------


def test_nonstream_reasoning_chat(floe: Floe, relay: Relay) -> None:
    """vLLM 0.32 names it message.reasoning; the chat caller must get it (floe's
    reasoning_content), not an empty message."""
    s = floe.session("reasoning", "mm-reasoning-chat", 1)
    m = (
        chat_client(s)
        .chat.completions.create(
            model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=16, reasoning_effort="low"
        )
        .choices[0]
        .message
    )
    _, body = only_call(floe, relay, s)
    want = body["choices"][0]["message"]["reasoning"]
    assert want, "vLLM returned no reasoning: the test's premise (thinking on) failed"
    got = getattr(m, "reasoning_content", None) or getattr(m, "reasoning", None)
    assert got == want


def test_nonstream_reasoning_anthropic(floe: Floe, relay: Relay) -> None:
    s = floe.session("reasoning", "mm-reasoning-anthropic", 1)
    m = anthropic_client(s).messages.create(
        model="claude-floe",
        max_tokens=16,
        messages=[{"role": "user", "content": QUESTION}],
        thinking={"type": "enabled", "budget_tokens": 16},
    )
    _, body = only_call(floe, relay, s)
    want = body["choices"][0]["message"]["reasoning"]
    assert want
    assert [b.thinking for b in m.content if b.type == "thinking"] == [want]


def test_nonstream_reasoning_responses(floe: Floe, relay: Relay) -> None:
    s = floe.session("reasoning", "mm-reasoning-responses", 1)
    r = chat_client(s).responses.create(
        model="m", input=QUESTION, max_output_tokens=16, reasoning={"effort": "low"}, store=False
    )
    _, body = only_call(floe, relay, s)
    want = body["choices"][0]["message"]["reasoning"]
    assert want
    texts = [
        p.text for o in r.output if o.type == "reasoning" for p in [*(o.summary or []), *(o.content or [])]
    ]
    assert texts == [want], f"output {r.output!r}, status {r.status}"


# --- 2. constrained decoding -------------------------------------------------------------------


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "read_file"}}],
    ids=["required", "named"],
)
def test_constrained_decoding_not_trained_as_free(
    floe: Floe, relay: Relay, smollm2: Any, tool_choice: Any
) -> None:
    """With tool_choice required or a named function, vLLM samples from the grammar-masked
    distribution and reports its log-probs; the model's own differ by nats. floe must not
    record such a call as an ordinary trainable one: untrainable with a reason, or flagged
    in its sampling record."""
    import torch

    s = floe.session(
        "constrained", f"mm-constrained-{tool_choice if isinstance(tool_choice, str) else 'named'}", 1
    )
    chat_client(s).chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        tools=CHAT_TOOLS,
        tool_choice=tool_choice,
        max_tokens=24,
    )
    relay.wait_done()
    c = floe.calls(s)[0]
    prompt, ids, lps, _ = vllm_tokens(relay.chats(s.id)[0])
    # The premise: these log-probs are not the model's. SmolLM2 scores the same tokens
    # freely; the largest gap is nats (1e-4 on free calls, test_sdk.py).
    with torch.no_grad():
        logits = smollm2(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    free = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
    gap = float((free - torch.tensor(lps, dtype=torch.float64)).abs().max())
    assert gap > 1.0, f"vLLM's log-probs are within {gap:.3g} of the free model's: not constrained?"
    flagged = set(c.get("sampling") or {}) - {"temperature", "top_p", "top_k"}
    assert not c["trainable"] or flagged, (
        f"a call sampled under tool_choice={tool_choice!r} is recorded trainable and unflagged, "
        f"its log-probs up to {gap:.1f} nats from the model's"
    )


# --- 3. context-length errors ------------------------------------------------------------------


def test_prompt_too_long_anthropic(floe: Floe) -> None:
    s = floe.session("context", "mm-context-anthropic", 1)
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client(s).messages.create(
            model="claude-floe", max_tokens=16, messages=[{"role": "user", "content": TOO_LONG}]
        )
    msg = e.value.body["error"]["message"]
    assert msg.startswith("prompt is too long: ") and msg.endswith(f" > {MAX_MODEL_LEN} maximum"), msg


def test_prompt_too_long_chat(floe: Floe) -> None:
    s = floe.session("context", "mm-context-chat", 1)
    with pytest.raises(openai.BadRequestError) as e:
        chat_client(s).chat.completions.create(
            model="m", max_tokens=16, messages=[{"role": "user", "content": TOO_LONG}]
        )
    assert e.value.code == "context_length_exceeded", e.value.body
    assert (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your messages resulted in"
        in str(e.value.body)
    )


def test_max_tokens_over_window_anthropic(floe: Floe) -> None:
    """Claude Code asks for max_tokens 32000 and lowers it only on this wording."""
    s = floe.session("context", "mm-max-tokens-anthropic", 1)
    with pytest.raises(anthropic.BadRequestError) as e:
        # an explicit timeout: without one the SDK refuses a non-streamed call with this
        # max_tokens before sending it ("Streaming is required ...")
        anthropic_client(s).messages.create(
            model="claude-floe",
            max_tokens=MAX_MODEL_LEN + 1,
            messages=[{"role": "user", "content": QUESTION}],
            timeout=120,
        )
    msg = e.value.body["error"]["message"]
    # Claude Code reads the numbers: "… exceed context limit: P + T > C" (anything may follow)
    m = re.match(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)", msg)
    assert m, msg
    assert (int(m[2]), int(m[3])) == (MAX_MODEL_LEN + 1, MAX_MODEL_LEN), msg


def test_max_tokens_over_window_chat(floe: Floe) -> None:
    s = floe.session("context", "mm-max-tokens-chat", 1)
    with pytest.raises(openai.BadRequestError) as e:
        chat_client(s).chat.completions.create(
            model="m", max_tokens=MAX_MODEL_LEN + 1, messages=[{"role": "user", "content": QUESTION}]
        )
    assert e.value.code == "context_length_exceeded", e.value.body


# --- 4. Anthropic stop_sequences ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_stop_sequence(floe: Floe, relay: Relay, stream: bool) -> None:
    s = floe.session("stop", f"mm-stop-{stream}", 1)
    kw: dict[str, Any] = dict(
        model="claude-floe",
        max_tokens=48,
        messages=[{"role": "user", "content": QUESTION}],
        stop_sequences=["e"],
    )
    if stream:
        with anthropic_client(s).messages.stream(**kw) as st:
            m = st.get_final_message()
    else:
        m = anthropic_client(s).messages.create(**kw)
    relay.wait_done()
    ex = relay.chats(s.id)[0]
    chunks = ex.sse() if ex.streamed else [ex.response_json()]
    stop_reasons = [
        ch.get("stop_reason") for c in chunks for ch in c.get("choices") or [] if ch.get("finish_reason")
    ]
    assert stop_reasons == ["e"], f"the premise failed: vLLM did not stop on 'e' ({stop_reasons})"
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "e")


# --- 5. count_tokens with reasoning in history -------------------------------------------------


def test_count_tokens_with_thinking(floe: Floe, relay: Relay) -> None:
    """count_tokens on a history with a thinking block counts what the model will be
    given: the prompt of the same messages sent as a call."""
    s = floe.session("count", "mm-count", 1)
    client = anthropic_client(s)
    # streamed, so that the thinking block is there whatever becomes of item 1
    with client.messages.stream(
        model="claude-floe",
        max_tokens=16,
        messages=[{"role": "user", "content": QUESTION}],
        thinking={"type": "enabled", "budget_tokens": 16},
    ) as st:
        first = st.get_final_message()
    history: list[dict[str, Any]] = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": "Go on."},
    ]
    assert any(b["type"] == "thinking" for b in history[1]["content"]), "no thinking block: premise failed"
    counted = client.messages.count_tokens(
        model="claude-floe", messages=history, thinking={"type": "enabled", "budget_tokens": 16}
    ).input_tokens
    client.messages.create(
        model="claude-floe", max_tokens=1, messages=history, thinking={"type": "enabled", "budget_tokens": 16}
    )
    relay.wait_done()
    prompt, _, _, _ = vllm_tokens(relay.chats(s.id)[-1])
    assert counted == len(prompt)


# --- 6. a stop string inside a token -----------------------------------------------------------


def test_stop_string_records_exact(floe: Floe, relay: Relay) -> None:
    """vLLM cuts the text at the stop string but its ids keep the whole last token. The
    call is recorded with vLLM's ids and log-probs, and the next turn, whose history holds
    the cut text, is recorded exactly too (its prompt as vLLM tokenized it)."""
    s = floe.session("stop-string", "mm-stop-string", 1)
    client = chat_client(s)
    msgs: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model="m", messages=msgs, max_tokens=48, stop=["e"]).choices[0]
    relay.wait_done()
    body = relay.chats(s.id)[0].response_json()
    assert body["choices"][0]["stop_reason"] == "e", "the premise failed: vLLM did not stop on 'e'"
    msgs += [{"role": "assistant", "content": first.message.content}, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
    relay.wait_done()
    calls, sent = floe.calls(s), relay.chats(s.id)
    assert len(calls) == len(sent) == 2
    for c, ex in zip(calls, sent, strict=True):
        prompt, ids, lps, _ = vllm_tokens(ex)
        assert c["trainable"], c.get("untrainable_reason")
        assert (c["prompt_ids"], c["response_ids"]) == (prompt, ids)
        assert np.array_equal(np.asarray(c["logprobs"], np.float32), np.asarray(lps, np.float32))
    # The cut text re-tokenizes differently from the ids sampled: the second prompt does
    # not extend the first call token for token, which is what floe's drift handling sees.
    a, b = calls
    h = a["prompt_ids"] + a["response_ids"]
    assert b["prompt_ids"][: len(h)] != h, "no drift: the stop string did not cut inside a token"
