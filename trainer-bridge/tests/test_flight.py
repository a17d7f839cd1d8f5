"""floe's Flight service end to end: a real ``floe corpus-serve`` and the pyarrow Flight
client, through :class:`floe_bridge.FloeClient` and raw pyarrow (docs/flight.md)."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from floe_bridge import (
    MICRO_BATCH_SCHEMA,
    SAMPLE_SCHEMA,
    BadRequest,
    FloeClient,
    FloeError,
    MicroBatch,
    NotReady,
    Step,
    StepCommitted,
    StepNotFound,
    Unauthenticated,
    check_schema,
    translate_error,
)

from conftest import FloeServer

Start = Callable[..., FloeServer]
GROUPS = 6  # 3 steps of 2 groups: quick to form, enough to exercise the READY buffer
PAD = 128


def _types(schema: pa.Schema) -> list[tuple[str, pa.DataType]]:
    return [(f.name, f.type) for f in schema]


def _raw_error(fn: Callable[[], object]) -> BaseException:
    """Run a raw pyarrow call that must fail; return its exception."""
    with pytest.raises((flight.FlightError, pa.ArrowException)) as ei:
        fn()
    err: BaseException = ei.value
    return err


def _wait_status(client: FloeClient, key: str, want: object) -> dict[str, Any]:
    """Poll status until ``status[key] == want`` (steps are formed in the background)."""
    deadline = time.monotonic() + 10
    while (st := client.status())[key] != want:
        assert time.monotonic() < deadline, f"status {key} never became {want!r}: {st}"
        time.sleep(0.02)
    return st


def _wait_formed(client: FloeClient) -> None:
    """Wait until the server has formed every step (status "closed"): only then does it know
    which steps will never exist (NOT_FOUND: "the source is finished")."""
    _wait_status(client, "closed", True)


def _trainable(session: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in session["calls"] if c["trainable"]]


def _sampled(call: dict[str, Any]) -> list[tuple[int, float]]:
    """(token id, rollout logprob as float32) of each token a trainable call sampled."""
    ids = call["response_ids"] or []
    lps = call["logprobs"] or []
    assert len(ids) == len(lps), f"trainable call {call['index']} has {len(ids)} ids, {len(lps)} logprobs"
    return [(int(t), float(np.float32(lp))) for t, lp in zip(ids, lps, strict=True)]


# --- round trip ------------------------------------------------------------------------


def _check_padding(mb: MicroBatch) -> None:
    meta = mb.meta
    assert meta is not None and meta.rows is not None, "every micro-batch carries 'rows'"
    n, rows = mb.num_rows, meta.rows
    assert n % PAD == 0 and n == max(PAD, -(-rows // PAD) * PAD), (n, rows)
    pad = np.arange(rows, n)
    assert (mb.loss_mask[rows:] == 0).all()
    assert (mb.subtree_end[rows:] == pad + 1).all()
    assert (mb.pred_idx[rows:] == -1).all()
    assert (mb.position_ids[rows:] == 0).all()
    assert (mb.sample_idx[rows:] == -1).all()
    # rows before padding are tokens: the forest must not spill into the padding
    assert (mb.subtree_end[:rows] <= rows).all()


def _check_step(client: FloeClient, server: FloeServer, step: int, dp: int, strategy: str) -> list[str]:
    """Everything docs/flight.md and docs/batcher.md promise about one step; returns the
    step's group ids."""
    info = client.step_info(step)
    assert info.step == step and info.num_ranks == dp and info.strategy == strategy
    assert _types(info.schema) == _types(MICRO_BATCH_SCHEMA)
    assert info.total_records == dp * info.micro_batches_per_rank
    assert [json.loads(t) for t in info.rank_tickets] == [{"step": step, "rank": r} for r in range(dp)]
    assert json.loads(info.samples_ticket) == {"step": step, "kind": "samples"}

    steps = [client.read_step(step, rank=r) for r in range(dp)]
    assert len({len(s.micro_batches) for s in steps}) == 1, "every rank runs the same number of batches"
    loss_rows = 0
    for r, s in enumerate(steps):
        assert (s.step, s.rank, len(s.micro_batches)) == (step, r, info.micro_batches_per_rank)
        assert s.wait_seconds >= 0
        for i, mb in enumerate(s.micro_batches):
            meta = mb.meta
            assert meta is not None
            assert _types(mb.record_batch.schema) == _types(MICRO_BATCH_SCHEMA)
            assert (meta.step, meta.rank, meta.micro_batch, meta.num_micro_batches) == (
                step, r, i, info.micro_batches_per_rank)
            assert meta.loss_tokens_global == info.loss_tokens_global
            assert (meta.policy_version_min, meta.policy_version_max, meta.strategy) == (
                info.policy_version_min, info.policy_version_max, strategy)
            _check_padding(mb)
            mb.validate()
            loss_rows += mb.num_loss_tokens
    assert loss_rows == info.loss_tokens_global, "loss_tokens_global counts every rank's loss rows"

    # The sample table, against the loss rows.
    samples = steps[0].samples()
    check_schema(samples.schema, SAMPLE_SCHEMA)
    assert _types(samples.schema) == _types(SAMPLE_SCHEMA)
    assert samples.num_rows == info.num_samples
    assert samples.column("sample_idx").to_pylist() == list(range(info.num_samples))
    table = samples.to_pylist()
    adv = np.asarray(samples.column("advantage"), dtype=np.float32)
    terms: dict[int, Counter[tuple[int, float]]] = {i: Counter() for i in range(info.num_samples)}
    for s in steps:
        for mb in s.micro_batches:
            loss = mb.loss_mask != 0
            assert (mb.sample_idx[loss] >= 0).all() and (mb.sample_idx[loss] < info.num_samples).all()
            assert (mb.sample_idx[~loss] == -1).all(), "sample_idx is -1 on rows without loss"
            assert (mb.advantages[~loss] == 0).all() and (mb.old_logprobs[~loss] == 0).all()
            assert (mb.advantages[loss] == adv[mb.sample_idx[loss]]).all()
            for t, lp, si in zip(mb.input_ids[loss], mb.old_logprobs[loss], mb.sample_idx[loss], strict=True):
                terms[int(si)][(int(t), float(lp))] += 1
    for i, row in enumerate(table):
        assert sum(terms[i].values()) == row["num_loss_tokens"], row

    # The sample table, against the corpus the server dumped.
    groups = {g["id"]: g for g in server.groups()}
    sessions = {(g["id"], s["id"]): (g, s) for g in groups.values() for s in g["sessions"]}
    step_groups = sorted({row["group_id"] for row in table})
    assert len(step_groups) <= 2  # -groups-per-step 2
    expected_sessions = {k for k in sessions if k[0] in step_groups}
    assert {(row["group_id"], row["session_id"]) for row in table} == expected_sessions
    versions = []
    for i, row in enumerate(table):
        g, sess = sessions[(row["group_id"], row["session_id"])]
        trainable = _trainable(sess)
        assert row["task_id"] == g["task_id"]
        assert row["reward"] == sess["reward"]
        assert np.float32(row["advantage"]) == np.float32(sess["advantage"])
        assert row["num_calls"] == len(sess["calls"])
        want = Counter(t for c in trainable for t in _sampled(c))
        assert row["num_loss_tokens"] == sum(want.values())
        assert terms[i] == want, f"session {row['session_id']}: loss terms differ from its trainable calls"
        if trainable:
            assert row["policy_version"] == min(c["policy_version"] for c in trainable)
            versions += [c["policy_version"] for c in trainable]
    assert (info.policy_version_min, info.policy_version_max) == (min(versions), max(versions))
    return step_groups


