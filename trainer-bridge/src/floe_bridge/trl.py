"""floe as the rollout source of Hugging Face TRL's ``AsyncGRPOTrainer`` (TRL 1.16,
``trl.experimental.async_grpo``). See docs/trl.md.

* :class:`FloeRolloutWorker` implements TRL's ``RolloutWorkerProtocol``: it reads floe's
  steps over Flight and puts one ``RolloutSample`` per recorded call on ``rollout_buffer``.
* :class:`FloeWeightTransfer` wraps any ``WeightTransferProtocol`` (TRL's NCCL client, or a
  no-op) and pauses floe's proxy around it, so no harness call straddles a weight swap.
* :func:`to_trl_tree` converts a floe micro-batch into the tensors TRL's tree attention and
  ``compute_loss`` take (what ``TreeRow.pack()`` returns), and :class:`FloeAsyncGRPOTrainer`
  is the smallest subclass that trains ``AsyncGRPOTrainer`` on floe-packed rows.
* :func:`register_cpu_tree_attention` registers, under TRL's attention name, an SDPA
  implementation of TRL's tree attention (TRL's own one needs FA3 kernels from the Hub).

How calls are recovered from a tree micro-batch
-----------------------------------------------
A micro-batch is a trie, not a list of sequences. A *leaf* is a loss row with no loss row of
the same sample (session) below it; walking ``pred_idx`` from a leaf to its root gives the
token path the inference server conditioned on. Each loss row is claimed by exactly one leaf
of its own sample (the first, in row order); on every other path it is context. So the
samples carry every loss term of the micro-batch exactly once, each with its exact context,
old log-prob and advantage: the same terms as ``per_request``. The walk works for every
strategy (``tree``, ``prefix_merging``, ``per_request``), so floe's default layout is kept
and nothing asks floe for ``per_request``. A recovered sample is not always one recorded
call: two calls of a session whose second prompt is exactly the first prompt + response
become one sample, and a call cut across micro-batches becomes two (its first part is the
second's context). The loss terms are the same either way.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .batch import MicroBatch
from .client import FloeClient, FloeError, NotReady, StepNotFound

log = logging.getLogger(__name__)

__all__ = [
    "CallPath",
    "call_paths",
    "to_trl_tree",
    "FloeRolloutWorker",
    "FloeWeightTransfer",
    "NoWeightTransfer",
    "FloeAsyncGRPOTrainer",
    "register_cpu_tree_attention",
    "use_cpu_tree_attention",
    "tree_terms",
    "cpu_tree_attention",
    "TREE_ATTENTION",
    "mask_other_temperatures",
]

if TYPE_CHECKING:
    # built on first use by the module's __getattr__ (below)
    FloeAsyncGRPOTrainer: type[Any]

#: TRL's attention name (``trl.experimental.async_grpo.packing.TREE_ATTENTION``).
TREE_ATTENTION = "tree_fa3"


# --- calls out of a tree micro-batch -----------------------------------------------------


@dataclass(frozen=True)
class CallPath:
    """One recovered sequence: the rows root..leaf, and which of them it trains."""

    rows: npt.NDArray[np.int64]  # root first, the leaf last
    trained: npt.NDArray[np.bool_]  # per row of ``rows``: a loss term this sequence carries
    sample_idx: int  # floe's sample (session) index


def _is_padding(mb: MicroBatch) -> npt.NDArray[np.bool_]:
    n = mb.num_rows
    idx = np.arange(n)
    lone = (mb.subtree_end == idx + 1) & (mb.pred_idx < 0) & (mb.loss_mask == 0)
    return np.asarray(lone, dtype=bool)


def call_paths(mb: MicroBatch) -> list[CallPath]:
    """The sequences of a micro-batch, one per leaf (see the module doc), in row order."""
    pred = mb.pred_idx.astype(np.int64)
    loss = mb.loss_mask.astype(bool)
    sidx = mb.sample_idx.astype(np.int64)
    n = mb.num_rows
    # a loss row is a leaf when no loss row of the same sample has it as its predecessor
    has_child = np.zeros(n, dtype=bool)
    child = np.flatnonzero(loss & (pred >= 0))
    same = sidx[child] == sidx[pred[child]]
    has_child[pred[child][same & loss[pred[child]]]] = True
    leaves = np.flatnonzero(loss & ~has_child)
    claimed = np.zeros(n, dtype=bool)
    out: list[CallPath] = []
    for leaf in leaves.tolist():
        path = []
        r = leaf
        while r >= 0:
            path.append(r)
            r = int(pred[r])
        rows = np.asarray(path[::-1], dtype=np.int64)
        trained = loss[rows] & (sidx[rows] == sidx[leaf]) & ~claimed[rows]
        claimed[rows[trained]] = True
        out.append(CallPath(rows, trained, int(sidx[leaf])))
    if int(claimed.sum()) != int(loss.sum()):  # pragma: no cover - a malformed micro-batch
        raise ValueError(f"{int(loss.sum()) - int(claimed.sum())} loss rows are on no leaf's path")
    return out


# --- the converter: floe micro-batch -> TRL tree tensors ---------------------------------


def to_trl_tree(mb: MicroBatch) -> dict[str, Any]:
    """The tensors ``TreeRow.pack()`` returns, from a floe micro-batch (same keys, dtypes).

    floe's rows keep their DFS pre-order; segments are the maximal unary chains; each loss
    row's ``token_index`` is its ``pred_idx`` (as a packed position). TRL labels a position
    with one next token (``shift_labels``), while floe's trie may branch right after a row
    into two *trained* tokens (two sessions sampling differently after a shared prompt).
    Such a row is forwarded once per distinct trained next token (a copy at the same depth,
    on the same path), which is what ``TreeRow`` does by keying nodes on (token, next
    token). Padding rows are dropped. ``segment_id`` numbers the sequences of
    :func:`call_paths`.
    """
    import torch

    pad = _is_padding(mb)
    n = mb.num_rows
    pred = mb.pred_idx.astype(np.int64)
    loss = mb.loss_mask.astype(bool)
    ids = mb.input_ids.astype(np.int64)
    children: list[list[int]] = [[] for _ in range(n)]
    roots: list[int] = []
    for r in range(n):
        if pad[r]:
            continue
        (roots if pred[r] < 0 else children[int(pred[r])]).append(r)
    # sequence (segment_id) of each loss term
    seq_of = np.full(n, -1, dtype=np.int64)
    for i, cp in enumerate(call_paths(mb)):
        seq_of[cp.rows[cp.trained]] = i

    # copies[r]: the nodes row r becomes; a node is (row, child nodes). Children follow
    # their parent in pre-order, so a reverse sweep builds every child before its parent.
    copies: list[list[tuple[int, list[Any]]]] = [[] for _ in range(n)]
    for r in range(n - 1, -1, -1):
        if pad[r]:
            continue
        untrained: list[Any] = []
        by_label: dict[int, list[Any]] = {}
        for c in children[r]:
            (by_label.setdefault(int(ids[c]), []) if loss[c] else untrained).extend(copies[c])
        groups = list(by_label.values()) or [[]]
        groups[0] = untrained + groups[0] if untrained else groups[0]
        # keep pre-order among a copy's children
        copies[r] = [(r, sorted(g, key=lambda node: node[0])) for g in groups]
        for c in children[r]:
            copies[c] = []  # placed; free
    top = sorted((node for r in roots for node in copies[r]), key=lambda node: node[0])

    input_ids: list[int] = []
    position_ids: list[int] = []
    offsets, cu_k, kv_index = [0], [0], []
    paths: list[list[int]] = []
    terms: list[tuple[int, int]] = []  # (packed position of the predecessor, row)
    seen: set[int] = set()
    stack: list[tuple[tuple[int, list[Any]], int | None, int | None]] = [
        (node, None, None) for node in reversed(top)
    ]
    while stack:
        node, parent_seg, parent_pos = stack.pop()
        seg = len(paths)
        start = len(input_ids)
        prev = parent_pos
        while True:
            row, kids = node
            pos = len(input_ids)
            input_ids.append(int(ids[row]))
            position_ids.append(int(mb.position_ids[row]))
            if loss[row] and row not in seen:
                seen.add(row)
                assert prev is not None, "a loss row at a root"
                terms.append((prev, row))
            prev = pos
            if len(kids) != 1:
                break
            node = kids[0]
        offsets.append(len(input_ids))
        paths.append(
            (paths[parent_seg] if parent_seg is not None else []) + list(range(start, len(input_ids)))
        )
        kv_index.extend(paths[-1])
        cu_k.append(len(kv_index))
        stack.extend((kid, seg, prev) for kid in reversed(kids))

    shift_labels = [-100] * len(input_ids)
    for p, row in terms:
        shift_labels[p] = int(ids[row])
    terms.sort(key=lambda t: (seq_of[t[1]], t[1]))
    rows = [row for _, row in terms]
    return {
        "input_ids": torch.tensor(input_ids),
        "position_ids": torch.tensor(position_ids),
        "shift_labels": torch.tensor(shift_labels),
        "tree_kv_index": torch.tensor(kv_index, dtype=torch.long),
        "tree_cu_seqlens_q": torch.tensor(offsets, dtype=torch.int32),
        "tree_cu_seqlens_k": torch.tensor(cu_k, dtype=torch.int32),
        "tree_max_seqlens": torch.tensor(
            [max(b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)), max(map(len, paths))]
        ),
        "token_index": torch.tensor([p for p, _ in terms], dtype=torch.long),
        "old_log_probs": torch.tensor(mb.old_logprobs[rows].astype(np.float32)),
        "advantages": torch.tensor(mb.advantages[rows].astype(np.float32)),
        "segment_id": torch.tensor(seq_of[rows], dtype=torch.long),
    }


def tree_terms(packed: dict[str, Any]) -> list[tuple[tuple[int, ...], int, float, float]]:
    """The loss terms of a ``TreeRow.pack()``-shaped dict: (context token ids, target,
    old log-prob, advantage) per term, the context read off the segment's K/V path."""
    ids = packed["input_ids"].tolist()
    kv = packed["tree_kv_index"].tolist()
    cq = packed["tree_cu_seqlens_q"].tolist()
    ck = packed["tree_cu_seqlens_k"].tolist()
    labels = packed["shift_labels"].tolist()
    seg_of = np.searchsorted(np.asarray(cq), np.arange(len(ids)), side="right") - 1
    out = []
    for p, lp, adv in zip(
        packed["token_index"].tolist(),
        packed["old_log_probs"].tolist(),
        packed["advantages"].tolist(),
        strict=True,
    ):
        s = int(seg_of[p])
        end = ck[s + 1] - (cq[s + 1] - 1 - p)
        out.append((tuple(ids[i] for i in kv[ck[s]:end]), labels[p], lp, adv))
    return out


