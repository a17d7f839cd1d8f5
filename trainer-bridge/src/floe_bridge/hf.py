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
applied to a custom mask: floe applies it in the tree mask itself (a row sees an ancestor
only when their depths differ by less than ``sliding_window``, exactly what the call saw
alone). A model whose every attention layer slides (Mistral, Mixtral, Starcoder2, Phi3:
``sliding_window`` without ``layer_types``) gets the windowed mask; a model mixing full
and sliding layers (``layer_types``) gets the dict ``{"full_attention": ...,
"sliding_attention": ...}`` that its forward takes as ``causal_mask_mapping``.

What :func:`score` refuses (:func:`refusal`, naming the model and its model type):
attention the tree mask does not express (ALiBi, chunked, indexed or compressed attention,
GPT-Neo's local attention, bidirectional attention), on every micro-batch; token-mixing
layers (short convolutions, SSMs, linear attention: LFM2, Mamba, Jamba, Qwen3-Next, ...),
which mix every earlier row of the packed sequence regardless of the mask, on any
micro-batch holding more than one sequence; and any model type outside
:data:`PROVEN_MODEL_TYPES`, the architectures tests/test_architectures.py proves equal on a
packed tree. What each attention implementation does with the mask:

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

__all__ = [
    "AttnKind",
    "PROVEN_MODEL_TYPES",
    "attn_kind",
    "refusal",
    "register_proven_model_type",
    "sliding_window",
    "tree_attention_mask",
    "score",
    "score_logprobs",
]

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


#: layer types the tree mask handles (the sliding window is part of the mask)
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})
#: layer types that are not token mixers at all (the feed-forward entries of hybrid lists)
_NON_MIXING_LAYER_TYPES = frozenset({"mlp", "moe"})
#: attention variants the tree mask does not express: each picks its keys by its own rule
#: (a chunk of positions, a learned top-k index, compressed blocks), applied to the packed
#: row order or skipped entirely when a custom mask is passed, never to each call's tokens
_ATTENTION_VARIANTS: dict[str, str] = {
    "chunked_attention": "chunked attention (a row attends only within its chunk of positions)",
    "indexed_attention": "indexed sparse attention (a learned indexer picks each row's top-k keys)",
    "compressed_sparse_attention": "compressed sparse attention",
    "heavily_compressed_attention": "compressed attention",
    "hybrid_sliding": "hybrid sliding attention",
}
#: models whose token mixers are not (only) attention, whatever their configs list: the
#: layer type reported for each
_TOKEN_MIXING_MODEL_TYPES: dict[str, str] = {
    "mamba": "mamba",
    "mamba2": "mamba2",
    "falcon_mamba": "mamba",
    "rwkv": "rwkv",
    "xlstm": "xlstm",
    "recurrent_gemma": "recurrent",
    "jamba": "mamba",
    "bamba": "mamba2",
    "zamba": "mamba",
    "zamba2": "mamba2",
    "falcon_h1": "mamba2",
    "granitemoehybrid": "mamba2",
    "nemotron_h": "mamba2",
    "lfm2": "conv",
    "lfm2_moe": "conv",
    "qwen3_next": "linear_attention",
    "minimax": "linear_attention",
}

