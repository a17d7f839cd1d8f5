"""Hugging Face ``transformers`` adapter: run a causal LM on one floe micro-batch.

The whole micro-batch is ONE sequence of N rows (batch dim 1). ``position_ids`` are the
tree depths, so RoPE sees each token's true position in its own root-to-leaf sequence, and
the attention mask is the tree mask (row k visible to row q iff ``k <= q <
subtree_end[k]``). The result equals running every root-to-leaf path as its own causal
sequence (tests/test_equivalence.py proves it against floe's Flight output).

How transformers (checked on 5.x, ``masking_utils.py``) takes a precomputed mask
-------------------------------------------------------------------------------
``create_causal_mask`` -> ``_preprocess_mask_arguments``: an ``attention_mask`` that is a
``torch.Tensor`` or a FlexAttention ``BlockMask`` with ``len(mask.shape) == 4`` is returned
AS-IS ("already prepared, or custom"): no causal mask, no padding mask and no
packed-sequence detection is applied on top. Sliding-window layers
(``create_sliding_window_causal_mask``) take the same early exit, so the window is NOT
applied to a custom mask: :func:`score` refuses a model whose sliding-window layers would
matter. What each attention implementation then does with the mask:

- ``sdpa`` (``integrations/sdpa_attention.py``): passed to
  ``F.scaled_dot_product_attention(attn_mask=...)`` with ``is_causal=False`` (it is only
  set when the mask is None). A bool mask means True = attend. We pass bool ``[1, 1, N, N]``.
- ``eager`` (``eager_attention_forward``): the mask is ADDED to the scores, so it must be
  additive float: 0 where visible, ``finfo(dtype).min`` elsewhere. (A bool mask would be
  added as 0/1 and silently break the tree.)
- ``flex_attention`` (``integrations/flex_attention.py``): a ``BlockMask`` is used as the
  ``block_mask`` of ``flex_attention`` (a 4-D tensor would become an additive score_mod).
  We pass :func:`floe_bridge.torch_ops.flex_block_mask` (shape ``(1, 1, N, N)``), which
  never builds an N×N tensor. transformers wraps ``flex_attention`` in ``torch.compile``.
- ``flash_attention_2``/``_3``: these take no custom mask; with ``attention_mask=None``
  transformers derives ``cu_seqlens`` from ``position_ids`` restarting at 0. That is only
  right when the micro-batch is a concatenation of plain chains
  (:func:`floe_bridge.torch_ops.cu_seqlens` is not None: ``prefix_merging``,
  ``per_request``, or a ``tree`` batch without shared rows); :func:`score` checks it and
  raises otherwise.

The trap: never call a transformers model on a tree micro-batch with
``attention_mask=None`` under sdpa/eager/flex. ``find_packed_sequence_indices`` would read
the depth column as packed sequences (a new sequence wherever the position does not go up
by exactly one), so a branch would lose sight of the prompt it shares, silently.

Only the rows that predict a loss token need logits: :func:`score_logprobs` passes their
indices as ``logits_to_keep`` (a 1-D tensor: transformers slices the hidden states before
``lm_head``), so no ``[N, V]`` logits tensor exists.
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
from torch import Tensor

from .torch_ops import TreeBatch, cu_seqlens, dense_mask, flex_block_mask, token_logprobs

__all__ = ["AttnKind", "attn_kind", "tree_attention_mask", "score", "score_logprobs"]

AttnKind = Literal["sdpa", "eager", "flex", "flash", "auto"]

_IMPL_TO_KIND: dict[str, str] = {
    "sdpa": "sdpa",
    "eager": "eager",
    "flex_attention": "flex",
    "flash_attention_2": "flash",
    "flash_attention_3": "flash",
}
_KIND_TO_IMPL: dict[str, str] = {
    "sdpa": "sdpa",
    "eager": "eager",
    "flex": "flex_attention",
    "flash": "flash_attention_2",
}


def _impl(model: Any) -> str:
    cfg = model.config
    impl = getattr(cfg, "_attn_implementation", None) or getattr(cfg, "attn_implementation", None)
    return str(impl or "eager")


def attn_kind(model: Any, attn: AttnKind = "auto") -> str:
    """The mask kind to build for ``model``: its ``config._attn_implementation`` mapped to
    ``sdpa``/``eager``/``flex``/``flash``. An explicit ``attn`` must agree with how the model
    was loaded (``attn_implementation=...``): the mask type is implementation-specific."""
    impl = _impl(model)
    kind = _IMPL_TO_KIND.get(impl)
    if kind is None:
        raise ValueError(
            f"floe_bridge.hf: unsupported attn_implementation {impl!r}; load the model with "
            "attn_implementation='sdpa', 'eager', 'flex_attention' or 'flash_attention_2'"
        )
    if attn != "auto" and attn != kind:
        raise ValueError(
            f"floe_bridge.hf: attn={attn!r}, but the model runs attn_implementation={impl!r}; load it with "
            f"attn_implementation={_KIND_TO_IMPL[attn]!r} (or pass attn='auto')"
        )
    return kind


def _check_sliding_window(model: Any, batch: TreeBatch) -> None:
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or []
    window = getattr(cfg, "sliding_window", None)
    if "sliding_attention" in types and window is not None:
        depth = int(batch.position_ids.max()) + 1 if batch.num_rows else 0
        if depth > int(window):
            raise NotImplementedError(
                f"floe_bridge.hf: the model has sliding-window layers (window {window}) and this micro-batch "
                f"has paths of {depth} tokens; a custom 4-D tree mask bypasses transformers' window"
            )


def tree_attention_mask(
    model: Any, batch: TreeBatch, attn: AttnKind = "auto", *, block_size: int = 128
) -> Any:
    """The ``attention_mask`` argument for ``model`` on ``batch`` (see the module doc):
    bool ``[1,1,N,N]`` (sdpa), additive float ``[1,1,N,N]`` in the model's dtype (eager),
    a ``BlockMask`` (flex), or ``None`` for flash when the batch is plain chains."""
    kind = attn_kind(model, attn)
    end = batch.subtree_end
    if kind == "flex":
        return flex_block_mask(end, block_size)
    if kind == "flash":
        if cu_seqlens(end, batch.position_ids) is None:
            raise ValueError(
                "floe_bridge.hf: flash attention takes no tree mask and this micro-batch shares rows "
                "(cu_seqlens is None); use sdpa/eager/flex_attention, or a prefix_merging/per_request floe"
            )
        return None
    mask = dense_mask(end)[None, None]
    if kind == "sdpa":
        return mask
    dtype = next(model.parameters()).dtype
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(~mask, torch.finfo(dtype).min)


def _forward(model: Any, batch: TreeBatch, attn: AttnKind, block_size: int, **kwargs: Any) -> Any:
    _check_sliding_window(model, batch)
    mask = tree_attention_mask(model, batch, attn, block_size=block_size)
    return model(
        input_ids=batch.input_ids[None],
        position_ids=batch.position_ids[None],
        attention_mask=mask,
        use_cache=False,
        **kwargs,
    )


def score(model: Any, batch: TreeBatch, *, attn: AttnKind = "auto", block_size: int = 128) -> Tensor:
    """Logits ``[N, V]`` of every row of ``batch`` (row ``i``'s output predicts the children
    of ``i``). Materialises ``N × V`` logits: prefer :func:`score_logprobs` for training."""
    out = _forward(model, batch, attn, block_size)
    logits: Tensor = out.logits[0]
    return logits


@overload
def score_logprobs(
    model: Any,
    batch: TreeBatch,
    *,
    attn: AttnKind = ...,
    block_size: int = ...,
    entropy: Literal[False] = ...,
) -> Tensor: ...
@overload
def score_logprobs(
    model: Any, batch: TreeBatch, *, attn: AttnKind = ..., block_size: int = ..., entropy: Literal[True]
) -> tuple[Tensor, Tensor]: ...
def score_logprobs(
    model: Any,
    batch: TreeBatch,
    *,
    attn: AttnKind = "auto",
    block_size: int = 128,
    entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probabilities (float32) of the loss rows of ``batch``, in row order: the same as
    ``gather_logprobs(score(model, batch), ...)`` but the logits are computed only for the
    predicting rows ``pred_idx[loss rows]`` (``logits_to_keep``). With ``entropy=True``
    returns ``(logp, entropy)``. Pair with ``batch.old_logprobs[batch.loss_mask]`` and
    ``batch.advantages[batch.loss_mask]`` for :func:`floe_bridge.torch_ops.grpo_loss`."""
    rows = batch.loss_rows()
    pred = batch.pred_idx[rows]
    if rows.numel() and bool((pred < 0).any()):
        raise ValueError("score_logprobs: a loss row has no predicting row (pred_idx = -1)")
    out = _forward(model, batch, attn, block_size, logits_to_keep=pred)
    logits: Tensor = out.logits[0]
    if logits.shape[0] != pred.shape[0]:
        raise RuntimeError(
            f"score_logprobs: the model returned {logits.shape[0]} logit rows for {pred.shape[0]} kept "
            "positions; "
            "this transformers version does not take a tensor logits_to_keep (use score + gather_logprobs)"
        )
    targets = batch.input_ids[rows]
    if entropy:
        return token_logprobs(logits, targets, entropy=True)
    return token_logprobs(logits, targets)
