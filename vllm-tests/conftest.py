"""Fixtures of the real-vLLM suite: one vLLM serving SmolLM2 for the whole test session,
the recording relay in front of it, floe built from this checkout and `floe serve`
instances pointed at the relay, and the SmolLM2 weights in fp32 for rescoring.

Set FLOE_VLLM_URL=http://127.0.0.1:PORT to use a vLLM that is already running (started
with vllm_argv's flags, e.g. by `python vllm-tests/capture.py --serve`): the suite then
skips the minutes of start-up.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import floe_stack  # noqa: E402

import vllmstack  # noqa: E402
from vllmstack import REPO, SERVED, Floe, Relay, log, model_dir, start_vllm  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def live_log(pytestconfig: pytest.Config) -> Iterator[None]:
    """Log lines reach the terminal as they happen, not only in a failed test's report."""
    capman = pytestconfig.pluginmanager.getplugin("capturemanager")

    def sink(line: str) -> None:
        with capman.global_and_fixture_disabled():
            print("\n" + line, file=sys.stderr, flush=True)

    vllmstack.log_sink = sink
    yield
    vllmstack.log_sink = vllmstack._stderr


@pytest.fixture(scope="session")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if url := os.environ.get("FLOE_VLLM_URL"):
        log(f"using the running vLLM at {url}")
        yield url.rstrip("/")
        return
    logs = Path(os.environ.get("FLOE_VLLM_LOG_DIR") or tmp_path_factory.mktemp("vllm"))
    try:
        # dev mode: /collective_rpc and /reset_prefix_cache, make learn's weight sync
        # (test_learn.py); nothing else the tests use changes with it
        server = start_vllm(logs / "vllm.log", env={"VLLM_SERVER_DEV_MODE": "1"})
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    with server:
        yield server.url


@pytest.fixture(scope="session")
def relay(vllm_url: str) -> Iterator[Relay]:
    r = Relay(vllm_url).start()
    yield r
    r.stop()


@pytest.fixture(scope="session")
def floe_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return floe_stack.build_floe(tmp_path_factory.mktemp("bin"), REPO)
    except RuntimeError as e:
        pytest.fail(f"the vLLM tests need floe: {e}")


@pytest.fixture(scope="session")
def floe_serve(
    floe_bin: Path, relay: Relay, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Floe]]:
    """Factory: floe_serve(strategy, group_size=2, ...) starts `floe serve` on free loopback
    ports with its upstream at the relay; extra flags as keywords (underscores become
    dashes). Every one started is stopped at the end of the session."""
    tmp = tmp_path_factory.mktemp("floe")
    with floe_stack.Stack(tmp / "logs", grace=20) as procs:

        def start(strategy: str, **flags: object) -> Floe:
            data = tmp / f"data-{len(procs.children)}"
            args = [
                str(floe_bin),
                "serve",
                "-proxy-addr",
                "127.0.0.1:0",
                "-control-addr",
                "127.0.0.1:0",
                "-flight-addr",
                "127.0.0.1:0",
                "-data-dir",
                str(data),
                "-upstream",
                relay.url,
                "-model",
                SERVED,
                "-strategy",
                strategy,
                "-pad-multiple",
                "16",
                "-token-budget",
                "8192",
            ]
            for k, v in flags.items():
                args += [f"-{k.replace('_', '-')}", str(v)]
            child, addrs = procs.start_server(f"floe-{strategy}", args, timeout=60)
            return Floe(addrs["proxy"], addrs["control"], addrs["flight"], data, strategy, child)

        yield start


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """SmolLM2 in fp32 from the same safetensors vLLM serves, for rescoring."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir()), dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()  # type: ignore[no-untyped-call]
