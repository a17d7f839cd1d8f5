"""floe_bridge.verl.FloeAgentLoopManager against verl 0.9.1 from PyPI, on CPU.

floe serve runs in front of the reference server (a real tiny Qwen2); a scripted harness
(the official openai SDK against each session's base URL and key) makes two calls per
session with a tool result between. The manager builds verl's DataProto with verl's own
classes; the test checks it with verl's own validation (``DataProto.check_consistency``,
``union`` with the n-times repeated input as ``ray_trainer.fit`` does, verl's GRPO
advantage) and against what floe recorded, read back independently: the control API's
calls (ids and log-probs) and the Flight sample table of the step floe formed (loss tokens,
reward, advantage). Every wait is on an event (a child's first line, an HTTP answer, a
Flight step becoming READY), never on a clock.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import floe_stack
from floe_bridge import FloeClient
from floe_bridge.verl import (
    FloeAgentLoopManager,
    FloeCheckpointEngineManager,
    FloeSettings,
    HarnessResult,
    HarnessTask,
)
from floe_stack import refserver_argv

ROOT = Path(__file__).resolve().parent.parent
N = 2  # rollouts per prompt: verl's rollout.n, floe's group size
PROMPTS = 2
TOOLS = [{"type": "function", "function": {
    "name": "run", "description": "run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]
FIGURES: dict[str, Any] = {}


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=60) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("verl")
    floe_bin = floe_stack.build_floe(tmp, ROOT)
    with floe_stack.Stack(tmp / "logs", stop_order=("floe", "refserver"), label="verl-test") as st:
        _, hello = st.start_server("refserver", refserver_argv(
            "--port", "0", "--threads", "1", "--log-level", "WARNING", "--cache-dir", str(tmp / "tok")),
            timeout=600)  # a bound on the wait for its first line, generous on a loaded machine
        ref = hello["base_url"][: -len("/v1")]
        _, addrs = st.start_server("floe", [
            str(floe_bin), "serve", "-proxy-addr", "127.0.0.1:0", "-control-addr", "127.0.0.1:0",
            "-flight-addr", "127.0.0.1:0", "-data-dir", str(tmp / "floe-data"), "-upstream", ref,
            "-group-size", str(N), "-groups-per-step", "1", "-min-group-size", "2",
            "-token-budget", "4096", "-pad-multiple", "16", "-steps-ahead", "8",
        ], timeout=600)
        yield {"tmp": tmp, "ref": ref, "control": addrs["control"], "flight": addrs["flight"]}


@pytest.fixture(scope="module")
def model_dir(stack: dict[str, Any]) -> Path:
    """The reference server's model and tokenizer in Hugging Face form: verl's HFModelConfig
    loads its tokenizer (pad id, chat template) and config from this path."""
    from floe_refserver.model import build_model
    from floe_refserver.tokenizer import load_tokenizer

    out = Path(stack["tmp"]) / "model"
    tok = load_tokenizer(Path(stack["tmp"]) / "tok")
    build_model(len(tok), seed=0).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def config(stack: dict[str, Any], model_dir: Path) -> DictConfig:
    import verl.trainer.config as vc

    with initialize_config_dir(config_dir=os.path.dirname(vc.__file__), version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.rollout.n={N}",
            "actor_rollout_ref.rollout.prompt_length=512",
            "actor_rollout_ref.rollout.response_length=256",
            "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=floe_bridge.verl.FloeAgentLoopManager",
            f"+floe.control_url={stack['control']}",
            "+floe.concurrency=4",
            "+floe.runner=test_verl_manager:harness",
        ])


def harness(task: HarnessTask) -> HarnessResult:
    """A scripted two-call harness: the model calls the ``run`` tool (scripted in the
    reference server), the harness answers with the tool's result, and the model's second
    answer is sampled for real. The reward is the rollout's index, so the group's
    advantages differ."""
    from openai import OpenAI

    client = OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0)
    # The rollout's own marker, which its scripted tool call is matched on: the group's
    # sessions share one prompt, and each must take the output scripted for it.
    messages: list[Any] = [{**m} for m in task.messages]
    messages[-1]["content"] += f"/{task.rollout}"
    first = client.chat.completions.create(model="floe-ref", messages=messages, tools=TOOLS, max_tokens=64)
    msg = first.choices[0].message
    assert msg.tool_calls, "the scripted tool call did not come back"
    call = msg.tool_calls[0]
    messages.append({"role": "assistant", "content": msg.content or "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": f"README.md\nsetup.py (rollout {task.rollout})"})
    # The same tools again (the system prompt lists them, so the context extends); no
    # scripted output matches this call's marker any more, so the model samples it.
    client.chat.completions.create(model="floe-ref", messages=messages, tools=TOOLS, max_tokens=12,
                                   temperature=1.0)
    return HarnessResult(reward=float(task.rollout))


def gen_batch(step: int) -> Any:
    """A batch as ray_trainer.fit hands it to the manager: the prompts' non-tensor fields,
    a uid per prompt, repeated n times interleaved."""
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    raw = np.empty(PROMPTS, dtype=object)
    ask = "List the files and say which is the setup script."
    raw[:] = [[{"role": "user", "content": f"{ask} TASK-{step}-{k}"}] for k in range(PROMPTS)]
    # What RLHFDataset's rows give the trainer: a dummy tensor and the non-tensor fields.
    batch = DataProto.from_single_dict({
        "dummy_tensor": torch.zeros((PROMPTS, 1), dtype=torch.uint8),
        "raw_prompt": raw,
        "data_source": np.array(["floe-test"] * PROMPTS, dtype=object),
        "index": np.arange(PROMPTS),
    })
    batch.non_tensor_batch["uid"] = np.array([f"s{step}p{k}" for k in range(PROMPTS)], dtype=object)
    gen = RayPPOTrainer._get_gen_batch(None, batch)  # verl's own split (it reads no trainer state)
    gen.meta_info["global_steps"] = step
    return batch, gen.repeat(repeat_times=N, interleave=True)


def script(stack: dict[str, Any], step: int) -> None:
    """One scripted tool call per session, matched to its prompt's marker."""
    outs = [{"tool_calls": [{"name": "run", "arguments": {"cmd": "ls"}}], "content": "",
             "match": {"tool": "run", "contains": f"TASK-{step}-{k}/{r}"}}
            for k in range(PROMPTS) for r in range(N)]
    _post(stack["ref"] + "/script", {"outputs": outs})


