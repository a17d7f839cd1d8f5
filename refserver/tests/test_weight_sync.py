"""Weight sync: vLLM's dev-mode ``POST /collective_rpc`` (``reload_weights``) and
``POST /reset_prefix_cache`` against a real refserver subprocess, and the exclusion between
a reload and running requests."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from floe_refserver import Engine, build_model, load_tokenizer
from floe_stack import Stack, refserver_argv

MAX_LEN = 4096  # the server's default --max-model-len, which build_model's config depends on
MESSAGES: Any = [{"role": "user", "content": "Say something."}]
OUTPUT = {"content": "Le chat dort sur le canapé, tranquille."}


# --- fixtures --------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("refserver-cache")


@pytest.fixture(scope="module")
def tok(cache_dir: Path) -> Any:
    return load_tokenizer(cache_dir)


@pytest.fixture(scope="module")
def server(cache_dir: Path, tok: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A refserver subprocess (seed 0); yields its root URL (no /v1). After `tok`, so the
    server finds the tokenizer cached instead of training it; a generous start timeout for
    loaded CI machines."""
    with Stack(tmp_path_factory.mktemp("refserver-logs"), grace=20) as st:
        try:
            argv = refserver_argv("--port", "0", "--cache-dir", str(cache_dir))
            proc, hello = st.start_server("refserver", argv, timeout=300)
        except RuntimeError as e:
            pytest.fail(f"refserver did not start: {e}")
        yield hello["base_url"].removesuffix("/v1")
        assert st.stop(proc) == 0 and not proc.killed, proc.tail(50)


@pytest.fixture(scope="module")
def models(tok: Any) -> dict[int, Any]:
    """The seeded models the tests move the server between, by seed."""
    return {s: build_model(len(tok), seed=s, max_model_len=MAX_LEN) for s in (0, 1, 2)}


@pytest.fixture(scope="module")
def ckpts(models: dict[int, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """save_pretrained checkpoints of the models, as a trainer writes them."""
    out = {}
    for s, m in models.items():
        d = tmp_path_factory.mktemp(f"ckpt-seed{s}")
        m.save_pretrained(d, safe_serialization=True)
        out[s] = d
    return out


# --- helpers ---------------------------------------------------------------------


def call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read()
            return r.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, body: Any) -> Any:
    status, out = call("POST", url, body)
    assert status == 200, out
    return out


def reload(server: str, path: Path | str) -> tuple[int, Any]:
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
    return call("POST", server + "/collective_rpc", body)


def served(server: str) -> tuple[list[int], list[int], list[float]]:
    """Prompt ids, output ids and log-probs of a fixed scripted answer: teacher-forced by
    the served weights, so a pure function of them."""
    assert call("DELETE", server + "/script")[0] == 200
    post(server + "/script", {"outputs": [OUTPUT]})
    res = post(
        server + "/v1/chat/completions",
        {"model": "floe-ref", "messages": MESSAGES, "logprobs": True, "return_token_ids": True},
    )
    ch = res["choices"][0]
    return res["prompt_token_ids"], ch["token_ids"], [e["logprob"] for e in ch["logprobs"]["content"]]


def own_logprobs(model: Any, prompt_ids: list[int], ids: list[int]) -> torch.Tensor:
    """The model's own teacher-forced log-probs of ids after prompt_ids, computed here."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + ids])).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)[len(prompt_ids) - 1 : -1]
    return logp.gather(1, torch.tensor(ids)[:, None])[:, 0]


def assert_serves(server: str, model: Any) -> list[float]:
    prompt_ids, ids, lps = served(server)
    want = own_logprobs(model, prompt_ids, ids)
    got = torch.tensor(lps, dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    return lps


# --- tests -----------------------------------------------------------------------


def test_reload_weights_serves_the_checkpoint(
    server: str, models: dict[int, Any], ckpts: dict[int, Path]
) -> None:
    before = assert_serves(server, models[0])
    # save_pretrained leaves out the tied lm_head.weight; the reload must tie it as transformers does.
    assert "lm_head.weight" not in load_file(next(ckpts[1].glob("*.safetensors")))

    assert reload(server, ckpts[1]) == (200, {"results": [None]})
    assert post(server + "/reset_prefix_cache", None) == {"success": True}
    after = assert_serves(server, models[1])
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3

    # and back: the seed-0 checkpoint restores the original log-probs exactly
    assert reload(server, ckpts[0]) == (200, {"results": [None]})
    assert served(server)[2] == before


def test_reload_bf16_checkpoint(server: str, tok: Any, tmp_path: Path) -> None:
    """Trainers often save bf16: it is cast to the served fp32, like vLLM's loader does."""
    build_model(len(tok), seed=2, max_model_len=MAX_LEN).to(torch.bfloat16).save_pretrained(
        tmp_path, safe_serialization=True
    )
    assert reload(server, tmp_path) == (200, {"results": [None]})
    # The reference: the fp32 model with its parameters rounded through bf16 (rounding the
    # whole model would round its rotary buffer too, which no checkpoint carries).
    ref = build_model(len(tok), seed=2, max_model_len=MAX_LEN)
    with torch.no_grad():
        for prm in ref.parameters():
            prm.copy_(prm.to(torch.bfloat16).float())
    assert_serves(server, ref)


def test_reload_errors_leave_the_weights(
    server: str, models: dict[int, Any], ckpts: dict[int, Path], tmp_path: Path
) -> None:
    assert reload(server, ckpts[1]) == (200, {"results": [None]})
    good = assert_serves(server, models[1])

    # Each bad checkpoint is otherwise seed 2's weights: a partial copy would show.
    base = {k: v.clone() for k, v in load_file(next(ckpts[2].glob("*.safetensors"))).items()}
    layer = "model.layers.1.mlp.down_proj.weight"

    def ckpt(name: str, tensors: dict[str, torch.Tensor] | None = None, raw: bytes | None = None) -> Path:
        d = tmp_path / name
        d.mkdir()
        if raw is not None:
            (d / "model.safetensors").write_bytes(raw)
        elif tensors is not None:
            save_file(tensors, str(d / "model.safetensors"))
        return d

    wrong_shape = dict(base, **{layer: torch.zeros(3, 3)})
    missing = {k: v for k, v in base.items() if k != layer}
    extra = dict(base, **{"model.extra.weight": torch.zeros(2)})
    untied = dict(base, **{"lm_head.weight": base["model.embed_tokens.weight"] + 1})
    ints = dict(base, **{layer: base[layer].to(torch.int32)})
    def rw(path: Path | str) -> dict[str, Any]:
        return {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}

    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"method": "load_weights", "kwargs": {}}, 400, "load_weights"),
        ({"method": "reload_weights"}, 400, "weights_path"),
        ({"method": "reload_weights", "kwargs": {"weights_path": 3}}, 400, "weights_path"),
        (rw(tmp_path / "nope"), 400, "not a directory"),
        (rw(ckpt("empty")), 400, "no *.safetensors"),
        (rw(ckpt("junk", raw=b"\x10" * 64)), 400, "model.safetensors"),
        (rw(ckpt("shape", wrong_shape)), 400, layer),
        (rw(ckpt("missing", missing)), 400, layer),
        (rw(ckpt("extra", extra)), 400, "model.extra.weight"),
        (rw(ckpt("untied", untied)), 400, "lm_head.weight"),
        (rw(ckpt("ints", ints)), 400, layer),
    ]
    for body, status, needle in cases:
        got_status, out = call("POST", server + "/collective_rpc", body)
        assert got_status == status, (body, out)
        assert needle in out["message"], (needle, out)
        assert out["object"] == "error" and out["code"] == status
        assert served(server)[2] == good, body