# --- CPU tree attention ------------------------------------------------------------------


def cpu_tree_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    *,
    tree_kv_index: Any,
    tree_cu_seqlens_q: Any,
    tree_cu_seqlens_k: Any,
    tree_max_seqlen_q: int,
    tree_max_seqlen_k: int,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
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
    trainer (:class:`FloeAsyncGRPOTrainer` does it with ``cpu_tree_attention=True``)."""
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


# --- the rollout worker ------------------------------------------------------------------


def mask_other_temperatures(mb: MicroBatch, temperature: float, step: int) -> MicroBatch:
    """``mb`` with its loss rows sampled at another temperature than ``temperature`` (TRL's
    ``args.temperature``) taken out of the loss: TRL divides every row's logits by that one
    value, so such a row's ratio would compare two different distributions. They are
    masked, with a warning, rather than refused: under ``-sampling record`` the harness
    picks its temperature, and a refused step would be served again after every restart,
    so one call could stop training for good (docs/security.md). Their tokens still count
    in the step's ``loss_tokens_global``."""
    loss = mb.loss_mask.astype(bool)
    # the column is float32: compare at its precision
    off = loss & ~np.isclose(mb.temperature.astype(np.float64), temperature, rtol=1e-6, atol=0.0)
    if not bool(off.any()):
        return mb
    got = ", ".join(f"{x:.6g}" for x in sorted(set(mb.temperature[off].astype(np.float64).tolist())))
    log.warning(
        "floe step %d: %d loss tokens were sampled at temperature %s, but TRL scores every sample at its "
        "args.temperature = %g: they are left out of the loss (run floe with -sampling force, or set TRL's "
        "temperature to the harnesses')", step, int(off.sum()), got, temperature,
    )
    mask = mb.loss_mask.copy()
    mask[off] = 0
    return dataclasses.replace(mb, loss_mask=mask)


