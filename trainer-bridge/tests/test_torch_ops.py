"""Unit tests of floe_bridge.torch_ops on hand-made and random trees (CPU)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch")

from floe_bridge import MicroBatch  # noqa: E402
from floe_bridge.torch_ops import (  # noqa: E402
    LOG_RATIO_MAX,
    TreeBatch,
    cu_seqlens,
    dense_mask,
    flex_block_mask,
    gather_logprobs,
    grpo_loss,
    to_tensors,
    tree_mask_mod,
)

from conftest import HAND, RandomTree, make_batch  # noqa: E402


def naive_mask(end: list[int]) -> np.ndarray:
    n = len(end)
    m = np.zeros((n, n), dtype=bool)
    for q in range(n):
        for k in range(n):
            m[q, k] = k <= q < end[k]
    return m


def chain_batch(lengths: list[int], pad: int = 0) -> dict[str, np.ndarray]:
    """Plain causal sequences back to back (what prefix_merging emits), then padding."""
    pos, end, pred = [], [], []
    start = 0
    for n in lengths:
        pos += list(range(n))
        end += [start + n] * n
        pred += [-1] + list(range(start, start + n - 1))
        start += n
    for i in range(pad):
        pos.append(0)
        end.append(start + i + 1)
        pred.append(-1)
    n = len(pos)
    return {
        "input_ids": np.arange(n, dtype=np.int32) % 7,
        "position_ids": np.asarray(pos, np.int32),
        "subtree_end": np.asarray(end, np.int32),
        "pred_idx": np.asarray(pred, np.int32),
        "loss_mask": (np.asarray(pred) >= 0).astype(np.uint8),
        "old_logprobs": np.zeros(n, np.float32),
        "advantages": np.zeros(n, np.float32),
        "sample_idx": np.full(n, -1, np.int32),
    }


# --- to_tensors ----------------------------------------------------------------------


def test_to_tensors_dtypes_and_values(hand_batch: pa.RecordBatch) -> None:
    mb = MicroBatch.from_record_batch(hand_batch)
    tb = to_tensors(mb, "cpu")
    assert isinstance(tb, TreeBatch)
    for name in ("input_ids", "position_ids", "subtree_end", "pred_idx", "sample_idx"):
        t = getattr(tb, name)
        assert t.dtype == torch.int64, name
        assert t.tolist() == list(HAND[name]), name
    assert tb.loss_mask.dtype == torch.bool
    assert tb.loss_mask.tolist() == [bool(v) for v in HAND["loss_mask"]]
    assert tb.old_logprobs.dtype == torch.float32 and tb.advantages.dtype == torch.float32
    assert tb.old_logprobs.tolist() == pytest.approx(list(HAND["old_logprobs"]))
    assert tb.meta == mb.meta and tb.num_rows == 10
    assert tb.loss_rows().tolist() == [4, 6, 7]
    # the tensors own their memory: writing them leaves the Arrow buffers alone
    tb.input_ids[0] = -5
    assert int(mb.input_ids[0]) == 101


# --- masks -----------------------------------------------------------------------------


def test_dense_mask_hand_tree() -> None:
    end = list(map(int, HAND["subtree_end"]))
    got = dense_mask(torch.tensor(end))
    assert got.dtype == torch.bool
    np.testing.assert_array_equal(got.numpy(), naive_mask(end))
    # branch B (rows 5-7) sees the shared prompt, not branch A (rows 3-4)
    assert got[7].tolist() == [True, True, True, False, False, True, True, True, False, False]


@pytest.mark.parametrize("seed", range(5))
def test_dense_mask_random_trees(seed: int, make_random_tree: Callable[..., RandomTree]) -> None:
    rng = np.random.default_rng(seed)
    tree = make_random_tree(rng, int(rng.integers(1, 80)), int(rng.integers(0, 6)))
    end = tree.columns["subtree_end"]
    got = dense_mask(torch.from_numpy(end.astype(np.int64))).numpy()
    np.testing.assert_array_equal(got, naive_mask(end.tolist()))
    for q, anc in enumerate(tree.ancestors):
        assert np.flatnonzero(got[q]).tolist() == anc + [q]


def _block_tables(bm: object) -> dict[str, list[int]]:
    keys = (
        "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices"
    )
    out = {}
    for k in keys:
        t = getattr(bm, k)
        out[k] = None if t is None else t.to(torch.int64).flatten().tolist()
    return out


def _expand_block_mask(bm: object, n: int, end: torch.Tensor) -> np.ndarray:
    """Token-level mask a BlockMask stands for: full blocks True, partial blocks through
    the mask_mod, everything else False."""
    bs_q, bs_kv = bm.BLOCK_SIZE  # type: ignore[attr-defined]
    nb = bm.kv_num_blocks.shape[-1]  # type: ignore[attr-defined]
    out = np.zeros((nb * bs_q, nb * bs_kv), bool)
    mod = bm.mask_mod  # type: ignore[attr-defined]
    q = torch.arange(nb * bs_q)[:, None]
    kv = torch.arange(nb * bs_kv)[None, :]
    exact = mod(torch.tensor(0), torch.tensor(0), q, kv).numpy()
    for i in range(nb):
        for kind, num, idx in (("partial", bm.kv_num_blocks, bm.kv_indices),  # type: ignore[attr-defined]
                               ("full", bm.full_kv_num_blocks, bm.full_kv_indices)):  # type: ignore[attr-defined]
            for j in idx[0, 0, i, : int(num[0, 0, i])].tolist():
                sl = (slice(i * bs_q, (i + 1) * bs_q), slice(j * bs_kv, (j + 1) * bs_kv))
                out[sl] = True if kind == "full" else exact[sl]
    return out[:n, :n]


@pytest.mark.parametrize("seed", range(4))
def test_flex_block_mask_matches_create_block_mask_and_dense(
    seed: int, make_random_tree: Callable[..., RandomTree]
) -> None:
    rng = np.random.default_rng(100 + seed)
    tree = make_random_tree(rng, int(rng.integers(20, 200)), int(rng.integers(0, 20)))
    end = torch.from_numpy(tree.columns["subtree_end"].astype(np.int64))
    n = int(end.shape[0])
    for bs in (16, 32):
        ours = flex_block_mask(end, bs)
        ref = flex_block_mask(end, bs, build="create_block_mask")  # torch's own, CPU
        assert tuple(ours.shape) == (1, 1, n, n)
        assert _block_tables(ours) == _block_tables(ref)
        # and the tables + mask_mod reproduce the dense tree mask exactly
        np.testing.assert_array_equal(_expand_block_mask(ours, n, end), dense_mask(end).numpy())


def test_tree_mask_mod_on_all_pairs() -> None:
    end = torch.tensor(list(map(int, HAND["subtree_end"])))
    mod = tree_mask_mod(end)
    n = end.shape[0]
    got = mod(torch.tensor(0), torch.tensor(0), torch.arange(n)[:, None], torch.arange(n)[None, :])
    assert torch.equal(got, dense_mask(end))


def test_flex_attention_matches_sdpa(make_random_tree: Callable[..., RandomTree]) -> None:
    """FlexAttention with our BlockMask vs SDPA with the dense mask on random q, k, v (GQA).
    flex_attention runs on CPU in this torch (eager, unfused)."""
    from torch.nn.attention.flex_attention import flex_attention

    rng = np.random.default_rng(7)
    tree = make_random_tree(rng, 150, 10)
    end = torch.from_numpy(tree.columns["subtree_end"].astype(np.int64))
    n = int(end.shape[0])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, n, 16, generator=g)
    k = torch.randn(1, 2, n, 16, generator=g)
    v = torch.randn(1, 2, n, 16, generator=g)
    bm = flex_block_mask(end, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense_mask(end)[None, None]
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_cu_seqlens_chains_and_trees(make_random_tree: Callable[..., RandomTree]) -> None:
    cols = chain_batch([5, 1, 3], pad=2)
    got = cu_seqlens(torch.from_numpy(cols["subtree_end"]), torch.from_numpy(cols["position_ids"]))
    assert got is not None and got.dtype == torch.int32
    assert got.tolist() == [0, 5, 6, 9, 10, 11]
    # a shared prompt with two branches is not a concatenation of chains
    end = torch.tensor(list(map(int, HAND["subtree_end"])))
    pos = torch.tensor(list(map(int, HAND["position_ids"])))
    assert cu_seqlens(end, pos) is None
    # a single chain whose subtree_end is not the sequence end (inconsistent) is rejected too
    bad = torch.from_numpy(cols["subtree_end"]).clone()
    bad[1] = 3
    assert cu_seqlens(bad, torch.from_numpy(cols["position_ids"])) is None
    # random trees with a branch are rejected
    rng = np.random.default_rng(3)
    tree = make_random_tree(rng, 60, 0)
    if any(tree.columns["pred_idx"][i] not in (-1, i - 1) for i in range(60)):
        assert cu_seqlens(
            torch.from_numpy(tree.columns["subtree_end"]), torch.from_numpy(tree.columns["position_ids"])
        ) is None
    # and a chain batch's mask is the block-diagonal causal mask cu_seqlens describes
    mask = dense_mask(torch.from_numpy(cols["subtree_end"]))
    cu = got.tolist()
    ref = torch.zeros_like(mask)
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        ref[a:b, a:b] = torch.tril(torch.ones(b - a, b - a, dtype=torch.bool))
    assert torch.equal(mask, ref)


# --- log-probabilities -------------------------------------------------------------------


def test_gather_logprobs_vs_naive(make_random_tree: Callable[..., RandomTree]) -> None:
    rng = np.random.default_rng(11)
    tree = make_random_tree(rng, 120, 5)
    cols = tree.columns
    n, v = len(cols["input_ids"]), 50
    ids = torch.from_numpy(cols["input_ids"].astype(np.int64) % v)
    pred = torch.from_numpy(cols["pred_idx"].astype(np.int64))
    loss = torch.from_numpy(cols["loss_mask"].astype(bool))
    logits = torch.randn(n, v, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    logits.requires_grad_(True)
    logp, ent = gather_logprobs(logits, ids, pred, loss, entropy=True)
    rows = [t for t in range(n) if loss[t]]
    assert logp.shape == (len(rows),) and logp.dtype == torch.float32
    naive = torch.stack([torch.log_softmax(logits[pred[t]], -1)[ids[t]] for t in rows]).float()
    torch.testing.assert_close(logp, naive, atol=1e-5, rtol=1e-5)
    p = torch.softmax(logits.detach()[pred[rows]], -1)
    naive_ent = -(p * torch.log(p)).sum(-1).float()
    torch.testing.assert_close(ent, naive_ent, atol=1e-5, rtol=1e-5)
    # gradient flows only into the predicting rows
    logp.sum().backward()
    assert logits.grad is not None
    touched = set(pred[rows].tolist())
    for r in range(n):
        assert bool(logits.grad[r].abs().sum() > 0) == (r in touched), r
    # [1, N, V] logits and no entropy
    assert torch.equal(gather_logprobs(logits.detach()[None], ids, pred, loss), logp.detach())


def test_gather_logprobs_rejects_root_loss_row() -> None:
    logits = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="no predicting row"):
        gather_logprobs(logits, torch.tensor([0, 1, 2]), torch.tensor([-1, 0, -1]), torch.tensor([0, 1, 1]))


# --- GRPO loss ----------------------------------------------------------------------------


def _hand_loss(logp: list[float], old: list[float], adv: list[float], denom: int, lo: float, hi: float,
               cap: float | None, world: int) -> tuple[float, list[float]]:
    """Loss value and d loss / d logp, by hand (python floats).

    Without a cap: clipped PPO against the rollout, d/dlogp of -min(r·A, clip(r)·A).
    With a cap: the decoupled estimator with the proximal policy = the current weights (one
    optimizer step per batch): the objective is E_rollout[min(π/μ, C) · A · log π] up to a
    constant, so the value is -Σ min(π/μ, C)·A and the gradient -min(π/μ, C)·A per token.
    """
    total, grads = 0.0, []
    for lp, o, a in zip(logp, old, adv, strict=True):
        r = math.exp(lp - o)
        if cap is not None:
            w = min(r, cap)
            total += -w * a
            grads.append(-w * a * world / denom)
            continue
        c = min(max(r, 1 - lo), 1 + hi)
        unclipped, clipped = -r * a, -c * a
        total += max(unclipped, clipped)
        # gradient through the unclipped branch only (ties go to the unclipped one)
        g = -r * a if unclipped >= clipped else 0.0
        grads.append(g * world / denom)
    return total * world / denom, grads


@pytest.mark.parametrize("cap", [None, 1.1])
@pytest.mark.parametrize("world", [1, 4])
def test_grpo_loss_by_hand(cap: float | None, world: int) -> None:
    # ratios: 0.5 (below 1-0.2), 0.9, 1.0, 1.25 (inside the asymmetric bounds, above 1.2),
    # 1.5 (above 1+0.28) with positive and negative advantages
    ratios = [0.5, 0.5, 0.9, 1.0, 1.25, 1.25, 1.5, 1.5]
    adv = [1.0, -1.0, 2.0, -0.5, 1.0, -1.0, 1.0, -2.0]
    old = [-1.0, -0.3, -2.0, -0.7, -1.5, -0.2, -0.9, -3.0]
    logp_v = [o + math.log(r) for o, r in zip(old, ratios, strict=True)]
    logp = torch.tensor(logp_v, dtype=torch.float64, requires_grad=True)
    denom = 20  # the step has more loss tokens than this micro-batch
    loss, m = grpo_loss(logp, torch.tensor(old), torch.tensor(adv), denom, clip_low=0.2, clip_high=0.28,
                        tis_cap=cap, world_size=world)
    want, want_grad = _hand_loss(logp_v, old, adv, denom, 0.2, 0.28, cap, world)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)
    loss.backward()
    assert logp.grad is not None
    np.testing.assert_allclose(logp.grad.numpy(), want_grad, rtol=1e-5, atol=1e-7)
    # 1.25 with A>0 is inside [0.8, 1.28]: unclipped (a symmetric 0.2 clip would cut it);
    # cut: 0.5 with A<0 and 1.5 with A>0 -> 2 of 8 (the others pick the unclipped term)
    if cap is None:
        assert float(m["clip_fraction"]) == pytest.approx(2 / 8)
        assert want_grad[4] != 0.0 and want_grad[1] == 0.0 and want_grad[6] == 0.0
    else:
        assert float(m["clip_fraction"]) == 0.0  # the ratio to the proximal policy is 1
    assert float(m["mismatch"]) == pytest.approx(sum(abs(math.log(r)) for r in ratios) / 8, rel=1e-5)
    assert float(m["ratio_mean"]) == pytest.approx(sum(ratios) / 8, rel=1e-5)
    assert int(m["loss_tokens"]) == 8
    assert ("tis_weight_mean" in m) == (cap is not None)


def test_grpo_loss_token_mean_over_micro_batches() -> None:
    """Summing per-micro-batch losses = one token-mean over the step, whatever the split."""
    g = torch.Generator().manual_seed(5)
    logp = -torch.rand(30, generator=g, dtype=torch.float64)
    old = logp + 0.1 * torch.randn(30, generator=g, dtype=torch.float64)
    adv = torch.randn(30, generator=g, dtype=torch.float64)
    whole, _ = grpo_loss(logp, old, adv, 30)
    parts = sum(grpo_loss(logp[a:b], old[a:b], adv[a:b], 30)[0] for a, b in ((0, 7), (7, 8), (8, 30)))
    assert float(parts) == pytest.approx(float(whole), rel=1e-12)
    empty, m = grpo_loss(logp[:0], old[:0], adv[:0], 30)
    assert float(empty) == 0.0 and float(m["clip_fraction"]) == 0.0 and int(m["loss_tokens"]) == 0
    with pytest.raises(ValueError):
        grpo_loss(logp, old, adv, 0)


def test_chain_batch_round_trip_through_arrow() -> None:
    cols = chain_batch([4, 2], pad=2)
    mb = MicroBatch.from_record_batch(make_batch(cols))
    mb.validate()
    tb = to_tensors(mb)
    assert cu_seqlens(tb.subtree_end, tb.position_ids) is not None


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_tis_weights_the_ratio_once(sign: float) -> None:
    """Issue 13 item 1: with rho = pi/mu = [0.5, 3, 10] and C = 2 the weight on A·grad logp
    is min(rho, C) = [0.5, 2, 2] (the old code gave rho·min(rho, C) = [0.25, 6, 20])."""
    rho = [0.5, 3.0, 10.0]
    old = [-1.0, -2.0, -3.0]
    adv = [sign] * 3
    logp = torch.tensor([o + math.log(r) for o, r in zip(old, rho, strict=True)], dtype=torch.float64,
                        requires_grad=True)
    loss, m = grpo_loss(logp, torch.tensor(old), torch.tensor(adv), 3, tis_cap=2.0)
    loss.backward()
    assert logp.grad is not None
    weights = (-logp.grad * 3 / sign).tolist()
    np.testing.assert_allclose(weights, [0.5, 2.0, 2.0], rtol=1e-12)
    assert float(m["tis_weight_mean"]) == pytest.approx(4.5 / 3)


def test_tis_with_explicit_proximal_logprobs() -> None:
    """Decoupled PPO (verl/AReaL) spelled out per token: r = pi/pi_prox clipped to
    [1-lo, 1+hi], constant weight w = min(pi_prox/mu, C); loss = -w·min(r·A, clip(r)·A)."""
    g = torch.Generator().manual_seed(11)
    n = 40
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    prox = old + torch.randn(n, generator=g, dtype=torch.float64)
    logp_v = prox + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    logp = logp_v.clone().requires_grad_()
    loss, _ = grpo_loss(logp, old, adv, 50, clip_low=0.2, clip_high=0.28, tis_cap=1.5,
                        prox_logprobs=prox, world_size=2)
    loss.backward()
    assert logp.grad is not None
    want_total, want_grad = 0.0, []
    for lp, p, o, a in zip(logp_v.tolist(), prox.tolist(), old.tolist(), adv.tolist(), strict=True):
        r = math.exp(lp - p)
        w = min(math.exp(p - o), 1.5)
        surr = min(r * a, min(max(r, 0.8), 1.28) * a)
        want_total += -w * surr
        cut = (a > 0 and r > 1.28) or (a < 0 and r < 0.8)
        want_grad.append(0.0 if cut else -w * r * a * 2 / 50)
    assert float(loss.detach()) == pytest.approx(want_total * 2 / 50, rel=1e-12)
    np.testing.assert_allclose(logp.grad.numpy(), want_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_poisoned_old_logprob_keeps_the_loss_finite(dtype: torch.dtype, cap: float | None) -> None:
    """Issue 13 item 4: vLLM's -9999 sentinel as a rollout log-prob gave an infinite ratio and
    a NaN/inf loss or gradient; the log-ratio is clamped to ±LOG_RATIO_MAX before exp."""
    old = torch.tensor([-9999.0, -1.0, -0.5], dtype=dtype)
    logp = torch.tensor([-2.0, -1.1, -0.4], dtype=dtype, requires_grad=True)
    for sign in (1.0, -1.0):
        logp.grad = None
        loss, m = grpo_loss(logp, old, torch.tensor([sign, -1.0, 1.0], dtype=dtype), 3, tis_cap=cap)
        loss.backward()
        assert logp.grad is not None
        assert bool(torch.isfinite(loss)) and bool(torch.isfinite(logp.grad).all())
        assert all(bool(torch.isfinite(v)) for v in m.values())
        # the clamped ratio is e^20 at most: the poisoned token's loss is bounded by it
        assert abs(float(loss.detach())) <= math.exp(LOG_RATIO_MAX) * 4


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window", [1, 3, 8, 40])
def test_sliding_window_tree_masks(
    seed: int, window: int, make_random_tree: Callable[..., RandomTree]
) -> None:
    """Issue 13 item 2: a row sees itself and the ancestors within ``window`` positions of
    depth, from the generator's own ancestor lists; dense mask, mask_mod and BlockMask
    (ours and create_block_mask's) all give exactly that, and flex_attention = sdpa."""
    from torch.nn.attention.flex_attention import flex_attention

    rng = np.random.default_rng(300 + seed)
    tree = make_random_tree(rng, int(rng.integers(60, 200)), int(rng.integers(0, 20)))
    end = torch.from_numpy(tree.columns["subtree_end"].astype(np.int64))
    pos = torch.from_numpy(tree.columns["position_ids"].astype(np.int64))
    n = int(end.shape[0])
    want = np.zeros((n, n), bool)
    for q, anc in enumerate(tree.ancestors):
        for k in anc + [q]:
            want[q, k] = len(anc) - len(tree.ancestors[k]) < window
    np.testing.assert_array_equal(dense_mask(end, pos, window).numpy(), want)
    mod = tree_mask_mod(end, pos, window)
    got = mod(torch.tensor(0), torch.tensor(0), torch.arange(n)[:, None], torch.arange(n)[None, :])
    np.testing.assert_array_equal(got.numpy(), want)
    for bs in (16, 32):
        ours = flex_block_mask(end, bs, position_ids=pos, window=window)
        ref = flex_block_mask(end, bs, build="create_block_mask", position_ids=pos, window=window)
        np.testing.assert_array_equal(_expand_block_mask(ours, n, end), want)
        np.testing.assert_array_equal(_expand_block_mask(ref, n, end), want)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, n, 16, generator=g)
    k = torch.randn(1, 2, n, 16, generator=g)
    v = torch.randn(1, 2, n, 16, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_attention(q, k, v, block_mask=flex_block_mask(end, 32, position_ids=pos, window=window),
                             enable_gqa=True)
    ref_out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=torch.from_numpy(want)[None, None]
    )
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