@pytest.mark.parametrize("strategy,dp", [("tree", 2), ("prefix_merging", 2), ("per_request", 1), ("tree", 3)])
def test_round_trip(floe_server: Start, strategy: str, dp: int) -> None:
    server = floe_server(groups=GROUPS, strategy=strategy, dp_size=dp, pad_multiple=PAD, token_budget=8192)
    assert server.steps == GROUPS // 2
    seen: list[str] = []
    with FloeClient(server.location, world_size=dp, rank=0) as client:
        assert sorted(client.actions()) == sorted(["commit", "report", "pause", "resume", "status"])
        for step in range(server.steps):
            assert client.step_info().step == step, "['next'] is the oldest uncommitted step"
            seen += _check_step(client, server, step, dp, strategy)
            assert client.commit(step) == {"step": step, "committed": True}
        assert seen == [g["id"] for g in server.groups()], "steps take the groups in order, each once"
        status = client.status()
        assert status["committed"] == server.steps and status["ready"] == []
        with pytest.raises(StepNotFound):
            client.step_info(server.steps)


def test_metadata_in_both_places(floe_server: Start) -> None:
    """Flight app_metadata and the record-batch custom metadata carry the same JSON. pyarrow's
    Flight reader does not expose IPC custom metadata (to_reader().read_next_batch_with_
    custom_metadata is not implemented), so the second copy is checked where pyarrow puts
    it when it does: the batch's schema metadata, if present."""
    server = floe_server(groups=2, dp_size=1)
    raw = flight.FlightClient(server.location)
    reader = raw.do_get(flight.Ticket(json.dumps({"step": 0, "rank": 0}).encode()))
    n = 0
    for chunk in iter(reader.read_chunk, None):  # pragma: no branch
        app = json.loads(chunk.app_metadata.to_pybytes())
        assert set(app) == {"step", "rank", "micro_batch", "num_micro_batches", "loss_tokens_global",
                            "policy_version_min", "policy_version_max", "strategy", "rows"}
        assert (app["step"], app["rank"], app["micro_batch"]) == (0, 0, n)
        md = chunk.data.schema.metadata
        if md and b"floe" in md:
            assert json.loads(md[b"floe"]) == app
        n += 1
        if n == app["num_micro_batches"]:
            with pytest.raises(StopIteration):
                reader.read_chunk()
            break
    assert n > 0


