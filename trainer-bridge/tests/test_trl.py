"""floe_bridge.trl against TRL 1.16's AsyncGRPOTrainer (docs/trl.md).

The converter is checked against TRL's own ``TreeRow.pack()`` on the same samples; the CPU
tree attention against plain causal scoring of each sample alone; and the real trainer
trains from a ``floe serve`` that recorded sessions through the reference server, its loss
terms checked against the per-request terms floe recorded (the reference server's own
log-probs: same model, same seed, so the first step's ratio is 1)."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from floe_stack import Stack, refserver_argv  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402

from floe_bridge import FloeClient, MicroBatch  # noqa: E402
from floe_bridge.trl import (  # noqa: E402
    TREE_ATTENTION,
    FloeRolloutWorker,
    FloeWeightTransfer,
    NoWeightTransfer,
    call_paths,
    register_cpu_tree_attention,
    to_trl_tree,
    tree_terms,
    use_cpu_tree_attention,
)

from conftest import HAND, make_batch, random_tree  # noqa: E402

# --- converter and attention, no server ------------------------------------------------


def _samples(mb: MicroBatch) -> list[dict[str, Any]]:
    out = []
    for cp in call_paths(mb):
        out.append(
            {
                "input_ids": torch.tensor(mb.input_ids[cp.rows].astype(np.int64)),
                "completion_mask": torch.tensor(cp.trained.astype(np.int64)),
                "old_log_probs": torch.tensor(
                    np.where(cp.trained, mb.old_logprobs[cp.rows], 0).astype(np.float32)
                ),
                "advantage": float(mb.advantages[cp.rows[cp.trained]][0]),
                "group_id": 0,
            }
        )
    return out


def _pack(mb: MicroBatch) -> dict[str, Any]:
    row = TreeRow()
    for s in _samples(mb):
        row.add(s)
    return row.pack()


def _terms(packed: dict[str, Any]) -> Counter[Any]:
    return Counter((c, t, round(lp, 5), round(a, 5)) for c, t, lp, a in tree_terms(packed))


def _random_batches(n: int, vocab: int = 3) -> Iterator[MicroBatch]:
    rng = np.random.default_rng(7)
    for _ in range(n):
        rt = random_tree(rng, int(rng.integers(10, 80)), 3)
        cols = rt.columns
        cols["input_ids"] = rng.integers(0, vocab, len(cols["input_ids"])).astype(
            np.int32
        )  # branches collide
        cols["sample_idx"] = np.where(cols["loss_mask"] == 1, rng.integers(0, 3, len(cols["input_ids"])), -1)
        cols["advantages"] = np.where(cols["loss_mask"] == 1, cols["sample_idx"] - 1.0, 0).astype(np.float32)
        yield MicroBatch.from_record_batch(make_batch(cols))


def test_call_paths_carry_every_loss_term_once_on_its_context() -> None:
    for mb in [MicroBatch.from_record_batch(make_batch(HAND)), *_random_batches(40)]:
        seen: Counter[int] = Counter()
        for cp in call_paths(mb):
            # a path: each row's predecessor is the row before it, from a root
            assert mb.pred_idx[cp.rows[0]] == -1
            assert (mb.pred_idx[cp.rows[1:]] == cp.rows[:-1]).all()
            assert mb.loss_mask[cp.rows[-1]] == 1
            assert (mb.sample_idx[cp.rows[cp.trained]] == cp.sample_idx).all()
            seen.update(cp.rows[cp.trained].tolist())
        assert sorted(seen) == np.flatnonzero(mb.loss_mask).tolist()
        assert set(seen.values()) <= {1}


def test_converter_equals_treerow_pack_on_the_same_samples() -> None:
    """to_trl_tree keeps floe's layout; TreeRow.pack() re-packs the recovered samples its own
    way. Same loss terms (context, target, old log-prob, advantage), and TRL's invariants."""
    hand = MicroBatch.from_record_batch(make_batch(HAND))
    for mb in [hand, *_random_batches(60)]:
        ours, trl = to_trl_tree(mb), _pack(mb)
        assert set(ours) == set(trl)
        for k in ours:
            assert ours[k].dtype == trl[k].dtype, k
        assert _terms(ours) == _terms(trl)
        assert len(ours["token_index"]) == mb.num_loss_tokens
        # one label per position: every term's target is its position's label
        assert (ours["shift_labels"][ours["token_index"]] >= 0).all()
    # the hand batch forwards its 8 real rows once (TRL forks one token early: 9)
    assert len(to_trl_tree(hand)["input_ids"]) == 8 and len(_pack(hand)["input_ids"]) == 9
    assert to_trl_tree(hand)["token_index"].tolist() == [3, 5, 6]  # pred_idx of the loss rows


