"""floe_bridge.recipe.train_step: one step over micro-batches is the hand-written loop
(score, grpo_loss over loss_tokens_global, backward per micro-batch, clip, step), and its
figures count what it trained."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from floe_bridge import MicroBatch

from conftest import HAND, HAND_META, make_batch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from floe_bridge.hf import score_logprobs  # noqa: E402
from floe_bridge.recipe import LossSettings, StepFigures, train_step  # noqa: E402
from floe_bridge.torch_ops import grpo_loss, to_tensors  # noqa: E402


def tiny_model() -> Any:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True, attention_dropout=0.0,
    )
    model = transformers.Qwen2ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    return model.train()


def micro_batches() -> list[MicroBatch]:
    """The hand-made tree twice, the second with other old log-probs and advantages."""
    second = dict(HAND)
    second["old_logprobs"] = [0, 0, 0, 0, -2.0, 0, -0.25, -3.0, 0, 0]
    second["advantages"] = [0, 0, 0, 0, -0.5, 0, 2.0, 2.0, 0, 0]
    meta = HAND_META.to_metadata()
    return [MicroBatch.from_record_batch(make_batch(cols, meta)) for cols in (HAND, second)]


def by_hand(model: Any, opt: Any, mbs: list[MicroBatch], denom: int, s: LossSettings) -> tuple[float, int]:
    opt.zero_grad(set_to_none=True)
    total, tokens = 0.0, 0
    for mb in mbs:
        tb = to_tensors(mb, "cpu")
        logp = score_logprobs(model, tb, attn="sdpa")
        rows = tb.loss_rows()
        loss, m = grpo_loss(logp, tb.old_logprobs[rows], tb.advantages[rows], denom, clip_low=s.clip_low,
                            clip_high=s.clip_high, tis_cap=s.tis_cap, world_size=s.world_size,
                            dual_clip=s.dual_clip, normalizer=s.normalizer)
        loss.backward()
        total += float(loss.detach())
        tokens += int(m["loss_tokens"])
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return total, tokens


@pytest.mark.parametrize("settings", [LossSettings(), LossSettings(clip_low=0.1, clip_high=0.5, tis_cap=2.0),
                                      LossSettings(dual_clip=None, normalizer=64.0)])
def test_train_step_is_the_loop(settings: LossSettings) -> None:
    mbs = micro_batches()
    a = tiny_model()
    b = copy.deepcopy(a)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    for _ in range(2):  # the second step starts from the first's weights and optimizer state
        f = train_step(a, opt_a, mbs, 12, loss=settings)
        want_loss, want_tokens = by_hand(b, opt_b, mbs, 12, settings)
        assert isinstance(f, StepFigures)
        assert f.loss == pytest.approx(want_loss, rel=1e-6, abs=1e-9)
        assert f.loss_tokens == want_tokens == 6
        assert (f.micro_batches, f.rows, f.real_rows) == (2, 20, 20)
        assert f.mismatch > 0 and f.step_seconds > 0 and f.peak_memory_bytes == 0
        for (name, pa_), pb in zip(a.named_parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(pa_, pb, rtol=0, atol=0, msg=name)


def test_train_step_real_rows_from_metadata() -> None:
    """real_rows counts the metadata's rows (before padding) where floe sends them."""
    meta = dataclasses.replace(HAND_META, rows=8)
    mb = MicroBatch.from_record_batch(make_batch(HAND, meta.to_metadata()))
    model = tiny_model()
    f = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [mb], 3, max_grad_norm=None)
    assert (f.rows, f.real_rows, f.loss_tokens) == (10, 8, 3)


def test_empty_step_is_a_no_op_step() -> None:
    model = tiny_model()
    f = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), [], 1)
    assert (f.loss, f.loss_tokens, f.rows, f.mismatch) == (0.0, 0, 0, 0.0)
