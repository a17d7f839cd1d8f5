"""One make learn run: a seed and a strategy, N GRPO steps through floe with weight sync.

The parts (each its own process but the trainer, which runs here):

- vLLM (started once by learn/run.py, shared by every run) serves the policy with
  ``VLLM_SERVER_DEV_MODE=1``, for ``/collective_rpc`` (``reload_weights``) and
  ``/reset_prefix_cache``;
- ``floe serve`` (one per run, its own data dir) in front of it, ``-max-staleness 1``,
  ``-steps-ahead 1``;
- the rollouts: ``groups × group_size`` sessions per step, each a thread running
  learn/harness.py's episode with the openai SDK against the session's proxy URL and key,
  finished with its reward on floe's control API;
- the trainer: reads each step over Flight (``FloeClient``), one
  ``floe_bridge.recipe.train_step``, reports, syncs the weights, commits.

The pipeline is one step off policy, as verl's one-step-off and AReaL's async modes: the
rollouts of step s+1 are sampled before step s trains, so they are one version old when
they train, and floe's ``-max-staleness 1`` is what lets them (docs/learn.md). The weight
sync sits inside floe's pause and resume: pause, save the weights, vLLM reloads them from
disk, its prefix cache is reset, resume at version s; only then is step s committed, so
floe forms step s+1 at version s and checks its calls' staleness against it.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import openai
import torch

import harness
import task
from vllmstack import SERVED, http_json  # learn/run.py and the vLLM suite put vllm-tests/ on sys.path


@dataclass(frozen=True)
class Settings:
    strategy: str
    seed: int
    steps: int
    groups_per_step: int = 2
    group_size: int = 8
    lr: float = 4e-5
    temperature: float = 1.0
    eval_every: int = 4
    eval_episodes: int = 64
    max_staleness: int = 1
    token_budget: int = 4096
    threads: int = 2


@dataclass
class StepLine:
    """One line of the run's JSONL (and of its printed table)."""

    run: str
    strategy: str
    seed: int
    step: int
    policy_version: int
    train_reward: float
    loss: float
    loss_tokens: int
    rows: int
    real_rows: int
    micro_batches: int
    mismatch: float
    rollout_s: float
    train_s: float
    sync_s: float
    eval_s: float
    step_s: float
    held_out_reward: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class VLLMControl:
    """What the loop asks of the inference server besides completions."""

    def __init__(self, url: str) -> None:
        self.url = url

    def load_weights(self, path: Path) -> None:
        # vLLM 0.32's in-place reload from a safetensors directory (docs/learn.md: why
        # this and not a LoRA adapter or the NCCL weight-transfer engine); the prefix
        # cache holds KV computed with the old weights, so it goes too.
        http_json(
            "POST",
            self.url + "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
        )
        http_json("POST", self.url + "/reset_prefix_cache")


def evaluate(vllm_url: str, settings: Settings) -> float:
    """Held-out reward: settings.eval_episodes held-out problems, one episode each,
    straight at the inference server (floe records nothing, so nothing is trained on),
    at the training temperature with a per-episode seed, so two runs at the same weights
    sample the same tokens."""
    client = openai.OpenAI(base_url=vllm_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    probs = task.problems("held_out", 0, settings.eval_episodes)
    with cf.ThreadPoolExecutor(16) as ex:
        eps = list(
            ex.map(
                lambda ip: harness.run_episode(
                    client, SERVED, ip[1], temperature=settings.temperature, seed=1000 + 2 * ip[0]
                ),
                enumerate(probs),
            )
        )
    return sum(e.reward for e in eps) / len(eps)


class Rollouts:
    """Opens, runs and finishes each step's sessions (threads of this process)."""

    def __init__(self, control: str, settings: Settings, run: str) -> None:
        self.control = control
        self.settings = settings
        self.run = run
        self.problems = task.problems("train", settings.seed, settings.steps * settings.groups_per_step)
        self.pool = cf.ThreadPoolExecutor(settings.groups_per_step * settings.group_size)

    def _session(self, step: int, group: int, index: int, problem: task.Problem) -> float:
        s = self.settings
        sess = http_json(
            "POST",
            self.control + "/floe/v1/sessions",
            {"task_id": problem.key, "group_id": f"{self.run}-s{step}-g{group}", "group_size": s.group_size},
        )
        client = openai.OpenAI(
            base_url=sess["base_urls"]["openai"], api_key=sess["api_key"], max_retries=0, timeout=900
        )
        try:
            ep = harness.run_episode(client, SERVED, problem, temperature=s.temperature)
        except Exception:
            http_json(
                "POST",
                f"{self.control}/floe/v1/sessions/{sess['session_id']}/finish",
                {"reward": 0.0, "status": "failed"},
            )
            raise
        http_json(
            "POST",
            f"{self.control}/floe/v1/sessions/{sess['session_id']}/finish",
            {"reward": ep.reward, "status": "completed"},
        )
        return ep.reward

    def run_step(self, step: int) -> tuple[float, float]:
        """All of step's sessions, to their finish; returns (mean reward, seconds)."""
        t0 = time.monotonic()
        s = self.settings
        futs = [
            self.pool.submit(self._session, step, g, i, self.problems[(step - 1) * s.groups_per_step + g])
            for g in range(s.groups_per_step)
            for i in range(s.group_size)
        ]
        rewards = [f.result() for f in futs]
        return sum(rewards) / len(rewards), time.monotonic() - t0

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def load_policy(model_dir: Path, lr: float, seed: int) -> tuple[Any, torch.optim.Optimizer]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    )
    model.train()  # SmolLM2 has no dropout: train mode scores as vLLM's eval mode does
    # The embedding matrix is tied to the LM head: it stays frozen (28M of 135M
    # parameters, the largest single AdamW update), everything else trains.
    model.get_input_embeddings().weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    return model, opt


