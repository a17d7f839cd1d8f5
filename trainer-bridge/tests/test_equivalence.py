"""THE PROOF: training on floe's packed micro-batches is training on the recorded calls.

A tiny Qwen2 (built from a config, seeded, fp32, no download) scores every micro-batch
that a real ``floe corpus-serve`` serves over Flight, as ONE sequence with the tree mask
and depth positions (``floe_bridge.hf``). Independently, every trainable call of the
dumped corpus is run as a plain causal sequence ``prompt + response``. Each loss row is
matched to a response token by (session, exact context tokens, target token), its context
rebuilt by walking ``pred_idx``; then:

- per-token log-probabilities agree within 1e-5 (absolute);
- the GRPO loss summed over micro-batches equals the per-call loss within 1e-4 (relative);
- every parameter's gradient agrees: ||g_tree - g_ref|| / ||g_ref|| <= 1e-4.

Run for ``tree`` and ``prefix_merging``. A negative control shows the comparison is
sensitive: the same micro-batch run with transformers' own mask (attention_mask=None,
packed-sequence detection on the depth column) is far off.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from floe_bridge import MicroBatch, context_rows  # noqa: E402
from floe_bridge.client import FloeClient  # noqa: E402
from floe_bridge.hf import score, score_logprobs  # noqa: E402
from floe_bridge.torch_ops import cu_seqlens, gather_logprobs, grpo_loss, to_tensors  # noqa: E402

from conftest import FloeServer  # noqa: E402

VOCAB = 512
GROUPS = 3
SEED = 1
TOKEN_BUDGET = 2048  # >= the longest call of the Small corpus (<1.1k); small enough to force cuts
PAD = 16
INIT_RANGE = 0.1

LOGP_ATOL = 1e-5
LOSS_RTOL = 1e-4
GRAD_RTOL = 1e-4

SERVER_FLAGS: dict[str, object] = dict(
    corpus="small",
    groups=GROUPS,
    seed=SEED,
    fold_vocab=VOCAB,
    dp_size=1,
    token_budget=TOKEN_BUDGET,
    pad_multiple=PAD,
    groups_per_step=2,
)


def tiny_qwen(attn: str = "sdpa") -> Any:
    """2-layer Qwen2 with GQA (4 query heads, 2 kv heads), fp32, eval. initializer_range 0.1
    (5x the default) so that the context moves the predictions by nats (a wrong mask is off
    by ~3 nats, see the negative control) while fp32 rounding stays well under 1e-5 (at 0.2
    the logits are large enough for rounding to reach ~1e-5)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10_000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        initializer_range=INIT_RANGE,
        attention_dropout=0.0,
    )
    model = transformers.Qwen2ForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


# --- context keys: a hash chain over the path, same function on both sides -------------

_ROOT = b""


def _link(prev: bytes, token: int) -> bytes:
    return hashlib.blake2b(prev + int(token).to_bytes(4, "little"), digest_size=16).digest()


def path_hashes(tokens: Iterable[int]) -> list[bytes]:
    """h[i] = hash of tokens[:i] (h[0] = the empty context)."""
    out = [_ROOT]
    for t in tokens:
        out.append(_link(out[-1], t))
    return out


def row_path_hashes(mb: MicroBatch) -> list[bytes]:
    """hash of the path root..row (inclusive) for every row, walking pred_idx (parents
    precede children in DFS pre-order, so one pass memoises every walk)."""
    pred = mb.pred_idx.tolist()
    ids = mb.input_ids.tolist()
    out: list[bytes] = []
    for i, p in enumerate(pred):
        assert p < i
        out.append(_link(_ROOT if p < 0 else out[p], ids[i]))
    return out


Key = tuple[str, str, bytes, int]  # (group_id, session_id, context hash, target token)


@dataclass
class Term:
    logp: float
    old: float
    adv: float


@dataclass
class Side:
    """Loss terms of one side, keyed for matching; ``terms[key]`` is a multiset (a list)."""

    terms: dict[Key, list[Term]] = field(default_factory=lambda: defaultdict(list))
    count: int = 0

    def add(self, key: Key, term: Term) -> None:
        self.terms[key].append(term)
        self.count += 1


