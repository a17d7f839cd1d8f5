"""Compute side of the bridge: floe micro-batches as torch tensors, tree attention masks,
loss-row log-probabilities and the GRPO loss.

Importing this module imports torch; ``floe_bridge`` itself does not.

Layout reminder (docs/batcher.md): one row per token in DFS pre-order of a token forest;
row ``k`` is visible to row ``q`` iff ``k <= q < subtree_end[k]``; ``pred_idx[t]`` is the
parent row, whose output predicts token ``t`` (``-1`` at roots and on padding);
``position_ids`` is the depth, i.e. the token's position in its own root-to-leaf sequence.

Everything here is exact with respect to running each root-to-leaf path as its own causal
sequence: the rows a query sees under the mask are exactly its ancestors and itself, and
RoPE sees the true positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from .batch import MicroBatch, MicroBatchMeta

__all__ = [
    "TreeBatch",
    "to_tensors",
    "dense_mask",
    "tree_mask_mod",
    "flex_block_mask",
    "cu_seqlens",
    "token_logprobs",
    "gather_logprobs",
    "grpo_loss",
    "LOG_RATIO_MAX",
    "DUAL_CLIP",
]


# --- transport columns -> compute tensors ------------------------------------------------


@dataclass(frozen=True, slots=True)
class TreeBatch:
    """One micro-batch as compute tensors, all of length ``N`` (rows, padding included).

    dtypes: ``input_ids``, ``position_ids``, ``subtree_end``, ``pred_idx``, ``sample_idx``
    int64 (what embedding lookups, RoPE and advanced indexing want); ``loss_mask`` bool;
    ``old_logprobs``, ``advantages`` and ``temperature`` float32 (cast to the loss dtype
    where used). ``temperature`` is the sampling temperature of each loss row's call (1
    elsewhere): a loss row's log-prob is ``log_softmax(logits[pred] / temperature)``.
    """

    input_ids: Tensor
    position_ids: Tensor
    subtree_end: Tensor
    pred_idx: Tensor
    loss_mask: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    sample_idx: Tensor
    temperature: Tensor | None = None  # None: every row at T = 1
    meta: MicroBatchMeta | None = None

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def loss_rows(self) -> Tensor:
        """Indices of the loss rows, ascending (int64). Synchronises with the device."""
        return torch.nonzero(self.loss_mask, as_tuple=False).squeeze(-1)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> TreeBatch:
        moved: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device, non_blocking=non_blocking) if isinstance(v, Tensor) else v
        return TreeBatch(**moved)


_INT_COLUMNS = ("input_ids", "position_ids", "subtree_end", "pred_idx", "sample_idx")
_FLOAT_COLUMNS = ("old_logprobs", "advantages", "temperature")


def to_tensors(mb: MicroBatch, device: torch.device | str = "cpu") -> TreeBatch:
    """The one place where transport columns become compute tensors.

    Each column is copied once out of the (read-only) Arrow buffer into a fresh host array of
    its compute dtype, pinned when the target is CUDA, then moved with ``non_blocking``.
    """
    dev = torch.device(device)
    pin = dev.type == "cuda"

    def conv(arr: npt.NDArray[Any], dtype: type[np.generic]) -> Tensor:
        host = torch.from_numpy(np.array(arr, dtype=dtype, copy=True))
        if pin:
            host = host.pin_memory()
        return host.to(dev, non_blocking=pin)

    cols: dict[str, Tensor] = {}
    for name in _INT_COLUMNS:
        cols[name] = conv(getattr(mb, name), np.int64)
    for name in _FLOAT_COLUMNS:
        cols[name] = conv(getattr(mb, name), np.float32)
    cols["loss_mask"] = conv(mb.loss_mask, np.bool_)
    return TreeBatch(meta=mb.meta, **cols)


# --- masks --------------------------------------------------------------------------------


def _check_window(position_ids: Tensor | None, window: int | None) -> None:
    if window is None:
        return
    if position_ids is None:
        raise ValueError("a sliding-window tree mask needs position_ids (the depths)")
    if int(window) < 1:
        raise ValueError(f"sliding window must be at least 1, got {window}")


def dense_mask(subtree_end: Tensor, position_ids: Tensor | None = None, window: int | None = None) -> Tensor:
    """Boolean ``[N, N]`` mask, ``mask[q, k] = k <= q < subtree_end[k]`` (True = q may attend
    to k). O(N²) memory: for CPU, SDPA/eager and tests. On the same device as the input.

    With a sliding ``window`` (and the depths ``position_ids``), a row also sees an ancestor
    only when ``position_ids[q] - position_ids[k] < window``: the ``window`` most recent
    tokens of its own sequence, itself included, which is what a sliding-window layer of
    transformers (``kv_idx > q_idx - sliding_window``) and vLLM saw on that call alone."""
    _check_window(position_ids, window)
    end = subtree_end.to(torch.int64)
    rows = torch.arange(end.shape[0], device=end.device)
    q = rows[:, None]
    k = rows[None, :]
    mask = (k <= q) & (q < end[None, :])
    if window is not None:
        assert position_ids is not None
        pos = position_ids.to(torch.int64)
        mask &= (pos[:, None] - pos[None, :]) < int(window)
    return mask


def tree_mask_mod(
    subtree_end: Tensor, position_ids: Tensor | None = None, window: int | None = None
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """FlexAttention ``mask_mod``: ``(kv <= q) & (q < subtree_end[kv])``, and with a sliding
    ``window`` also ``position_ids[q] - position_ids[kv] < window`` (see :func:`dense_mask`).

    ``subtree_end`` (and ``position_ids``) must cover every index the kernel may ask about,
    i.e. be padded to a multiple of the block size (``flex_block_mask`` pads them with
    zeros: a padded key is visible to nobody)."""
    _check_window(position_ids, window)
    if window is None:

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

        return mask_mod
    assert position_ids is not None
    pos = position_ids
    w = int(window)

    def window_mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx]) & (pos[q_idx] - pos[kv_idx] < w)

    return window_mask_mod


def _tree_block_tables(
    end: Tensor, n: int, bs: int, pos: Tensor | None = None, window: int | None = None
) -> tuple[Tensor, Tensor]:
    """Block-level (partial, full) tables ``[nb, nb]`` of the tree mask, computed from
    per-block min/max of ``subtree_end``, never touching an N×N tensor.

    For query block i = rows [qs, qe) and key block j = rows [ks, ke):
    - j > i: every key is after every query: empty.
    - j == i: the diagonal holds (q, q), always visible: non-empty, never full (bs > 1).
    - j < i: every key precedes every query, so a key k sees the block iff
      ``subtree_end[k] > qs``: non-empty iff ``max(end[j-block]) > qs``; full iff
      ``min(end[j-block]) >= qe``.
    A block that runs past N is never full (create_block_mask pads the mask with False
    there, and so do we), which keeps these tables identical to ``create_block_mask``'s.

    With a sliding ``window`` over the depths ``pos``: a block pair is full only if also
    ``max(pos[q-block]) - min(pos[k-block]) < window``, and empty if
    ``min(pos[q-block]) - max(pos[k-block]) >= window`` (bounds, so a pair the window
    empties may still be listed as partial: the mask_mod decides inside it).
    """
    nb = (n + bs - 1) // bs
    pad = nb * bs - n
    dev = end.device
    e = end.to(torch.int64)
    # padded keys: end = 0 for the max (never visible), a huge end for the min (no effect;
    # the last block is excluded from "full" anyway when it is incomplete)
    e_max = torch.nn.functional.pad(e, (0, pad), value=0).view(nb, bs).amax(-1)
    e_min = torch.nn.functional.pad(e, (0, pad), value=n).view(nb, bs).amin(-1)
    blk = torch.arange(nb, device=dev)
    qs = blk * bs
    qe = torch.clamp(qs + bs, max=n)
    complete = (qe - qs) == bs
    i = blk[:, None]  # query block
    j = blk[None, :]  # key block
    below = j < i
    nonempty = (j == i) | (below & (e_max[None, :] > qs[:, None]))
    full = below & (e_min[None, :] >= qe[:, None]) & complete[:, None] & complete[None, :]
    if window is not None:
        assert pos is not None
        big = torch.iinfo(torch.int64).max // 4
        p = pos.to(torch.int64)
        p_max = torch.nn.functional.pad(p, (0, pad), value=-big).view(nb, bs).amax(-1)
        p_min = torch.nn.functional.pad(p, (0, pad), value=big).view(nb, bs).amin(-1)
        full &= (p_max[:, None] - p_min[None, :]) < int(window)
        nonempty &= (j == i) | ((p_min[:, None] - p_max[None, :]) < int(window))
    partial = nonempty & ~full
    return partial, full


def _dense_to_ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """``[nq, nkv]`` bool -> (num_blocks ``[1,1,nq]`` int32, indices ``[1,1,nq,nkv]`` int32),
    set blocks first, ascending (the order create_block_mask produces)."""
    b = blocks.to(torch.int8)
    num = b.sum(-1, dtype=torch.int32)
    idx = torch.argsort(b, dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None], idx[None, None]


def flex_block_mask(
    subtree_end: Tensor,
    block_size: int = 128,
    *,
    build: Literal["blocks", "create_block_mask"] = "blocks",
    position_ids: Tensor | None = None,
    window: int | None = None,
) -> Any:
    """A FlexAttention ``BlockMask`` (B=1, H=1, shape ``[1, 1, N, N]``) for the tree mask
    ``(kv <= q) & (q < subtree_end[kv])``, on ``subtree_end``'s device.

    ``build="blocks"`` (default, the GPU path): the block tables are computed directly from
    per-block min/max of ``subtree_end`` (see ``_tree_block_tables``): O(N + (N/bs)²)
    memory, no N×N tensor, no ``torch.compile``; then ``BlockMask.from_kv_blocks`` with the
    mask_mod for the partial blocks. ``build="create_block_mask"`` calls
    ``torch.nn.attention.flex_attention.create_block_mask`` with the same mask_mod; in
    eager mode that evaluates the mask_mod on all N×N pairs (it materialises a [N, N] bool
    tensor), so use it for checking, or wrap it in ``torch.compile`` yourself. Both give
    the same tables (tested). With a sliding ``window`` (and the depths ``position_ids``)
    the mask also requires ``position_ids[q] - position_ids[kv] < window``
    (:func:`dense_mask`).
    """
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    n = int(subtree_end.shape[0])
    if n == 0:
        raise ValueError("flex_block_mask: empty micro-batch")
    nb = (n + block_size - 1) // block_size
    # pad so the mask_mod can be asked about any index of a partial tail block
    _check_window(position_ids, window)
    end_p = torch.nn.functional.pad(subtree_end.to(torch.int64), (0, nb * block_size - n), value=0)
    pos_p = None
    if window is not None:
        assert position_ids is not None
        pos_p = torch.nn.functional.pad(position_ids.to(torch.int64), (0, nb * block_size - n), value=0)
    mask_mod = tree_mask_mod(end_p, pos_p, window)
    if build == "create_block_mask":
        return create_block_mask(mask_mod, 1, 1, n, n, device=subtree_end.device, BLOCK_SIZE=block_size)
    if build != "blocks":
        raise ValueError(f"flex_block_mask: build must be 'blocks' or 'create_block_mask', got {build!r}")
    partial, full = _tree_block_tables(subtree_end, n, block_size, position_ids, window)
    kv_num, kv_idx = _dense_to_ordered(partial)
    full_num, full_idx = _dense_to_ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(block_size, block_size),
        mask_mod=mask_mod,
        seq_lengths=(n, n),
    )


def cu_seqlens(subtree_end: Tensor, position_ids: Tensor) -> Tensor | None:
    """Cumulative sequence lengths (int32, ``[S + 1]``, starting at 0, ending at N) when the
    micro-batch is a plain concatenation of causal sequences, else ``None``.

    Detection: split the rows at every ``position_ids == 0`` (a root starts a sequence).
    The batch is a concatenation of chains iff row 0 is a root, every other row's position
    is either 0 or the previous row's plus one (so each row's parent is the row just before
    it: no branch, no shared row), and every row's ``subtree_end`` equals the end of its
    sequence (the next root, or N). Then the tree mask equals the block-diagonal causal mask
    of those sequences, which flash-attn varlen (``cu_seqlens_q = cu_seqlens_k``) computes
    directly. Padding rows are roots of one row each, so each is its own length-1 sequence.
    ``prefix_merging`` and ``per_request`` micro-batches pass; a ``tree`` micro-batch passes
    only when no row is shared. One host synchronisation.
    """
    n = int(subtree_end.shape[0])
    if n == 0:
        return None
    pos = position_ids.to(torch.int64)
    end = subtree_end.to(torch.int64)
    is_root = pos == 0
    if not bool(is_root[0]):
        return None
    step_ok = is_root[1:] | (pos[1:] == pos[:-1] + 1)
    starts = torch.nonzero(is_root, as_tuple=False).squeeze(-1)
    bounds = torch.cat([starts, torch.tensor([n], device=starts.device, dtype=starts.dtype)])
    seq_id = torch.cumsum(is_root.to(torch.int64), 0) - 1
    seq_end = bounds[1:][seq_id]
    if not (bool(step_ok.all()) and bool((end == seq_end).all())):
        return None
    return bounds.to(torch.int32)


# --- log-probabilities --------------------------------------------------------------------


@overload
def token_logprobs(
    logits: Tensor, targets: Tensor, *, entropy: Literal[False] = ..., temperature: Tensor | None = ...
) -> Tensor: ...
@overload
def token_logprobs(
    logits: Tensor, targets: Tensor, *, entropy: Literal[True], temperature: Tensor | None = ...
) -> tuple[Tensor, Tensor]: ...
def token_logprobs(
    logits: Tensor, targets: Tensor, *, entropy: bool = False, temperature: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """``log_softmax(logits[i] / T[i])[targets[i]]`` for already-gathered rows ``logits [M,
    V]`` (``T`` = ``temperature``, ``[M]``, default 1: the processed log-probs of a call
    sampled at that temperature, as vLLM returns them with ``--logprobs-mode
    processed_logprobs``), in float32 via one logsumexp per row (no [M, V] log-softmax kept
    for backward beyond what logsumexp and the gather need). With ``entropy=True`` also the
    entropy of each row's distribution (``lse - sum(p * logits)``)."""
    h = logits.float()
    if temperature is not None:
        h = h / temperature.to(h.device, torch.float32)[:, None]
    lse = torch.logsumexp(h, dim=-1)
    logp = h.gather(-1, targets.to(torch.int64)[:, None]).squeeze(-1) - lse
    if not entropy:
        return logp
    p = torch.softmax(h, dim=-1)
    ent = lse - (p * h).sum(-1)
    return logp, ent


