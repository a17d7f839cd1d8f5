"""make learn's short version: two GRPO steps of learn/loop.py through floe against the
real vLLM, with the weight sync, and what must hold of them (docs/learn.md):

- step 1's loss and gradient from floe's micro-batches equal a per-call scoring written
  from the paper's formula (1e-5, 1e-4), for tree and per_request;
- after each step vLLM serves the trainer's weights: its log-probs for a fixed prompt
  equal the trained model's (rescoring, 1e-4), and are off the untrained model's;
- every archived call names the version that sampled it; the second step trained calls
  one version old, which -max-staleness 1 admits, and none older than its step's cut-off.

The vLLM is the suite's (conftest.py, dev mode on); the test puts the base weights back
when it is done, so the other tests see the untrained model.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from vllmstack import REPO, SERVED, Floe, http_json, model_dir

sys.path.insert(0, str(REPO / "learn"))

import equivalence  # noqa: E402
import harness  # noqa: E402
import loop  # noqa: E402
import run as learn_run  # noqa: E402

STEPS = 2


def vllm_logprobs(vllm_url: str, prompt_ids: list[int], n: int = 8) -> tuple[list[int], list[float]]:
    """n tokens vLLM samples after prompt_ids at T = 1, with their log-probs."""
    r = http_json(
        "POST",
        vllm_url + "/v1/completions",
        {
            "model": SERVED,
            "prompt": prompt_ids,
            "max_tokens": n,
            "temperature": 1.0,
            "seed": 7,
            "logprobs": 0,
            "return_token_ids": True,
        },
    )
    choice = r["choices"][0]
    return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]


def rescore(model: Any, prompt_ids: list[int], ids: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    return [float(x) for x in lp]


@pytest.mark.parametrize("strategy", ["tree", "per_request"])
def test_two_steps_learn_through_floe(
    strategy: str, vllm_url: str, floe_serve: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    base = model_dir()
    settings = loop.Settings(
        strategy=strategy,
        seed=3,
        steps=STEPS,
        groups_per_step=1,
        group_size=4,
        eval_every=STEPS,
        eval_episodes=4,
        lr=1e-4,
    )
    started: list[Floe] = []

    def floe_start(s: loop.Settings, run: str) -> tuple[str, str]:
        f = floe_serve(
            s.strategy,
            group_size=s.group_size,
            groups_per_step=s.groups_per_step,
            steps_ahead=1,
            max_staleness=s.max_staleness,
            token_budget=s.token_budget,
        )
        started.append(f)
        return f.control, f.flight

    # keep a handle on the trained model, to rescore vLLM's answers with it
    models: list[Any] = []
    real_load = loop.load_policy

    def load(model_path: Path, lr: float, seed: int) -> Any:
        m, opt = real_load(model_path, lr, seed)
        models.append(m)
        return m, opt

    monkeypatch.setattr(loop, "load_policy", load)

    # The equivalence check needs advantages that are not all zero, and a group of four
    # sampled episodes gets one reward for all about one time in six. What is checked is
    # the loss and gradient from the step's samples, whatever their rewards, so the
    # training episodes' rewards alternate 1, 0 in the order they finish: every step's
    # group holds two of each. Held-out evaluation keeps the task's own reward.
    real_episode = harness.run_episode
    finished = itertools.count()
    lock = threading.Lock()

    def episode(client: Any, model: str, problem: Any, **kw: Any) -> Any:
        ep = real_episode(client, model, problem, **kw)
        if kw.get("seed") is not None:  # held-out evaluation: seeded
            return ep
        with lock:
            n = next(finished)
        return dataclasses.replace(ep, reward=float(n % 2 == 0))

    monkeypatch.setattr(harness, "run_episode", episode)
    lines: list[loop.StepLine] = []
    sync = tmp_path / "weights"
    sync.mkdir()
    probe = [1, 9690, 198, 2683, 314, 216, 33, 1232, 216, 34, 47, 2]  # "<|im_start|>system..." a fixed prompt
    try:
        loop.run(
            settings,
            floe_start=floe_start,
            vllm_url=vllm_url,
            base_model=base,
            sync_dir=sync,
            out=lines.append,
            equivalence=equivalence.check,
        )
        trained = models[0]
        ids, served = vllm_logprobs(vllm_url, probe)
        after = rescore(trained, probe, ids)
    finally:
        loop.VLLMControl(vllm_url).load_weights(base)  # the other tests see the untrained model
    from transformers import AutoModelForCausalLM

    untrained = AutoModelForCausalLM.from_pretrained(
        str(base), dtype=torch.float32, attn_implementation="sdpa"
    )
    before = rescore(untrained, probe, ids)

    assert [ln.step for ln in lines] == list(range(STEPS + 1))
    assert [ln.policy_version for ln in lines] == list(range(STEPS + 1))
    assert lines[0].held_out_reward is not None and lines[-1].held_out_reward is not None
    assert all(ln.real_rows > 0 and ln.loss_tokens > 0 for ln in lines[1:])

    eq = lines[1].extra["equivalence"]
    assert eq["calls"] == 2 * settings.group_size, eq  # two calls a session, every one trainable
    assert eq["loss_tokens"] == eq["loss_tokens_ref"], eq
    assert eq["loss_abs_diff"] <= 1e-5, eq
    assert eq["grad_rel_diff"] <= 1e-4, eq
    assert eq["grad_norm"] > 0, eq  # a group of identical rewards would test nothing

    # vLLM serves what the trainer trained: its log-probs are the trained model's
    assert max(abs(a - b) for a, b in zip(served, after, strict=True)) <= 1e-4, (served, after)
    assert max(abs(a - b) for a, b in zip(served, before, strict=True)) > 1e-3, (
        "the sync changed nothing vLLM serves"
    )

    # the weight-sync endpoint vLLM's dev mode serves is not reachable through floe's
    # proxy, whatever key a harness holds
    sess = http_json(
        "POST",
        started[0].control + "/floe/v1/sessions",
        {"task_id": "probe", "group_id": "probe", "group_size": 2},
    )
    req = urllib.request.Request(
        started[0].proxy + "/collective_rpc",
        method="POST",
        data=json.dumps({"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}).encode(),
        headers={"Authorization": f"Bearer {sess['api_key']}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=30)
    assert refused.value.code == 404, refused.value.read()

    arch = learn_run.check_archive(started[0].data_dir, settings.max_staleness)  # loop.run waited for it
    assert arch["calls_without_version"] == 0, arch
    assert arch["trained_older_than_cutoff"] == 0, arch
    # step 1 trained version-0 calls at version 0; step 2 trained the version-0 calls
    # sampled before step 1 trained, at version 1: -max-staleness 1 admitted them
    assert arch["lag_histogram"] == {"0": 2 * settings.group_size, "1": 2 * settings.group_size}, arch
