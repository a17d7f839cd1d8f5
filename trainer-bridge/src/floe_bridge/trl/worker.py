"""floe as TRL's rollout source (docs/trl.md): :class:`FloeRolloutWorker` implements TRL's
``RolloutWorkerProtocol`` over floe's Flight steps, and :class:`FloeWeightTransfer` wraps
any ``WeightTransferProtocol`` so floe's proxy is paused around every weight swap. trl is
imported when a step is read, so importing this module needs neither trl nor torch."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.queues import Queue as MPQueue
from typing import TYPE_CHECKING, Any

import numpy as np

from ..client import FloeClient, FloeError, NotReady, StepNotFound
from .packing import call_paths, is_padding, mask_other_temperatures

if TYPE_CHECKING:
    import torch
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutWorkerProtocol, WeightTransferProtocol
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

log = logging.getLogger(__name__)


@dataclass
class _GroupIds:
    """floe's group ids (strings) as the ints TRL's ``RolloutSample.group_id`` wants."""

    ids: dict[str, int] = field(default_factory=dict)

    def __call__(self, group: str) -> int:
        return self.ids.setdefault(group, len(self.ids))


class _StepBuffer(queue.Queue["RolloutSample"]):
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

    def _put(self, item: RolloutSample) -> None:
        super()._put(item)
        self._steps.append(self._putting)

    def _get(self) -> RolloutSample:
        item = super()._get()
        self._left[self._steps.popleft()] -= 1
        return item

    def get(self, block: bool = True, timeout: float | None = None) -> RolloutSample:
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
    temperature, so a loss row sampled at another (the micro-batch's ``temperature``
    column) is left out of the loss, with a warning (:func:`mask_other_temperatures`).
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
        self.step_buffer = _StepBuffer(queue_maxsize, self._commit)
        # rollout_buffer is step_buffer, typed as TRL's RolloutWorkerProtocol declares its
        # attributes (invariant, so they cannot be narrower)
        self.rollout_buffer: queue.Queue[Any] | MPQueue[Any] = self.step_buffer
        self._seen_drops: set[str] = set()
        self._next_step: int | None = None
        self.metrics_queue: queue.Queue[Any] | MPQueue[Any] = queue.Queue()
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

    def samples_of_step(
        self, step_no: int | None = None
    ) -> tuple[int, list[RolloutSample], dict[str, float]]:
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
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        out: list[RolloutSample] = []
        seq_tokens = rows = 0
        for mb in mbs:
            rows += int((~is_padding(mb)).sum())
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
                self.step_buffer.expect(step, len(samples))
                for s in samples:
                    s.enqueued_at = time.time()
                    while not self._stop.is_set():
                        try:
                            self.step_buffer.put(s, timeout=0.5)
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

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
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
        inner: WeightTransferProtocol,
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

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
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


if TYPE_CHECKING:

    def _implements(
        w: FloeRolloutWorker, t: FloeWeightTransfer, n: NoWeightTransfer
    ) -> tuple[RolloutWorkerProtocol, WeightTransferProtocol, WeightTransferProtocol]:
        """mypy checks here that the classes satisfy TRL's protocols."""
        return w, t, n
