"""Models the plain tree mask would score wrongly (issue 13 item 2).

Sliding-window attention: the reference is each root-to-leaf path run ALONE through the
same model as a plain causal sequence, where transformers builds its own sliding-window
mask; floe's tree mask must give the same log-probs within 1e-5 on a depth-38 tree with
window 8. Token-mixing layers (LFM2's short convolutions, Mamba) are refused on any packed
micro-batch, naming the model and the layer type.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from floe_bridge.hf import score_logprobs, sliding_window  # noqa: E402
from floe_bridge.torch_ops import TreeBatch  # noqa: E402

VOCAB = 97
WINDOW = 8
LOGP_ATOL = 1e-5


def _common() -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                initializer_range=0.1, tie_word_embeddings=False)


def _build(name: str, attn: str) -> Any:
    torch.manual_seed(0)
    if name == "mistral":
        cfg = transformers.MistralConfig(**_common(), sliding_window=WINDOW, head_dim=16)
        cls = transformers.MistralForCausalLM
    elif name == "mixtral":
        cfg = transformers.MixtralConfig(**_common(), sliding_window=WINDOW, num_local_experts=4,
                                         num_experts_per_tok=2, head_dim=16)
        cls = transformers.MixtralForCausalLM
    elif name == "starcoder2":
        cfg = transformers.Starcoder2Config(**_common(), sliding_window=WINDOW, residual_dropout=0.0,
                                            embedding_dropout=0.0, attention_dropout=0.0)
        cls = transformers.Starcoder2ForCausalLM
    elif name == "phi3":
        cfg = transformers.Phi3Config(**_common(), sliding_window=WINDOW, pad_token_id=0,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
        cls = transformers.Phi3ForCausalLM
    elif name == "qwen2-mixed":  # layer 0 full attention, layer 1 sliding
        cfg = transformers.Qwen2Config(**_common(), use_sliding_window=True, sliding_window=WINDOW,
                                       max_window_layers=1)
        cls = transformers.Qwen2ForCausalLM
    else:
        raise AssertionError(name)
    return cls._from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()


def _tree(paths: list[list[int]], pad: int = 3) -> tuple[TreeBatch, list[list[int]]]:
    """The trie of ``paths`` in DFS pre-order (then ``pad`` padding rows), every non-root
    row a loss row; and for each row the path index and position it stands for."""
    children: list[dict[int, int]] = [{}]
    token: list[int] = [-1]
    parent: list[int] = [-1]
    for p in paths:
        v = 0
        for t in p:
            if t not in children[v]:
                children[v][t] = len(token)
                children.append({})
                token.append(t)
                parent.append(v)
            v = children[v][t]
    order: list[int] = []
    stack = list(reversed(children[0].values()))
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(reversed(list(children[v].values())))
    row = {v: r for r, v in enumerate(order)}
    n = len(order) + pad
    size = {v: 1 for v in order}
    for v in reversed(order):
        if parent[v] > 0:
            size[parent[v]] += size[v]
    depth = np.zeros(n, np.int64)
    end = np.arange(1, n + 1, dtype=np.int64)
    pred = np.full(n, -1, np.int64)
    ids = np.zeros(n, np.int64)
    for r, v in enumerate(order):
        d, p = 0, parent[v]
        while p > 0:
            d, p = d + 1, parent[p]
        depth[r], end[r], ids[r] = d, r + size[v], token[v]
        pred[r] = row[parent[v]] if parent[v] > 0 else -1
    loss = pred >= 0
    tb = TreeBatch(
        input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(depth),
        subtree_end=torch.from_numpy(end), pred_idx=torch.from_numpy(pred),
        loss_mask=torch.from_numpy(loss), old_logprobs=torch.zeros(n), advantages=torch.zeros(n),
        sample_idx=torch.from_numpy(np.where(loss, 0, -1)),
    )
    return tb, []


def _paths() -> list[list[int]]:
    """A depth-38 tree: a 20-token shared prompt, three branches to depth 38, one of which
    forks again at depth 30, and a short branch of 12."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, VOCAB, 20).tolist()
    a = prompt + rng.integers(1, VOCAB, 18).tolist()
    b = prompt + rng.integers(1, VOCAB, 18).tolist()
    c = a[:30] + rng.integers(1, VOCAB, 8).tolist()
    d = prompt[:12]
    e = prompt + rng.integers(1, VOCAB, 11).tolist()
    return [a, b, c, d, e]


