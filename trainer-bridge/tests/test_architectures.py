"""Every causal-LM architecture transformers ships is either proven to score a packed tree
exactly, or refused by name (issue 21 item 10).

The walk: for each model type with an ``AutoModelForCausalLM`` mapping (the rule that
decides what is walked: a model the bridge cannot load as a causal LM is never scored by
it; every other config is counted as skipped), a tiny config is built from the config
class's defaults (hidden 64, 2 layers, 4 heads, vocabulary 128, window and chunk sizes 8,
so that every window and chunk is smaller than the tree). Then either
``floe_bridge.hf.refusal`` refuses it, with a message naming its model type, or a tiny
random model built from it scores a depth-33 branching tree (the tree mask, depth
positions) within 1e-5 of each root-to-leaf path run alone through the same model with
transformers' own causal mask, the reference of tests/test_window.py and
tests/test_equivalence.py. A model type the bridge lists as proven must pass that run; a
refused one that is refused only for being unproven is run too, and the test fails if it
passes, so ``PROVEN_MODEL_TYPES`` is exactly what this walk proves.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_window import _reference, _tree  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

import floe_bridge.hf as hf  # noqa: E402
from floe_bridge.torch_ops import TreeBatch  # noqa: E402

VOCAB = 128
LOGP_ATOL = 1e-5
#: a tiny config that still builds a bigger model than this is a shrinking rule that missed
#: a dimension: fail loudly rather than spend minutes of CPU
MAX_PARAMS = 16_000_000

#: constructor arguments set wherever a config class takes them (or maps them)
TINY: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "n_embd": 64, "d_model": 64, "n_embed": 64,
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "decoder_layers": 2,
    "encoder_layers": 2, "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "decoder_attention_heads": 4, "encoder_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
    "n_routed_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "max_position_embeddings": 128, "max_seq_len": 128, "n_positions": 128, "n_ctx": 128,
    # windows and chunks smaller than the tree's depth, so that a mask that drops them shows
    "sliding_window": 8, "window_size": 8, "attention_chunk_size": 8,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "rotary_dim": 8, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
    "image_size": 28, "patch_size": 14,
    # non-flat logits, so that a wrong mask moves the log-probs well past the tolerance
    "initializer_range": 0.1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
#: per model type, where the generic shrink breaks a config's own validation
OVERRIDES: dict[str, dict[str, Any]] = {
    # attention_types must list num_layers layers: one global, one local
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # its validator wants as many key/value heads as query heads
    "dots3_note_text": {"num_key_value_heads": 4},
}
#: configurations beside the defaults: the features a default does not switch on
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "falcon-alibi": ("falcon", {"alibi": True}),
    "mpt-no-alibi": ("mpt", {"attn_config": {"alibi": False}}),
    "gpt_neo-global": ("gpt_neo", {"attention_types": [[["global"], 2]]}),
    "qwen2-sliding": ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}),
}
#: model types the walk cannot even ask about: none today. Each entry says why; the test
#: asserts the set stays small.
EXCLUDED: dict[str, str] = {}

CAUSAL = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _tiny_config(cls: Any, extra: dict[str, Any], depth: int = 0) -> Any:
    params = inspect.signature(cls.__init__).parameters
    names = set(params) | set(getattr(cls, "attribute_map", None) or {})
    kw = {k: v for k, v in TINY.items() if k in names}
    if "qk_rope_head_dim" in names:  # multi-head latent attention: the head dim is the rope dim,
        kw.pop("head_dim", None)     # and there are as many key/value heads as query heads
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    subs = getattr(cls, "sub_configs", None) or {}
    if subs and depth < 3:  # a composite config (vision + text): shrink each part
        default = cls()
        for name in subs:
            sub = getattr(default, name, None)
            if name in params and sub is not None and hasattr(sub, "to_dict"):
                kw[name] = _tiny_config(type(sub), {}, depth + 1)
    kw.update(OVERRIDES.get(str(getattr(cls, "model_type", "")), {}))
    kw.update(extra)
    return cls(**kw)


def _paths() -> list[list[int]]:
    """A depth-33 branching tree: a 16-token prompt, two branches to depth 33, a third that
    forks from the first at depth 26, a prefix of the prompt, and a short branch."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, VOCAB, 16).tolist()
    a = prompt + rng.integers(3, VOCAB, 17).tolist()
    b = prompt + rng.integers(3, VOCAB, 17).tolist()
    c = a[:26] + rng.integers(3, VOCAB, 7).tolist()
    return [a, b, c, prompt[:10], prompt + rng.integers(3, VOCAB, 9).tolist()]


@pytest.fixture(scope="module")
def tree() -> tuple[list[list[int]], TreeBatch]:
    paths = _paths()
    tb, _ = _tree(paths)
    assert int(tb.position_ids.max()) + 1 == 33 and int((tb.position_ids == 0).sum()) > 1
    return paths, tb


def _build(cfg: Any) -> Any:
    with torch.device("meta"):
        shape = transformers.AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in shape.parameters())
    assert n <= MAX_PARAMS, f"the tiny config still builds {n / 1e6:.1f}M parameters"
    err: Exception | None = None
    for impl in ("sdpa", "eager"):  # sdpa where the model has it
        torch.manual_seed(0)
        try:
            return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl,
                                                                 dtype=torch.float32).eval()
        except (ValueError, ImportError) as e:
            err = e
    assert err is not None
    raise err