def _tiny_model(vocab: int) -> Any:
    cfg = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    m = transformers.Qwen2ForCausalLM(cfg).eval()
    return m


def _tree_logps(model: Any, packed: dict[str, Any]) -> Any:
    from trl.experimental.async_grpo.packing import register_tree_attention

    register_tree_attention()
    register_cpu_tree_attention()
    model.config._attn_implementation = TREE_ATTENTION
    kw = {k: packed[k] for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    kw["tree_max_seqlen_q"], kw["tree_max_seqlen_k"] = packed["tree_max_seqlens"].tolist()
    with torch.no_grad():
        logits = model(
            input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None], **kw
        ).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    idx = packed["token_index"]
    return lp[idx, packed["shift_labels"][idx]]


def test_cpu_tree_attention_scores_each_term_as_its_own_sequence() -> None:
    """SDPA over each segment's gathered K/V path, through a real Qwen2 (RoPE, GQA): every
    loss term's log-prob equals a plain causal forward of its context alone."""
    vocab = 3
    model = _tiny_model(vocab)
    plain = _tiny_model(vocab)
    plain.config._attn_implementation = "sdpa"
    for mb in list(_random_batches(6, vocab)):
        for packed in (to_trl_tree(mb), _pack(mb)):
            got = _tree_logps(model, packed)
            want = []
            for ctx, target, _, _ in tree_terms(packed):
                with torch.no_grad():
                    lg = plain(input_ids=torch.tensor([ctx])).logits[0, -1]
                want.append(torch.log_softmax(lg.float(), -1)[target])
            assert torch.allclose(got, torch.stack(want), atol=1e-5), (got - torch.stack(want)).abs().max()


# --- a floe serve that recorded sessions through the reference server --------------------

MODEL = "floe-ref"


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)  # type: ignore[no-any-return]


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.load(r)  # type: ignore[no-any-return]


@dataclass
class Floe:
    proxy: str
    control: str
    flight: str
    sessions: list[str]

    def session(self, sid: str) -> dict[str, Any]:
        return _get(f"{self.control}/floe/v1/sessions/{sid}")

    def new_session(self, group: str, size: int) -> dict[str, Any]:
        return _post(
            f"{self.control}/floe/v1/sessions", {"task_id": group, "group_id": group, "group_size": size}
        )


def chat(sess: dict[str, Any], messages: list[dict[str, Any]], max_tokens: int) -> str:
    import openai

    client = openai.OpenAI(
        base_url=sess["base_urls"]["openai"], api_key=sess["api_key"], max_retries=0, timeout=120
    )
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)
    return r.choices[0].message.content or ""


def drive(floe: Floe, groups: int, size: int = 2, turns: int = 2, max_tokens: int = 8) -> None:
    """Harness-like sessions: a shared system prompt, a task, and follow-up turns that
    extend the conversation; rewards differ within a group."""
    for g in range(groups):
        for s in range(size):
            sess = floe.new_session(f"g{g}", size)
            floe.sessions.append(sess["session_id"])
            msgs = [
                {"role": "system", "content": "You are a coding agent. Fix the failing test."},
                {"role": "user", "content": f"Task {g}: tests/test_{g}.py fails with an AssertionError."},
            ]
            for t in range(turns):
                answer = chat(sess, msgs, max_tokens)
                msgs += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"Tool output {t}: ok"},
                ]
            _post(f"{floe.control}/floe/v1/sessions/{sess['session_id']}/finish",
                  {"reward": float(s + g % 2), "status": "completed"})


@pytest.fixture(scope="module")
def refserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("trl-ref")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with Stack(tmp / "logs", grace=20) as procs:
        _, hello = procs.start_server(
            "refserver",
            refserver_argv("--port", "0", "--threads", "1", "--log-level", "WARNING"),
            120,
            env=env,
        )
        yield hello["base_url"].removesuffix("/v1")