def run(
    settings: Settings,
    *,
    floe_start: Callable[[Settings, str], tuple[str, str]],
    vllm_url: str,
    base_model: Path,
    sync_dir: Path,
    out: Callable[[StepLine], None],
    equivalence: Callable[[Any, Any, str], dict[str, Any]] | None = None,
) -> list[StepLine]:
    """One run; floe_start(settings, run) starts floe serve and returns (control, flight)."""
    from floe_bridge.client import FloeClient
    from floe_bridge.recipe import train_step

    torch.set_num_threads(settings.threads)
    run_name = f"{settings.strategy}-seed{settings.seed}"
    vllm = VLLMControl(vllm_url)
    vllm.load_weights(base_model)  # every run starts from the untrained model
    control, flight = floe_start(settings, run_name)
    model, opt = load_policy(base_model, settings.lr, settings.seed)
    rollouts = Rollouts(control, settings, run_name)
    lines: list[StepLine] = []
    t_eval = time.monotonic()
    held0 = evaluate(vllm_url, settings)
    base = StepLine(
        run_name,
        settings.strategy,
        settings.seed,
        0,
        0,
        float("nan"),
        float("nan"),
        0,
        0,
        0,
        0,
        0.0,
        0.0,
        0.0,
        0.0,
        time.monotonic() - t_eval,
        0.0,
        held_out_reward=held0,
    )
    out(base)
    lines.append(base)
    version = 0
    try:
        with FloeClient(flight, rank=0, world_size=1, timeout=900) as floe:
            next_reward, next_rollout_s = rollouts.run_step(1)
            for step in range(1, settings.steps + 1):
                reward, rollout_s = next_reward, next_rollout_s
                if step < settings.steps:
                    # one step off policy: step+1's sessions are sampled by the weights
                    # step trains from
                    next_reward, next_rollout_s = rollouts.run_step(step + 1)
                else:
                    next_rollout_s = 0.0
                t_read = time.monotonic()
                fetched = floe.read_step()  # the oldest uncommitted: floe numbers steps from 0
                read_s = time.monotonic() - t_read
                extra: dict[str, Any] = {}
                if step == 1 and equivalence is not None:
                    extra["equivalence"] = equivalence(model, fetched, control)
                t_train = time.monotonic()
                fig = train_step(model, opt, fetched.micro_batches, fetched.loss_tokens_global, attn="sdpa")
                train_s = time.monotonic() - t_train
                floe.report(
                    fetched.step,
                    rank=0,
                    step_seconds=fig.step_seconds,
                    wait_seconds=fetched.wait_seconds,
                    loss=fig.loss,
                )
                t_sync = time.monotonic()
                floe.pause()
                model.save_pretrained(str(sync_dir), safe_serialization=True)
                vllm.load_weights(sync_dir)
                version = step
                floe.resume(version)
                sync_s = time.monotonic() - t_sync
                floe.commit(fetched.step)
                held: float | None = None
                eval_s = 0.0
                if step % settings.eval_every == 0 or step == settings.steps:
                    t_eval = time.monotonic()
                    held = evaluate(vllm_url, settings)
                    eval_s = time.monotonic() - t_eval
                line = StepLine(
                    run_name,
                    settings.strategy,
                    settings.seed,
                    step,
                    version,
                    reward,
                    fig.loss,
                    fig.loss_tokens,
                    fig.rows,
                    fig.real_rows,
                    fig.micro_batches,
                    fig.mismatch,
                    rollout_s,
                    train_s,
                    sync_s,
                    eval_s,
                    rollout_s + read_s + train_s + sync_s + eval_s,
                    held_out_reward=held,
                    extra=extra,
                )
                out(line)
                lines.append(line)
            wait_archived(control, settings.steps)
    finally:
        rollouts.close()
    return lines


def wait_archived(control: str, steps: int, timeout: float = 300.0) -> None:
    """Returns once floe has archived every committed step: the archiver runs after each
    commit, and the run's archive check reads what it wrote. Polls floe's status, the
    only signal there is; the deadline is for a floe that cannot archive at all."""
    deadline = time.monotonic() + timeout
    while True:
        done = (http_json("GET", control + "/floe/v1/status").get("store") or {}).get("archived_steps", 0)
        if done >= steps:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"floe archived {done} of {steps} committed steps within {timeout:g} s (its log says why)"
            )
        time.sleep(0.2)


def to_json(line: StepLine) -> str:
    return json.dumps(asdict(line), allow_nan=True)


def ensure_dir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


__all__ = ["Settings", "StepLine", "run", "evaluate", "to_json", "ensure_dir", "SERVED", "http_json"]
