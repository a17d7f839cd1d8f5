"""Two data-parallel ranks (torch.distributed, gloo, two CPU processes) read one floe step
each from a ``-dp-size 2`` server; their token-mean loss, all-reduced, equals the same loss
computed in one process over a ``-dp-size 1`` server with the same corpus: the same loss
terms in another layout.

The ranks run this file as a script (``python test_distributed.py LOCATION OUT RANK WORLD
PORT``): a plain subprocess needs no pickling and starts the same way under any pytest
import mode.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from floe_bridge import FloeClient, MicroBatch

if TYPE_CHECKING:
    from conftest import FloeServer

GROUPS = 4  # 2 steps of 2 groups
STEPS = 2
SEED = 7
WORLD = 2


def _loss_terms(mbs: list[MicroBatch]) -> list[tuple[int, float, float]]:
    """(token, old_logprob, advantage) of every loss row, sorted: the step's loss terms."""
    out: list[tuple[int, float, float]] = []
    for mb in mbs:
        loss = mb.loss_mask != 0
        ids, lps, advs = mb.input_ids[loss], mb.old_logprobs[loss], mb.advantages[loss]
        out += zip(ids.tolist(), lps.tolist(), advs.tolist(), strict=True)
    return sorted(out)


def _local_sum(mbs: list[MicroBatch]) -> float:
    """Σ loss_mask · advantage · old_logprob over the micro-batches, in float64."""
    f8 = np.float64
    return float(sum(
        np.sum(mb.loss_mask.astype(f8) * mb.advantages.astype(f8) * mb.old_logprobs.astype(f8)) for mb in mbs
    ))


# --- the rank processes ---------------------------------------------------------------------


def _worker(location: str, out: str, rank: int, world: int, port: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=30),
    )
    try:
        results: list[dict[str, Any]] = []
        with FloeClient(location, timeout=20) as floe:  # rank and world size from torch.distributed
            assert (floe.rank, floe.world_size) == (rank, world), (floe.rank, floe.world_size)
            for s in range(STEPS):
                t0 = time.monotonic()
                step = floe.read_step(s)
                assert step.rank == rank
                L = step.loss_tokens_global
                # a token-mean loss as a trainer computes it: Σ_local / L, then SUM over ranks
                local = torch.zeros((), dtype=torch.float64)
                for mb in step.micro_batches:
                    mask = torch.from_numpy(mb.loss_mask.astype(np.float64))
                    adv = torch.from_numpy(mb.advantages.astype(np.float64))
                    lp = torch.from_numpy(mb.old_logprobs.astype(np.float64))
                    local = local + (mask * adv * lp).sum() / L
                loss = local.clone()
                dist.all_reduce(loss, op=dist.ReduceOp.SUM)
                counts = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
                dist.all_gather(counts, torch.tensor([len(step.micro_batches), step.num_loss_tokens]))
                floe.report(s, step_seconds=time.monotonic() - t0, wait_seconds=step.wait_seconds)
                dist.barrier()  # every rank is done with the step: one commits it
                if rank == 0:
                    floe.commit(s)
                dist.barrier()
                results.append({
                    "step": s,
                    "micro_batches": len(step.micro_batches),
                    "counts": [c.tolist() for c in counts],
                    "loss_tokens_global": L,
                    "local": float(local),
                    "loss": float(loss),
                    "terms": _loss_terms(step.micro_batches),
                })
        Path(out).write_text(json.dumps({"rank": rank, "steps": results}))
    finally:
        dist.destroy_process_group()


# --- the test ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_two_ranks_match_one(floe_server: Callable[..., FloeServer], tmp_path: Path) -> None:
    dp2 = floe_server(groups=GROUPS, seed=SEED, dp_size=WORLD, steps_ahead=STEPS)
    dp1 = floe_server(groups=GROUPS, seed=SEED, dp_size=1, steps_ahead=STEPS)
    assert dp2.steps == dp1.steps == STEPS

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    outs = [tmp_path / f"rank{r}.json" for r in range(WORLD)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, dp2.location, str(outs[r]), str(r), str(WORLD), str(port)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(WORLD)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=90)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r]}"
    ranks = [json.loads(o.read_text()) for o in outs]

    with FloeClient(dp1.location) as single:
        for s in range(STEPS):
            ref = single.read_step(s)
            assert ref.info.num_ranks == 1
            L = ref.loss_tokens_global
            want = _local_sum(ref.micro_batches) / L
            per_rank = [r["steps"][s] for r in ranks]
            # both ranks ran the same number of micro-batches, and agree on the counts
            assert per_rank[0]["counts"] == per_rank[1]["counts"]
            assert len({c[0] for c in per_rank[0]["counts"]}) == 1
            assert [p["micro_batches"] for p in per_rank] == [c[0] for c in per_rank[0]["counts"]]
            # the same loss terms, split over the ranks
            assert all(p["loss_tokens_global"] == L for p in per_rank)
            assert sum(c[1] for c in per_rank[0]["counts"]) == L
            merged = sorted(tuple(t) for p in per_rank for t in p["terms"])
            assert merged == _loss_terms(ref.micro_batches)
            # the all-reduced token-mean loss is the single-process one
            assert per_rank[0]["loss"] == per_rank[1]["loss"]
            assert abs(per_rank[0]["loss"] - want) <= 1e-12 * max(1.0, abs(want)), (per_rank[0]["loss"], want)
            assert abs(sum(p["local"] for p in per_rank) - want) <= 1e-12 * max(1.0, abs(want))
            single.commit(s)
    with FloeClient(dp2.location) as check:
        assert check.status()["committed"] == STEPS, "rank 0 committed every step once"


if __name__ == "__main__":
    _loc, _out, _rank, _world, _port = sys.argv[1:]
    _worker(_loc, _out, int(_rank), int(_world), int(_port))
