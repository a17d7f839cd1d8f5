"""TRL's tree attention on a machine without CUDA (docs/trl.md): an SDPA implementation
registered under TRL's attention name, and the patch that lets ``AsyncGRPOTrainer`` start
there. torch, transformers and trl are imported when called."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: TRL's attention name (``trl.experimental.async_grpo.packing.TREE_ATTENTION``).
TREE_ATTENTION = "tree_fa3"


def cpu_tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q: int,
    tree_max_seqlen_k: int,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """TRL's tree attention (``packing.tree_attention``) with SDPA instead of FA3 varlen:
    each segment's queries attend causally (bottom-right aligned) to the gathered K/V of
    its root-to-segment path. Same inputs, same output layout ``(1, N, heads, dim)``."""
    import torch
    import torch.nn.functional as F

    if softcap:
        raise NotImplementedError("cpu_tree_attention: softcap is not supported")
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # (N, heads, dim)
    k = k.index_select(0, tree_kv_index)
    v = v.index_select(0, tree_kv_index)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    out = torch.empty_like(q)
    cq, ck = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        qs, ks = q[cq[s]:cq[s + 1]], k[ck[s]:ck[s + 1]]
        lq, lk = qs.shape[0], ks.shape[0]
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        mask = j <= i + (lk - lq)
        if sliding_window:
            mask &= j > i + (lk - lq) - sliding_window
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1),
            ks.transpose(0, 1),
            v[ck[s] : ck[s + 1]].transpose(0, 1),
            attn_mask=mask,
            scale=scaling,
        )
        out[cq[s]:cq[s + 1]] = o.transpose(0, 1)
    return out.unsqueeze(0), None


def register_cpu_tree_attention() -> None:
    """Register :func:`cpu_tree_attention` under TRL's attention name ``tree_fa3``.

    ``AsyncGRPOTrainer.__init__`` registers TRL's FA3 implementation under that name, and
    transformers looks the function up at every forward, so call this *after* building the
    trainer (``FloeAsyncGRPOTrainer`` does it with ``cpu_tree_attention=True``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TREE_ATTENTION, cpu_tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, lambda **kwargs: None)


def use_cpu_tree_attention() -> None:
    """Make ``AsyncGRPOTrainer`` run on a machine without CUDA (tests, CPU examples).

    TRL 1.16's trainer registers its FA3 tree attention in ``__init__`` (the kernel comes
    from the Hugging Face Hub and needs a GPU) and asks CUDA for the device's peak FLOPs
    unconditionally. This rebinds, in ``trl.experimental.async_grpo.async_grpo_trainer``,
    ``register_tree_attention`` to :func:`register_cpu_tree_attention` (SDPA, same
    semantics, same name ``tree_fa3``) and ``get_peak_flops_per_device`` to answer None (no
    MFU metric) off CUDA. Nothing else of TRL changes; the loss is TRL's."""
    import torch
    from trl.experimental.async_grpo import async_grpo_trainer as agt
    from trl.trainer.utils import get_peak_flops_per_device

    register_cpu_tree_attention()
    # the trainer module's own bindings (imported there, not exported): rebinding them is the patch
    names = vars(agt)
    names["register_tree_attention"] = register_cpu_tree_attention
    if names["get_peak_flops_per_device"] is not get_peak_flops_per_device:
        return  # patched already

    def peak_flops(accelerator: Any, dtype: str) -> float | None:  # accelerate has no types
        if accelerator.device.type != "cuda" or not torch.cuda.is_available():
            return None
        return get_peak_flops_per_device(accelerator, dtype)

    names["get_peak_flops_per_device"] = peak_flops