#: The model types (``config.model_type`` of the loaded model) proven to score a packed tree
#: micro-batch exactly: a tiny random model of each default config (transformers 5.24),
#: scored on a depth-33 branching tree packed with the tree mask and each root-to-leaf path
#: alone with transformers' own causal mask, agrees within 1e-5
#: (tests/test_architectures.py walks every causal-LM config and keeps this set equal to
#: what it proves). Any other model type is refused: a model's position encoding or mask
#: handling decides whether the tree mask and depth positions reproduce each call (absolute
#: positions with an offset, ALiBi, relative buckets and encoder-style bidirectional
#: attention do not), and only a run shows it. Features within a proven type that the mask
#: does not express (ALiBi, chunked or local attention, bidirectional attention,
#: token-mixing layers) are refused by :func:`refusal` whatever the type.
PROVEN_MODEL_TYPES: frozenset[str] = frozenset({
    'afmoe', 'apertus', 'apertus1p5_text', 'arcee', 'aria_text', 'beam', 'biogpt', 'bitnet', 'codegen',
    'cohere', 'cohere2', 'cohere2_moe', 'ctrl', 'cwm', 'deepseek_v2', 'deepseek_v3', 'diffllama',
    'doge', 'dory', 'dots1', 'emu3', 'emu3_text_model', 'ernie4_5', 'ernie4_5_moe', 'exaone', 'exaone4',
    'exaone_moe', 'falcon', 'flex_olmo', 'flint', 'fuyu', 'gemma', 'gemma2', 'gemma3', 'gemma3_text',
    'gemma4', 'gemma4_text', 'gemma4_unified', 'gemma4_unified_text', 'git', 'glm', 'glm4', 'glm4_moe',
    'glm4_moe_lite', 'got_ocr2', 'gpt-sw3', 'gpt2', 'gpt_bigcode', 'gpt_neox', 'gpt_neox_japanese',
    'gpt_oss', 'gptj', 'granite', 'granite_swa', 'granitemoe', 'granitemoe_swa', 'granitemoeshared',
    'helium', 'hrm_text', 'hunyuan_v1_dense', 'hunyuan_v1_moe', 'hy_v3', 'hyperclovax', 'internlm3',
    'iquestcoder', 'jais2', 'jetmoe', 'kolibri1', 'laguna', 'llama', 'mellum', 'mimo_v2_flash',
    'minicpm3', 'minimax_m2', 'minimax_m3_vl_text', 'ministral', 'ministral3', 'mistral', 'mixtral',
    'mllama', 'mllama_text_model', 'modernbert-decoder', 'moss_transcribe_diarize', 'nanochat',
    'nemotron', 'olmo', 'olmo2', 'olmo3', 'olmoe', 'opt', 'persimmon', 'phi', 'phi3', 'phi4_multimodal',
    'phimoe', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_moe', 'sarvam_mla', 'sarvam_moe', 'seed_oss',
    'smollm3', 'solar_open', 'stablelm', 'starcoder2', 'vaultgemma', 'xglm', 'youtu',
})
_registered: set[str] = set()


def register_proven_model_type(model_type: str) -> None:
    """Accept ``model_type`` (a model's ``config.model_type``) beside
    :data:`PROVEN_MODEL_TYPES`: for a custom or newer architecture that you have proven
    yourself, as tests/test_architectures.py does (a packed tree scored against each path
    alone, within 1e-5). :func:`refusal`'s feature checks still apply."""
    _registered.add(str(model_type))


def _config(model: Any) -> Any:
    """``model.config``, or ``model`` itself when it is a config."""
    cfg = getattr(model, "config", None)
    return model if cfg is None else cfg


def _text_config(model: Any) -> Any:
    cfg = _config(model)
    get = getattr(cfg, "get_text_config", None)
    if not callable(get):
        return cfg
    try:
        return get()
    except ValueError:  # several text configs (an encoder and a decoder: MusicGen)
        return cfg


def _model_name(model: Any) -> str:
    cfg = _config(model)
    kind = getattr(cfg, "model_type", None) or type(model).__name__
    name = getattr(cfg, "_name_or_path", "") or ""
    owner = type(model).__name__ if cfg is not model else type(cfg).__name__
    return f"{owner} (model_type {kind!r}{', ' + name if name else ''})"


def _layer_types(cfg: Any) -> list[str]:
    out: list[str] = []
    for attr in ("layer_types", "layers_block_type"):
        out.extend(str(t) for t in getattr(cfg, attr, None) or [])
    return out


def _token_mixing_layer(model: Any) -> str | None:
    """The first layer type of ``model`` that mixes tokens other than by attention."""
    cfg = _text_config(model)
    for t in _layer_types(cfg):
        if t not in _ATTENTION_LAYER_TYPES | _NON_MIXING_LAYER_TYPES and t not in _ATTENTION_VARIANTS:
            return t
    return _TOKEN_MIXING_MODEL_TYPES.get(str(getattr(cfg, "model_type", "")))