@pytest.fixture(scope="module")
def manager(config: DictConfig) -> FloeAgentLoopManager:
    m: FloeAgentLoopManager = FloeAgentLoopManager.create(config=config, llm_client=None, runner=harness)
    return m


def check_rows(out: Any, stack: dict[str, Any], layout: str) -> dict[str, Any]:
    """Every row against floe's record of its session, read back from the control API."""
    prompts, responses = out.batch["prompts"], out.batch["responses"]
    mask, lps, attn = out.batch["response_mask"], out.batch["rollout_log_probs"], out.batch["attention_mask"]
    P = prompts.shape[1]
    fig = {"rows": len(out), "calls": 0, "sampled_tokens": 0, "masked_tokens": 0,
           "ids_equal": 0, "logprobs_equal": 0, "mask_ok": 0}
    seen: set[str] = set()
    for i in range(len(out)):
        sid = str(out.non_tensor_batch["floe_session_id"][i])
        calls = sorted(_get(f"{stack['control']}/floe/v1/sessions/{sid}")["calls"], key=lambda c: c["index"])
        if layout == "call":
            calls = [calls[int(out.non_tensor_batch["floe_calls"][i][0])]]
        # The expected row, built here from the raw record: ids, mask and log-probs.
        want_prompt = calls[0]["prompt_ids"]
        want_ids: list[int] = []
        want_mask: list[int] = []
        want_lps: list[float] = []
        ctx = len(want_prompt)
        for c in calls:
            assert c["trainable"], c.get("untrainable_reason")
            assert c["prompt_ids"][: len(want_prompt)] == want_prompt
            gap = c["prompt_ids"][ctx:]
            want_ids += gap + c["response_ids"]
            want_mask += [0] * len(gap) + [1] * len(c["response_ids"])
            want_lps += c["logprobs"]
            ctx = len(c["prompt_ids"]) + len(c["response_ids"])
        got_prompt = prompts[i][attn[i, :P].bool()].tolist()
        n = int(attn[i, P:].sum())
        got_ids = responses[i, :n].tolist()
        got_mask = mask[i].tolist()
        ids_equal = got_prompt == want_prompt and got_ids == want_ids
        # Log-probs: exactly floe's float32s on the sampled tokens, 0 elsewhere.
        got_lps = lps[i][mask[i].bool()]
        lps_equal = torch.equal(got_lps, torch.tensor(want_lps, dtype=torch.float32)) and bool(
            (lps[i][~mask[i].bool()] == 0).all())
        mask_ok = got_mask == want_mask + [0] * (len(got_mask) - len(want_mask))
        fig["ids_equal"] += ids_equal
        fig["logprobs_equal"] += lps_equal
        fig["mask_ok"] += mask_ok
        if sid not in seen or layout == "call":
            fig["calls"] += len(calls)
        seen.add(sid)
        fig["sampled_tokens"] += sum(want_mask)
        fig["masked_tokens"] += len(want_mask) - sum(want_mask)
        assert ids_equal, (i, sid)
        assert lps_equal, (i, sid)
        assert mask_ok, (i, sid)
        assert all(c["policy_version"] == calls[0]["policy_version"] for c in calls)
    return fig


