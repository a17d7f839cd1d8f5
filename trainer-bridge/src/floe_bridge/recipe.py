"""One GRPO training step over a floe step's micro-batches: the loop every trainer of this
repository runs (``examples/train_grpo.py``, ``demo/trainer.py``).

    figures = train_step(model, opt, step.micro_batches, step.loss_tokens_global,
                         loss=LossSettings(clip_low=0.2, clip_high=0.28), device="cuda", attn="flex")
    floe.report(step.step, step_seconds=figures.step_seconds, wait_seconds=step.wait_seconds,
                loss=figures.loss)

Per micro-batch: its columns become tensors (``to_tensors``), the model scores its loss
rows with the tree mask (``score_logprobs``), ``grpo_loss`` divides the summed per-token
loss by the step's ``loss_tokens_global`` and ``backward`` accumulates the gradient, so the
gradient is that of the token-mean over the whole step whatever the packing. Then the
gradient norm is clipped and the optimizer steps once.

Needs torch and transformers (through ``floe_bridge.hf``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .batch import MicroBatch
from .hf import AttnKind, score_logprobs
from .torch_ops import DUAL_CLIP, grpo_loss, to_tensors

__all__ = ["LossSettings", "StepFigures", "train_step"]


@dataclass(frozen=True)
class LossSettings:
    """The GRPO loss's knobs (``floe_bridge.torch_ops.grpo_loss``): asymmetric clip bounds,
    the truncated importance sampling cap (None: off), the data-parallel world size (when
    gradients are averaged across ranks), the dual-clip constant for negative advantages
    (None: off) and the aggregation: ``normalizer=None`` divides the step's summed per-token
    loss by its loss tokens (the step-global token mean), a number divides it by that
    constant instead (Dr. GRPO's: e.g. sessions per step × max tokens per call)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float | None = None
    world_size: int = 1
    dual_clip: float | None = DUAL_CLIP
    normalizer: float | None = None


@dataclass(frozen=True)
class StepFigures:
    """What one training step did, on this rank."""

    #: the step's loss: the sum of the micro-batch losses (the token-mean over the step's
    #: loss tokens, on one rank)
    loss: float
    #: loss tokens in this rank's micro-batches
    loss_tokens: int
    micro_batches: int
    #: rows forwarded, padding included
    rows: int
    #: rows before padding (the metadata's ``rows``, else the forwarded rows)
    real_rows: int
    #: mean |logp - old_logprobs| over the loss tokens (0 with none)
    mismatch: float
    #: seconds from the start of the step to the optimizer step done (CUDA synchronised)
    step_seconds: float
    #: peak CUDA memory allocated during the step (0 off CUDA)
    peak_memory_bytes: int


def train_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[MicroBatch],
    loss_tokens_global: int,
    *,
    loss: LossSettings = LossSettings(),
    device: torch.device | str = "cpu",
    attn: AttnKind = "sdpa",
    block_size: int = 128,
    max_grad_norm: float | None = 1.0,
) -> StepFigures:
    """One optimizer step of ``model`` over a step's micro-batches (this rank's share):
    forward and backward per micro-batch with the token-mean over ``loss_tokens_global``,
    gradient norm clipped to ``max_grad_norm`` (None: no clipping), ``optimizer.step()``.
    The gradients are zeroed first. ``attn`` and ``block_size`` go to ``score_logprobs``."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.monotonic()
    optimizer.zero_grad(set_to_none=True)
    total_loss = torch.zeros((), device=device)
    abs_diff = torch.zeros((), device=device)
    loss_tokens = rows = real_rows = 0
    for mb in micro_batches:
        tb = to_tensors(mb, device)
        logp = score_logprobs(model, tb, attn=attn, block_size=block_size)
        loss_rows = tb.loss_rows()
        mb_loss, m = grpo_loss(
            logp,
            tb.old_logprobs[loss_rows],
            tb.advantages[loss_rows],
            loss_tokens_global,
            clip_low=loss.clip_low,
            clip_high=loss.clip_high,
            tis_cap=loss.tis_cap,
            world_size=loss.world_size,
            dual_clip=loss.dual_clip,
            normalizer=loss.normalizer,
        )
        mb_loss.backward()  # type: ignore[no-untyped-call]  # accumulate: the losses sum to the step's token-mean
        total_loss += mb_loss.detach()
        n = int(m["loss_tokens"])
        abs_diff += m["mismatch"] * n
        loss_tokens += n
        rows += tb.num_rows
        real_rows += mb.meta.rows if mb.meta is not None and mb.meta.rows is not None else tb.num_rows
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    if cuda:
        torch.cuda.synchronize(device)
    step_seconds = time.monotonic() - t0
    return StepFigures(
        loss=float(total_loss),
        loss_tokens=loss_tokens,
        micro_batches=len(micro_batches),
        rows=rows,
        real_rows=real_rows,
        mismatch=float(abs_diff) / max(loss_tokens, 1),
        step_seconds=step_seconds,
        peak_memory_bytes=int(torch.cuda.max_memory_allocated(device)) if cuda else 0,
    )
