"""HTTP front end: an OpenAI-compatible server that speaks vLLM's wire format (>= 0.10.2:
``return_token_ids``, ``prompt_token_ids``, per-chunk ``token_ids``)."""

from __future__ import annotations

import collections
import copy
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from transformers import PreTrainedTokenizerFast

from .model import Engine, TokenLogprob, WeightsError
from .parser import OutputParser, _id
from .tokenizer import ENDOFTEXT, IM_END, render, render_assistant_turn, token_bytes

log = logging.getLogger("floe_refserver")


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type_: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message, self.status, self.type = message, status, type_

    def body(self) -> dict[str, Any]:
        return {
            "object": "error",
            "message": self.message,
            "type": self.type,
            "param": None,
            "code": self.status,
        }


# --- scripted outputs ---------------------------------------------------------


def validate_output(o: Any) -> dict[str, Any]:
    """A scripted assistant output: {"content"?, "reasoning"?, "tool_calls"?: [{"name",
    "arguments"}], "finish"?: "stop"|"length", "match"?: {"tool"?: str, "contains"?: str},
    "hold"?: bool}. With "match", the output answers only a request that offers a tool of
    that name and whose messages contain that text; harnesses make side calls (titles,
    summaries) that must not take the outputs meant for the conversation. With "hold", the
    request that takes it waits before answering until POST /script/release (or DELETE
    /script): a test can act while a call is known to be in flight upstream."""
    if not isinstance(o, dict):
        raise APIError("a scripted output must be an object")
    m = o.get("match", {})
    if (
        not isinstance(m, dict)
        or set(m) - {"tool", "contains"}
        or not all(isinstance(v, str) for v in m.values())
    ):
        raise APIError('scripted "match" must be {"tool"?: str, "contains"?: str}')
    unknown = set(o) - {"content", "reasoning", "tool_calls", "finish", "match", "hold"}
    if unknown:
        raise APIError(f"unknown fields in scripted output: {sorted(unknown)}")
    for k in ("content", "reasoning"):
        if o.get(k) is not None and not isinstance(o[k], str):
            raise APIError(f"scripted output {k!r} must be a string")
    if not isinstance(o.get("hold", False), bool):
        raise APIError('scripted output "hold" must be a boolean')
    if o.get("finish", "stop") not in ("stop", "length"):
        raise APIError('scripted output "finish" must be "stop" or "length"')
    calls = o.get("tool_calls") or []
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c for c in calls
    ):
        raise APIError('scripted "tool_calls" must be a list of {"name": str, "arguments": ...}')
    return o


class ScriptQueue:
    def __init__(self) -> None:
        self._q: collections.deque[dict[str, Any]] = collections.deque()
        self._lock = threading.Lock()
        # held outputs' requests wait for a release: each release (or clear) starts a new
        # round, and a request waits until the round it arrived in ends
        self._released = threading.Condition(self._lock)
        self._round = 0
        self._holding = 0

    def wait_if_held(self, o: dict[str, Any]) -> None:
        """Block the request that took o, when o holds, until the next release."""
        if not o.get("hold"):
            return
        with self._released:
            arrived = self._round
            self._holding += 1
            try:
                self._released.wait_for(lambda: self._round != arrived)
            finally:
                self._holding -= 1

    def release(self) -> int:
        """Let every held request answer; returns how many were held."""
        with self._released:
            n = self._holding
            self._round += 1
            self._released.notify_all()
            return n

    def holding(self) -> int:
        with self._lock:
            return self._holding

    def push(self, outputs: list[Any]) -> int:
        checked = [validate_output(o) for o in outputs]
        with self._lock:
            self._q.extend(checked)
            return len(self._q)

    def pop(self, fits: Callable[[dict[str, Any]], bool] = lambda m: True) -> dict[str, Any] | None:
        """Remove and return the first output whose match the request fits."""
        with self._lock:
            for i, o in enumerate(self._q):
                if fits(o.get("match") or {}):
                    del self._q[i]
                    return o
            return None

    def clear(self) -> int:
        """Drop the outputs left, and release the requests held."""
        with self._released:
            n = len(self._q)
            self._q.clear()
            self._round += 1
            self._released.notify_all()
            return n

    def __len__(self) -> int:
        with self._lock:
            return len(self._q)