def _rollout_sample_cls() -> Any:
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    return RolloutSample


@dataclass
class _GroupIds:
    """floe's group ids (strings) as the ints TRL's ``RolloutSample.group_id`` wants."""

    ids: dict[str, int] = field(default_factory=dict)

    def __call__(self, group: str) -> int:
        return self.ids.setdefault(group, len(self.ids))


class _StepBuffer(queue.Queue[Any]):
    """``rollout_buffer``: a FIFO that knows which floe step each sample came from and calls
    ``on_taken(step)`` once TRL has taken a step's last sample (``get``, on TRL's thread).

    Only the worker's thread puts, one step at a time after :meth:`expect`."""

    def __init__(self, maxsize: int, on_taken: Callable[[int], None]) -> None:
        super().__init__(maxsize=maxsize)
        self._on_taken = on_taken
        self._steps: deque[int] = deque()
        self._left: dict[int, int] = {}
        self._putting = -1

    def expect(self, step: int, samples: int) -> None:
        with self.mutex:
            self._putting = step
            if samples > 0:
                self._left[step] = samples
        if samples == 0:  # nothing for TRL to take: done now, and never again from get()
            self._taken(step)

    def _put(self, item: Any) -> None:
        super()._put(item)
        self._steps.append(self._putting)

    def _get(self) -> Any:
        item = super()._get()
        self._left[self._steps.popleft()] -= 1
        return item

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout)
        with self.mutex:
            done = [s for s, n in self._left.items() if n == 0]
            for s in done:
                del self._left[s]
        for s in sorted(done):
            self._taken(s)
        return item

    def _taken(self, step: int) -> None:
        self._on_taken(step)


