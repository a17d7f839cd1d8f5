"""The official SDKs as clients of floe's proxy, in front of the reference inference server.

Each SDK holds a two-turn tool conversation — the model reasons and calls read_file, the
harness answers with the file, the model answers — streaming and not. Every call floe
records must carry exactly the prompt ids, sampled ids and log-probs the server generated,
and the second call's prompt must extend the first call's prompt + response token for
token: reasoning and tool calls survived the round trip through the SDK."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import floe_stack
from floe_stack import refserver_argv

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
genai = pytest.importorskip("google.genai")
from google.genai import types as gtypes  # noqa: E402

KEY = "sk-floe-e2e"
SESSION = "sess-e2e"
REASONING = "The user wants the file; I should read notes.txt first."
ANSWER = "The file says: hello from floe."
FILE_TEXT = "hello from floe"
SCRIPT = [
    {
        "reasoning": REASONING,
        "content": "Let me read it.",
        "tool_calls": [{"name": "read_file", "arguments": {"path": "notes.txt"}}],
    },
    {"content": ANSWER},
]
PARAMS = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


@dataclass
class Stack:
    proxy: str
    upstream: str
    calls_path: Path

    def push_script(self) -> None:
        _post(self.upstream + "/script", {"outputs": SCRIPT})

    def calls(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.calls_path.read_text().splitlines() if line.strip()]

    def generations(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.upstream + "/generations") as r:
            return json.load(r)["generations"]  # type: ignore[no-any-return]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def stack(floe_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("proxy")
    with floe_stack.Stack(tmp / "logs", grace=20) as procs:
        _, hello = procs.start_server(
            "refserver", refserver_argv("--port", "0", "--cache-dir", str(tmp / "tok"))
        )
        upstream = hello["base_url"].removesuffix("/v1")
        calls = tmp / "calls.jsonl"
        _, phello = procs.start_server(
            "proxy",
            [
                str(floe_bin),
                "proxy",
                "-proxy-addr",
                "127.0.0.1:0",
                "-control-addr",
                "127.0.0.1:0",
                "-upstream",
                upstream,
                "-session",
                f"{KEY}={SESSION}",
                "-record",
                str(calls),
            ],
        )
        yield Stack(phello["proxy"], upstream, calls)


def check_recorded(stack: Stack, before: int, n: int) -> list[dict[str, Any]]:
    """The last n recorded calls equal the last n generations, and chain."""
    calls = stack.calls()[before:]
    gens = stack.generations()[-n:]
    assert len(calls) == n, f"{len(calls)} calls recorded, want {n}"
    for c, g in zip(calls, gens, strict=True):
        assert c["session_id"] == SESSION and c["trainable"], c.get("untrainable_reason")
        assert c["prompt_ids"] == g["prompt_token_ids"]
        assert c["response_ids"] == g["token_ids"]
        assert c["logprobs"] == pytest.approx(g["logprobs"], rel=1e-6, abs=1e-6)
    first, second = calls[0], calls[1]
    history = first["prompt_ids"] + first["response_ids"]
    pairs = zip(second["prompt_ids"], history, strict=False)  # the prompt may be longer
    assert second["prompt_ids"][: len(history)] == history, (
        "the second prompt does not extend the first call token for token: "
        f"first difference at {next(i for i, (a, b) in enumerate(pairs) if a != b)}"
    )
    return calls


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat(stack: Stack, stream: bool) -> None:
    client = openai.OpenAI(base_url=stack.proxy + "/v1", api_key=KEY)
    tools = [
        {
            "type": "function",
            "function": {"name": "read_file", "description": "Read a file", "parameters": PARAMS},
        }
    ]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "What does notes.txt say?"}]
    before = len(stack.calls())
    stack.push_script()

    def ask() -> dict[str, Any]:
        if not stream:
            m = (
                client.chat.completions.create(model="gpt-floe", messages=messages, tools=tools)
                .choices[0]
                .message
            )
            return m.model_dump(exclude_none=True)
        msg: dict[str, Any] = {"role": "assistant", "content": "", "reasoning_content": ""}
        calls: dict[int, dict[str, Any]] = {}
        for chunk in client.chat.completions.create(
            model="gpt-floe", messages=messages, tools=tools, stream=True
        ):
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            msg["content"] += d.content or ""
            msg["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(
                    tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                c["id"] += tc.id or ""
                c["function"]["name"] += (tc.function.name or "") if tc.function else ""
                c["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
        if calls:
            msg["tool_calls"] = [calls[i] for i in sorted(calls)]
        return msg

    first = ask()
    call = first["tool_calls"][0]
    assert call["function"]["name"] == "read_file" and json.loads(call["function"]["arguments"]) == {
        "path": "notes.txt"
    }
    assert first["reasoning_content"].strip() == REASONING
    messages += [first, {"role": "tool", "tool_call_id": call["id"], "content": FILE_TEXT}]
    second = ask()
    assert second["content"].strip() == ANSWER
    check_recorded(stack, before, 2)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_responses(stack: Stack, stream: bool) -> None:
    client = openai.OpenAI(base_url=stack.proxy + "/v1", api_key=KEY)
    tools = [{"type": "function", "name": "read_file", "description": "Read a file", "parameters": PARAMS}]
    items: list[Any] = [{"role": "user", "content": "What does notes.txt say?"}]
    before = len(stack.calls())
    stack.push_script()

    def ask() -> Any:
        kw = dict(
            model="gpt-floe", instructions="You are a coding agent.", input=items, tools=tools, store=False
        )
        if not stream:
            return client.responses.create(**kw)
        with client.responses.stream(**kw) as s:
            for _ in s:
                pass
            return s.get_final_response()

    first = ask()
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "read_file" and json.loads(calls[0].arguments) == {"path": "notes.txt"}
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": FILE_TEXT})
    second = ask()
    assert second.output_text.strip() == ANSWER
    check_recorded(stack, before, 2)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages(stack: Stack, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=stack.proxy, api_key=KEY)
    tools = [{"name": "read_file", "description": "Read a file", "input_schema": PARAMS}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What does notes.txt say?"}]
    before = len(stack.calls())
    stack.push_script()

    def ask() -> Any:
        kw = dict(
            model="claude-floe",
            max_tokens=512,
            system="You are a coding agent.",
            tools=tools,
            messages=messages,
            thinking={"type": "enabled", "budget_tokens": 256},
        )
        if not stream:
            return client.messages.create(**kw)
        with client.messages.stream(**kw) as s:
            return s.get_final_message()

    first = ask()
    assert first.stop_reason == "tool_use"
    thinking = [b for b in first.content if b.type == "thinking"]
    use = [b for b in first.content if b.type == "tool_use"]
    assert thinking and thinking[0].thinking.strip() == REASONING
    assert use and use[0].name == "read_file" and use[0].input == {"path": "notes.txt"}
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": FILE_TEXT}],
        },
    ]
    second = ask()
    assert "".join(b.text for b in second.content if b.type == "text").strip() == ANSWER
    check_recorded(stack, before, 2)


@pytest.mark.parametrize("stream", [False, True])
def test_google_genai(stack: Stack, stream: bool) -> None:
    client = genai.Client(api_key=KEY, http_options=gtypes.HttpOptions(base_url=stack.proxy))
    decl = gtypes.FunctionDeclaration(
        name="read_file", description="Read a file", parameters_json_schema=PARAMS
    )
    config = gtypes.GenerateContentConfig(
        system_instruction="You are a coding agent.", tools=[gtypes.Tool(function_declarations=[decl])],
        thinking_config=gtypes.ThinkingConfig(include_thoughts=True),
        automatic_function_calling=gtypes.AutomaticFunctionCallingConfig(disable=True),
    )
    contents: list[Any] = [gtypes.Content(role="user", parts=[gtypes.Part(text="What does notes.txt say?")])]
    before = len(stack.calls())
    stack.push_script()

    def ask() -> gtypes.Content:
        if not stream:
            r = client.models.generate_content(model="gemini-floe", contents=contents, config=config)
            return r.candidates[0].content
        parts: list[gtypes.Part] = []
        for chunk in client.models.generate_content_stream(
            model="gemini-floe", contents=contents, config=config
        ):
            if chunk.candidates and chunk.candidates[0].content and chunk.candidates[0].content.parts:
                parts += chunk.candidates[0].content.parts
        return gtypes.Content(role="model", parts=parts)

    first = ask()
    fcs = [p.function_call for p in first.parts or [] if p.function_call]
    assert fcs and fcs[0].name == "read_file" and fcs[0].args == {"path": "notes.txt"}
    contents += [first, gtypes.Content(role="user", parts=[gtypes.Part.from_function_response(
        name="read_file", response={"content": FILE_TEXT})])]
    second = ask()
    text = "".join(p.text or "" for p in second.parts or [] if not p.thought)
    assert text.strip() == ANSWER
    check_recorded(stack, before, 2)


def test_streaming_and_not_record_the_same_call(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.proxy + "/v1", api_key=KEY)
    messages = [{"role": "user", "content": "Say it."}]
    before = len(stack.calls())
    for stream in (False, True):
        _post(stack.upstream + "/script", {"outputs": [{"reasoning": "short", "content": "It."}]})
        if stream:
            for _ in client.chat.completions.create(model="m", messages=messages, stream=True):
                pass
        else:
            client.chat.completions.create(model="m", messages=messages)
    a, b = stack.calls()[before:]
    for k in ("prompt_ids", "response_ids", "logprobs", "finish_reason", "trainable"):
        assert a[k] == b[k], k