def _reference(model: Any, paths: list[list[int]], tb: TreeBatch) -> torch.Tensor:
    """Each path alone, plain causal, transformers' own (sliding-window) mask; the log-prob
    of each loss row of ``tb``, found by its token path."""
    want: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for p in paths:
            logits = model(input_ids=torch.tensor([p]), use_cache=False).logits[0]
            lp = torch.log_softmax(logits.double(), -1)
            for i in range(1, len(p)):
                want[tuple(p[: i + 1])] = float(lp[i - 1, p[i]])
    ids = tb.input_ids.tolist()
    pred = tb.pred_idx.tolist()
    out = []
    for r in torch.nonzero(tb.loss_mask).squeeze(-1).tolist():
        key, v = [], r
        while v >= 0:
            key.append(ids[v])
            v = pred[v]
        out.append(want[tuple(reversed(key))])
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["mistral", "mixtral", "starcoder2", "phi3", "qwen2-mixed"])
def test_sliding_window_tree_matches_per_request(name: str, attn: str) -> None:
    model = _build(name, attn)
    window, mixed = sliding_window(model)
    assert window == WINDOW and mixed == (name == "qwen2-mixed")
    paths = _paths()
    tb, _ = _tree(paths)
    assert int(tb.position_ids.max()) + 1 == 38
    want = _reference(model, paths, tb)
    with torch.no_grad():
        got = score_logprobs(model, tb, attn=attn)  # type: ignore[arg-type]
    err = float((got - want).abs().max())
    print(f"\n{name}/{attn}: window {WINDOW}, depth 38: max |tree - per-request| = {err:.3g}")
    assert err < LOGP_ATOL
    # negative control: the same model with the window dropped from the tree mask is far off
    # (what floe_bridge did before 13.2)
    cfg = model.config
    saved = cfg.sliding_window
    try:
        cfg.sliding_window = None
        with torch.no_grad():
            nowin = score_logprobs(model, tb, attn=attn)  # type: ignore[arg-type]
    finally:
        cfg.sliding_window = saved
    off = float((nowin - want).abs().max())
    print(f"{name}/{attn}: without the window in the mask: off by {off:.3g} nats")
    assert off > 1e-2


def _tiny_lfm2() -> Any:
    torch.manual_seed(0)
    cfg = transformers.Lfm2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        layer_types=["conv", "full_attention"],
        initializer_range=0.1,
    )
    return transformers.Lfm2ForCausalLM._from_config(
        cfg, attn_implementation="sdpa", dtype=torch.float32
    ).eval()


def test_token_mixing_layers_are_refused_on_packed_micro_batches() -> None:
    model = _tiny_lfm2()
    paths = _paths()
    tree, _ = _tree(paths)
    with pytest.raises(ValueError, match=r"Lfm2ForCausalLM \(model_type 'lfm2'.*'conv'"):
        score_logprobs(model, tree, attn="sdpa")
    # per_request packing: two plain sequences side by side is refused too
    two, _ = _tree([paths[0], [5, 6, 7, 8]])
    assert int((two.position_ids == 0).sum()) == 2 + 3
    with pytest.raises(ValueError, match="token-mixing"):
        score_logprobs(model, two, attn="sdpa")
    # one call alone (then padding) is exact
    one, _ = _tree([paths[0]])
    want = _reference(model, [paths[0]], one)
    with torch.no_grad():
        got = score_logprobs(model, one, attn="sdpa")
    assert float((got - want).abs().max()) < LOGP_ATOL

    torch.manual_seed(0)
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32,
                                                                   num_hidden_layers=1, state_size=4)).eval()
    with pytest.raises(ValueError, match=r"model_type 'mamba'.*token-mixing layers"):
        score_logprobs(mamba, tree, attn="auto")


@pytest.mark.slow
def test_sliding_window_flex_attention_path() -> None:
    """The FlexAttention path (windowed BlockMask + mask_mod, compiled by transformers) on
    Mistral with window 8 equals per-request scoring. ~30 s of torch.compile on CPU."""
    import warnings

    # A FlexAttention kernel compiled earlier in this process (test_equivalence's) makes
    # dynamo recompile this one with dynamic shapes, and inductor's CPU flex template
    # then emits C++ that does not build (`cur_qSplitSize8` undeclared, torch 2.11). This
    # test checks the windowed mask, so it compiles afresh, as it would alone.
    torch._dynamo.reset()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _build("mistral", "flex_attention").to(device)
    ref_model = _build("mistral", "sdpa")
    paths = _paths()
    tb, _ = _tree(paths, pad=26)  # several 32-row blocks, a partial last one
    want = _reference(ref_model, paths, tb)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = score_logprobs(model, tb.to(device), attn="flex", block_size=32).cpu()
    err = float((got - want).abs().max())
    print(f"\nmistral/flex: window {WINDOW}, depth 38: max |tree - per-request| = {err:.3g}")
    assert err < (LOGP_ATOL if device == "cpu" else 2e-3)