@pytest.fixture
def floe_serve(floe_bin: Path, refserver: str, tmp_path: Path) -> Iterator[Callable[..., Floe]]:
    with Stack(tmp_path / "logs", grace=20) as procs:

        def start(**flags: object) -> Floe:
            args = [str(floe_bin), "serve", "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0",
                    "-data-dir", str(tmp_path / f"data-{len(procs.children)}"), "-upstream", refserver,
                    "-group-size", "2", "-groups-per-step", "1", "-steps-ahead", "2",
                    "-token-budget", "4096", "-pad-multiple", "16", "-control-addr", "127.0.0.1:0",
                    # the loss terms are checked against the sessions the control API still
                    # holds after the commits: keep committed steps in the store (docs/archive.md)
                    "-archive=false"]
            for k, v in flags.items():
                args += [f"-{k.replace('_', '-')}", str(v)]
            _, addrs = procs.start_server("floe", args, 60)
            return Floe(addrs["proxy"], addrs["control"], addrs["flight"], [])

        yield start


def _trainer_args(out: Path, **kw: Any) -> Any:
    from trl.experimental.async_grpo import AsyncGRPOConfig

    base = dict(
        output_dir=str(out), max_steps=2, learning_rate=1e-3, per_device_train_batch_size=4,
        gradient_accumulation_steps=1, logging_steps=1, report_to=[], use_cpu=True, dtype="float32",
        temperature=1.0, weight_sync_steps=1, max_staleness=8, save_strategy="no", token_budget=4096,
        bf16=False, disable_tqdm=True, heartbeat_stale_after_s=120,
    )
    base.update(kw)
    return AsyncGRPOConfig(**base)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """The reference server's model (its vocabulary, seed 0), saved for TRL to load."""
    from floe_refserver.model import build_model
    from floe_refserver.tokenizer import load_tokenizer

    tok = load_tokenizer()
    path = tmp_path_factory.mktemp("trl-model")
    build_model(len(tok), seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), tok