def test_session_layout(manager: FloeAgentLoopManager, stack: dict[str, Any]) -> None:
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    step = 1
    script(stack, step)
    batch, gen = gen_batch(step)
    out = manager.generate_sequences(gen)

    # verl's own validation and the trainer's next moves on the batch.
    out.check_consistency()
    assert len(out) == PROMPTS * N
    merged = batch.repeat(repeat_times=N, interleave=True).union(out)  # ray_trainer.fit's union
    assert list(merged.non_tensor_batch["uid"]) == list(gen.non_tensor_batch["uid"])
    fig = check_rows(out, stack, "session")
    assert fig["calls"] == 2 * PROMPTS * N and fig["masked_tokens"] > 0
    assert all(len(x) == 0 for x in out.non_tensor_batch["floe_calls_left_out"])

    # Rewards: the runner's, on the last response token, as verl's rm_scores.
    rewards = out.batch["rm_scores"].sum(-1)
    assert rewards.tolist() == [float(r % N) for r in range(PROMPTS * N)]
    adv, _ = compute_grpo_outcome_advantage(
        token_level_rewards=out.batch["rm_scores"], response_mask=out.batch["response_mask"],
        index=merged.non_tensor_batch["uid"])

    # floe formed one step per group from the same sessions: its Flight sample table agrees
    # on each session's loss tokens, reward and GRPO advantage. Reading and committing the
    # steps also lets floe archive them.
    client = FloeClient(stack["flight"], timeout=120)
    by_session: dict[str, Any] = {}
    for _ in range(PROMPTS):
        info = client.step_info()
        t = client.read_samples(info).to_pylist()
        by_session.update({r["session_id"]: r for r in t})
        client.commit(info.step)
    for i in range(len(out)):
        s = by_session[str(out.non_tensor_batch["floe_session_id"][i])]
        assert s["num_loss_tokens"] == int(out.batch["response_mask"][i].sum())
        assert s["reward"] == float(rewards[i])
        assert s["group_id"].endswith(str(out.non_tensor_batch["uid"][i]))
        assert abs(s["advantage"] - float(adv[i][out.batch["response_mask"][i].bool()][0])) < 1e-5
    fig["flight_sessions_equal"] = len(out)
    FIGURES["session"] = fig
    print("\nsession layout:", json.dumps(fig), file=sys.stderr)