# --- commit ----------------------------------------------------------------------------


def test_commit_once(floe_server: Start) -> None:
    server = floe_server(groups=GROUPS, dp_size=1)
    with FloeClient(server.location) as client:
        step = client.read_step(0)
        samples = step.samples()  # fetched before the commit, cached after
        assert client.commit(0) == {"step": 0, "committed": True}
        assert step.samples() is samples

        with pytest.raises(StepCommitted, match="step 0 is already committed") as e:
            client.commit(0)
        assert e.value.code == "FAILED_PRECONDITION"
        with pytest.raises(StepCommitted, match="step 0 was committed"):
            client.read_step(0)
        with pytest.raises(StepCommitted, match="step 0 was committed"):
            client.step_info(0)
        with pytest.raises(StepCommitted, match="step 0 was committed"):
            client.read_samples(step.info)
        assert client.step_info().step == 1
        assert client.status()["committed"] == 1


# --- authentication ----------------------------------------------------------------------


def test_auth(floe_server: Start) -> None:
    server = floe_server(groups=GROUPS, flight_token="s3cret")
    assert server.token == "s3cret"
    for token in (None, "wrong", ""):
        with FloeClient(server.location, token=token) as client:
            for call in (client.status, lambda: client.step_info(0), lambda: client.read_step(0),
                         lambda: client.commit(0), client.actions):
                with pytest.raises(Unauthenticated) as e:
                    call()
                assert e.value.code == "UNAUTHENTICATED"
    # DoGet with a good ticket but no token
    err = _raw_error(lambda: flight.FlightClient(server.location).do_get(
        flight.Ticket(b'{"step": 0, "rank": 0}')).read_all())
    assert isinstance(translate_error(err), Unauthenticated)

    with FloeClient(server.location, token="s3cret") as client:
        step = client.read_step(0)
        assert len(step.micro_batches) == step.info.micro_batches_per_rank
        assert step.samples().num_rows == step.info.num_samples
        assert client.commit(0)["committed"] is True
        assert client.status()["committed"] == 1