class FloeRolloutWorker:
    """TRL's ``RolloutWorkerProtocol`` over floe (docs/trl.md).

    A thread reads floe's steps (all ranks of each: TRL's planner re-batches on rank 0) and
    puts a ``RolloutSample`` per recovered sequence (:func:`call_paths`) on
    ``rollout_buffer``: the path's token ids, ``completion_mask`` on the tokens it trains,
    their rollout log-probs, floe's advantage, the session's policy version (shifted by
    ``version_offset``) and group. A step is committed when TRL takes its last sample off
    the buffer (docs/trl.md: what a crash can lose, and why that bound). Per step it puts on
    ``metrics_queue``: ``floe/data_wait_s`` (time blocked on Flight), ``floe/tokens_saved``
    (per-sequence tokens minus floe's real rows), ``floe/samples``, ``floe/loss_tokens``, and
    from floe's status ``floe/groups_dropped`` (groups floe set aside since the previous
    step, of every kind) and ``floe/groups_dropped/<kind>`` per kind.
    ``update_model_version`` records the trainer's version (``model_version``); pair it with
    :class:`FloeWeightTransfer`, which makes floe stamp new calls with that version.

    ``temperature`` must be TRL's ``args.temperature``: TRL scores every sample at that one
    temperature, so a step with a loss row sampled at another (the micro-batch's
    ``temperature`` column) is refused with an error naming both.
    """

    def __init__(
        self,
        flight_uri: str,
        token: str | None = None,
        *,
        queue_maxsize: int = 0,
        timeout: float = 30.0,
        max_steps: int | None = None,
        version_offset: int = 0,
        client: FloeClient | None = None,
        temperature: float = 1.0,
    ) -> None:
        self.flight_uri = flight_uri
        self.temperature = float(temperature)
        self.rollout_buffer: _StepBuffer = _StepBuffer(queue_maxsize, self._commit)
        self._seen_drops: set[str] = set()
        self._next_step: int | None = None
        self.metrics_queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self.model_version = 0
        self.version_offset = version_offset
        self.max_steps = max_steps
        self.steps_committed: list[int] = []
        self._client = client or FloeClient(flight_uri, token, rank=0, world_size=None, timeout=timeout)
        self._timeout = timeout
        self._group_ids = _GroupIds()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._heartbeat = time.time()

    # -- RolloutWorkerProtocol --

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="floe-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout + 5)
        self._client.close()

    def update_model_version(self, model_version: int) -> None:
        self.model_version = int(model_version)

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError("floe rollout worker failed; see the chained exception") from self._error
        age = time.time() - self._heartbeat
        if age > stale_after_s:
            raise RuntimeError(f"floe rollout worker produced nothing for {age:.0f}s > {stale_after_s:.0f}s")

    # -- the loop --

    def samples_of_step(self, step_no: int | None = None) -> tuple[int, list[Any], dict[str, float]]:
        """Read one step (all ranks) and build its samples; (step, samples, metrics)."""
        t0 = time.monotonic()
        info = self._client.step_info(step_no, timeout=self._timeout)
        mbs = [
            mask_other_temperatures(mb, self.temperature, info.step)
            for r in range(info.num_ranks)
            for mb in self._client.read_step(info.step, rank=r).micro_batches
        ]
        table = self._client.read_samples(info).to_pydict()
        wait = time.monotonic() - t0
        by_idx = {int(i): k for k, i in enumerate(table["sample_idx"])}
        RolloutSample = _rollout_sample_cls()
        out = []
        seq_tokens = rows = 0
        for mb in mbs:
            rows += int((~_is_padding(mb)).sum())
            for cp in call_paths(mb):
                k = by_idx[cp.sample_idx]
                mask = cp.trained.astype(np.int64)
                logps = np.where(cp.trained, mb.old_logprobs[cp.rows], 0.0).astype(np.float32)
                adv = mb.advantages[cp.rows[cp.trained]]
                seq_tokens += len(cp.rows)
                out.append(
                    RolloutSample(
                        prompt=[],
                        completion=[],
                        input_ids=mb.input_ids[cp.rows].astype(np.int64),
                        completion_mask=mask,
                        old_log_probs=logps,
                        advantage=float(adv[0]),
                        model_version=int(table["policy_version"][k]) + self.version_offset,
                        group_id=self._group_ids(table["group_id"][k]),
                        metrics={"reward": float(table["reward"][k])},
                    )
                )
        metrics = {
            "floe/data_wait_s": wait,
            "floe/tokens_saved": float(seq_tokens - rows),
            "floe/samples": float(len(out)),
            "floe/loss_tokens": float(info.loss_tokens_global),
        }
        return info.step, out, metrics

    def _run(self) -> None:
        n = 0
        try:
            while not self._stop.is_set() and (self.max_steps is None or n < self.max_steps):
                self._heartbeat = time.time()
                try:
                    step, samples, metrics = self.samples_of_step(self._next_step)
                except NotReady:
                    continue
                except StepNotFound:
                    return
                # the step stays uncommitted (floe re-serves it after a crash) until TRL takes
                # its last sample; floe's -steps-ahead bounds how many are read ahead meanwhile
                self._next_step = step + 1
                self.rollout_buffer.expect(step, len(samples))
                for s in samples:
                    s.enqueued_at = time.time()
                    while not self._stop.is_set():
                        try:
                            self.rollout_buffer.put(s, timeout=0.5)
                            break
                        except queue.Full:
                            self._heartbeat = time.time()
                if self._stop.is_set():
                    return
                log.info("floe step %d: %d samples handed to TRL", step, len(samples))
                try:
                    metrics.update(self._drop_metrics(self._client.status()))
                except FloeError:
                    pass
                self.metrics_queue.put(metrics)
                self._heartbeat = time.time()
                n += 1
        except BaseException as e:  # noqa: BLE001 - surfaced by check_health
            log.exception("floe rollout worker failed")
            self._error = e

    def _commit(self, step: int) -> None:
        """TRL took step ``step``'s last sample: release it (on TRL's thread)."""
        self._client.commit(step)
        self.steps_committed.append(step)
        log.info("floe step %d: TRL took its last sample, committed", step)

    def _drop_metrics(self, status: dict[str, Any]) -> dict[str, float]:
        """Groups floe set aside since the previous step: its status lists the last 16
        (``dropped_groups``, each with its ``kind``), so each group is counted once by id.
        floe reports no staleness here: its stale calls are ``floe_calls_stale_total`` on
        its metrics endpoint, TRL's stale samples ``sample/dropped_stale_total``."""
        out: dict[str, float] = {"floe/groups_dropped": 0.0}
        for d in status.get("dropped_groups") or []:
            gid = str(d.get("group"))
            if gid in self._seen_drops:
                continue
            self._seen_drops.add(gid)
            out["floe/groups_dropped"] += 1.0
            key = f"floe/groups_dropped/{d.get('kind') or 'unknown'}"
            out[key] = out.get(key, 0.0) + 1.0
        return out