def test_gather_logprobs_at_each_rows_temperature() -> None:
    """Issue 13 item 5: a loss row of a call sampled at T is scored log_softmax(logits / T)
    (vLLM's processed log-probs), computed here in float64 numpy from the definition."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 11, generator=g) * 3
    ids = torch.tensor([0, 4, 2, 9, 1, 7])
    pred = torch.tensor([-1, 0, 1, 2, 3, 4])
    mask = torch.tensor([0, 1, 1, 1, 0, 1])
    temp = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 0.7])
    got = gather_logprobs(logits, ids, pred, mask, temperature=temp).numpy()
    want = []
    for t in (1, 2, 3, 5):
        z = logits[int(pred[t])].double().numpy() / float(temp[t])
        z = z - z.max()
        want.append(z[int(ids[t])] - math.log(np.exp(z).sum()))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    plain = gather_logprobs(logits, ids, pred, mask).numpy()
    assert abs(got[0] - plain[0]) > 1e-2  # the temperature changes the scores


def _dual_clip_objective(r: float, a: float, lo: float, hi: float, c: float | None) -> float:
    """Dual-clip PPO's per-token objective as Ye et al. (2020) and DAPO write it:
    min(r·A, clip(r, 1-lo, 1+hi)·A), and for A < 0 the max of that and c·A."""
    surr = min(r * a, min(max(r, 1.0 - lo), 1.0 + hi) * a)
    return max(surr, c * a) if (c is not None and a < 0) else surr


@pytest.mark.parametrize("c", [3.0, 5.0, None])
def test_dual_clip_bounds_negative_advantage_tokens(c: float | None) -> None:
    """Issue 21 item 11: a valid token with rollout log-prob -15, current -0.1 and A = -1 had
    a gradient weight r·|A| = e^14.9 ≈ 3e6. Reference: the loss is -Σ objective / denom with
    the formula above, and the gradient its central difference in log-prob (float64)."""
    old = [-15.0, -1.0, -1.0, -2.0, -0.5, -3.0]
    logp_v = [-0.1, -1.0 + math.log(2.0), -1.0 + math.log(4.0), -2.0 + math.log(6.0), -0.5,
              -3.0 + math.log(0.5)]
    adv = [-1.0, -1.0, -0.5, 2.0, -1.0, -1.0]
    denom = 10
    logp = torch.tensor(logp_v, dtype=torch.float64, requires_grad=True)
    kw: dict[str, float | None] = {} if c == 3.0 else {"dual_clip": c}  # 3 is the default
    loss, m = grpo_loss(logp, torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64),
                        denom, **kw)
    loss.backward()
    assert logp.grad is not None

    def ref(lps: list[float]) -> float:
        return -sum(_dual_clip_objective(math.exp(lp - o), a, 0.2, 0.28, c)
                    for lp, o, a in zip(lps, old, adv, strict=True)) / denom

    assert float(loss.detach()) == pytest.approx(ref(logp_v), rel=1e-12)
    # each token's gradient is the central difference of its own term (a sum would lose the
    # small terms' digits next to the e^14.9 one)
    h = 1e-6

    def term(lp: float, o: float, a: float) -> float:
        return -_dual_clip_objective(math.exp(lp - o), a, 0.2, 0.28, c) / denom

    want_grad = [(term(lp + h, o, a) - term(lp - h, o, a)) / (2 * h)
                 for lp, o, a in zip(logp_v, old, adv, strict=True)]
    if c is None:
        # no dual clip: the first token weighs e^14.9 ≈ 2.95e6 per unit of |A|
        assert logp.grad[0] * denom == pytest.approx(math.exp(14.9), rel=1e-9)
        np.testing.assert_allclose(logp.grad.numpy(), want_grad, rtol=1e-5)
        assert "dual_clip_fraction" not in m
        return
    np.testing.assert_allclose(logp.grad.numpy(), want_grad, rtol=1e-5, atol=1e-9)
    # the -15 token: bounded at -c·A, no gradient; ratio 2 < c: r·A, weight 2
    assert float(logp.grad[0]) == 0.0
    assert float(logp.grad[1]) * denom == pytest.approx(2.0, rel=1e-9)
    cut = sum(1 for lp, o, a in zip(logp_v, old, adv, strict=True) if a < 0 and math.exp(lp - o) > c)
    assert float(m["dual_clip_fraction"]) == pytest.approx(cut / len(old))


def test_dual_clip_must_exceed_the_upper_clip() -> None:
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="dual_clip"):
        grpo_loss(x, x, -torch.ones(2), 2, dual_clip=1.2)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_tis_masks_tokens_at_the_log_ratio_clamp(sign: float) -> None:
    """Issue 21 item 11: under TIS, a token whose behaviour log-ratio log(π/μ) reached the ±20
    clamp got the full weight C. It gets none: weight 0, no loss, no gradient; the others keep
    min(π/μ, C) (the truncated-IS formula)."""
    old = [-40.0, -1.0, -2.0, -0.5]
    logp_v = [-0.1, -1.0 + math.log(3.0), -2.0 + math.log(0.5), -25.0]  # log-ratios 39.9, ., ., -24.5
    cap = 2.0
    logp = torch.tensor(logp_v, dtype=torch.float64, requires_grad=True)
    adv = torch.full((4,), sign, dtype=torch.float64)
    loss, m = grpo_loss(logp, torch.tensor(old, dtype=torch.float64), adv, 4, tis_cap=cap)
    loss.backward()
    assert logp.grad is not None
    rho = [math.exp(lp - o) for lp, o in zip(logp_v, old, strict=True)]
    w = [0.0 if abs(math.log(r)) >= LOG_RATIO_MAX else min(r, cap) for r in rho]
    assert w[0] == 0.0 and w[3] == 0.0 and w[1] == 2.0
    # r = π/π_prox = 1 in value: loss = -Σ w·A / denom, gradient -w·A / denom
    assert float(loss.detach()) == pytest.approx(-sum(wi * sign for wi in w) / 4, rel=1e-12)
    np.testing.assert_allclose(logp.grad.numpy(), [-wi * sign / 4 for wi in w], rtol=1e-12, atol=0)
    assert int(m["tis_masked"]) == 2


def test_constant_normalizer_is_dr_grpo_s() -> None:
    """Issue 21 item 13: Dr. GRPO divides the summed per-token loss by a constant (TRL: batch
    size × max_completion_length), not by the step's token count. With ``normalizer=K`` the
    loss is -Σ min(r·A, clip(r)·A) / K whatever the step's loss tokens."""
    old = [-1.0, -2.0, -0.5]
    ratios = [1.1, 0.7, 1.4]
    adv = [1.0, -1.0, 0.5]
    logp = torch.tensor([o + math.log(r) for o, r in zip(old, ratios, strict=True)], dtype=torch.float64)
    want = -sum(_dual_clip_objective(r, a, 0.2, 0.28, None) for r, a in zip(ratios, adv, strict=True))
    for tokens in (3, 17, 1000):
        loss, _ = grpo_loss(logp, torch.tensor(old), torch.tensor(adv), tokens, normalizer=4096.0)
        assert float(loss) == pytest.approx(want / 4096.0, rel=1e-12)
    token_mean, _ = grpo_loss(logp, torch.tensor(old), torch.tensor(adv), 17)
    assert float(token_mean) == pytest.approx(want / 17, rel=1e-12)
