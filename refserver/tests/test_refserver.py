"""The reference inference server (floe_refserver): tokenizer, chat template, and the
vLLM wire format over HTTP against a real subprocess."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from floe_refserver import (
    build_model,
    load_tokenizer,
    render,
    render_assistant_turn,
    tokenizer_json_path,
    train_tokenizer,
)
from floe_refserver.tokenizer import token_bytes
from floe_stack import Child, Stack, refserver_argv

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a time zone.",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
]

USER: Any = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather and time in Paris?"},
]

# A scripted output with reasoning, content, two tool calls and non-ASCII text.
TOOL_OUTPUT: Any = {
    "reasoning": "Two lookups: weather, then time.",
    "content": "Checking — un instant.",
    "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris", "units": ["c", "f"]}},
        {"name": "get_time", "arguments": {"tz": "Europe/Paris"}},
    ],
}


# --- fixtures --------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("refserver-cache")


@pytest.fixture(scope="module")
def tok(cache_dir: Path) -> Any:
    return load_tokenizer(cache_dir)


def stop_cleanly(st: Stack, child: Child) -> None:
    """SIGTERM must end the server with exit 0 within the grace period."""
    rc = st.stop(child)
    if child.killed:
        pytest.fail("refserver did not exit on SIGTERM")
    assert rc == 0, child.tail(50)


@pytest.fixture(scope="module")
def server(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A refserver subprocess on a free port; yields its base URL (…/v1). Teardown sends
    SIGTERM and requires a clean exit."""
    with Stack(tmp_path_factory.mktemp("refserver-logs"), grace=20) as st:
        try:
            proc, hello = st.start_server(
                "refserver", refserver_argv("--port", "0", "--cache-dir", str(cache_dir))
            )
        except RuntimeError as e:
            pytest.fail(f"refserver did not start: {e}")
        yield hello["base_url"]
        stop_cleanly(st, proc)


def root(base: str) -> str:
    return base.removesuffix("/v1")


def call(method: str, url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read()
            return r.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, body: Any) -> Any:
    status, out = call("POST", url, body)
    assert status == 200, out
    return out


def stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE events of a streaming chat completion, up to and checking [DONE]."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    events: list[dict[str, Any]] = []
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        payload = r.read().decode()
    blocks = [b for b in payload.split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") for b in blocks), blocks
    assert blocks[-1] == "data: [DONE]"
    for b in blocks[:-1]:
        events.append(json.loads(b[len("data: ") :]))
    return events


def script(base: str, *outputs: dict[str, Any]) -> None:
    assert call("DELETE", root(base) + "/script")[0] == 200
    out = post(root(base) + "/script", {"outputs": list(outputs)})
    assert out["remaining"] == len(outputs)


def chat_body(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "floe-ref",
        "messages": USER,
        "tools": TOOLS,
        "logprobs": True,
        "return_token_ids": True,
        "max_tokens": 200,
    }
    body.update(kw)
    return body


def reassemble(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Token ids, log-probs, message and finish reason of choice 0 rebuilt from chunks."""
    ids: list[int] = []
    lps: list[float] = []
    content, reasoning = "", ""
    calls: list[dict[str, Any]] = []
    finish = None
    for ev in events:
        for ch in ev["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            reasoning += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                if "id" in tc:
                    assert tc["index"] == len(calls) and tc["type"] == "function"
                    assert tc["function"]["arguments"] == ""
                    calls.append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
                else:
                    assert set(tc["function"]) == {"arguments"}
                    calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
            if "token_ids" in ch and ch["token_ids"] is not None:
                assert ch["logprobs"] is not None and len(ch["logprobs"]["content"]) == len(ch["token_ids"])
                ids += ch["token_ids"]
                lps += [e["logprob"] for e in ch["logprobs"]["content"]]
            if ch["finish_reason"] is not None:
                finish = ch["finish_reason"]
    return {
        "ids": ids,
        "logprobs": lps,
        "content": content or None,
        "reasoning": reasoning or None,
        "tool_calls": [(c["name"], c["arguments"]) for c in calls],
        "finish": finish,
    }


# --- tokenizer and template --------------------------------------------------------


def test_tokenizer_deterministic_and_cached(tmp_path: Path) -> None:
    a, b = train_tokenizer(), train_tokenizer()
    assert a.to_str() == b.to_str()
    assert 4000 <= a.get_vocab_size() <= 8200
    p = tokenizer_json_path(tmp_path)
    assert p.is_file() and p.parent.parent == tmp_path
    mtime = p.stat().st_mtime_ns
    assert tokenizer_json_path(tmp_path) == p and p.stat().st_mtime_ns == mtime  # reused, not retrained
    tok = load_tokenizer(tmp_path)
    for t in [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    ]:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    text = "def f(x):\n    return {'ü': x}  # naïve 🙂"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def write_byte_tokenizer(directory: Path) -> None:
    """A model-like tokenizer.json with none of the server's tokens: byte-level, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bt = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    bt.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bt.decoder = decoders.ByteLevel()
    directory.mkdir(parents=True, exist_ok=True)
    bt.save(str(directory / "tokenizer.json"))


def test_tokenizer_from_a_model_directory(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path / "bytes")
    tok = load_tokenizer(tokenizer_dir=tmp_path / "bytes")
    markup = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
    # The 256 bytes keep their ids; the ChatML and markup tokens follow, in order.
    assert len(tok) == 256 + 3 + len(markup)
    added = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *markup]
    assert tok.convert_tokens_to_ids(added) == list(range(256, 256 + len(added)))
    text = render(tok, [{"role": "user", "content": "naïve 🙂 <think>x</think>"}])
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids("<think>")) == 1 and ids[0] == 257
    assert b"".join(token_bytes(tok, i) for i in ids).decode() == text
    # The shipped BPE's own tokens keep their ids when a directory holds it.
    (tmp_path / "shipped").mkdir()
    (tmp_path / "shipped" / "tokenizer.json").write_text(tokenizer_json_path(tmp_path / "cache").read_text())
    shipped, again = load_tokenizer(tmp_path / "cache"), load_tokenizer(tokenizer_dir=tmp_path / "shipped")
    assert again.get_vocab() == shipped.get_vocab()


