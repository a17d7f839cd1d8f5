"""FloeRolloutWorker against a scripted floe (issue 21 item 12): what it refuses, when it
commits, what its drop metric counts. The end-to-end runs through a real floe are in
test_trl.py; these pin the worker's own decisions without a server, thread or clock."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest

pytest.importorskip("trl")

from floe_bridge import MicroBatch  # noqa: E402
from floe_bridge.client import StepNotFound  # noqa: E402
from floe_bridge.trl import FloeRolloutWorker  # noqa: E402

from conftest import HAND, HAND_META, make_batch  # noqa: E402

#: HAND's loss rows: 4 (sample 0) and 6, 7 (sample 1): two samples per step
SAMPLES_PER_STEP = 2


class ScriptedFloe:
    """The few client calls the worker makes, answered from a list of steps."""

    def __init__(self, steps: int, temperature: float = 1.0, drops: list[list[dict[str, str]]] | None = None):
        cols = dict(HAND)
        cols["temperature"] = [temperature if m else 1.0 for m in HAND["loss_mask"]]
        self.mb = MicroBatch.from_record_batch(make_batch(cols, HAND_META.to_metadata()))
        self.steps = steps
        self.commits: list[int] = []
        self.drops = drops or []
        self.status_calls = 0

    def step_info(self, step: int | None, timeout: float | None = None) -> Any:
        if step is None:  # the oldest uncommitted step, as floe answers "next"
            step = min(set(range(self.steps + 1)) - set(self.commits))
        if step >= self.steps:
            raise StepNotFound("no more steps")
        return SimpleNamespace(step=step, num_ranks=1, loss_tokens_global=3)

    def read_step(self, step: int, rank: int | None = None, timeout: float | None = None) -> Any:
        return SimpleNamespace(micro_batches=[self.mb])

    def read_samples(self, info: Any, timeout: float | None = None) -> pa.Table:
        return pa.table({"sample_idx": [0, 1], "group_id": ["g", "g"], "policy_version": [0, 0],
                         "reward": [1.0, 0.0]})

    def commit(self, step: int, timeout: float | None = None) -> dict[str, Any]:
        self.commits.append(step)
        return {}

    def status(self) -> dict[str, Any]:
        k = min(self.status_calls, len(self.drops) - 1) if self.drops else -1
        self.status_calls += 1
        return {"dropped_groups": self.drops[k] if k >= 0 else []}

    def close(self) -> None:
        pass


def test_rows_at_another_temperature_are_left_out_of_the_loss(caplog: pytest.LogCaptureFixture) -> None:
    """TRL scores every sample at its one args.temperature; a loss row sampled at 0.7 under
    TRL's 1.0 would train on a ratio between two distributions. The worker masks such rows
    with a warning naming both temperatures. It used to refuse the step, and a refused step
    is served again after every restart: a harness that picks its temperature (-sampling
    record) could stop training for good. At a matching temperature the rows train."""
    floe = ScriptedFloe(1, temperature=0.7)
    worker = FloeRolloutWorker("grpc://unused", client=floe, temperature=1.0)  # type: ignore[arg-type]
    with caplog.at_level("WARNING"):
        step, samples, _ = worker.samples_of_step()
    assert step == 0
    assert sum(int(sum(s.completion_mask)) for s in samples) == 0
    assert (
        "3 loss tokens were sampled at temperature 0.7" in caplog.text
        and "args.temperature = 1" in caplog.text
    )
    ok = FloeRolloutWorker("grpc://unused", client=floe, temperature=0.7)  # type: ignore[arg-type]
    step, samples, _ = ok.samples_of_step()
    assert (step, len(samples)) == (0, SAMPLES_PER_STEP)
    assert sum(int(sum(s.completion_mask)) for s in samples) == 3


def test_a_step_without_samples_is_committed_once() -> None:
    """A step whose every sample was left out is committed when it is expected, and the
    next sample TRL takes does not commit it again (floe refuses a second commit, and the
    error surfaced inside TRL's data loop)."""
    floe = ScriptedFloe(3)
    worker = FloeRolloutWorker("grpc://unused", client=floe)  # type: ignore[arg-type]
    buf = worker.step_buffer
    buf.expect(0, 0)
    assert floe.commits == [0]
    buf.expect(1, 1)
    buf.put("sample of step 1")
    assert buf.get_nowait() == "sample of step 1"
    assert floe.commits == [0, 1]


def test_a_step_is_committed_only_when_trl_took_its_last_sample() -> None:
    """The worker used to commit a step as soon as its samples were on the buffer, before TRL
    took them: after a crash those were archived and never trained. Now a step stays
    uncommitted (floe re-serves it) until TRL's dataset takes its last sample."""
    floe = ScriptedFloe(2)
    worker = FloeRolloutWorker("grpc://unused", client=floe)  # type: ignore[arg-type]
    worker._run()  # reads steps 0 and 1 onto the buffer, then floe has no more
    assert worker._error is None
    assert worker.rollout_buffer.qsize() == 2 * SAMPLES_PER_STEP
    assert floe.commits == []  # handed over, nothing taken: nothing committed
    taken = []
    for _ in range(SAMPLES_PER_STEP - 1):
        taken.append(worker.rollout_buffer.get_nowait())
    assert floe.commits == []
    taken.append(worker.rollout_buffer.get_nowait())
    assert floe.commits == [0] and worker.steps_committed == [0]
    for _ in range(SAMPLES_PER_STEP):
        taken.append(worker.rollout_buffer.get_nowait())
    assert floe.commits == [0, 1]
    assert len(taken) == 2 * SAMPLES_PER_STEP


def test_drop_metric_counts_each_dropped_group_once_by_kind() -> None:
    """floe's status lists the last 16 dropped groups of every kind; the worker reported
    their number as ``floe/staleness_drops`` at every step (16 for ever once 16 groups were
    dropped, none of them for staleness). Now: groups newly dropped since the last step,
    in all and per kind."""
    first = [{"group": "a", "kind": "too_few_sessions", "reason": "1 < 2"},
             {"group": "b", "kind": "path_too_long", "reason": "..."}]
    second = first + [{"group": "c", "kind": "too_few_sessions", "reason": "0 < 2"}]
    floe = ScriptedFloe(3, drops=[first, second, second])
    worker = FloeRolloutWorker("grpc://unused", client=floe)  # type: ignore[arg-type]
    worker._run()
    got = [worker.metrics_queue.get_nowait() for _ in range(3)]
    assert all("floe/staleness_drops" not in m for m in got)
    assert [m["floe/groups_dropped"] for m in got] == [2.0, 1.0, 0.0]
    assert got[0]["floe/groups_dropped/too_few_sessions"] == 1.0
    assert got[0]["floe/groups_dropped/path_too_long"] == 1.0
    assert got[1]["floe/groups_dropped/too_few_sessions"] == 1.0
    assert "floe/groups_dropped/path_too_long" not in got[1]