# --- weight sync ------------------------------------------------------------------------


class NoWeightTransfer:
    """A ``WeightTransferProtocol`` that sends nothing (the inference server loads weights
    some other way, or a test)."""

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        for _ in iterator:
            pass

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


class FloeWeightTransfer:
    """Wraps a ``WeightTransferProtocol``: ``pause`` pauses floe's proxy first (Flight
    action ``pause``: new harness calls wait, in-flight ones finish before it returns), then
    the inner backend; ``resume`` resumes the inner backend, then floe under the next policy
    version, so every call is served and stamped by one set of weights. The version counts
    up from ``start_version`` once per sync, as ``AsyncGRPOTrainer.model_version`` does;
    by default it starts from floe's current policy version (its status), so that a trainer
    restarted against a running floe resumes it forward instead of failing ("policy version
    1 is older than the current 3") and leaving it paused. A trainer whose own version
    starts at 0 pairs it with ``FloeRolloutWorker(version_offset=-wt.start_version)``.
    Uses the Flight token ``token``, else ``FloeClient``'s default."""

    def __init__(
        self,
        inner: Any,
        flight_uri: str,
        token: str | None = None,
        *,
        start_version: int | None = None,
        timeout: float = 300.0,
        client: FloeClient | None = None,
        on_version: Callable[[int], None] | None = None,
    ) -> None:
        self.inner = inner
        self._client = client or FloeClient(flight_uri, token, rank=0, world_size=None, timeout=timeout)
        if start_version is None:
            start_version = int(self._client.status()["policy_version"])
        self.start_version = start_version
        self.policy_version = start_version
        self._on_version = on_version
        self.paused = False

    def init_weight_transfer(self) -> None:
        self.inner.init_weight_transfer()

    def pause(self) -> None:
        self._client.pause()
        self.paused = True
        self.inner.pause()

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        self.inner.send_weights(iterator)

    def resume(self) -> None:
        self.inner.resume()
        self.policy_version += 1
        self._client.resume(self.policy_version)
        self.paused = False
        if self._on_version is not None:
            self._on_version(self.policy_version)

    def destroy(self) -> None:
        try:
            self.inner.destroy()
        finally:
            self._client.close()