class Recorder:
    """Wraps the trainer's compute_loss: keeps each batch and the log-probs TRL's own forward
    gives its loss terms (scored again under no_grad, before the update)."""

    def __init__(self, trainer: Any) -> None:
        self.batches: list[dict[str, Any]] = []
        self.logps: list[Any] = []
        inner = trainer.compute_loss

        def compute_loss(model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
            row = {k: v[0] for k, v in inputs.items()}
            keep = row["attention_mask"].bool()
            packed = {k: row[k][keep] for k in ("input_ids", "position_ids", "shift_labels")}
            for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k", "token_index",
                      "old_log_probs", "advantages", "segment_id"):
                sel = (
                    row[k] >= 0
                    if k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k", "token_index")
                    else row["token_index"] >= 0
                )
                packed[k] = row[k][sel]
            packed["tree_max_seqlens"] = row["tree_max_seqlens"]
            self.batches.append(packed)
            kwargs = {k: packed[k] for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
            kwargs["tree_max_seqlen_q"], kwargs["tree_max_seqlen_k"] = packed["tree_max_seqlens"].tolist()
            with torch.no_grad():
                out = model(input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
                            shift_labels=packed["shift_labels"][None], fused_lm_head=True, **kwargs)
            self.logps.append(out.log_probs.flatten()[packed["token_index"]])
            return inner(model, inputs, *a, **kw)

        trainer.compute_loss = compute_loss


def _f32(x: float) -> float:
    """x at float32, the width the packed batch carries: the recorded log-prob arrives as a
    JSON double, and rounding the two widths to a few decimals splits values that sit near
    a rounding boundary."""
    return float(np.float32(x))


def _check_terms(rec: Recorder, floe: Floe, sessions_advantage: dict[str, float]) -> None:
    # Each term is keyed by its context, target and old log-prob, all exact at float32; the
    # advantages under a key are compared with a tolerance, since floe's float64 advantage
    # and this test's may differ in the last bit before the cast.
    got: dict[Any, list[float]] = defaultdict(list)
    for packed in rec.batches:
        for ctx, tgt, lp, adv in tree_terms(packed):
            got[(ctx, tgt, _f32(lp))].append(adv)
    want: dict[Any, list[float]] = defaultdict(list)
    for sid in floe.sessions:
        for c in floe.session(sid).get("calls") or []:
            if not c.get("trainable") or sid not in sessions_advantage:
                continue
            p, r, lps = c["prompt_ids"], c["response_ids"], c["logprobs"]
            for i in range(len(r)):
                want[(tuple(p + r[:i]), r[i], _f32(lps[i]))].append(sessions_advantage[sid])
    n_got, n_want = sum(map(len, got.values())), sum(map(len, want.values()))
    assert n_got == n_want > 0
    assert got.keys() == want.keys()
    for k, advs in want.items():
        assert sorted(got[k]) == pytest.approx(sorted(advs), abs=1e-6), k
    # the first batch is scored by the weights the reference server sampled with
    first = rec.logps[0]
    assert torch.allclose(first, rec.batches[0]["old_log_probs"], atol=2e-4), \
        (first - rec.batches[0]["old_log_probs"]).abs().max()


def test_async_grpo_trainer_trains_from_floe(
    floe_serve: Callable[..., Floe], model_dir: tuple[str, Any], tmp_path: Path
) -> None:
    """The real AsyncGRPOTrainer, FloeRolloutWorker as its rollout worker and
    FloeWeightTransfer (around a no-op: the reference server keeps its weights) as its
    weight sync, trains 2 steps on CPU. Tree attention: TRL's name, SDPA implementation."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    use_cpu_tree_attention()
    floe = floe_serve()
    # 3 steps for 2 trained: accelerate's dispatcher fetches one micro-batch ahead
    drive(floe, groups=3)
    path, tok = model_dir
    # the steps as floe formed them: their sample tables (advantages) and sequence counts,
    # read before the worker commits them
    advantages: dict[str, float] = {}
    counts = []
    with FloeClient(floe.flight, rank=0, world_size=None) as c:
        for step in (0, 1):
            t = c.read_samples(step).to_pydict()
            advantages.update(zip(t["session_id"], t["advantage"], strict=True))
            counts.append(sum(len(call_paths(mb)) for mb in c.read_step(step).micro_batches))
    assert counts[0] == counts[1], counts
    worker = FloeRolloutWorker(floe.flight, timeout=30)
    wt = FloeWeightTransfer(NoWeightTransfer(), floe.flight)
    # token_budget=0: TRL's fixed-count planner, one floe step's sequences per TRL step
    args = _trainer_args(tmp_path / "out", token_budget=0, per_device_train_batch_size=counts[0])
    trainer = AsyncGRPOTrainer(
        path,
        args=args,
        processing_class=tok,
        train_dataset=_placeholder(),
        rollout_worker=worker,
        weight_transfer=wt,
    )
    rec = Recorder(trainer)
    out = trainer.train()
    worker.stop()
    assert trainer.state.global_step == 2
    assert worker.steps_committed == [0, 1, 2]
    # a cold sync at train begin, then one per step (weight_sync_steps=1)
    assert wt.policy_version == 3 and trainer.model_version == 3
    with FloeClient(floe.flight, rank=0, world_size=None) as c:
        st = c.status()
    assert st["policy_version"] == 3 and not st["paused"]
    assert np.isfinite(out.training_loss)
    _check_terms(rec, floe, advantages)
    logged = [h for h in trainer.state.log_history if "floe/tokens_saved" in h]
    assert logged and all(h["floe/tokens_saved"] > 0 for h in logged)


def _placeholder() -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]]})


class _SlowTransfer(NoWeightTransfer):
    """An inner backend whose transfer takes a while and records when it ran."""

    def __init__(self, during: Callable[[], None]) -> None:
        self.during = during
        self.times: dict[str, float] = {}

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        self.times["send_start"] = time.monotonic()
        self.during()
        time.sleep(1.5)
        self.times["send_end"] = time.monotonic()


def test_weight_sync_pauses_floe_around_the_transfer(floe_serve: Callable[..., Floe]) -> None:
    """A call in flight when the sync starts completes before the transfer; a call that
    arrives during the transfer waits for resume and is stamped with the new version."""
    floe = floe_serve()
    done: dict[str, float] = {}
    sess = {k: floe.new_session(f"w{k}", 2) for k in ("a", "b")}
    msgs = [{"role": "user", "content": "Write a long story about a compiler."}]

    def call(k: str, n: int) -> None:
        chat(sess[k], msgs, n)
        done[k] = time.monotonic()

    threads: list[threading.Thread] = []

    def during() -> None:
        t = threading.Thread(target=call, args=("b", 4))
        t.start()
        threads.append(t)
        time.sleep(0.5)
        assert "b" not in done, "a call went upstream during the weight transfer"

    inner = _SlowTransfer(during)
    wt = FloeWeightTransfer(inner, floe.flight)
    ta = threading.Thread(target=call, args=("a", 600))
    ta.start()
    with FloeClient(floe.flight, rank=0, world_size=None) as c:  # wait until a is upstream
        deadline = time.monotonic() + 30
        while c.status()["inflight"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert "a" not in done, "the in-flight call finished too early to test anything"
    wt.pause()
    paused_at = time.time()  # wall clock, as floe stamps its calls
    wt.send_weights(iter(()))
    resuming_at = time.time()
    wt.resume()
    ta.join(60)
    threads[0].join(60)
    assert set(done) == {"a", "b"}
    # The order is floe's, from the calls it recorded: the client threads' own clocks would
    # race the pause's reply by a scheduler tick. a was answered before pause returned;
    # b went upstream only after resume, under the new version.
    calls = {k: floe.session(s["session_id"])["calls"] for k, s in sess.items()}
    finished = {k: datetime.fromisoformat(c[0]["finished"]).timestamp() for k, c in calls.items()}
    assert finished["a"] <= paused_at
    assert finished["b"] >= resuming_at
    assert inner.times["send_start"] <= inner.times["send_end"]
    assert {k: [c["policy_version"] for c in cs] for k, cs in calls.items()} == {"a": [0], "b": [1]}
    assert wt.policy_version == 1


def test_floe_packed_rows_train_async_grpo_trainer(
    floe_serve: Callable[..., Floe], model_dir: tuple[str, Any], tmp_path: Path
) -> None:
    """FloeAsyncGRPOTrainer: TRL's loss on floe's own packing (to_trl_tree of each floe
    micro-batch), 2 steps; every loss term is a per-request term, each step committed."""
    from floe_bridge.trl import FloeAsyncGRPOTrainer

    use_cpu_tree_attention()
    floe = floe_serve()
    drive(floe, groups=3)
    advantages: dict[str, float] = {}
    with FloeClient(floe.flight, rank=0, world_size=None) as c:
        for step in (0, 1):
            t = c.read_samples(step).to_pydict()
            advantages.update(zip(t["session_id"], t["advantage"], strict=True))
    path, tok = model_dir
    trainer = FloeAsyncGRPOTrainer(
        path, flight_uri=floe.flight, args=_trainer_args(tmp_path / "out"), processing_class=tok,
    )
    rec = Recorder(trainer)
    out = trainer.train()
    assert trainer.state.global_step == 2 and trainer.floe_committed == [0, 1]
    assert np.isfinite(out.training_loss)
    _check_terms(rec, floe, advantages)
    # floe's layout, not TRL's: each batch forwards exactly floe's real rows
    with FloeClient(floe.flight, rank=0, world_size=None) as c:
        assert c.status()["committed"] == 2


def test_weight_transfer_restarted_against_a_running_floe(floe_serve: Callable[..., Floe]) -> None:
    """Issue 21 item 7: a trainer restarted against a floe that a previous trainer took to
    policy version 3 resumes it forward (4), where counting from 0 failed with "policy
    version 1 is older than the current 3" and left floe paused."""
    floe = floe_serve()
    with FloeClient(floe.flight, rank=0, world_size=None) as c:
        for v in (1, 2, 3):  # the previous trainer's syncs
            c.pause()
            c.resume(v)
    wt = FloeWeightTransfer(NoWeightTransfer(), floe.flight)
    assert wt.start_version == wt.policy_version == 3
    wt.pause()
    wt.resume()
    with FloeClient(floe.flight, rank=0, world_size=None) as c:
        st = c.status()
    assert st["policy_version"] == 4 and not st["paused"]