def scripted_message(o: dict[str, Any]) -> dict[str, Any]:
    """The assistant message a scripted output stands for (for the chat template)."""
    msg: dict[str, Any] = {"role": "assistant", "content": o.get("content") or ""}
    if o.get("reasoning"):
        msg["reasoning_content"] = o["reasoning"]
    if o.get("tool_calls"):
        msg["tool_calls"] = [
            {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in o["tool_calls"]
        ]
    return msg


# --- generation ----------------------------------------------------------------


@dataclass
class Generation:
    """One choice's tokens, produced lazily; finish_reason/stop_reason are set once the
    iterator is exhausted."""

    tokens: Iterator[TokenLogprob]
    finish_reason: str = "stop"
    stop_reason: int | str | None = None
    ids: list[int] = field(default_factory=list)


@dataclass
class ChatRequest:
    body: dict[str, Any]
    prompt_ids: list[int]
    max_tokens: int
    n: int
    stream: bool
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool
    tokens_as_ids: bool
    include_usage: bool
    parse_tools: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]


class RefServer:
    """State shared by all request threads."""

    def __init__(
        self,
        tok: PreTrainedTokenizerFast,
        engine: Engine,
        model_name: str = "floe-ref",
        max_model_len: int = 4096,
    ) -> None:
        self.tok = tok
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.script = ScriptQueue()
        # What was generated, newest last, so tests can compare it with what floe recorded.
        self.generations: collections.deque[dict[str, Any]] = collections.deque(maxlen=1024)
        self.created = int(time.time())
        self.eos_ids = {_id(tok, IM_END), _id(tok, ENDOFTEXT)}

    # --- helpers ---

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def check_model(self, body: dict[str, Any]) -> None:
        m = body.get("model")
        if m is not None and m != self.model_name:
            raise APIError(f"The model `{m}` does not exist.", 404, "NotFoundError")

    def render_chat(self, body: dict[str, Any], default_gen_prompt: bool = True) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise APIError("messages must be a non-empty list of message objects")
        msgs = copy.deepcopy(messages)
        for m in msgs:
            if not isinstance(m.get("role"), str):
                raise APIError("every message needs a string role")
            # vLLM hands the template tool-call arguments as objects, parsed from the JSON string.
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") if isinstance(tc, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise APIError("tools must be a list")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise APIError("chat_template_kwargs must be an object")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("tools", "messages", "add_generation_prompt")}
        agp = body.get("add_generation_prompt", default_gen_prompt)
        try:
            return render(self.tok, msgs, tools, add_generation_prompt=bool(agp), **kwargs)
        except Exception as e:  # template errors are the client's (bad message shapes)
            raise APIError(f"chat template error: {e}") from e

    def logprob_entry(self, tid: int, lp: float, as_ids: bool) -> dict[str, Any]:
        if as_ids:
            token = f"token_id:{tid}"
        else:
            token = self.tok.backend_tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": token, "logprob": lp, "bytes": list(token_bytes(self.tok, tid))}

    def logprob_content(self, t: TokenLogprob, req: ChatRequest) -> dict[str, Any]:
        e = self.logprob_entry(t.token_id, t.logprob, req.tokens_as_ids)
        e["top_logprobs"] = [
            self.logprob_entry(i, v, req.tokens_as_ids) for i, v in t.top[: req.top_logprobs]
        ]
        return e

    # --- chat completions ---

    def parse_chat(self, body: dict[str, Any]) -> ChatRequest:
        self.check_model(body)
        prompt = self.render_chat(body)
        prompt_ids = self.encode(prompt)
        p = len(prompt_ids)

        def num(key: str, default: Any, kind: type) -> Any:
            v = body.get(key)
            if v is None:
                return default
            if kind is float and isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
            if kind is int and isinstance(v, int) and not isinstance(v, bool):
                return v
            raise APIError(f"{key} must be a{'n integer' if kind is int else ' number'}")

        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is not None:
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise APIError(f"max_tokens must be at least 1, got {max_tokens}.")
            if p + max_tokens > self.max_model_len:
                raise APIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                    f"requested {p + max_tokens} tokens ({p} in the messages, {max_tokens} in the "
                    "completion). Please reduce the length of the messages or completion."
                )
        else:
            if p >= self.max_model_len:
                raise APIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                    f"requested {p} tokens in the messages, Please reduce the length of the messages."
                )
            max_tokens = self.max_model_len - p
        logprobs = bool(body.get("logprobs") or False)
        top_logprobs = num("top_logprobs", 0, int)
        if top_logprobs and not logprobs:
            raise APIError("when using `top_logprobs`, `logprobs` must be set to true.")
        if not 0 <= top_logprobs <= 20:
            raise APIError("`top_logprobs` must be between 0 and 20")
        n = num("n", 1, int)
        if n < 1:
            raise APIError("n must be at least 1")
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIError("stop must be a string or a list of strings")
        stop_token_ids = body.get("stop_token_ids") or []
        tools = body.get("tools") or []
        stream_options = body.get("stream_options") or {}
        return ChatRequest(
            body=body,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            n=n,
            stream=bool(body.get("stream") or False),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            return_token_ids=bool(body.get("return_token_ids") or False),
            tokens_as_ids=bool(body.get("return_tokens_as_token_ids") or False),
            include_usage=bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
            parse_tools=bool(tools) and body.get("tool_choice") != "none",
            temperature=num("temperature", 1.0, float),
            top_p=num("top_p", 1.0, float),
            top_k=num("top_k", -1, int),
            seed=num("seed", None, int),
            stop=stop,
            stop_token_ids=[int(x) for x in stop_token_ids],
        )

    @staticmethod
    def _fits(match: dict[str, str], req: ChatRequest) -> bool:
        if "tool" in match:
            names = {
                (t.get("function") or {}).get("name")
                for t in req.body.get("tools") or []
                if isinstance(t, dict)
            }
            if match["tool"] not in names:
                return False
        if "contains" in match:
            return match["contains"] in json.dumps(req.body.get("messages"), ensure_ascii=False)
        return True

    def generation(self, req: ChatRequest) -> Generation:
        out = self.script.pop(lambda m: self._fits(m, req))
        k = req.top_logprobs if req.logprobs else 0
        if out is not None:
            self.script.wait_if_held(out)
            text = render_assistant_turn(self.tok, scripted_message(out))
            finish = out.get("finish") or "stop"
            if finish == "length":
                text = text[: -len(IM_END)]
            ids = self.encode(text)
            if len(ids) > req.max_tokens:
                ids, finish = ids[: req.max_tokens], "length"
            scored = self.engine.score(req.prompt_ids, ids, k, req.temperature)
            log.info("scripted output: %d tokens, finish %s", len(ids), finish)
            return Generation(iter(scored), finish_reason=finish)
        return self._sample(req, k)

    def _sample(self, req: ChatRequest, k: int) -> Generation:
        stop_ids = self.eos_ids | set(req.stop_token_ids)
        g = Generation(iter(()), finish_reason="length")

        def run() -> Iterator[TokenLogprob]:
            ids: list[int] = []
            for t in self.engine.sample(
                req.prompt_ids, req.max_tokens, stop_ids, req.temperature, req.top_p, req.top_k, k, req.seed
            ):
                ids.append(t.token_id)
                yield t
                if t.token_id in stop_ids:
                    g.finish_reason = "stop"
                    g.stop_reason = None if t.token_id in self.eos_ids else t.token_id
                    return
                if req.stop:
                    text = self.tok.backend_tokenizer.decode(ids, skip_special_tokens=True)
                    hit = next((s for s in req.stop if s in text), None)
                    if hit is not None:
                        g.finish_reason, g.stop_reason = "stop", hit
                        return

        g.tokens = run()
        return g

    def completion_id(self) -> str:
        return f"chatcmpl-{uuid.uuid4().hex}"

    def chat(self, req: ChatRequest) -> dict[str, Any]:
        # One weights version for the whole request (all choices): a reload waits.
        with self.engine.weights.shared():
            return self._chat(req)

    def _chat(self, req: ChatRequest) -> dict[str, Any]:
        choices = []
        completion_tokens = 0
        for i in range(req.n):
            g = self.generation(req)
            parser = OutputParser(self.tok, req.parse_tools)
            toks = list(g.tokens)
            for t in toks:
                parser.feed(t.token_id)
            parser.finish()
            completion_tokens += len(toks)
            self._log_generation(req, toks)
            finish = "tool_calls" if parser.tools_called else g.finish_reason
            choices.append(
                {
                    "index": i,
                    "message": parser.parsed.message(),
                    "logprobs": {"content": [self.logprob_content(t, req) for t in toks]}
                    if req.logprobs
                    else None,
                    "finish_reason": finish,
                    "stop_reason": g.stop_reason,
                    "token_ids": [t.token_id for t in toks] if req.return_token_ids else None,
                }
            )
        p = len(req.prompt_ids)
        return {
            "id": self.completion_id(),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": p,
                "total_tokens": p + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": None,
            },
            "prompt_logprobs": None,
            "prompt_token_ids": req.prompt_ids if req.return_token_ids else None,
            "kv_transfer_params": None,
        }

    def chat_stream(self, req: ChatRequest) -> Iterator[dict[str, Any]]:
        # Held while the stream is consumed, released when the generator ends or is closed.
        with self.engine.weights.shared():
            yield from self._chat_stream(req)

    def _chat_stream(self, req: ChatRequest) -> Iterator[dict[str, Any]]:
        cid, created = self.completion_id(), int(time.time())

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            c: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            c.update(extra)
            return c

        completion_tokens = 0
        for i in range(req.n):
            first: dict[str, Any] = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            if req.return_token_ids:
                yield chunk([first], prompt_token_ids=req.prompt_ids)
            else:
                yield chunk([first])
            g = self.generation(req)
            parser = OutputParser(self.tok, req.parse_tools)
            held: tuple[TokenLogprob, dict[str, Any]] | None = None
            emitted: list[TokenLogprob] = []
            for t in g.tokens:
                completion_tokens += 1
                emitted.append(t)
                delta = parser.feed(t.token_id)
                if held is not None:
                    yield chunk([self._stream_choice(i, req, held[0], held[1], None, None)])
                held = (t, delta)
            tail = parser.finish()
            self._log_generation(req, emitted)
            finish = "tool_calls" if parser.tools_called else g.finish_reason
            if held is not None:
                t, delta = held
                for key, v in tail.items():  # text held back at the end joins the last token
                    if key == "tool_calls":
                        delta.setdefault("tool_calls", []).extend(v)
                    else:
                        delta[key] = delta.get(key, "") + v
                yield chunk([self._stream_choice(i, req, t, delta, finish, g.stop_reason)])
            else:  # nothing generated (a scripted empty output cut at "length")
                yield chunk([self._stream_choice(i, req, None, tail, finish, g.stop_reason)])
        if req.include_usage:
            p = len(req.prompt_ids)
            usage = {
                "prompt_tokens": p,
                "total_tokens": p + completion_tokens,
                "completion_tokens": completion_tokens,
            }
            yield chunk([], usage=usage)

    def _log_generation(self, req: ChatRequest, toks: list[TokenLogprob]) -> None:
        self.generations.append(
            {
                "prompt_token_ids": list(req.prompt_ids),
                "token_ids": [t.token_id for t in toks],
                "logprobs": [t.logprob for t in toks],
            }
        )

    def _stream_choice(
        self,
        i: int,
        req: ChatRequest,
        t: TokenLogprob | None,
        delta: dict[str, Any],
        finish: str | None,
        stop_reason: int | str | None,
    ) -> dict[str, Any]:
        c: dict[str, Any] = {
            "index": i,
            "delta": delta,
            "logprobs": {"content": [self.logprob_content(t, req)] if t else []} if req.logprobs else None,
            "finish_reason": finish,
        }
        if finish is not None:
            c["stop_reason"] = stop_reason
        c["token_ids"] = ([t.token_id] if t else []) if req.return_token_ids else None
        return c

    # --- other endpoints ---

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "floe",
                    "root": self.model_name,
                    "parent": None,
                    "max_model_len": self.max_model_len,
                    "permission": [],
                }
            ],
        }

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        self.check_model(body)
        if "messages" in body:
            ids = self.encode(self.render_chat(body, default_gen_prompt=True))
        elif isinstance(body.get("prompt"), str):
            ids = self.encode(body["prompt"])
        else:
            raise APIError("tokenize needs `messages` or a string `prompt`")
        strs = self.tok.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    # --- weight sync (vLLM's dev-mode endpoints, VLLM_SERVER_DEV_MODE=1) ---

    def collective_rpc(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``POST /collective_rpc``: call ``method`` on every worker, one result each.
        The refserver has one "worker" and knows one method, ``reload_weights(weights_path)``."""
        method = body.get("method")
        if not isinstance(method, str):
            raise APIError('collective_rpc needs a string "method"')
        args = body.get("args") or []
        kwargs = body.get("kwargs") or {}
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise APIError('collective_rpc: "args" must be a list and "kwargs" an object')
        # "timeout" bounds vLLM's wait on its workers; the reload here is synchronous and
        # waits only for running requests, so it is accepted and not used.
        unknown = set(body) - {"method", "args", "kwargs", "timeout"}
        if unknown:
            raise APIError(f"collective_rpc: unknown fields {sorted(unknown)}")
        if method != "reload_weights":
            raise APIError(f"collective_rpc: unsupported method {method!r} (only reload_weights)")
        if args or set(kwargs) != {"weights_path"} or not isinstance(kwargs["weights_path"], str):
            raise APIError('reload_weights takes exactly kwargs {"weights_path": "<checkpoint dir>"}')
        path = kwargs["weights_path"]
        try:
            self.engine.reload_weights(path)
        except WeightsError as e:
            raise APIError(f"reload_weights: {e}") from e
        except OSError as e:
            raise APIError(f"reload_weights: reading {path!r}: {e}", 500, "InternalServerError") from e
        log.info("reloaded weights from %s", path)
        return {"results": [None]}

    def reset_prefix_cache(self) -> dict[str, Any]:
        # The refserver caches no KV across requests (each request runs its own forward
        # passes), so there is nothing stale after a reload: a no-op, answered as vLLM does.
        return {"success": True}

    def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        self.check_model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise APIError("tokens must be a list of integers")
        if any(i < 0 or i >= len(self.tok) for i in ids):
            raise APIError("token id out of range")
        return {"prompt": self.tok.backend_tokenizer.decode(ids, skip_special_tokens=False)}


# --- HTTP ------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "floe-refserver"
    ref: RefServer  # set on the subclass made by make_server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.info("%s %s", self.address_string(), format % args)

    # --- plumbing ---

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _json_body(self) -> dict[str, Any]:
        raw = self._read_body()
        try:
            body = json.loads(raw or b"null")
        except ValueError as e:
            raise APIError(f"Invalid JSON body: {e}") from e
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        return body

    def _send(self, status: int, obj: Any) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: Iterator[dict[str, Any]]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def write(payload: str) -> None:
            b = f"data: {payload}\n\n".encode()
            self.wfile.write(f"{len(b):x}\r\n".encode() + b + b"\r\n")
            self.wfile.flush()

        try:
            for ev in events:
                write(json.dumps(ev, ensure_ascii=False))
            write("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            log.info("client went away mid-stream")
            self.close_connection = True
        finally:
            # Release what the generator holds (the shared weights lock) now, not at GC.
            if isinstance(events, Generator):
                events.close()

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        routes: dict[str, dict[str, Callable[[], None]]] = {
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/models": {"GET": lambda: self._send(200, self.ref.models())},
            "/tokenize": {"POST": lambda: self._send(200, self.ref.tokenize(self._json_body()))},
            "/detokenize": {"POST": lambda: self._send(200, self.ref.detokenize(self._json_body()))},
            "/collective_rpc": {"POST": lambda: self._send(200, self.ref.collective_rpc(self._json_body()))},
            "/reset_prefix_cache": {"POST": self._reset_prefix_cache},
            "/script": {"GET": self._script_get, "POST": self._script_post, "DELETE": self._script_delete},
            "/script/release": {"POST": self._script_release},
            "/generations": {"GET": lambda: self._send(200, {"generations": list(self.ref.generations)})},
            "/health": {"GET": self._health},
            "/version": {"GET": lambda: self._send(200, {"version": "floe-refserver"})},
        }
        try:
            if path not in routes:
                if method in ("POST", "PUT"):
                    self._read_body()
                self._send(404, {"detail": "Not Found"})
                return
            handler = routes[path].get(method)
            if handler is None:
                self._read_body()
                self._send(405, {"detail": "Method Not Allowed"})
                return
            handler()
        except APIError as e:
            self._send(e.status, e.body())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug: answer like vLLM's 500, keep serving
            log.exception("internal error")
            err = APIError(f"{type(e).__name__}: {e}", 500, "InternalServerError")
            self._send(500, err.body())

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    # --- endpoints ---

    def _health(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _chat(self) -> None:
        req = self.ref.parse_chat(self._json_body())
        if req.stream:
            self._stream(self.ref.chat_stream(req))
        else:
            self._send(200, self.ref.chat(req))

    def _reset_prefix_cache(self) -> None:
        self._read_body()  # vLLM takes no body; drain any so the connection stays usable
        self._send(200, self.ref.reset_prefix_cache())

    def _script_get(self) -> None:
        self._send(200, {"remaining": len(self.ref.script), "held": self.ref.script.holding()})

    def _script_post(self) -> None:
        body = self._json_body()
        outputs = body.get("outputs")
        if not isinstance(outputs, list):
            raise APIError('POST /script needs {"outputs": [...]}')
        remaining = self.ref.script.push(outputs)
        self._send(200, {"queued": len(outputs), "remaining": remaining})

    def _script_release(self) -> None:
        self._read_body()
        self._send(200, {"released": self.ref.script.release()})

    def _script_delete(self) -> None:
        self._read_body()
        self._send(200, {"cleared": self.ref.script.clear(), "remaining": 0})


def make_server(ref: RefServer, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("RefHandler", (Handler,), {"ref": ref})
    srv = ThreadingHTTPServer((host, port), handler)
    srv.daemon_threads = True
    return srv