@pytest.mark.parametrize(
    ("make", "want"),
    [
        (lambda d: None, "not a directory"),
        (lambda d: d.mkdir(), "no tokenizer.json"),
        (lambda d: (d.mkdir(), (d / "tokenizer.json").write_text("{not json")), "does not load"),
    ],
    ids=["missing", "empty", "corrupt"],
)
def test_tokenizer_directory_errors(tmp_path: Path, make: Any, want: str) -> None:
    d = tmp_path / "tok"
    make(d)
    with pytest.raises(ValueError, match=want) as e:
        load_tokenizer(tokenizer_dir=d)
    assert str(d) in str(e.value)


def test_chat_template_tool_conversation(tok: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "\nNeed the weather tool.\n",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
        {"role": "assistant", "content": "18C and sunny.", "reasoning_content": "Answer directly."},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]
    tools_json = "\n".join(json.dumps(t) for t in TOOLS)
    expected = (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions to assist "
        "with the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
        f"tags:\n<tools>\n{tools_json}\n</tools>\n\nFor each function call, return a json object with "
        "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nNeed the weather tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAnswer directly.\n</think>\n\n18C and sunny.<|im_end|>\n"
        "<|im_start|>user\nAnd tomorrow?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(tok, messages, TOOLS) == expected
    no_think = render(tok, messages, TOOLS, enable_thinking=False)
    assert no_think == expected + "<think>\n\n</think>\n\n"
    # Arguments as a JSON string (what clients send back) render the same.
    msgs2 = json.loads(json.dumps(messages))
    msgs2[2]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
    assert render(tok, msgs2, TOOLS) == expected


# --- the server ------------------------------------------------------------------------


def test_models_and_errors(server: str) -> None:
    status, models = call("GET", server + "/models")
    assert status == 200 and models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == "floe-ref" and card["object"] == "model" and card["max_model_len"] == 4096
    assert card["owned_by"] == "floe"

    status, err = call("POST", server + "/chat/completions", raw=b"{not json")
    assert status == 400 and err["object"] == "error" and err["type"] == "BadRequestError"
    assert err["code"] == 400 and err["param"] is None
    assert call("GET", server + "/nope")[0] == 404

    body = chat_body(max_tokens=4096)
    n_prompt = post(root(server) + "/tokenize", {"model": "floe-ref", "messages": USER, "tools": TOOLS})[
        "count"
    ]
    status, err = call("POST", server + "/chat/completions", body)
    assert status == 400
    assert err == {
        "object": "error",
        "message": (
            "This model's maximum context length is 4096 tokens. However, you requested "
            f"{n_prompt + 4096} tokens ({n_prompt} in the messages, 4096 in the completion). "
            "Please reduce the length of the messages or completion."
        ),
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


def test_script_mode_token_faithful(server: str, tok: Any) -> None:
    script(server, TOOL_OUTPUT)
    res = post(server + "/chat/completions", chat_body(top_logprobs=3))
    assert call("GET", root(server) + "/script")[1] == {"remaining": 0, "held": 0}
    ch = res["choices"][0]
    rendered = render_assistant_turn(
        tok,
        {
            "role": "assistant",
            "content": TOOL_OUTPUT["content"],
            "reasoning_content": TOOL_OUTPUT["reasoning"],
            "tool_calls": [{"type": "function", "function": c} for c in TOOL_OUTPUT["tool_calls"]],
        },
    )
    assert rendered.startswith("<think>\n") and rendered.endswith("</tool_call><|im_end|>")
    ids = ch["token_ids"]
    assert tok.decode(ids) == rendered
    assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")

    # The prompt is exactly what /tokenize renders; usage counts agree.
    prompt_ids = res["prompt_token_ids"]
    tk = post(root(server) + "/tokenize", {"model": "floe-ref", "messages": USER, "tools": TOOLS})
    assert prompt_ids == tk["tokens"] and tk["count"] == len(prompt_ids) and tk["max_model_len"] == 4096
    assert res["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt_ids) + len(ids),
        "prompt_tokens_details": None,
    }
    assert post(root(server) + "/detokenize", {"tokens": ids})["prompt"] == rendered

    # Log-probs: the seeded model's own, teacher-forced, computed here independently.
    model = build_model(len(tok), seed=0, max_model_len=4096)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + ids])).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)[len(prompt_ids) - 1 : -1]
    want = logp.gather(1, torch.tensor(ids)[:, None])[:, 0]
    got = torch.tensor([e["logprob"] for e in ch["logprobs"]["content"]], dtype=torch.float64)
    assert len(got) == len(ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    for row, e, tid in zip(logp, ch["logprobs"]["content"], ids, strict=True):
        assert e["token"] == tok.decode([tid])
        assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(
            torch.topk(row, 3).values.tolist(), abs=1e-5
        )
    assert bytes(sum((e["bytes"] for e in ch["logprobs"]["content"]), [])).decode() == rendered

    # Parsed: reasoning separated, content before the first call, tool calls with arguments.
    msg = ch["message"]
    assert ch["finish_reason"] == "tool_calls" and ch["stop_reason"] is None
    assert msg["role"] == "assistant"
    assert msg["reasoning_content"].strip("\n") == TOOL_OUTPUT["reasoning"]
    assert msg["content"].strip() == TOOL_OUTPUT["content"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        (c["name"], c["arguments"]) for c in TOOL_OUTPUT["tool_calls"]
    ]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in msg["tool_calls"])
    # Rendering the returned message back reproduces the sampled text exactly.
    back = dict(msg)
    back["tool_calls"] = [dict(c) for c in msg["tool_calls"]]
    assert render_assistant_turn(tok, back) == rendered