def _tree_error(cfg: Any, tree: tuple[list[list[int]], TreeBatch], *, unchecked: bool = False) -> float:
    """max |packed tree - per-request| over the loss rows, nats. ``unchecked`` scores the
    tree with the bridge's refusal switched off (a negative control)."""
    paths, tb = tree
    model = _build(cfg)
    want = _reference(model, paths, tb)
    saved = hf.refusal
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if unchecked:
                hf.refusal = lambda *a, **k: None  # type: ignore[assignment]
            got = hf.score_logprobs(model, tb)
        finally:
            hf.refusal = saved  # type: ignore[assignment]
    return float((got - want).abs().max())


def _cases() -> Iterator[Any]:
    for mt in CAUSAL:
        yield pytest.param(mt, {}, id=mt)
    for name, (mt, extra) in VARIANTS.items():
        yield pytest.param(mt, extra, id=name)


@pytest.mark.parametrize(("model_type", "extra"), list(_cases()))
def test_config_is_proven_or_refused(model_type: str, extra: dict[str, Any],
                                     tree: tuple[list[list[int]], TreeBatch]) -> None:
    if model_type in EXCLUDED:
        pytest.skip(f"excluded: {EXCLUDED[model_type]}")
    cls = CONFIG_MAPPING[model_type]
    transformers.logging.set_verbosity_error()
    try:
        cfg = _tiny_config(cls, extra)
    except Exception as shrink:  # the generic shrink broke this config's own validation
        if extra:
            raise
        assert model_type not in hf.PROVEN_MODEL_TYPES, f"{model_type}: proven, no tiny config: {shrink!r}"
        try:  # the refusal is decided on the defaults
            cfg = cls()
        except Exception:
            # not even the defaults validate (gemma4_assistant in 5.24): a model of this type
            # is refused as unproven, which its model_type alone decides
            cfg = SimpleNamespace(model_type=cls.model_type)
        why = hf.refusal(cfg)
        assert why is not None and f"model_type {cls.model_type!r}" in why, why
        return
    kind = str(cfg.model_type)  # an alias (gpt-sw3) loads its target's config (gpt2)
    why = hf.refusal(cfg)
    if why is not None:
        assert why.startswith("floe_bridge.hf: ") and f"model_type {kind!r}" in why, why
        assert kind not in hf.PROVEN_MODEL_TYPES or "is not among" not in why
        if "is not among" in why and extra == {}:
            # unproven: it must not pass the proof (else it belongs in PROVEN_MODEL_TYPES)
            try:
                err = _tree_error(cfg, tree, unchecked=True)
            except Exception:  # it cannot even be built or run: refused, rightly
                return
            assert err >= LOGP_ATOL, f"{model_type}: the tree within {err:.2g}: add it to PROVEN_MODEL_TYPES"
        return
    err = _tree_error(cfg, tree)
    assert err < LOGP_ATOL, f"{model_type}{extra or ''}: packed tree {err:.3g} nats off per-request"


def test_walk_rule_and_exclusions() -> None:
    """What the walk skips, by its rule, and that the exclusions stay few and explained."""
    skipped = sorted(set(CONFIG_MAPPING_NAMES) - set(CAUSAL))
    print(f"\n{len(CAUSAL)} causal-LM configs walked, {len(skipped)} configs without an "
          f"AutoModelForCausalLM mapping skipped, {len(EXCLUDED)} excluded, "
          f"{len(hf.PROVEN_MODEL_TYPES)} proven")
    assert len(CAUSAL) > 100
    assert len(EXCLUDED) <= 3 and all(len(why) > 20 for why in EXCLUDED.values())
    # besides the walked types: the text models that two composite configs load as
    assert hf.PROVEN_MODEL_TYPES - set(CAUSAL) == {"emu3_text_model", "mllama_text_model"}


@pytest.mark.parametrize(("model_type", "extra", "words"), [
    ("mpt", {}, "ALiBi"),
    ("bloom", {}, "ALiBi"),
    ("falcon", {"alibi": True}, "ALiBi"),
    ("gpt_neo", {}, "local attention"),
    ("llama4_text", {}, "chunked attention"),
    ("llama4", {}, "chunked attention"),
])
def test_named_refusals(model_type: str, extra: dict[str, Any], words: str,
                        tree: tuple[list[list[int]], TreeBatch]) -> None:
    """The configurations issue 21 found scored wrong or crashing are refused, saying why;
    chunked attention is not called a token-mixing layer."""
    cfg = _tiny_config(CONFIG_MAPPING[model_type], extra)
    model = _build(cfg)
    _, tb = tree
    # Llama4ForCausalLM loads the text config of a composite llama4 config: 'llama4_text'
    with pytest.raises(ValueError, match=rf"model_type '{model.config.model_type}'.*{words}") as e:
        hf.score_logprobs(model, tb)
    assert "token-mixing" not in str(e.value)


@pytest.mark.parametrize("model_type", ["mpt", "gpt_neo"])
def test_refused_attention_really_is_off(model_type: str, tree: tuple[list[list[int]], TreeBatch]) -> None:
    """Negative control: with the refusal switched off, MPT's ALiBi and GPT-Neo's local
    attention score the packed tree far from per-request (what the bridge did before)."""
    err = _tree_error(_tiny_config(CONFIG_MAPPING[model_type], {}), tree, unchecked=True)
    print(f"\n{model_type}: unrefused, packed tree {err:.3g} nats off per-request")
    assert err > 1e-2