# --- reference: every trainable call as its own causal sequence ---------------------------


@dataclass
class Reference:
    """One step's loss terms, loss and gradients, from the per-call causal runs."""

    side: Side
    loss: float
    grads: dict[str, torch.Tensor]


def chain_breaks(groups: list[dict[str, Any]]) -> tuple[int, int]:
    """Calls whose prompt does not start with the previous call's prompt + response (in the
    session's recorded order): drift, compaction, sub-agents, retries, n>1 choices.
    Returns (all such calls, the trainable ones)."""
    total = trainable = 0
    for g in groups:
        for s in g["sessions"]:
            prev: list[int] | None = None
            for c in s["calls"]:
                if c["prompt_ids"] is None or c["response_ids"] is None:
                    prev = None
                    continue
                if prev is not None and c["prompt_ids"][: len(prev)] != prev:
                    total += 1
                    trainable += bool(c["trainable"])
                prev = c["prompt_ids"] + c["response_ids"]
    return total, trainable


def run_reference(model: Any, groups: list[dict[str, Any]]) -> Reference:
    """Every trainable call of ``groups`` (one step's) as its own causal sequence; the
    step's GRPO loss is the sum over all their response tokens / their count."""
    side = Side()
    logps: list[torch.Tensor] = []
    olds: list[float] = []
    advs: list[float] = []
    model.zero_grad(set_to_none=True)
    for g in groups:
        for s in g["sessions"]:
            for c in s["calls"]:
                if not c["trainable"]:
                    continue
                prompt, resp = c["prompt_ids"], c["response_ids"]
                assert max(prompt + resp) < VOCAB, "fold_vocab did not fold the dump"
                full = torch.tensor(prompt + resp, dtype=torch.int64)[None]
                logits = model(input_ids=full, use_cache=False).logits[0]  # positions 0..L-1, causal
                p = len(prompt)
                lsm = torch.log_softmax(logits[p - 1 : p - 1 + len(resp)].float(), dim=-1)
                lp = lsm.gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
                logps.append(lp)
                lp_values = lp.detach().tolist()
                hashes = path_hashes(prompt + resp)
                old = np.asarray(c["logprobs"], np.float32)
                adv = float(np.float32(s["advantage"]))
                assert len(old) == len(resp)
                for j, tok in enumerate(resp):
                    side.add((g["id"], s["id"], hashes[p + j], tok), Term(lp_values[j], float(old[j]), adv))
                    olds.append(float(old[j]))
                    advs.append(adv)
    logp_all = torch.cat(logps)
    loss, _ = grpo_loss(logp_all, torch.tensor(olds), torch.tensor(advs), side.count)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return Reference(side, float(loss.detach()), grads)


_REFERENCE: dict[tuple[str, tuple[str, ...]], Reference] = {}


def reference_for(model: Any, groups: list[dict[str, Any]], group_ids: set[str]) -> Reference:
    """The reference depends only on the corpus (same seed -> same dump) and on which
    groups form the step: computed once per step and shared by the strategies."""
    digest = hashlib.sha256(json.dumps(groups, sort_keys=True).encode()).hexdigest()
    key = (digest, tuple(sorted(group_ids)))
    if key not in _REFERENCE:
        _REFERENCE[key] = run_reference(model, [g for g in groups if g["id"] in group_ids])
    return _REFERENCE[key]


# --- the floe side ------------------------------------------------------------------------


@dataclass
class StepData:
    step: int
    loss_tokens_global: int
    micro_batches: list[MicroBatch]
    sessions: dict[int, tuple[str, str]]  # sample_idx -> (group_id, session_id)


def read_all_steps(server: FloeServer) -> list[StepData]:
    out = []
    with FloeClient(server.location, rank=0, world_size=1, timeout=30) as client:
        for n in range(server.steps):
            st = client.read_step(n)
            samples = st.samples().to_pydict()
            sessions = {
                int(i): (str(g), str(s))
                for i, g, s in zip(
                    samples["sample_idx"], samples["group_id"], samples["session_id"], strict=True
                )
            }
            out.append(StepData(n, st.loss_tokens_global, list(st.micro_batches), sessions))
            client.commit(n)
    return out