def test_auth_token_file_and_env(floe_server: Start, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token from -flight-token-file (never on a command line); FloeClient without a
    token reads $FLOE_FLIGHT_TOKEN, and pyarrow without the header is refused."""
    path = tmp_path / "flight.token"
    path.write_text("from-a-file\n")
    server = floe_server(groups=GROUPS, flight_token_file=str(path))
    monkeypatch.delenv("FLOE_FLIGHT_TOKEN", raising=False)
    with FloeClient(server.location) as client:
        with pytest.raises(Unauthenticated):
            client.status()
    err = _raw_error(
        lambda: list(flight.FlightClient(server.location).do_action(flight.Action("commit", b'{"step": 0}')))
    )
    assert isinstance(translate_error(err), Unauthenticated)
    monkeypatch.setenv("FLOE_FLIGHT_TOKEN", "wrong")
    with FloeClient(server.location) as client:
        with pytest.raises(Unauthenticated):
            client.commit(0)
    monkeypatch.setenv("FLOE_FLIGHT_TOKEN", "from-a-file")
    with FloeClient(server.location) as client:
        step = client.read_step(0)
        assert len(step.micro_batches) == step.info.micro_batches_per_rank
        assert client.commit(0)["committed"] is True
    # an explicit token wins over the environment
    with FloeClient(server.location, token="wrong") as client:
        with pytest.raises(Unauthenticated):
            client.status()


# --- waiting for READY ------------------------------------------------------------------


def test_wait_for_ready(floe_server: Start) -> None:
    server = floe_server(groups=GROUPS, steps_ahead=1)
    with FloeClient(server.location) as client:
        _wait_status(client, "ready", [0])
        time.sleep(0.2)
        assert client.status()["ready"] == [0], "steps_ahead 1: one uncommitted step at most"

        # a short deadline on a step that is not READY
        t0 = time.monotonic()
        with pytest.raises(NotReady) as e:
            client.step_info(1, timeout=0.5)
        assert 0.4 < time.monotonic() - t0 < 5
        assert e.value.code == "DEADLINE_EXCEEDED" and e.value.message
        with pytest.raises(NotReady):
            client.read_step(1, timeout=0.3)
        raw = flight.FlightClient(server.location)
        err = _raw_error(lambda: raw.do_get(flight.Ticket(b'{"step": 1, "rank": 0}'),
                                            options=flight.FlightCallOptions(timeout=0.3)).read_all())
        assert isinstance(translate_error(err, timed_out=True), NotReady)

        # a long one: the step becomes READY once step 0 is committed
        result: list[Step] = []
        errors: list[BaseException] = []

        def read() -> None:
            try:
                result.append(client.read_step(1, timeout=20))
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        waiter = threading.Thread(target=read)
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive() and not result and not errors, "step 1 is served only after 0 is committed"
        client.commit(0)
        waiter.join(timeout=15)
        assert not waiter.is_alive()
        assert not errors, errors
        (step,) = result
        assert step.step == 1 and len(step.micro_batches) == step.info.micro_batches_per_rank
        assert 0.9 < step.wait_seconds < 15
        assert client.status()["ready"] == [1]


def test_server_deadline_names_ready_steps(floe_server: Start) -> None:
    """docs/flight.md: a step not READY by the deadline fails with DEADLINE_EXCEEDED whose
    message names the READY steps. The client must actually receive that message, so the
    server has to answer before the call's deadline expires on the client side (otherwise
    the client only sees gRPC's own "Deadline Exceeded" / "Stream removed")."""
    server = floe_server(groups=GROUPS, steps_ahead=1)
    raw = flight.FlightClient(server.location)
    # The server answers a tenth of the deadline early (at most 1 s). The deadline is taken
    # from this machine's round trip, not fixed: on a loaded machine a 0.3 s deadline left
    # 30 ms for floe's answer, and gRPC's own "Deadline Exceeded" won the race.
    with FloeClient(server.location) as client:
        _wait_status(client, "ready", [0])
        t0 = time.monotonic()
        for _ in range(5):
            client.status()
        round_trip = (time.monotonic() - t0) / 5
    deadline = max(2.0, 100 * round_trip)
    messages = []
    for _ in range(3):
        err = _raw_error(lambda: raw.get_flight_info(flight.FlightDescriptor.for_path("step", "2"),
                                                     options=flight.FlightCallOptions(timeout=deadline)))
        mapped = translate_error(err, timed_out=True)
        assert isinstance(mapped, NotReady)
        messages.append(mapped.message)
    assert all("READY" in m and "0" in m for m in messages), f"no READY steps named: {messages}"


# --- bad requests -------------------------------------------------------------------------


def test_bad_requests(floe_server: Start) -> None:
    server = floe_server(groups=GROUPS, dp_size=2, steps_ahead=GROUPS)
    raw = flight.FlightClient(server.location)

    err = _raw_error(lambda: raw.do_get(flight.Ticket(b"{nope")).read_all())
    mapped = translate_error(err)
    assert isinstance(mapped, BadRequest) and mapped.code == "INVALID_ARGUMENT"
    assert "ticket" in mapped.message and "{nope" in mapped.message

    err = _raw_error(lambda: raw.do_get(flight.Ticket(b'{"step": 0}')).read_all())
    mapped = translate_error(err)
    assert isinstance(mapped, BadRequest) and "rank" in mapped.message

    err = _raw_error(lambda: raw.do_get(flight.Ticket(b'{"step": 0, "rank": 5}')).read_all())
    mapped = translate_error(err)
    assert isinstance(mapped, BadRequest)
    assert "rank 5" in mapped.message and "2 ranks" in mapped.message, mapped.message

    err = _raw_error(lambda: list(raw.do_action(flight.Action("bogus", b"{}"))))
    mapped = translate_error(err)
    assert isinstance(mapped, BadRequest) and "bogus" in mapped.message
    assert all(a in mapped.message for a in ("commit", "report", "pause", "resume", "status"))

    err = _raw_error(lambda: list(raw.do_action(flight.Action("commit", b"{}"))))
    mapped = translate_error(err)
    assert isinstance(mapped, BadRequest) and '"step"' in mapped.message

    err = _raw_error(lambda: list(raw.do_action(flight.Action("commit", b"not json"))))
    assert isinstance(translate_error(err), BadRequest)

    with FloeClient(server.location, world_size=2, rank=0) as client:
        _wait_formed(client)
        with pytest.raises(BadRequest, match="rank 5.*2 ranks"):
            client.read_step(0, rank=5)
        with pytest.raises(StepNotFound) as e:
            client.step_info(server.steps)
        assert e.value.code == "NOT_FOUND" and "2" in e.value.message, e.value.message  # steps 0..2
        with pytest.raises(StepNotFound):
            client.read_step(server.steps + 10, timeout=5)
        with pytest.raises(FloeError) as fe:  # not in docs/flight.md's table: FAILED_PRECONDITION
            client.commit(server.steps + 1)
        assert not isinstance(fe.value, StepCommitted) and str(server.steps + 1) in fe.value.message
    # a client whose world size disagrees with the server's ranks is stopped before reading
    with FloeClient(server.location, world_size=1, rank=0) as client, \
            pytest.raises(FloeError, match="-dp-size 1"):
        client.read_step(0)


# --- control actions -------------------------------------------------------------------


def test_control_actions(floe_server: Start) -> None:
    server = floe_server(groups=GROUPS, steps_ahead=2)
    with FloeClient(server.location) as client:
        st = _wait_status(client, "ready", [0, 1])
        assert set(st) >= {"ready", "next_step", "committed", "steps_ahead", "paused", "policy_version",
                           "closed"}
        assert st["committed"] == 0 and st["steps_ahead"] == 2 and st["paused"] is False
        assert isinstance(st["closed"], bool)

        v = st["policy_version"]
        assert client.pause() == {"paused": True, "policy_version": v}
        assert client.status()["paused"] is True
        assert client.resume(v + 3) == {"paused": False, "policy_version": v + 3}
        st = client.status()
        assert st["paused"] is False and st["policy_version"] == v + 3

        step = client.read_step(0)
        assert client.report(0, peak_memory_bytes=1 << 30, step_seconds=1.25,
                             wait_seconds=step.wait_seconds) == {"ok": True}
        assert client.report(0, rank=0) == {"ok": True}
        client.commit(0)
        st = _wait_status(client, "ready", [1, 2])
        assert st["committed"] == 1


# --- transport --------------------------------------------------------------------------


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # a short path: Unix socket paths are limited to ~107 bytes
    d = Path(tempfile.mkdtemp(prefix="floe", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_unix_socket(floe_server: Start, sock_dir: Path) -> None:
    sock = sock_dir / "flight.sock"
    server = floe_server(groups=GROUPS, flight_addr=f"unix:{sock}")
    assert sock.exists()
    assert server.location == f"grpc+unix://{sock}"
    with FloeClient(f"grpc+unix://{sock}") as client:
        step = client.read_step(0)
        assert len(step.micro_batches) == step.info.micro_batches_per_rank
        assert step.samples().num_rows == step.info.num_samples
        assert client.commit(0)["committed"] is True


# --- client-side units ---------------------------------------------------------------------


def test_error_translation() -> None:
    cases: list[tuple[BaseException, type[FloeError], str]] = [
        (flight.FlightUnauthenticatedError("Flight returned unauthenticated error, with message: nope"),
         Unauthenticated, "nope"),
        (flight.FlightTimedOutError("Flight returned timeout error, with message: ready: [0]"), NotReady,
         "ready: [0]"),
        (pa.ArrowKeyError("Flight returned not found error, with message: floe: step 9: no such step"),
         StepNotFound, "floe: step 9: no such step"),
        (pa.ArrowInvalid("gRPC returned precondition failed error, with message: floe: step 0 was committed. "
                         "gRPC client debug context: FAILED_PRECONDITION:..."), StepCommitted,
         "floe: step 0 was committed"),
        (pa.ArrowInvalid("Flight returned invalid argument error, with message: floe: bad ticket"),
         BadRequest, "floe: bad ticket"),
        (flight.FlightUnavailableError("Flight returned unavailable error, with message: connection refused"),
         FloeError, "connection refused"),
    ]
    for exc, cls, message in cases:
        got = translate_error(exc)
        assert type(got) is cls and got.message == message, (exc, got)
    late = translate_error(
        flight.FlightTimedOutError("Flight returned timeout error, with message: Deadline Exceeded"),
        "step 4 not READY within 0.5 s",
    )
    cancelled = translate_error(
        flight.FlightCancelledError("Flight cancelled call, with message: Stream removed"),
        "step 4",
        timed_out=True,
    )
    assert isinstance(cancelled, NotReady) and cancelled.message == "step 4: Stream removed"
    other = translate_error(flight.FlightCancelledError("Flight cancelled call, with message: x"))
    assert type(other) is FloeError and other.message == "x" and other.code == "CANCELLED"
    assert isinstance(late, NotReady) and "step 4 not READY within 0.5 s" in late.message
    assert issubclass(NotReady, TimeoutError) and issubclass(BadRequest, ValueError)


def test_rank_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    loc = "grpc+tcp://127.0.0.1:1"  # never contacted
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    c = FloeClient(loc)
    assert (c.rank, c.world_size) == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    c = FloeClient(loc)
    assert (c.rank, c.world_size) == (3, 4)
    c = FloeClient(loc, rank=1)
    assert (c.rank, c.world_size) == (1, None)
    with pytest.raises(ValueError, match="out of range"):
        FloeClient(loc, rank=4, world_size=4)
    c.close()


def test_steps_iterator_prefetches_commits_and_stops(floe_server: Callable[..., FloeServer]) -> None:
    """steps() yields every step in order, commits each as the caller moves on (the next one
    is formed only then, with -steps-ahead 1, so the prefetch has to wait for that commit),
    and ends when floe has no more steps."""
    server = floe_server(groups=6, groups_per_step=2, steps_ahead=1)
    with FloeClient(server.location, rank=0, world_size=1, timeout=20) as client:
        seen = []
        for step in client.steps():
            assert step.micro_batches and step.wait_seconds >= 0
            seen.append(step.step)
            # the step is not committed until the caller asks for the next one
            assert step.step not in range(client.status()["committed"])
        assert seen == list(range(server.steps))
        assert client.status()["committed"] == server.steps
        with pytest.raises(StepCommitted):
            client.read_step(0)


def test_steps_iterator_without_commit_or_prefetch(floe_server: Callable[..., FloeServer]) -> None:
    server = floe_server(groups=6, groups_per_step=2, steps_ahead=3)
    with FloeClient(server.location, rank=0, world_size=1) as client:
        got = [s.step for s in client.steps(1, count=2, prefetch=False, commit=False)]
        assert got == [1, 2]
        assert client.status()["committed"] == 0