def test_stream_matches_non_stream(server: str, tok: Any) -> None:
    plain_out = {"content": "Plain answer, no tools: 3 × 4 = 12."}
    for out in (TOOL_OUTPUT, plain_out):
        script(server, out, out)
        full = post(server + "/chat/completions", chat_body())
        events = stream(
            server + "/chat/completions", chat_body(stream=True, stream_options={"include_usage": True})
        )
        ch = full["choices"][0]

        first = events[0]
        assert first["object"] == "chat.completion.chunk"
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert first["prompt_token_ids"] == full["prompt_token_ids"]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(
            ch["token_ids"]
        )
        assert len({e["id"] for e in events}) == 1

        got = reassemble(events)
        assert got["ids"] == ch["token_ids"]
        assert got["logprobs"] == pytest.approx([e["logprob"] for e in ch["logprobs"]["content"]], abs=1e-6)
        assert got["content"] == ch["message"]["content"]
        assert got["reasoning"] == ch["message"]["reasoning_content"]
        assert got["tool_calls"] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in ch["message"]["tool_calls"]
        ]
        assert got["finish"] == ch["finish_reason"]
        # one chunk per token: a token that shows nothing still carries its id and log-prob
        per_token = [e for e in events[1:-1]]
        assert all(len(e["choices"][0]["token_ids"]) == 1 for e in per_token)
        assert len(per_token) == len(ch["token_ids"])
        assert per_token[-1]["choices"][0]["finish_reason"] == ch["finish_reason"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert per_token[-1]["choices"][0]["token_ids"] == [im_end] and per_token[-1]["choices"][0]["delta"] == {}


def test_sampling_mode(server: str, tok: Any) -> None:
    assert call("DELETE", root(server) + "/script")[0] == 200
    res = post(
        server + "/chat/completions", chat_body(max_tokens=12, temperature=1.0, seed=7, top_logprobs=2)
    )
    ch = res["choices"][0]
    ids = ch["token_ids"]
    lps = [e["logprob"] for e in ch["logprobs"]["content"]]
    assert len(ids) == len(lps) <= 12 and all(0 <= i < len(tok) for i in ids)
    assert all(lp <= 0 for lp in lps)
    if ch["finish_reason"] != "tool_calls":
        assert ch["finish_reason"] == "length" and len(ids) == 12
    # same seed, same tokens; streaming gives the same sample
    again = post(server + "/chat/completions", chat_body(max_tokens=12, temperature=1.0, seed=7))
    assert again["choices"][0]["token_ids"] == ids
    events = stream(
        server + "/chat/completions", chat_body(max_tokens=12, temperature=1.0, seed=7, stream=True)
    )
    assert reassemble(events)["ids"] == ids
    # greedy decoding agrees with teacher forcing's argmax
    tops = post(server + "/chat/completions", chat_body(max_tokens=5, temperature=0, top_logprobs=1))
    for e in tops["choices"][0]["logprobs"]["content"]:
        assert e["token"] == e["top_logprobs"][0]["token"]
        assert e["logprob"] == pytest.approx(e["top_logprobs"][0]["logprob"], abs=1e-6)


def test_openai_sdk(server: str) -> None:
    client = openai.OpenAI(base_url=server, api_key="x")
    script(server, TOOL_OUTPUT, TOOL_OUTPUT)
    extra = {"return_token_ids": True}
    res = client.chat.completions.create(
        model="floe-ref", messages=USER, tools=TOOLS, logprobs=True, max_tokens=200, extra_body=extra
    )
    ch = res.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert [
        (t.function.name, json.loads(t.function.arguments))
        for t in ch.message.tool_calls or []
        if t.type == "function"
    ] == [(c["name"], c["arguments"]) for c in TOOL_OUTPUT["tool_calls"]]
    assert ch.logprobs is not None and ch.logprobs.content is not None
    ids = (ch.model_extra or {})["token_ids"]
    assert len(ids) == len(ch.logprobs.content)
    assert (res.model_extra or {})["prompt_token_ids"]
    assert (ch.message.model_extra or {})["reasoning_content"].strip() == TOOL_OUTPUT["reasoning"]

    chunks = list(
        client.chat.completions.create(
            model="floe-ref",
            messages=USER,
            tools=TOOLS,
            logprobs=True,
            max_tokens=200,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    sids: list[int] = []
    for c in chunks:
        for choice in c.choices:
            sids += (choice.model_extra or {}).get("token_ids") or []
            for tc in choice.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names[tc.index] = tc.function.name
                args[tc.index] = args.get(tc.index, "") + ((tc.function and tc.function.arguments) or "")
    assert sids == ids
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == [
        (c["name"], c["arguments"]) for c in TOOL_OUTPUT["tool_calls"]
    ]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ids)


def test_script_file_and_n(tmp_path: Path, cache_dir: Path, tok: Any) -> None:
    """--script preloads the queue; n>1 pops one output per choice; "finish": "length"
    leaves the turn open."""
    path = tmp_path / "script.json"
    path.write_text(json.dumps([{"content": "one"}, {"content": "two", "finish": "length"}]))
    argv = refserver_argv(
        "--port", "0", "--cache-dir", str(cache_dir), "--script", str(path), "--model-name", "m2",
        "--max-model-len", "512",
    )
    with Stack(tmp_path / "logs", grace=20) as st:
        proc, hello = st.start_server("refserver", argv)
        base = hello["base_url"]
        assert call("GET", root(base) + "/script")[1] == {"remaining": 2, "held": 0}
        res = post(
            base + "/chat/completions", {"model": "m2", "messages": USER, "n": 2, "return_token_ids": True}
        )
        a, b = res["choices"]
        assert (a["message"]["content"], a["finish_reason"]) == ("one", "stop")
        assert (b["message"]["content"], b["finish_reason"]) == ("two", "length")
        assert tok.decode(b["token_ids"]) == "two"
        assert res["model"] == "m2"
        status, err = call("POST", base + "/chat/completions", {"model": "other", "messages": USER})
        assert status == 404 and err["type"] == "NotFoundError"
        stop_cleanly(st, proc)


if os.environ.get("FLOE_REFSERVER_TIMINGS"):  # pragma: no cover - manual measurement aid

    def test_timings(server: str) -> None:
        script(server, {"content": "x " * 400})
        t = time.monotonic()
        events = stream(server + "/chat/completions", chat_body(stream=True, max_tokens=1000))
        dt = time.monotonic() - t
        print(f"\nscripted stream: {len(events) - 1} token chunks in {dt:.3f}s")
        t = time.monotonic()
        post(server + "/chat/completions", chat_body(max_tokens=200, temperature=1.0))
        print(f"sampling 200 tokens: {time.monotonic() - t:.3f}s")


def test_script_match_skips_side_calls(server: str) -> None:
    """An output with "match" waits for a request offering its tool; other requests (a
    harness's title or summary calls) fall through to sampling."""
    base = server.removesuffix("/v1")
    post(
        base + "/script",
        {"outputs": [{"content": "for the agent", "match": {"tool": "Read", "contains": "notes"}}]},
    )
    side = post(server + "/chat/completions", {"model": "floe-ref", "max_tokens": 4,
                "messages": [{"role": "user", "content": "title for this chat"}]})
    assert side["choices"][0]["message"]["content"] != "for the agent"
    tool = {"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}}
    main = post(server + "/chat/completions", {"model": "floe-ref", "tools": [tool],
                "messages": [{"role": "user", "content": "read notes"}]})
    assert main["choices"][0]["message"]["content"] == "for the agent"


def test_script_hold_waits_for_release(server: str) -> None:
    """An output with "hold" answers only after POST /script/release: a test can act (pause
    floe) while the call is known to be upstream. DELETE /script releases too."""
    from concurrent.futures import ThreadPoolExecutor

    base = server.removesuffix("/v1")
    body = {"model": "floe-ref", "max_tokens": 4, "messages": USER}
    for let_go in ("/script/release", "/script"):
        post(base + "/script", {"outputs": [{"content": "held", "hold": True}]})
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, server + "/chat/completions", body)
            deadline = time.monotonic() + 60  # a hang guard, not a measure
            while call("GET", base + "/script")[1] != {"remaining": 0, "held": 1}:
                assert time.monotonic() < deadline, "the request never took the held output"
                time.sleep(0.05)
            assert not answer.done(), "a held output answered before its release"
            if let_go == "/script/release":
                assert post(base + let_go, {}) == {"released": 1}
            else:
                assert call("DELETE", base + let_go)[0] == 200
            assert answer.result(timeout=60)["choices"][0]["message"]["content"] == "held"
        assert call("GET", base + "/script")[1] == {"remaining": 0, "held": 0}
    status, err = call("POST", base + "/script", {"outputs": [{"content": "x", "hold": "yes"}]})
    assert status == 400 and "hold" in json.dumps(err)


def test_sampling_at_a_temperature_returns_processed_logprobs(server: str, tok: Any) -> None:
    """Issue 13 item 5: sampled at T = 0.7, each token's log-prob is the one it was drawn
    with, log_softmax(logits / 0.7) (vLLM's processed_logprobs), recomputed here by teacher
    forcing the seeded model; at T = 1 they are the raw ones."""
    assert call("DELETE", root(server) + "/script")[0] == 200
    model = build_model(len(tok), seed=0, max_model_len=4096)
    for temp in (0.7, 1.0):
        res = post(
            server + "/chat/completions", chat_body(max_tokens=10, temperature=temp, seed=11, top_logprobs=2)
        )
        ch = res["choices"][0]
        prompt_ids, ids = res["prompt_token_ids"], ch["token_ids"]
        got = torch.tensor([e["logprob"] for e in ch["logprobs"]["content"]], dtype=torch.float64)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids + ids])).logits[0].double()
        rows = logits[len(prompt_ids) - 1 : -1]
        want = torch.log_softmax(rows / temp, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (temp, (got - want).abs().max())
        if temp != 1.0:
            raw = torch.log_softmax(rows, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
            assert float((got - raw).abs().max()) > 1e-2
