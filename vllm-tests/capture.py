"""Captures what a real vLLM (0.32, SmolLM2, vllm_argv's flags) answers in the cases
where floe and vLLM were seen to disagree (issue 20, part 3), byte for byte, through the
recording relay, into vllm-tests/fixtures/NAME.json: the request floe's vLLM engine
would send (logprobs and return_token_ids on), the status, the content type and the
answer's bytes as text. Go unit tests can replay them as a fake upstream.

    .venv/bin/python vllm-tests/capture.py                 # starts vLLM, captures, stops it
    FLOE_VLLM_URL=http://127.0.0.1:8123 .venv/bin/python vllm-tests/capture.py
    .venv/bin/python vllm-tests/capture.py --serve --port 8123   # only start vLLM and keep it
    FLOE_VLLM_URL=… .venv/bin/python vllm-tests/capture.py stop-sequence   # only these scenarios

(context-prompt-plus-max-tokens prefills a 31.8k-token prompt: about 4 minutes here.)

No request carries a seed: in vLLM 0.32's CPU build a seeded request whose prompt is
prefilled in chunks kills the engine ("CPU Generator does not use offset", docs/vllm.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllmstack import HERE, MAX_MODEL_LEN, SERVED, Exchange, Relay, log, start_vllm  # noqa: E402

FIXTURES = HERE / "fixtures"
SYSTEM = {"role": "system", "content": "You are a coding agent."}
USER = {"role": "user", "content": "What does notes.txt say?"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]
# An assistant turn with reasoning in history, under both names vLLM has used for it.
HISTORY = [
    SYSTEM,
    USER,
    {
        "role": "assistant",
        "content": "Let me read it.",
        "reasoning_content": "The user wants the file. I should read notes.txt first, then answer.",
    },
    {"role": "user", "content": "Go on."},
]


def chat(**kw: Any) -> dict[str, Any]:
    """A chat request as floe's vLLM engine sends it (proxy/vllm/vllm.go)."""
    body: dict[str, Any] = {
        "model": SERVED,
        "messages": [SYSTEM, USER],
        "max_tokens": 16,
        "logprobs": True,
        "return_token_ids": True,
    }
    body.update(kw)
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    return body


def long_text(tokens: int) -> str:
    # " hello" is one token of SmolLM2's BPE: the prompt is about this many tokens long.
    return " hello" * tokens


def scenarios() -> list[tuple[str, str, dict[str, Any]]]:
    """(fixture name, path, request body)."""
    think = {"enable_thinking": True}
    return [
        # 1. a non-streamed answer whose text is reasoning: vLLM 0.32 names it `reasoning`
        ("reasoning-nonstream", "/v1/chat/completions", chat(chat_template_kwargs=think)),
        ("reasoning-stream", "/v1/chat/completions", chat(chat_template_kwargs=think, stream=True)),
        # 2. constrained decoding: tool_choice required / a named function / structured output;
        # vLLM's processed log-probs are those of the grammar-masked distribution
        (
            "tool-choice-required",
            "/v1/chat/completions",
            chat(tools=TOOLS, tool_choice="required", max_tokens=24),
        ),
        (
            "tool-choice-named",
            "/v1/chat/completions",
            chat(
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "read_file"}},
                max_tokens=24,
            ),
        ),
        ("tool-choice-auto", "/v1/chat/completions", chat(tools=TOOLS, max_tokens=24)),
        # 3. context length: a prompt over the window, and max_tokens over it
        (
            "context-prompt-too-long",
            "/v1/chat/completions",
            chat(messages=[SYSTEM, {"role": "user", "content": long_text(MAX_MODEL_LEN + 500)}]),
        ),
        (
            "context-prompt-plus-max-tokens",
            "/v1/chat/completions",
            chat(
                messages=[SYSTEM, {"role": "user", "content": long_text(MAX_MODEL_LEN - 1000)}],
                max_tokens=4000,
            ),
        ),
        ("context-max-tokens-over-window", "/v1/chat/completions", chat(max_tokens=MAX_MODEL_LEN + 1)),
        # 4. stop sequences (Anthropic stop_sequences -> chat stop): finish_reason stop,
        # stop_reason the string matched
        ("stop-sequence", "/v1/chat/completions", chat(stop=["e"], max_tokens=32)),
        ("stop-sequence-stream", "/v1/chat/completions", chat(stop=["e"], max_tokens=32, stream=True)),
        # 5. count_tokens: /tokenize against the chat's usage.prompt_tokens, reasoning in history
        (
            "tokenize-reasoning-history",
            "/tokenize",
            {"model": SERVED, "messages": HISTORY, "add_generation_prompt": True},
        ),
        ("chat-reasoning-history", "/v1/chat/completions", chat(messages=HISTORY, max_tokens=1)),
        (
            "tokenize-reasoning-field-history",
            "/tokenize",
            {
                "model": SERVED,
                "add_generation_prompt": True,
                "messages": [
                    {**m, "reasoning": m.pop("reasoning_content")} if "reasoning_content" in m else m
                    for m in [dict(x) for x in HISTORY]
                ],
            },
        ),
        # 6. a stop string inside a token: the text is cut, the ids keep the whole token
        # ("e" cuts SmolLM2's first token here: "Note" is one token, the text says "Not")
        ("stop-string-mid-token", "/v1/chat/completions", chat(messages=HISTORY, stop=["e"], max_tokens=48)),
    ]


def post(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
    except urllib.error.HTTPError as e:
        e.read()


def record(name: str, ex: Exchange) -> Path:
    req = ex.request_json()
    for m in req.get("messages") or []:  # keep the fixture small: the long prompts are " hello" * N
        c = m.get("content")
        if isinstance(c, str) and len(c) > 1000 and c == long_text(len(c) // 6):
            m["content"] = {"floe_fixture_repeat": " hello", "times": len(c) // 6}
    out = {
        "scenario": name,
        "vllm": "0.32.0+cpu",
        "model": SERVED,
        "max_model_len": MAX_MODEL_LEN,
        "method": ex.method,
        "path": ex.path,
        "request": req,
        "status": ex.status,
        "content_type": ex.content_type,
        "response": ex.response.decode(),
    }
    FIXTURES.mkdir(exist_ok=True)
    path = FIXTURES / f"{name}.json"
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    return path


def capture(url: str, only: list[str]) -> None:
    relay = Relay(url).start()
    try:
        for name, path, body in scenarios():
            if only and name not in only:
                continue
            mark = relay.mark()
            post(relay.url + path, body)
            relay.wait_done()
            (ex,) = relay.since(mark)
            p = record(name, ex)
            log(f"{name}: {ex.status} {len(ex.response)} bytes -> {p.relative_to(HERE.parent)}")
    finally:
        relay.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", action="store_true", help="start vLLM and keep it running until interrupted")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--log", type=Path, default=Path("/tmp/floe-vllm.log"))
    ap.add_argument("names", nargs="*", help="capture only these scenarios (default: all)")
    args = ap.parse_args()
    if url := os.environ.get("FLOE_VLLM_URL"):
        capture(url.rstrip("/"), args.names)
        return
    with start_vllm(args.log, port=args.port or None) as v:
        if args.serve:
            print(json.dumps({"vllm": v.url, "log": str(args.log)}), flush=True)
            # SIGTERM and SIGINT leave the with block (SystemExit, KeyboardInterrupt),
            # which stops vLLM
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            while True:
                signal.pause()
            return
        capture(v.url, args.names)


if __name__ == "__main__":
    main()