def check_equivalence(model: Any, server: FloeServer, strategy: str) -> dict[str, Any]:
    groups = server.groups()
    steps = read_all_steps(server)
    breaks, trainable_breaks = chain_breaks(groups)
    # coverage of the corpus: chain breaks (drift, compaction, sub-agents, retries, n>1)
    assert breaks >= 3 and trainable_breaks >= 1, (breaks, trainable_breaks)

    max_dlogp = max_loss_rel = max_grad_rel = 0.0
    worst_param = ""
    n_mb = shared_mb = terms = 0
    seen_groups: set[str] = set()
    for st in steps:
        step_groups = {g for g, _ in st.sessions.values()}
        assert not step_groups & seen_groups, "a group is served in two steps"
        seen_groups |= step_groups
        ref = reference_for(model, groups, step_groups)

        tree = Side()
        model.zero_grad(set_to_none=True)
        tree_loss = 0.0
        for mb in st.micro_batches:
            mb.validate()
            assert mb.meta is not None and mb.meta.strategy == strategy
            tb = to_tensors(mb, "cpu")
            logp = score_logprobs(model, tb, attn="sdpa")
            rows = tb.loss_rows()
            loss, _ = grpo_loss(logp, tb.old_logprobs[rows], tb.advantages[rows], st.loss_tokens_global)
            loss.backward()  # accumulate over the step's micro-batches
            tree_loss += float(loss.detach())
            hashes = row_path_hashes(mb)
            pred = mb.pred_idx
            lp_values = logp.detach().tolist()
            for t in rows.tolist()[:: max(1, len(rows) // 16)]:  # spot-check the memoised walk
                ctx = [int(mb.input_ids[r]) for r in context_rows(mb.pred_idx, t)]
                assert len(ctx) == int(mb.position_ids[t])
                assert path_hashes(ctx)[-1] == hashes[int(pred[t])]
            for j, t in enumerate(rows.tolist()):
                gid, sid = st.sessions[int(mb.sample_idx[t])]
                key = (gid, sid, hashes[int(pred[t])], int(mb.input_ids[t]))
                tree.add(key, Term(lp_values[j], float(mb.old_logprobs[t]), float(mb.advantages[t])))
            n_mb += 1
            shared_mb += cu_seqlens(tb.subtree_end, tb.position_ids) is None
        tree_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)

        # 1. the same multiset of loss terms, with the same log-probabilities
        assert tree.count == ref.side.count == st.loss_tokens_global
        assert set(tree.terms) == set(ref.side.terms)
        for key, mine in tree.terms.items():
            theirs = ref.side.terms[key]
            assert len(mine) == len(theirs), key
            pairs = zip(sorted(mine, key=lambda x: x.old), sorted(theirs, key=lambda x: x.old), strict=True)
            for a, b in pairs:
                assert a.old == pytest.approx(b.old, abs=1e-6)
                assert a.adv == pytest.approx(b.adv, abs=1e-6)
                max_dlogp = max(max_dlogp, abs(a.logp - b.logp))
        assert max_dlogp <= LOGP_ATOL, max_dlogp
        terms += tree.count

        # 2. the step's loss: sum over micro-batches = token-mean over the calls
        loss_rel = abs(tree_loss - ref.loss) / abs(ref.loss)
        assert loss_rel <= LOSS_RTOL, (st.step, tree_loss, ref.loss)
        max_loss_rel = max(max_loss_rel, loss_rel)

        # 3. the gradients, parameter by parameter
        assert set(tree_grads) == set(ref.grads)
        for name, g in ref.grads.items():
            assert float(g.norm()) > 0, name
            rel = float((tree_grads[name] - g).norm() / g.norm())
            assert rel <= GRAD_RTOL, (st.step, name, rel)
            if rel > max_grad_rel:
                max_grad_rel, worst_param = rel, name

    assert seen_groups == {g["id"] for g in groups}
    if strategy == "tree":
        assert shared_mb >= 1, "no tree micro-batch shares a row"
    else:
        assert shared_mb == 0, f"{shared_mb} {strategy} micro-batches are not plain chains"

    stats = {
        "strategy": strategy,
        "steps": len(steps),
        "micro_batches": n_mb,
        "shared_micro_batches": shared_mb,
        "loss_terms": terms,
        "chain_breaks": breaks,
        "trainable_chain_breaks": trainable_breaks,
        "max_abs_dlogp": max_dlogp,
        "max_loss_rel_err": max_loss_rel,
        "max_grad_rel_err": max_grad_rel,
        "worst_param": worst_param,
    }
    print("\nequivalence:", json.dumps(stats))
    return stats


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_qwen("sdpa")


@pytest.mark.parametrize("strategy", ["tree", "prefix_merging"])
def test_equivalence(strategy: str, model: Any, floe_server: Callable[..., FloeServer]) -> None:
    server = floe_server(strategy=strategy, **SERVER_FLAGS)
    check_equivalence(model, server, strategy)


def test_mask_paths_agree_and_wrong_mask_is_caught(
    model: Any, floe_server: Callable[..., FloeServer]
) -> None:
    """On one shared-prefix tree micro-batch: eager (additive float mask), sdpa (bool mask)
    and score()+gather_logprobs agree; transformers' default mask (attention_mask=None,
    which reads the depth column as packed sequences) is far off: the comparison above
    would catch a broken mask."""
    server = floe_server(strategy="tree", **{**SERVER_FLAGS, "groups": 1, "groups_per_step": 1})
    with FloeClient(server.location, rank=0, world_size=1) as client:
        mbs = client.read_step(0).micro_batches
    mb = next(m for m in mbs if cu_seqlens(*(torch.from_numpy(np.array(a, np.int64)) for a in
                                             (m.subtree_end, m.position_ids))) is None)
    tb = to_tensors(mb)
    with torch.no_grad():
        sdpa = score_logprobs(model, tb, attn="sdpa")
        full = gather_logprobs(score(model, tb), tb.input_ids, tb.pred_idx, tb.loss_mask)
        eager_model = tiny_qwen("eager")
        eager = score_logprobs(eager_model, tb, attn="eager")
        torch.testing.assert_close(full, sdpa, atol=1e-5, rtol=0)
        torch.testing.assert_close(eager, sdpa, atol=1e-5, rtol=0)
        wrong_logits = model(input_ids=tb.input_ids[None], position_ids=tb.position_ids[None],
                             use_cache=False).logits[0]
        wrong = gather_logprobs(wrong_logits, tb.input_ids, tb.pred_idx, tb.loss_mask)
    off = float((wrong - sdpa).abs().max())
    print(f"\nnegative control: transformers' own mask on a tree batch is off by up to {off:.3g} nats")
    assert off > 1e-2
    with pytest.raises(ValueError, match="attn_implementation"):
        score_logprobs(model, tb, attn="flex")


@pytest.mark.slow
def test_flex_attention_path(floe_server: Callable[..., FloeServer]) -> None:
    """attn_implementation="flex_attention" with floe's BlockMask gives the sdpa log-probs.
    transformers always wraps flex_attention in torch.compile, which takes ~30 s on CPU;
    on CUDA when present."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    server = floe_server(strategy="tree", **{**SERVER_FLAGS, "groups": 1, "groups_per_step": 1})
    with FloeClient(server.location, rank=0, world_size=1) as client:
        mbs = client.read_step(0).micro_batches
    sdpa_model = tiny_qwen("sdpa").to(device)
    flex_model = tiny_qwen("flex_attention").to(device)
    # On CPU, one shape only: a second micro-batch length recompiles with dynamic shapes,
    # and this torch's inductor C++ codegen fails on that (undeclared `cur_qSplitSize8`).
    for mb in mbs if cuda else mbs[:1]:
        tb = to_tensors(mb, device)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = score_logprobs(sdpa_model, tb, attn="sdpa")
            got = score_logprobs(flex_model, tb, attn="flex", block_size=128)
        torch.testing.assert_close(got, want, atol=1e-5 if not cuda else 2e-3, rtol=0)


# --- the example trainer ---------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_grpo.py"
LINE = re.compile(
    r"^step (?P<step>\d+) loss (?P<loss>-?[\d.e+-]+|nan) loss_tokens (?P<tok>\d+) rows (?P<rows>\d+) "
    r"wait_s (?P<wait>[\d.]+) step_s (?P<secs>[\d.]+) mismatch (?P<mm>[\d.e+-]+|nan)$"
)


def test_train_grpo_example(floe_server: Callable[..., FloeServer]) -> None:
    server = floe_server(strategy="tree", **{**SERVER_FLAGS, "groups": 2, "groups_per_step": 1})
    assert server.steps >= 2
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--location", server.location, "--steps", "2", "--vocab", str(VOCAB),
         "--device", "cpu", "--attn", "sdpa"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 2, proc.stdout
    for n, ln in enumerate(lines):
        m = LINE.match(ln)
        assert m, ln
        assert int(m["step"]) == n
        assert int(m["tok"]) > 0 and int(m["rows"]) >= int(m["tok"])
        assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["mm"]))
    # every step was committed: the server has nothing left to serve before step 2
    with FloeClient(server.location, rank=0, world_size=1) as client:
        status = client.status()
    assert status["committed"] == 2, status
    assert time.monotonic() - t0 < 240


# --- sampling temperature: the rollout's processed log-probs, end to end ----------------------


def _post_json(url: str, body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)  # type: ignore[no-any-return]


@pytest.mark.parametrize("sampling", ["record", "force"])
def test_temperature_equivalence_through_refserver(
    sampling: str, floe_bin: Path, tmp_path: Path
) -> None:
    """Issue 13 item 5. Calls sampled by floe_refserver at T = 0.7 (and 1.0, and with
    top_p 0.9) through `floe serve --sampling record`: the bridge scores each loss row with
    log_softmax(logits / T) of the server's own model, and equals both the rollout
    log-probs (the server's processed log-probs) and each call scored alone at its
    temperature, within 1e-5; the top_p call, kept trainable by -train-truncated (by
    default such a call is recorded untrainable: docs/proxy.md), is flagged in the sample
    table. Under `--sampling force` every call is sampled and scored at T = 1."""
    import floe_stack
    from floe_refserver.model import build_model
    from floe_refserver.tokenizer import load_tokenizer

    temps = {"a": 0.7, "b": 1.0, "c": 0.7}
    with floe_stack.Stack(tmp_path / "logs", grace=20) as procs:
        _, hello = procs.start_server(
            "refserver", floe_stack.refserver_argv("--port", "0", "--cache-dir", str(tmp_path / "tok"))
        )
        upstream = hello["base_url"].removesuffix("/v1")
        _, addrs = procs.start_server("floe", [
            str(floe_bin), "serve", "-proxy-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0",
            "-data-dir", str(tmp_path / "data"), "-upstream", upstream, "-group-size", "3",
            "-groups-per-step", "1", "-token-budget", "2048", "-pad-multiple", "16", "-sampling", sampling,
            "-train-truncated",
        ], 60)
        control = addrs.get("control") or addrs["proxy"]
        for i, (name, temp) in enumerate(temps.items()):
            sess = _post_json(
                f"{control}/floe/v1/sessions", {"task_id": "t", "group_id": "g", "group_size": 3}
            )
            body: dict[str, Any] = {
                "model": "m", "max_tokens": 12, "temperature": temp, "seed": 5 + i,
                "messages": [{"role": "user", "content": f"write a haiku about tree masks, {name}"}],
            }
            if name == "c":
                body["top_p"] = 0.9
            _post_json(sess["base_urls"]["openai"].rstrip("/") + "/chat/completions", body, sess["api_key"])
            _post_json(f"{control}/floe/v1/sessions/{sess['session_id']}/finish",
                       {"reward": float(i), "status": "completed"})
        with FloeClient(addrs["flight"], rank=0, world_size=1) as client:
            step = client.read_step(0, timeout=60)
            samples = step.samples().to_pydict()
            mbs = step.micro_batches

    model = build_model(len(load_tokenizer()), seed=0, max_model_len=4096).eval()
    n_t07 = 0
    for mb in mbs:
        tb = to_tensors(mb)
        rows = tb.loss_rows()
        with torch.no_grad():
            got = score_logprobs(model, tb, attn="sdpa")
        want_t = tb.temperature[rows]
        if sampling == "force":
            assert bool((want_t == 1).all())
        n_t07 += int((want_t - 0.7).abs().lt(1e-6).sum())
        # the rollout's processed log-probs (refserver = vLLM --logprobs-mode processed_logprobs)
        rollout = tb.old_logprobs[rows]
        top_p = torch.tensor([samples["num_truncated_calls"][int(s)] > 0 for s in tb.sample_idx[rows]])
        err = float((got - rollout)[~top_p].abs().max())
        print(
            f"\n--sampling {sampling}: max |bridge - rollout| over {int((~top_p).sum())} tokens = {err:.3g}"
        )
        assert err < LOGP_ATOL
        if sampling == "record":  # negative control: scored at T = 1, as before 13.5
            import dataclasses

            with torch.no_grad():
                at1 = score_logprobs(model, dataclasses.replace(tb, temperature=None), attn="sdpa")
            t07 = (want_t - 0.7).abs().lt(1e-6) & ~top_p
            off = float((at1 - rollout)[t07].abs().max())
            print(f"scored at T = 1 (before 13.5): off by up to {off:.3g} nats on the T = 0.7 rows")
            assert off > 1e-2
        # and each loss row alone, as a plain causal sequence at its temperature
        ids, pred = tb.input_ids.tolist(), tb.pred_idx.tolist()
        for j, r in enumerate(rows.tolist()):
            seq, v = [], r
            while v >= 0:
                seq.append(ids[v])
                v = pred[v]
            seq.reverse()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq[:-1]])).logits[0, -1].double()
            ref = float(torch.log_softmax(logits / float(want_t[j]), -1)[seq[-1]])
            assert abs(float(got[j]) - ref) < LOGP_ATOL
    if sampling == "record":
        assert n_t07 > 0, "no loss row sampled at T = 0.7"
        assert sorted(samples["num_truncated_calls"]) == [0, 0, 1]
    else:
        assert n_t07 == 0 and sorted(samples["num_truncated_calls"]) == [0, 0, 0]


# --- the hand-built adversarial groups, dp = 3, budgets that force cuts ------------------------


def _adversarial_dump(tmp: Path) -> Path:
    root = Path(__file__).resolve().parents[2]
    out = tmp / "adversarial"
    out.mkdir()
    env = {**os.environ, "FLOE_DUMP_ADVERSARIAL": str(out)}
    subprocess.run(
        ["go", "test", "-count=1", "-run", "TestDumpAdversarialSteps", "./batcher/"],
        cwd=root,
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    return out


def _grpo_advantages(rewards: list[float]) -> list[float]:
    """(r - mean) / (unbiased std + 1e-6), a group of one gets 0 (docs/batcher.md)."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / (n - 1)) ** 0.5
    return [(r - mean) / (std + 1e-6) for r in rewards]


@pytest.mark.parametrize("strategy", ["tree", "prefix_merging", "per_request"])
def test_adversarial_groups_dp3(strategy: str, tmp_path: Path) -> None:
    """Issue 13 item 6: identical samples, n > 1, retries, prompts ending inside responses,
    single tokens, untrainable calls, a deep chain with drift, some calls sampled at T = 0.7
    (batcher/adversarial_test.go's shapes), packed by floe at dp = 3 under a budget equal to
    the longest path. Every rank's micro-batches through the tiny model with world_size = 3
    and the rank gradients averaged as DDP does, against each trainable call scored alone:
    log-probs within 1e-5, loss and every parameter gradient within 1e-4."""
    import os

    import pyarrow as pa

    dump = _adversarial_dump(tmp_path)
    groups = json.loads((dump / "groups.json").read_text())
    meta = json.loads((dump / strategy / "meta.json").read_text())
    world = int(meta["ranks"])
    denom = int(meta["loss_tokens_global"])
    vocab = 1 + max(max([*(c["prompt_ids"] or []), *(c["response_ids"] or []), 0]) for g in groups
                    for s in g["sessions"] for c in s["calls"] or [])
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM._from_config(
        cfg, attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    params = [p for p in model.parameters()]

    # reference: each trainable call alone, at its temperature; loss terms keyed by context
    ref_terms: dict[tuple[tuple[int, ...], int, float], list[float]] = defaultdict(list)
    # The recorded log-probs are tags (distinct per call, down to -95), not a model's: the
    # loss takes old = the reference log-prob + 0.15·sin(1000·tag), so ratios sit around 1
    # (some clipped, most not) and every term has a gradient; both sides use the same.
    old_of: dict[tuple[tuple[int, ...], int, float], float] = {}
    ref_loss = torch.zeros((), dtype=torch.float64)
    n_terms = 0
    for g in groups:
        advs = _grpo_advantages([s["reward"] for s in g["sessions"]])
        for s, adv in zip(g["sessions"], advs, strict=True):
            for c in s["calls"] or []:
                if not c["trainable"]:
                    continue
                p, r = c["prompt_ids"], c["response_ids"]
                temp = ((c.get("sampling") or {}).get("temperature")) or 1.0
                logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1]
                logp = torch.log_softmax(logits.float() / temp, -1).gather(1, torch.tensor(r)[:, None])[:, 0]
                tags = torch.tensor(c["logprobs"], dtype=torch.float32)
                old = logp.detach() + 0.15 * torch.sin(1000 * tags)
                a = torch.full((len(r),), float(adv), dtype=torch.float32)
                loss, _ = grpo_loss(logp, old, a, denom)
                ref_loss = ref_loss + loss.double()
                n_terms += len(r)
                for k in range(len(r)):
                    key = (tuple(p + r[:k]), r[k], round(float(tags[k]), 7))
                    ref_terms[key].append(float(logp[k].detach()))
                    old_of[key] = float(old[k])
    assert n_terms == denom
    ref_loss.backward()  # type: ignore[no-untyped-call]
    ref_grads = [p.grad.detach().clone() for p in params]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)

    # floe: every rank's micro-batches, world_size = 3, gradients averaged over the ranks
    rank_grads = []
    total_loss = 0.0
    worst = 0.0
    for rank in range(world):
        with pa.ipc.open_stream(os.fspath(dump / strategy / f"rank{rank}.arrows")) as rd:
            batches = list(rd)
        assert len(batches) == int(meta["micro_batches"])
        model.zero_grad(set_to_none=True)
        for b in batches:
            mb = MicroBatch.from_record_batch(b)
            tb = to_tensors(mb)
            rows = tb.loss_rows()
            if rows.numel() == 0:
                continue
            logp = score_logprobs(model, tb, attn="sdpa")
            ids, pred = tb.input_ids.tolist(), tb.pred_idx.tolist()
            olds = []
            for j, q in enumerate(rows.tolist()):
                ctx, v = [], pred[q]
                while v >= 0:
                    ctx.append(ids[v])
                    v = pred[v]
                key = (tuple(reversed(ctx)), ids[q], round(float(tb.old_logprobs[q]), 7))
                assert key in ref_terms, f"a loss row no call sampled: {key}"
                worst = max(worst, min(abs(float(logp[j].detach()) - x) for x in ref_terms[key]))
                olds.append(old_of[key])
            loss, _ = grpo_loss(logp, torch.tensor(olds), tb.advantages[rows], denom, world_size=world)
            loss.backward()  # type: ignore[no-untyped-call]
            total_loss += float(loss.detach())
        rank_grads.append(
            [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
        )
    print(f"\n{strategy} dp={world}: logprob max err {worst:.3g}")
    assert worst < LOGP_ATOL
    loss_avg = total_loss / world
    assert loss_avg == pytest.approx(float(ref_loss.detach()), rel=LOSS_RTOL, abs=1e-7)
    max_rel = 0.0
    for i in range(len(params)):
        got = sum(g[i] for g in rank_grads) / world
        want = ref_grads[i]
        scale = float(want.abs().max()) + 1e-12
        max_rel = max(max_rel, float((got - want).abs().max()) / scale)
    ref = float(ref_loss.detach())
    print(f"{strategy} dp={world}: loss {loss_avg:.6g} vs {ref:.6g}; grad max rel err {max_rel:.3g}")
    assert max_rel < GRAD_RTOL