@overload
def gather_logprobs(
    logits: Tensor, input_ids: Tensor, pred_idx: Tensor, loss_mask: Tensor, *, entropy: Literal[False] = ...,
    temperature: Tensor | None = ...,
) -> Tensor: ...
@overload
def gather_logprobs(
    logits: Tensor, input_ids: Tensor, pred_idx: Tensor, loss_mask: Tensor, *, entropy: Literal[True],
    temperature: Tensor | None = ...,
) -> tuple[Tensor, Tensor]: ...
def gather_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    pred_idx: Tensor,
    loss_mask: Tensor,
    *,
    entropy: bool = False,
    temperature: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probabilities of the loss rows, in row order: ``logp[t] =
    log_softmax(logits[pred_idx[t]])[input_ids[t]]`` for every ``t`` with ``loss_mask[t]``.

    ``logits`` is ``[N, V]`` (or ``[1, N, V]``). Only the ``n_loss`` predicting rows are
    indexed (a parent with several sampled children is gathered once per child); the
    normaliser is a logsumexp over those rows, never a log-softmax over all N rows.
    With ``entropy=True`` returns ``(logp, entropy)`` over the same gathered rows. With
    ``temperature`` (``[N]``, the micro-batch's column) each loss row is scored at its
    call's temperature, ``log_softmax(logits[pred_idx[t]] / temperature[t])``.
    """
    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise ValueError(
                f"gather_logprobs: expected batch dim 1, got logits of shape {tuple(logits.shape)}"
            )
        logits = logits[0]
    loss = loss_mask.to(torch.bool)
    rows = torch.nonzero(loss, as_tuple=False).squeeze(-1)
    pred = pred_idx.to(torch.int64)[rows]
    if rows.numel() and bool((pred < 0).any()):
        raise ValueError("gather_logprobs: a loss row has no predicting row (pred_idx = -1)")
    picked = logits.index_select(0, pred)
    targets = input_ids.to(torch.int64)[rows]
    temp = None if temperature is None else temperature[rows]
    if entropy:
        return token_logprobs(picked, targets, entropy=True, temperature=temp)
    return token_logprobs(picked, targets, temperature=temp)


# --- the loss ------------------------------------------------------------------------------


#: The log-ratio ``logp - old_logprobs`` is clamped to ``[-LOG_RATIO_MAX, LOG_RATIO_MAX]``
#: before ``exp``: a poisoned rollout log-prob (vLLM's -9999 sentinel) would otherwise give
#: an infinite ratio and a NaN gradient. e^20 ≈ 4.9e8; a clamped token gets no gradient, and
#: under ``tis_cap`` a token whose behaviour log-ratio hit the clamp gets no weight at all.
LOG_RATIO_MAX = 20.0

#: Default dual-clip constant c (Ye et al. 2020, "Mastering Complex Control in MOBA Games with
#: Deep RL"; DAPO's and verl's ``clip_ratio_c``): with A < 0 a token's surrogate is bounded
#: below by c·A, so a token the policy now finds far likelier than the rollout did (ratio
#: e^14.9 for a rollout log-prob of -15 and a current one of -0.1) weighs at most c·|A|
#: instead of ratio·|A| ≈ 3e6.
DUAL_CLIP = 3.0


def _ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_MAX, LOG_RATIO_MAX))


def grpo_loss(
    logp: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_tokens_global: int,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    tis_cap: float | None = None,
    prox_logprobs: Tensor | None = None,
    world_size: int = 1,
    dual_clip: float | None = DUAL_CLIP,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate for one micro-batch's loss tokens (all 1-D, same length).

    Two estimators (trainer-bridge/README.md, "The loss"):

    - ``tis_cap=None`` (default): plain clipped PPO against the rollout log-probs.
      ``ratio = exp(logp - old_logprobs)``; ``clipped = clamp(ratio, 1 - clip_low,
      1 + clip_high)`` (asymmetric, "clip-higher"); per-token loss ``-min(ratio·A,
      clipped·A)``.
    - ``tis_cap=C``: the decoupled form (verl, AReaL). The PPO ratio and its clip are taken
      against a proximal log-prob ``prox`` (the trainer's weights before this update, no
      gradient), and the behaviour mismatch is corrected by the constant truncated weight
      ``w = min(exp(prox - old_logprobs), C)``: per-token loss ``-w · min(r·A, clip(r)·A)``
      with ``r = exp(logp - prox)``. ``prox_logprobs`` defaults to ``logp.detach()``: exact
      when each fetched step is one optimizer step (``recipe.train_step``), where the
      weights that score the batch are the proximal weights; then ``r = 1`` in value and the
      gradient is ``-min(π/π_rollout, C) · A · ∇logp``. Pass ``prox_logprobs`` (scored
      under the pre-update weights, no grad) when a step takes several optimizer updates.
      The ratio is never applied twice. A token whose behaviour log-ratio ``prox -
      old_logprobs`` reaches ``±LOG_RATIO_MAX`` gets weight 0 (masked): its rollout log-prob
      is off the scale the weight can correct, and the cap would otherwise hand it the full
      weight ``C``.

    Dual clip (``dual_clip=c``, default :data:`DUAL_CLIP` = 3; None: off): for ``A < 0`` the
    surrogate is ``max(min(r·A, clip(r)·A), c·A)`` (Ye et al. 2020; DAPO/verl
    ``clip_ratio_c``), so a negative-advantage token whose ratio ``r`` exceeds ``c`` gets no
    gradient and a bounded loss ``-c·A``, instead of a gradient weight ``r·|A|`` that grows
    without bound. ``A >= 0`` is untouched. ``c`` must exceed ``1 + clip_high``.

    Every log-ratio is clamped to ``±LOG_RATIO_MAX`` before ``exp``.

    Normalisation: the per-token losses are SUMMED over this micro-batch and divided by
    ``loss_tokens_global``, the step's loss tokens over all micro-batches and all ranks (the
    ``loss_tokens_global`` of the floe metadata). Summing the returned losses over every
    micro-batch of every rank therefore gives the token-mean over the whole step, whatever
    the packing: call ``backward`` on each micro-batch's loss and accumulate, never divide
    by the number of micro-batches. When gradients are AVERAGED across data-parallel ranks
    (DDP/FSDP all-reduce mean), pass ``world_size`` = the number of ranks: the loss is
    multiplied by it so the averaged gradient equals the gradient of the global token-mean.
    Leave ``world_size=1`` when gradients are summed across ranks, or on one rank.

    ``normalizer`` (default None: ``loss_tokens_global``) replaces that denominator with a
    constant, Dr. GRPO's (Liu et al. 2025): e.g. the step's sessions × the maximum tokens a
    call may sample, TRL's ``loss_type="dr_grpo"`` (batch size × ``max_completion_length``).
    Then a token's gradient does not depend on how many loss tokens the step happens to hold.

    Metrics (detached 0-d tensors, no host synchronisation): ``clip_fraction`` (share of
    tokens where the clipped term is the active one, i.e. whose gradient is cut),
    ``mismatch`` (mean ``|logp - old_logprobs|``), ``ratio_mean`` (mean of ``exp(logp -
    old_logprobs)``, clamped), ``loss_tokens`` (count), ``dual_clip_fraction`` (share of
    tokens the dual clip bounds) when ``dual_clip`` is set, and ``tis_weight_mean`` and
    ``tis_masked`` (tokens masked at the clamp, count) when ``tis_cap`` is set. Means over
    an empty micro-batch are 0.
    """
    if loss_tokens_global <= 0:
        raise ValueError(f"grpo_loss: loss_tokens_global must be positive, got {loss_tokens_global}")
    if not (logp.shape == old_logprobs.shape == advantages.shape) or logp.dim() != 1:
        raise ValueError(
            f"grpo_loss: logp, old_logprobs and advantages must be 1-D of one length, got "
            f"{tuple(logp.shape)}, {tuple(old_logprobs.shape)}, {tuple(advantages.shape)}"
        )
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"grpo_loss: tis_cap must be positive, got {tis_cap}")
    if dual_clip is not None and not dual_clip > 1.0 + clip_high:
        raise ValueError(
            f"grpo_loss: dual_clip must exceed 1 + clip_high = {1.0 + clip_high}, got {dual_clip}"
        )
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"grpo_loss: normalizer must be positive, got {normalizer}")
    if prox_logprobs is not None and tis_cap is None:
        raise ValueError("grpo_loss: prox_logprobs is the decoupled estimator's; set tis_cap")
    dt = torch.promote_types(logp.dtype, torch.float32)  # bf16 logp -> float32; float64 stays
    logp = logp.to(dt)
    old = old_logprobs.to(logp.device, dt)
    adv = advantages.to(logp.device, dt)
    rollout_log_ratio = logp.detach() - old
    tis_w: Tensor | None = None
    masked: Tensor | None = None
    if tis_cap is None:
        ratio = _ratio(logp - old)
    else:
        prox = logp.detach() if prox_logprobs is None else prox_logprobs.to(logp.device, dt).detach()
        if prox.shape != logp.shape:
            raise ValueError(
                f"grpo_loss: prox_logprobs has shape {tuple(prox.shape)}, want {tuple(logp.shape)}"
            )
        ratio = _ratio(logp - prox)
        behaviour = prox - old
        # a behaviour log-ratio at the clamp is no measurement: mask the token (weight 0)
        in_range = behaviour.abs() < LOG_RATIO_MAX
        masked = ~in_range
        tis_w = torch.where(
            in_range, torch.clamp(_ratio(behaviour), max=tis_cap), torch.zeros_like(behaviour)
        )
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    unclipped_loss = -ratio * adv
    clipped_loss = -clipped * adv
    per_token = torch.maximum(unclipped_loss, clipped_loss)  # = -min(ratio·A, clipped·A)
    dual_cut: Tensor | None = None
    if dual_clip is not None:
        # -max(min(r·A, clip(r)·A), c·A) = min(per_token, -c·A), for A < 0 only
        bound = -dual_clip * adv
        dual_cut = (adv < 0) & (per_token > bound)
        per_token = torch.where(dual_cut, bound, per_token)
    if tis_w is not None:
        per_token = per_token * tis_w
    denominator = float(loss_tokens_global) if normalizer is None else float(normalizer)
    loss = per_token.sum() * (float(world_size) / denominator)

    n = logp.shape[0]
    with torch.no_grad():
        denom = float(max(n, 1))
        metrics: dict[str, Tensor] = {
            "clip_fraction": (clipped_loss > unclipped_loss).float().sum() / denom,
            "mismatch": rollout_log_ratio.abs().sum() / denom,
            "ratio_mean": _ratio(rollout_log_ratio).sum() / denom,
            "loss_tokens": torch.tensor(n, device=logp.device),
        }
        if dual_cut is not None:
            metrics["dual_clip_fraction"] = dual_cut.float().sum() / denom
        if tis_w is not None and masked is not None:
            metrics["tis_weight_mean"] = tis_w.sum() / denom
            metrics["tis_masked"] = masked.float().sum()
    return loss, metrics