def _alibi(cfg: Any) -> bool:
    if str(getattr(cfg, "model_type", "")) == "bloom":  # Bloom has no other position encoding
        return True
    if getattr(cfg, "alibi", False) is True or getattr(cfg, "position_embedding_type", None) == "alibi":
        return True
    attn = getattr(cfg, "attn_config", None)  # MPT
    return bool(attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", False))


def _feature_refusal(cfg: Any) -> str | None:
    """Why a config's attention cannot be reproduced by the tree mask, or None."""
    if _alibi(cfg):
        return (
            "uses ALiBi position biases, which are computed from row offsets in the packed sequence, "
            "not from each row's depth in its call (MPT scores a packed tree 5.7e-2 nats off per-request; "
            "Bloom's and Falcon's ALiBi attention cannot take a 4-D tree mask at all). Use a model with "
            "rotary or learned positions"
        )
    chunk = getattr(cfg, "attention_chunk_size", None)
    types = _layer_types(cfg)
    variant = next((t for t in types if t in _ATTENTION_VARIANTS), None)
    if variant is not None or (chunk and not types):
        variant = variant or "chunked_attention"  # a chunk size without layer types chunks every layer
        size = f", attention_chunk_size {chunk}" if chunk and variant == "chunked_attention" else ""
        return (
            f"has {variant!r} layers{size}: {_ATTENTION_VARIANTS[variant]}, which the tree mask does not "
            "express (transformers skips it when given a custom mask)"
        )
    local = [t for t in getattr(cfg, "attention_layers", None) or [] if t == "local"]
    if local:
        return (
            f"has local attention layers (attention_layers 'local', window_size "
            f"{getattr(cfg, 'window_size', None)}): GPT-Neo applies that window by row index in the packed "
            "sequence, not by depth, so it hides ancestors the call saw (5.6e-2 nats off on a packed tree)"
        )
    # "vision" (Gemma 4 unified) is bidirectional among an image's tokens only; a text call is causal
    bidi = getattr(cfg, "use_bidirectional_attention", None)
    if bidi is True or bidi == "all" or getattr(cfg, "is_causal", True) is False:
        return "attends bidirectionally; the tree mask is causal"
    return None


def refusal(model: Any, *, packed: bool = True) -> str | None:
    """Why :func:`score` refuses ``model`` (a model or its config) on a micro-batch, as the
    error message (naming the model and its model type), or None when it scores exactly.

    In order: an attention feature the tree mask does not express (ALiBi, chunked, indexed
    or compressed attention, GPT-Neo's local attention, bidirectional attention), refused
    on every micro-batch; token-mixing layers (convolutions, SSMs, linear attention), refused
    when ``packed`` (more than one sequence in the micro-batch: one call alone is a plain
    causal sequence and exact); and a model type outside :data:`PROVEN_MODEL_TYPES` (and
    :func:`register_proven_model_type`), refused on every micro-batch."""
    name = _model_name(model)
    feature = _feature_refusal(_text_config(model))
    if feature is None and _text_config(model) is not _config(model):
        feature = _feature_refusal(_config(model))
    if feature is not None:
        return f"floe_bridge.hf: {name} {feature}; floe_bridge cannot score it exactly and refuses it"
    layer = _token_mixing_layer(model)
    if layer is not None:
        if not packed:
            return None
        return (
            f"floe_bridge.hf: {name} has token-mixing layers ({layer!r}) that mix rows the tree mask hides; "
            "it cannot score a packed micro-batch exactly. Use a model whose layers are all attention, or "
            "one call per micro-batch"
        )
    kind = str(getattr(_config(model), "model_type", "") or "")
    if kind not in PROVEN_MODEL_TYPES and kind not in _registered:
        return (
            f"floe_bridge.hf: {name}: model_type {kind!r} is not among the architectures proven to score a "
            "tree micro-batch exactly (floe_bridge.hf.PROVEN_MODEL_TYPES, proven by "
            "tests/test_architectures.py); its positions or mask handling may not reproduce each call. Prove "
            f"it the same way, then call floe_bridge.hf.register_proven_model_type({kind!r})"
        )
    return None


def _is_packed(batch: TreeBatch) -> bool:
    """True unless the micro-batch is one chain followed by one-row padding."""
    bounds = cu_seqlens(batch.subtree_end, batch.position_ids)
    if bounds is None:
        return True
    lengths = bounds[1:] - bounds[:-1]
    return bool((lengths[1:] > 1).any())


def _check_model(model: Any, batch: TreeBatch) -> None:
    why = refusal(model, packed=_is_packed(batch))
    if why is not None:
        raise ValueError(why)


def sliding_window(model: Any) -> tuple[int | None, bool]:
    """``(window, mixed)``: the sliding window of ``model``'s sliding-attention layers (None:
    none), and whether it also has full-attention layers (``layer_types`` with both)."""
    cfg = _text_config(model)
    window = getattr(cfg, "sliding_window", None)
    if window is None:
        return None, False
    types = list(getattr(cfg, "layer_types", None) or [])
    if not types:
        return int(window), False  # Mistral, Mixtral, Starcoder2, Phi3: every layer slides
    if "sliding_attention" not in types:
        return None, False
    return int(window), any(t != "sliding_attention" for t in types)


def tree_attention_mask(
    model: Any, batch: TreeBatch, attn: AttnKind = "auto", *, block_size: int = 128
) -> Any:
    """The ``attention_mask`` argument for ``model`` on ``batch`` (see the module doc):
    bool ``[1,1,N,N]`` (sdpa), additive float ``[1,1,N,N]`` in the model's dtype (eager),
    a ``BlockMask`` (flex), or ``None`` for flash when the batch is plain chains (flash
    applies a sliding window itself). With sliding-window layers the window is part of the
    mask; when full and sliding layers are mixed, a dict keyed by layer type."""
    kind = attn_kind(model, attn)
    window, mixed = sliding_window(model)
    if window is not None and kind != "flash":
        depth = int(batch.position_ids.max()) + 1 if batch.num_rows else 0
        if depth > window:  # else no path is longer than the window: it hides nothing
            windowed = _mask(model, batch, kind, block_size, window)
            if not mixed:
                return windowed
            return {
                "full_attention": _mask(model, batch, kind, block_size, None),
                "sliding_attention": windowed,
            }
    return _mask(model, batch, kind, block_size, None)


def _mask(model: Any, batch: TreeBatch, kind: str, block_size: int, window: int | None) -> Any:
    end = batch.subtree_end
    pos = batch.position_ids if window is not None else None
    if kind == "flex":
        return flex_block_mask(end, block_size, position_ids=pos, window=window)
    if kind == "flash":
        if cu_seqlens(end, batch.position_ids) is None:
            raise ValueError(
                "floe_bridge.hf: flash attention takes no tree mask and this micro-batch shares rows "
                "(cu_seqlens is None); use sdpa/eager/flex_attention, or a prefix_merging/per_request floe"
            )
        return None
    mask = dense_mask(end, pos, window)[None, None]
    if kind == "sdpa":
        return mask
    dtype = next(model.parameters()).dtype
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(~mask, torch.finfo(dtype).min)


def _forward(model: Any, batch: TreeBatch, attn: AttnKind, block_size: int, **kwargs: Any) -> Any:
    _check_model(model, batch)
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
    predicting rows ``pred_idx[loss rows]`` (``logits_to_keep``), each at its call's
    sampling temperature (``batch.temperature``: ``log_softmax(logits / T)``, the processed
    log-probs the inference server returned). With ``entropy=True``
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
    temp = None if batch.temperature is None else batch.temperature[rows]
    if entropy:
        return token_logprobs(logits, targets, entropy=True, temperature=temp)
    return token_logprobs(logits, targets, temperature=temp)
