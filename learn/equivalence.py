"""Step 1 of every make learn run, scored twice from the same samples before it trains:

- as floe served it (its micro-batches, the strategy's packing and mask:
  ``floe_bridge.hf.score_logprobs`` and ``torch_ops.grpo_loss``, as ``recipe.train_step``
  runs them), and
- per request, written here from the paper's formula and nothing of floe's: every
  trainable call floe recorded (its control API's prompt ids, sampled ids and rollout
  log-probs) run as its own causal sequence ``prompt + response``, each token's loss
  ``-min(r·A, clip(r, 1-ε_low, 1+ε_high)·A)`` (for A < 0 bounded by ``-c·A``, the dual
  clip), summed over the step and divided by its sampled-token count, with A the
  session's advantage from the step's sample table.

Returned: both losses, their difference, and the gradients' relative difference
``||g_floe - g_ref|| / ||g_ref||`` (the issue's bounds: 1e-5 and 1e-4). The gradients are
zeroed after, so the step trains as if this never ran.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import torch

CLIP_LOW, CLIP_HIGH, DUAL_CLIP = 0.2, 0.28, 3.0


def _calls(control: str, session_id: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{control}/floe/v1/sessions/{session_id}", timeout=60) as r:
        calls: list[dict[str, Any]] = json.loads(r.read())["calls"] or []
    return calls


def _grads(model: Any) -> list[torch.Tensor]:
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in model.parameters()
        if p.requires_grad
    ]


def reference_loss(
    model: Any, calls: list[tuple[list[int], list[int], list[float], float, float]], n_tokens: int
) -> float:
    """The step's loss, its gradient accumulated into the model's .grad call by call (one
    call's graph alive at a time)."""
    total = 0.0
    for prompt, response, old, temperature, adv in calls:
        ids = torch.tensor([prompt + response], dtype=torch.long)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(response)[:, None])[
            :, 0
        ]
        ratio = torch.exp(logp - torch.tensor(old))
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH) * adv)
        if adv < 0:
            surrogate = torch.maximum(surrogate, torch.full_like(surrogate, DUAL_CLIP * adv))
        loss = (-surrogate).sum() / n_tokens
        loss.backward()  # type: ignore[no-untyped-call]
        total += float(loss.detach().double())
    return total


def check(model: Any, step: Any, control: str) -> dict[str, Any]:
    from floe_bridge.hf import score_logprobs
    from floe_bridge.torch_ops import grpo_loss, to_tensors

    samples = step.samples()
    advantage = dict(
        zip(samples.column("session_id").to_pylist(), samples.column("advantage").to_pylist(), strict=True)
    )
    calls: list[tuple[list[int], list[int], list[float], float, float]] = []
    for sid, adv in advantage.items():
        for c in _calls(control, sid):
            if c.get("trainable") and c["response_ids"]:
                t = c.get("temperature")
                calls.append(
                    (
                        c["prompt_ids"],
                        c["response_ids"],
                        c["logprobs"],
                        1.0 if t is None else float(t),
                        float(adv),
                    )
                )
    n_ref = sum(len(c[1]) for c in calls)

    model.zero_grad(set_to_none=True)
    floe_loss = torch.zeros((), dtype=torch.float64)
    for mb in step.micro_batches:
        tb = to_tensors(mb)
        logp = score_logprobs(model, tb, attn="sdpa")
        rows = tb.loss_rows()
        loss, _ = grpo_loss(
            logp,
            tb.old_logprobs[rows],
            tb.advantages[rows],
            step.loss_tokens_global,
            clip_low=CLIP_LOW,
            clip_high=CLIP_HIGH,
            dual_clip=DUAL_CLIP,
        )
        loss.backward()  # type: ignore[no-untyped-call]
        floe_loss += loss.detach().double()
    g_floe = _grads(model)

    model.zero_grad(set_to_none=True)
    ref = reference_loss(model, calls, n_ref)
    g_ref = _grads(model)
    model.zero_grad(set_to_none=True)

    diff = torch.stack([((a.double() - b.double()) ** 2).sum() for a, b in zip(g_floe, g_ref, strict=True)])
    diff = diff.sum().sqrt()
    norm = torch.stack([(b.double() ** 2).sum() for b in g_ref]).sum().sqrt()
    return {
        "calls": len(calls),
        "loss_tokens": step.loss_tokens_global,
        "loss_tokens_ref": n_ref,
        "loss_floe": float(floe_loss),
        "loss_ref": float(ref),
        "loss_abs_diff": abs(float(floe_loss) - float(ref)),
        "grad_rel_diff": float(diff / norm) if float(norm) > 0 else float(diff),
        "grad_norm": float(norm),
    }