def test_call_layout(manager: FloeAgentLoopManager, stack: dict[str, Any]) -> None:
    step = 2
    script(stack, step)
    _, gen = gen_batch(step)
    settings = manager.settings
    manager.settings = FloeSettings(**{**settings.__dict__, "layout": "call"})
    try:
        out = manager.generate_sequences(gen)
    finally:
        manager.settings = settings
    out.check_consistency()
    assert len(out) == 2 * PROMPTS * N  # two calls per session, one row each
    fig = check_rows(out, stack, "call")
    assert fig["masked_tokens"] == 0  # a call's response is all sampled
    # Each call row keeps its session's uid (verl's GRPO group) and reward.
    assert sorted(set(out.non_tensor_batch["uid"])) == sorted(set(gen.non_tensor_batch["uid"]))
    FIGURES["call"] = fig
    print("\ncall layout:", json.dumps(fig), file=sys.stderr)
    client = FloeClient(stack["flight"], timeout=120)
    for _ in range(PROMPTS):
        client.commit(client.step_info().step)


def test_agent_loop_in_verls_worker(config: DictConfig, stack: dict[str, Any]) -> None:
    """FloeAgentLoop run by verl's own AgentLoopWorker (the worker verl's default manager
    starts in Ray), picked by agent_name: the same rows as the manager's."""
    import asyncio

    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    step = 4
    script(stack, step)
    batch, gen = gen_batch(step)
    gen.non_tensor_batch["agent_name"] = np.array(["floe_agent"] * len(gen), dtype=object)
    worker = AgentLoopWorker(config, None)  # type: ignore[arg-type]
    out = asyncio.run(worker.generate_sequences(gen))
    out.check_consistency()
    batch.repeat(repeat_times=N, interleave=True).union(out)
    fig = check_rows(out, stack, "session")
    assert fig["calls"] == 2 * PROMPTS * N
    assert out.batch["rm_scores"].sum(-1).tolist() == [float(r % N) for r in range(PROMPTS * N)]
    # floe grouped the trajectories by uid, as the manager does.
    groups = {_get(f"{stack['control']}/floe/v1/sessions/{sid}")["group_id"]
              for sid in out.non_tensor_batch["floe_session_id"]}
    assert len(groups) == PROMPTS
    FIGURES["agent_loop"] = fig
    print("\nagent loop (verl's AgentLoopWorker):", json.dumps(fig), file=sys.stderr)
    client = FloeClient(stack["flight"], timeout=120)
    for _ in range(PROMPTS):
        client.commit(client.step_info().step)


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    import ray

    # This machine runs other work: Ray's memory monitor would kill the TransferQueue actors
    # when the node nears its limit, which says nothing about floe or verl. A small object
    # store is plenty for a few rows.
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=256 << 20)
    yield
    ray.shutdown()


def test_weight_sync(manager: FloeAgentLoopManager, stack: dict[str, Any], ray_local: None) -> None:
    """FloeCheckpointEngineManager: floe is paused while verl pushes weights, then resumed at
    verl's global step; the next batch's calls carry that policy version."""
    import ray
    from verl.workers.config import CheckpointEngineConfig

    seen: dict[str, Any] = {}

    class Actor:  # the naive backend's actor worker group: one call, a ray ref back
        def update_weights(self, global_steps: int, mode: str) -> list[Any]:
            seen["status_during"] = _get(f"{stack['control']}/floe/v1/status")
            seen["global_steps"] = global_steps
            return [ray.put(None)]

    ckpt = CheckpointEngineConfig(backend="naive",
                                  engine_kwargs={"floe": {"control_url": stack["control"]}})
    mgr = FloeCheckpointEngineManager(ckpt, Actor(), [])
    mgr.update_weights(3)
    assert seen["global_steps"] == 3
    assert seen["status_during"]["paused"] is True, seen["status_during"]
    after = _get(f"{stack['control']}/floe/v1/status")
    assert after["paused"] is False and after["policy_version"] == 3, after

    step = 3
    script(stack, step)
    _, gen = gen_batch(step)
    out = manager.generate_sequences(gen)
    versions = {c["policy_version"] for sid in out.non_tensor_batch["floe_session_id"]
                for c in _get(f"{stack['control']}/floe/v1/sessions/{sid}")["calls"]}
    assert versions == {3}
    FIGURES["weight_sync"] = {"paused_during_update": True, "policy_version_after": 3}
    print("\nweight sync:", json.dumps(FIGURES["weight_sync"]), file=sys.stderr)