# --- training AsyncGRPOTrainer on floe's own packing --------------------------------------


def _collate(packed: Sequence[dict[str, Any]], pad_token_id: int, global_n_tokens: float) -> dict[str, Any]:
    """What ``DataCollatorForRollout`` makes of packed rows (one per data-parallel rank)."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    padding = {
        "input_ids": pad_token_id,
        "shift_labels": -100,
        "token_index": -1,
        "tree_kv_index": -1,
        "tree_cu_seqlens_q": -1,
        "tree_cu_seqlens_k": -1,
    }
    batch = {
        key: pad_sequence([p[key] for p in packed], batch_first=True, padding_value=padding.get(key, 0))
        for key in packed[0]
    }
    batch["attention_mask"] = pad_sequence(
        [torch.ones_like(p["input_ids"]) for p in packed], batch_first=True, padding_value=0
    )
    n = len(packed)
    forward = sum(p["input_ids"].numel() for p in packed)
    seqs = sum(int(p["segment_id"].max()) + 1 if p["segment_id"].numel() else 0 for p in packed)
    batch["global_n_tokens"] = torch.full((n,), float(global_n_tokens))
    batch["global_n_forward_tokens"] = torch.full((n,), float(forward))
    batch["mean_seq_len"] = torch.full((n,), forward / max(seqs, 1))
    return batch


class _FloeStepSource:
    """The rollout worker :class:`FloeAsyncGRPOTrainer` hands TRL: it produces nothing on
    ``rollout_buffer`` (the trainer's dataloader reads floe directly) and only keeps the
    protocol's other duties."""

    def __init__(self) -> None:
        self.rollout_buffer: queue.Queue[Any] = queue.Queue()
        self.metrics_queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self.model_version = 0

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def update_model_version(self, model_version: int) -> None:
        self.model_version = int(model_version)

    def check_health(self, stale_after_s: float) -> None:
        pass


def _trainer_base() -> Any:
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    return AsyncGRPOTrainer


class _FloeBatches:
    """Iterable of collated TRL batches, one per floe micro-batch index of each step (its
    rows: that micro-batch of every rank). Commits a step when the next is asked for."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def __iter__(self) -> Iterator[dict[str, Any]]:
        t = self.trainer
        client: FloeClient = t.floe_client
        ga = t.args.gradient_accumulation_steps
        world = t.accelerator.num_processes
        n: int | None = None
        while True:
            t0 = time.monotonic()
            try:
                info = client.step_info(n, timeout=t.floe_timeout)
            except StepNotFound:
                return
            n = info.step + 1  # read ahead by the dataloader: the step is not committed yet
            steps = [
                client.read_step(info.step, rank=r, timeout=t.floe_timeout) for r in range(info.num_ranks)
            ]
            if info.num_ranks != world or info.micro_batches_per_rank != ga:
                raise FloeError(
                    f"floe step {info.step} has {info.num_ranks} ranks x {info.micro_batches_per_rank} "
                    f"micro-batches; this trainer runs {world} processes x gradient_accumulation_steps={ga}: "
                    "start floe with "
                    f"-dp-size {world} and a token budget that forms {ga} micro-batch(es) per rank"
                )
            mbs = [
                [mask_other_temperatures(mb, float(t.args.temperature), info.step) for mb in s.micro_batches]
                for s in steps
            ]
            t.floe_wait_s += time.monotonic() - t0
            # TRL divides each micro-batch's term sum by global_n_tokens / world_size and by the
            # accumulation steps; L / ga makes the step's loss floe's token-mean over the step.
            g = info.loss_tokens_global / ga
            t.floe_pending.append(info.step)  # one optimizer step trains it; committed after it
            for k in range(ga):
                yield _collate([to_trl_tree(rank[k]) for rank in mbs], t.processing_class.pad_token_id, g)


def _make_trainer_class() -> Any:
    Base = _trainer_base()

    class FloeAsyncGRPOTrainer(Base):  # type: ignore[misc, valid-type]
        """``AsyncGRPOTrainer`` trained on floe's packed rows instead of TRL's ``TreeRow``.

        The one override is ``get_train_dataloader`` (a ``transformers.Trainer`` method): it
        yields :func:`to_trl_tree` of each floe micro-batch, collated as TRL's collator does,
        so ``compute_loss`` (TRL's loss, unchanged) takes floe's layout. TRL 1.16 has no
        documented hook for a custom packer; this subclass is the smallest one. Each floe
        micro-batch is one TRL micro-batch: floe must form ``gradient_accumulation_steps``
        micro-batches per rank and ``-dp-size`` = the number of processes. The step is
        committed after its optimizer step. ``rollout_worker`` is a stub; ``weight_transfer``
        defaults to :class:`FloeWeightTransfer` around :class:`NoWeightTransfer`.
        """

        def __init__(
            self,
            model: str,
            *,
            flight_uri: str,
            floe_token: str | None = None,
            floe_timeout: float = 60.0,
            cpu_tree_attention: bool = False,
            weight_transfer: Any = None,
            **kwargs: Any,
        ) -> None:
            from datasets import Dataset

            self.floe_client = FloeClient(
                flight_uri, floe_token, rank=0, world_size=None, timeout=floe_timeout
            )
            self.floe_timeout = floe_timeout
            self.floe_wait_s = 0.0
            self.floe_pending: list[int] = []  # floe steps handed to the dataloader, in order
            self.floe_committed: list[int] = []
            if weight_transfer is None:
                weight_transfer = FloeWeightTransfer(NoWeightTransfer(), flight_uri, floe_token)
            kwargs.setdefault(
                "train_dataset", Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]]})
            )
            super().__init__(
                model, rollout_worker=_FloeStepSource(), weight_transfer=weight_transfer, **kwargs
            )
            if cpu_tree_attention:
                register_cpu_tree_attention()
            from transformers import TrainerCallback

            trainer = self

            class _Commit(TrainerCallback):
                def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                    # the optimizer step just taken trained the oldest floe step handed out
                    if trainer.floe_pending and trainer.accelerator.is_main_process:
                        step = trainer.floe_pending.pop(0)
                        trainer.floe_client.commit(step)
                        trainer.floe_committed.append(step)

            self.add_callback(_Commit())

        def get_train_dataloader(self) -> Any:
            from torch.utils.data import DataLoader, IterableDataset

            class _DS(IterableDataset[dict[str, Any]]):
                def __init__(self, it: Any) -> None:
                    self.it = it

                def __iter__(self) -> Any:
                    return iter(self.it)

            self._rollout_dataset = _Wait(self)
            src: Iterable[dict[str, Any]] = _FloeBatches(self) if self.accelerator.is_main_process else []
            return self.accelerator.prepare(
                DataLoader(_DS(src), batch_size=1, collate_fn=lambda xs: xs[0], num_workers=0)
            )

    return FloeAsyncGRPOTrainer


class _Wait:
    """Stands in for TRL's ``RolloutQueueDataset`` in ``_log_step_metrics`` (``wait_s``)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    @property
    def wait_s(self) -> float:
        return float(self.trainer.floe_wait_s)

    @wait_s.setter
    def wait_s(self, v: float) -> None:
        self.trainer.floe_wait_s = v


_trainer_class: Any = None


def __getattr__(name: str) -> Any:
    # FloeAsyncGRPOTrainer subclasses TRL's trainer, so it is built on first use: importing
    # floe_bridge.trl needs neither trl nor torch (the extra `trl` brings them).
    global _trainer_class
    if name == "FloeAsyncGRPOTrainer":
        if _trainer_class is None:
            _trainer_class = _make_trainer_class()
        return _trainer_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