def test_reload_waits_for_running_requests(tok: Any, models: dict[int, Any], ckpts: dict[int, Path]) -> None:
    """A reload queued behind a request holding the weights copies nothing until it ends."""
    eng = Engine(build_model(len(tok), seed=0, max_model_len=MAX_LEN))
    embed = eng.model.get_input_embeddings().weight
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            eng.reload_weights(ckpts[1])
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)
        done.set()

    t = threading.Thread(target=run, daemon=True)
    with eng.weights.shared():
        t.start()
        with eng.weights.cond:
            assert eng.weights.cond.wait_for(lambda: eng.weights.writers_waiting == 1, timeout=60)
        assert not done.is_set()
        assert torch.equal(embed, models[0].get_input_embeddings().weight)
    assert done.wait(60) and not errors, errors
    assert torch.equal(embed, models[1].get_input_embeddings().weight)
    assert eng.model.get_output_embeddings().weight is embed  # still tied


def test_reload_during_a_stream(server: str, models: dict[int, Any], ckpts: dict[int, Path]) -> None:
    """A reload sent while a greedy stream runs: every token of the stream is scored by the
    old weights, the next request by the new ones."""
    assert reload(server, ckpts[0]) == (200, {"results": [None]})
    body = {
        "model": "floe-ref",
        "messages": MESSAGES,
        "logprobs": True,
        "return_token_ids": True,
        "temperature": 0,
        "max_tokens": 48,
        "stream": True,
    }
    req = urllib.request.Request(
        server + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    result: list[tuple[int, Any]] = []
    reloader = threading.Thread(target=lambda: result.append(reload(server, ckpts[1])), daemon=True)
    started = False
    prompt_ids: list[int] = []
    ids: list[int] = []
    lps: list[float] = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            ev = json.loads(line[len(b"data: ") :])
            prompt_ids = ev.get("prompt_token_ids") or prompt_ids
            for ch in ev["choices"]:
                ids += ch.get("token_ids") or []
                lps += [e["logprob"] for e in (ch.get("logprobs") or {}).get("content") or []]
            if ids and not started:
                reloader.start()  # mid-stream: after the first generated token
                started = True
    reloader.join(120)
    assert result == [(200, {"results": [None]})]
    assert ids and len(lps) == len(ids)
    want = own_logprobs(models[0], prompt_ids, ids)
    assert torch.allclose(torch.tensor(lps, dtype=torch.float64), want, atol=1e-5, rtol=0)
    assert_serves(server, models[1])
