"""A small typed client for floe's Arrow Flight service (docs/flight.md).

One :class:`FloeClient` per trainer process. Each data-parallel rank reads its own
micro-batches of a step; one process commits the step once every rank is done with it::

    with FloeClient("grpc+tcp://127.0.0.1:8815") as floe:   # rank from torch.distributed
        step = floe.read_step()                              # the oldest uncommitted step
        for mb in step.micro_batches:
            loss = token_mean_loss(mb) ...                   # Σ / step.info.loss_tokens_global
        dist.barrier()
        if floe.rank == 0:
            floe.commit(step.step)

Errors
------
Flight errors are translated into :class:`FloeError` subclasses that keep the server's
message (``.message``; the gRPC code name is ``.code``). pyarrow maps gRPC status codes to
exception types as follows, and the client maps those on:

==========================  ===================================  ======================
gRPC code (server)          pyarrow exception                    floe_bridge exception
==========================  ===================================  ======================
``UNAUTHENTICATED``         ``FlightUnauthenticatedError``       :class:`Unauthenticated`
``PERMISSION_DENIED``       ``FlightUnauthorizedError``          :class:`Unauthenticated`
``DEADLINE_EXCEEDED``       ``FlightTimedOutError``              :class:`NotReady`
``NOT_FOUND``               ``ArrowKeyError``                    :class:`StepNotFound`
``FAILED_PRECONDITION``     ``ArrowInvalid`` ("precondition")    :class:`StepCommitted` [1]_
``INVALID_ARGUMENT``        ``ArrowInvalid`` ("invalid argument") :class:`BadRequest`
``CANCELLED`` at deadline  ``FlightCancelledError``             :class:`NotReady` [2]_
``UNAVAILABLE``, others     ``FlightError`` subclasses           :class:`FloeError`
==========================  ===================================  ======================

.. [1] when the message says "committed"; any other failed precondition (the server
   refuses to commit a step that is not READY) is a plain :class:`FloeError`.
.. [2] a call that fails with ``CANCELLED`` once its deadline has passed: gRPC reports the
   stream the server reset at the deadline ("Stream removed") when that arrives first.

``INVALID_ARGUMENT`` and ``FAILED_PRECONDITION`` both arrive as ``ArrowInvalid``; they are
told apart by pyarrow's status text ("... precondition failed error, with message: ...").
A deadline that expires on the client side (before the server answers) is also
``DEADLINE_EXCEEDED``: :class:`NotReady` then says which step was awaited and for how long.
A response that contradicts the protocol (wrong batch count, mismatched metadata, a
malformed FlightInfo) raises :class:`ProtocolError`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NoReturn

import pyarrow as pa
import pyarrow.flight as flight

from .batch import MicroBatch, MicroBatchMeta
from .schema import METADATA_KEY

__all__ = [
    "FloeClient",
    "StepInfo",
    "Step",
    "FloeError",
    "StepCommitted",
    "StepNotFound",
    "NotReady",
    "Unauthenticated",
    "BadRequest",
    "ProtocolError",
    "translate_error",
]

DEFAULT_LOCATION = "grpc+tcp://127.0.0.1:8815"
#: the environment variable FloeClient reads its bearer token from when none is given
FLIGHT_TOKEN_ENV = "FLOE_FLIGHT_TOKEN"


# --- errors --------------------------------------------------------------------------


class FloeError(Exception):
    """Base of every error the client raises. ``message`` is the server's message (with
    pyarrow's "Flight returned ... error, with message:" prefix removed) or the client's own;
    ``code`` the gRPC code name when known."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class StepCommitted(FloeError):
    """``FAILED_PRECONDITION``: the step was committed (it is never served again), or a
    second commit of it."""


class StepNotFound(FloeError, LookupError):
    """``NOT_FOUND``: the step will never exist (the source is finished)."""


class NotReady(FloeError, TimeoutError):
    """``DEADLINE_EXCEEDED``: the step was not READY by the call's deadline."""


class Unauthenticated(FloeError, PermissionError):
    """``UNAUTHENTICATED``: missing or wrong bearer token."""


class BadRequest(FloeError, ValueError):
    """``INVALID_ARGUMENT``: bad ticket or body JSON, a missing field, a rank out of range,
    an unknown action."""


class ProtocolError(FloeError):
    """The server's answer contradicts docs/flight.md."""


# "Flight returned invalid argument error, with message: <msg>",
# "gRPC returned precondition failed error, with message: <msg>",
# "Flight cancelled call, with message: <msg>", "Flight RPC failed with message: <msg>"
_PREFIX = re.compile(
    r"^(?:(?:Flight|gRPC) returned (?P<what>[a-z ]+?) error, with message: "
    r"|Flight cancelled call, with message: |Flight RPC failed with message: )"
)
# pyarrow's status text for each gRPC code it folds into a generic Arrow exception
_TEXT_CODES = {
    "invalid argument": "INVALID_ARGUMENT",
    "precondition failed": "FAILED_PRECONDITION",
    "not found": "NOT_FOUND",
    "timeout": "DEADLINE_EXCEEDED",
    "unauthenticated": "UNAUTHENTICATED",
    "unauthorized": "PERMISSION_DENIED",
    "unavailable": "UNAVAILABLE",
    "internal": "INTERNAL",
    "cancelled": "CANCELLED",
    "already exists": "ALREADY_EXISTS",
    "out of range": "OUT_OF_RANGE",
    "unimplemented": "UNIMPLEMENTED",
    "resource exhausted": "RESOURCE_EXHAUSTED",
}
_CODE_CLASSES: dict[str, type[FloeError]] = {
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": Unauthenticated,
    "DEADLINE_EXCEEDED": NotReady,
    "NOT_FOUND": StepNotFound,
    "FAILED_PRECONDITION": StepCommitted,
    "INVALID_ARGUMENT": BadRequest,
}


def _split_message(exc: BaseException) -> tuple[str | None, str]:
    """(gRPC code name from pyarrow's status text or None, the server's message)."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    # pyarrow may append "Detail: ..." / ". gRPC client debug context: ..." lines
    text = text.split(". gRPC client debug context:", 1)[0].strip()
    m = _PREFIX.match(text)
    if m is None:
        return None, text
    what = m.group("what")
    return (_TEXT_CODES.get(what) if what else None), text[m.end():]


def translate_error(exc: BaseException, context: str = "", *, timed_out: bool = False) -> FloeError:
    """Map a pyarrow Flight/Arrow exception to a :class:`FloeError` (see the module doc).

    ``context`` (e.g. ``"step 3 not READY within 5 s"``) is prepended to the message of a
    deadline that expired on the client side, whose text is gRPC's, not the server's.
    ``timed_out``: the call's deadline had passed when it failed; a ``CANCELLED`` is then a
    deadline too (gRPC reports the server's RST_STREAM at the deadline as "Stream removed",
    CANCELLED, when it arrives before the client's own timer fires)."""
    if isinstance(exc, FloeError):
        return exc
    code, message = _split_message(exc)
    # The exception type decides where it is unambiguous; the status text otherwise.
    if isinstance(exc, flight.FlightUnauthenticatedError):
        code = "UNAUTHENTICATED"
    elif isinstance(exc, flight.FlightUnauthorizedError):
        code = "PERMISSION_DENIED"
    elif isinstance(exc, flight.FlightTimedOutError):
        code = "DEADLINE_EXCEEDED"
    elif isinstance(exc, flight.FlightUnavailableError):
        code = "UNAVAILABLE"
    elif isinstance(exc, flight.FlightCancelledError):
        code = "CANCELLED"
    elif isinstance(exc, flight.FlightInternalError):
        code = "INTERNAL"
    elif isinstance(exc, pa.ArrowKeyError) and code is None:
        code = "NOT_FOUND"
    elif isinstance(exc, pa.ArrowInvalid) and code is None:
        code = "INVALID_ARGUMENT"
    if code == "CANCELLED" and timed_out:
        code = "DEADLINE_EXCEEDED"
    # A deadline that expired on the client side carries gRPC's text ("Deadline Exceeded",
    # "Stream removed"), not the server's: say what was awaited.
    if context and (not message or (code == "DEADLINE_EXCEEDED" and "READY" not in message)):
        message = f"{context}: {message or type(exc).__name__}"
    cls = _CODE_CLASSES.get(code or "", FloeError)
    if cls is StepCommitted and "committed" not in message:
        cls = FloeError  # another failed precondition (e.g. committing a step that is not READY)
    return cls(message, code)


def _raise(
    exc: BaseException, context: str, started: float | None = None, timeout: float | None = None
) -> NoReturn:
    timed_out = started is not None and timeout is not None and time.monotonic() - started >= 0.95 * timeout
    raise translate_error(exc, context, timed_out=timed_out) from exc


_FLIGHT_ERRORS = (flight.FlightError, pa.ArrowException)


# --- step description ----------------------------------------------------------------


def _json_object(raw: bytes | str | pa.Buffer | None, what: str) -> dict[str, Any]:
    if raw is None:
        raise ProtocolError(f"{what} is missing")
    data = raw.to_pybytes() if isinstance(raw, pa.Buffer) else raw
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"{what} is not valid JSON ({e}): {data!r}") from e
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {data!r}")
    return obj


def _int(obj: Mapping[str, Any], key: str, what: str) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(f"{what}: {key!r} must be an integer, got {v!r} in {dict(obj)}")
    return v


@dataclass(frozen=True, slots=True)
class StepInfo:
    """GetFlightInfo of one step (docs/flight.md, "GetFlightInfo")."""

    step: int
    num_ranks: int
    micro_batches_per_rank: int
    #: loss rows of the whole step over all ranks: the token-mean denominator
    loss_tokens_global: int
    policy_version_min: int
    policy_version_max: int
    strategy: str
    num_samples: int
    #: DoGet tickets, index = rank
    rank_tickets: tuple[bytes, ...]
    samples_ticket: bytes
    schema: pa.Schema = field(repr=False, compare=False)
    total_records: int = -1

    @classmethod
    def from_flight_info(cls, info: flight.FlightInfo) -> StepInfo:
        what = "FlightInfo app_metadata"
        meta = _json_object(info.app_metadata or None, what)
        ints = {
            k: _int(meta, k, what)
            for k in (
                "step",
                "num_ranks",
                "micro_batches_per_rank",
                "loss_tokens_global",
                "policy_version_min",
                "policy_version_max",
                "num_samples",
            )
        }
        strategy = meta.get("strategy")
        if not isinstance(strategy, str):
            raise ProtocolError(f"{what}: 'strategy' must be a string, got {strategy!r}")
        step, ranks = ints["step"], ints["num_ranks"]
        endpoints = list(info.endpoints)
        if ranks < 1 or len(endpoints) != ranks + 1:
            raise ProtocolError(
                f"step {step}: FlightInfo has {len(endpoints)} endpoints, "
                f"expected num_ranks + 1 = {ranks + 1}"
            )
        tickets = tuple(ep.ticket.ticket for ep in endpoints)
        for r, t in enumerate(tickets[:-1]):
            obj = _json_object(t, f"step {step} endpoint {r} ticket")
            if obj.get("step") != step or obj.get("rank") != r:
                raise ProtocolError(f"step {step} endpoint {r}: ticket {t!r}, expected step {step} rank {r}")
        obj = _json_object(tickets[-1], f"step {step} samples ticket")
        if obj.get("step") != step or obj.get("kind") != "samples":
            raise ProtocolError(
                f"step {step}: last endpoint's ticket is {tickets[-1]!r}, expected the samples ticket"
            )
        return cls(
            strategy=strategy,
            rank_tickets=tickets[:-1],
            samples_ticket=tickets[-1],
            schema=info.schema,
            total_records=int(info.total_records),
            **ints,
        )


@dataclass(eq=False)
class Step:
    """One rank's share of a step: its micro-batches, in order."""

    step: int
    rank: int
    info: StepInfo
    micro_batches: list[MicroBatch]
    #: seconds the caller waited for this step: from the read_step call to the last
    #: micro-batch received, or, for a step prefetched by :meth:`FloeClient.steps`, the time
    #: the iterator blocked on it
    wait_seconds: float
    _client: FloeClient | None = field(default=None, repr=False)
    _samples: pa.Table | None = field(default=None, repr=False)

    @property
    def loss_tokens_global(self) -> int:
        return self.info.loss_tokens_global

    @property
    def num_loss_tokens(self) -> int:
        """Loss rows in this rank's micro-batches."""
        return sum(mb.num_loss_tokens for mb in self.micro_batches)

    def samples(self, timeout: float | None = None) -> pa.Table:
        """The step's sample table (one row per sample, ``SAMPLE_SCHEMA``), fetched on first
        use. Must be called before the step is committed."""
        if self._samples is None:
            if self._client is None:
                raise FloeError(f"step {self.step}: no client to fetch the sample table with")
            self._samples = self._client.read_samples(self.info, timeout=timeout)
        return self._samples

    def __iter__(self) -> Iterator[MicroBatch]:
        return iter(self.micro_batches)

    def __len__(self) -> int:
        return len(self.micro_batches)


# --- the client ----------------------------------------------------------------------


def _default_rank() -> tuple[int, int]:
    """(rank, world_size): torch.distributed when initialized, else $RANK/$WORLD_SIZE, else
    (0, 1). torch is never imported here: a process group can only be initialized by code
    that imported torch.distributed already, so looking in ``sys.modules`` is enough."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank()), int(dist.get_world_size())
        except (AttributeError, RuntimeError):
            pass
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    try:
        return (int(rank) if rank else 0), (int(world) if world else 1)
    except ValueError as e:
        raise ValueError(f"RANK={rank!r} / WORLD_SIZE={world!r} must be integers") from e


class FloeClient:
    """Arrow Flight client for a floe server (docs/flight.md).

    ``rank``/``world_size`` default to torch.distributed's when a process group is
    initialized, else to ``$RANK``/``$WORLD_SIZE``, else to 0/1 (an explicit ``rank``
    without ``world_size`` leaves the world size unknown: ``None``). When the world size is
    known, :meth:`read_step` checks it against the server's number of ranks. ``timeout`` (seconds) is
    the default deadline of every call; calls that wait for a step pass it to the server,
    which waits at most that long for the step to become READY. ``token`` is the bearer
    token floe's Flight service requires (``-flight-token-file``); when none is given, it
    is read from ``$FLOE_FLIGHT_TOKEN``, so that it never needs to appear on a command line.
    """

    def __init__(
        self,
        location: str = DEFAULT_LOCATION,
        token: str | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: float = 60.0,
    ) -> None:
        if rank is None:
            rank, d_world = _default_rank()
            world_size = d_world if world_size is None else world_size
        if rank < 0 or (world_size is not None and not 0 <= rank < world_size):
            raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.location = location
        self.rank = rank
        self.world_size: int | None = world_size
        self.timeout = float(timeout)
        if token is None:
            token = os.environ.get(FLIGHT_TOKEN_ENV, "").strip() or None
        self._headers: list[tuple[bytes, bytes]] = (
            [] if token is None else [(b"authorization", b"Bearer " + token.encode())]
        )
        self._flight = flight.FlightClient(location)

    # -- plumbing --

    def _options(self, timeout: float | None) -> flight.FlightCallOptions:
        return flight.FlightCallOptions(
            timeout=self.timeout if timeout is None else timeout, headers=self._headers
        )

    def close(self) -> None:
        self._flight.close()

    def __enter__(self) -> FloeClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FloeClient({self.location!r}, rank={self.rank}, world_size={self.world_size})"

    def _action(self, kind: str, body: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        action = flight.Action(kind, json.dumps(dict(body)).encode())
        timeout = self.timeout if timeout is None else timeout
        t0 = time.monotonic()
        try:
            results = list(self._flight.do_action(action, options=self._options(timeout)))
        except _FLIGHT_ERRORS as e:
            _raise(e, f"{kind} {json.dumps(dict(body))}", t0, timeout)
        if len(results) != 1:
            raise ProtocolError(f"action {kind!r} returned {len(results)} results, expected 1")
        return _json_object(results[0].body, f"action {kind!r} result")

    # -- steps --

    def step_info(self, step: int | None = None, timeout: float | None = None) -> StepInfo:
        """GetFlightInfo for ``step`` (``None``: the oldest uncommitted step), waiting up to
        ``timeout`` seconds (default: the client's) for it to become READY."""
        path = ["next"] if step is None else ["step", str(int(step))]
        timeout = self.timeout if timeout is None else timeout
        what = "the next step" if step is None else f"step {step}"
        t0 = time.monotonic()
        try:
            fi = self._flight.get_flight_info(
                flight.FlightDescriptor.for_path(*path), options=self._options(timeout)
            )
        except _FLIGHT_ERRORS as e:
            _raise(e, f"{what} not READY within {timeout:g} s", t0, timeout)
        info = StepInfo.from_flight_info(fi)
        if step is not None and info.step != step:
            raise ProtocolError(f"asked for step {step}, FlightInfo describes step {info.step}")
        return info

    def read_step(
        self, step: int | None = None, rank: int | None = None, timeout: float | None = None
    ) -> Step:
        """Read ``rank``'s micro-batches (default: this client's rank) of ``step`` (default:
        the oldest uncommitted one), waiting up to ``timeout`` seconds in all."""
        t0 = time.monotonic()
        timeout = self.timeout if timeout is None else timeout
        info = self.step_info(step, timeout=timeout)
        if rank is None:
            rank = self.rank
            if self.world_size is not None and self.world_size != info.num_ranks:
                raise FloeError(
                    f"step {info.step} is formed for {info.num_ranks} data-parallel ranks, but this client "
                    f"is rank {self.rank} of {self.world_size}: start floe with -dp-size {self.world_size} "
                    "or pass rank= explicitly"
                )
        if not 0 <= rank < info.num_ranks:
            raise BadRequest(f"rank {rank} is out of range: step {info.step} has {info.num_ranks} ranks")
        remaining = max(timeout - (time.monotonic() - t0), 0.001)
        batches = self._read_batches(info, rank, remaining)
        return Step(
            step=info.step,
            rank=rank,
            info=info,
            micro_batches=batches,
            wait_seconds=time.monotonic() - t0,
            _client=self,
        )

    def steps(
        self,
        start: int | None = None,
        *,
        count: int | None = None,
        prefetch: bool = True,
        commit: bool | None = None,
        timeout: float | None = None,
    ) -> Iterator[Step]:
        """Yield this rank's share of consecutive steps, from ``start`` (default: the oldest
        uncommitted one), until floe has no more steps or ``count`` were yielded.

        With ``prefetch``, the next step is read on a background thread while the caller
        trains on the current one, so the trainer waits for data only when floe has not
        formed the step yet; ``Step.wait_seconds`` is then the time the iterator blocked.
        With ``commit`` (default: on rank 0 only), a step is committed when the caller asks
        for the next one. In data-parallel training that is after the step's optimizer
        update, which every rank reaches only after reading the whole step, so no rank can
        find its share committed under it. ``timeout`` bounds each wait for a step.
        """
        if commit is None:
            commit = self.rank == 0
        t_first = time.monotonic()
        n = self.step_info(timeout=timeout).step if start is None else int(start)
        first_lookup = time.monotonic() - t_first  # part of the first step's wait
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="floe-prefetch") if prefetch else None

        def fetch(k: int) -> Future[Step] | None:
            return None if pool is None else pool.submit(self.read_step, k, None, timeout)

        pending = fetch(n)
        yielded = 0
        try:
            while count is None or yielded < count:
                t0 = time.monotonic()
                try:
                    step = self.read_step(n, timeout=timeout) if pending is None else pending.result()
                except StepNotFound:
                    return
                if pending is not None:
                    step.wait_seconds = time.monotonic() - t0
                if yielded == 0:
                    step.wait_seconds += first_lookup
                if pending is not None:
                    more = count is None or yielded + 1 < count
                    pending = fetch(n + 1) if more else None
                yield step
                yielded += 1
                if commit:
                    self.commit(step.step, timeout=timeout)
                n += 1
        finally:
            if pool is not None:
                # A read in flight ends at its own deadline; nothing waits for it here.
                pool.shutdown(wait=False, cancel_futures=True)

    def _read_batches(self, info: StepInfo, rank: int, timeout: float) -> list[MicroBatch]:
        ctx = f"DoGet step {info.step} rank {rank}"
        batches: list[MicroBatch] = []
        t0 = time.monotonic()
        try:
            ticket = flight.Ticket(info.rank_tickets[rank])
            reader = self._flight.do_get(ticket, options=self._options(timeout))
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    break
                if chunk.data is None:
                    continue  # a metadata-only message; floe sends none
                app = chunk.app_metadata
                meta = None if app is None else {METADATA_KEY: app.to_pybytes()}
                try:
                    mb = MicroBatch.from_record_batch(chunk.data, meta)
                except ValueError as e:
                    raise ProtocolError(f"{ctx}, micro-batch {len(batches)}: {e}") from e
                self._check_meta(mb.meta, info, rank, len(batches), ctx)
                batches.append(mb)
        except _FLIGHT_ERRORS as e:
            _raise(e, f"{ctx} not complete within {timeout:g} s", t0, timeout)
        if len(batches) != info.micro_batches_per_rank:
            raise ProtocolError(
                f"{ctx}: received {len(batches)} micro-batches, expected {info.micro_batches_per_rank}"
            )
        return batches

    @staticmethod
    def _check_meta(meta: MicroBatchMeta | None, info: StepInfo, rank: int, index: int, ctx: str) -> None:
        if meta is None:
            raise ProtocolError(f"{ctx}, micro-batch {index}: no floe metadata")
        want = {
            "step": info.step,
            "rank": rank,
            "micro_batch": index,
            "num_micro_batches": info.micro_batches_per_rank,
            "loss_tokens_global": info.loss_tokens_global,
        }
        bad = {k: getattr(meta, k) for k, v in want.items() if getattr(meta, k) != v}
        if bad:
            raise ProtocolError(f"{ctx}, micro-batch {index}: metadata {bad} does not match expected {want}")

    def read_samples(self, info: StepInfo | int, timeout: float | None = None) -> pa.Table:
        """The sample table of a step (a :class:`StepInfo` or a step number)."""
        if isinstance(info, int):
            info = self.step_info(info, timeout=timeout)
        timeout = self.timeout if timeout is None else timeout
        t0 = time.monotonic()
        try:
            reader = self._flight.do_get(flight.Ticket(info.samples_ticket), options=self._options(timeout))
            table: pa.Table = reader.read_all()
        except _FLIGHT_ERRORS as e:
            _raise(e, f"DoGet step {info.step} samples not complete within {timeout:g} s", t0, timeout)
        if table.num_rows != info.num_samples:
            raise ProtocolError(
                f"step {info.step}: sample table has {table.num_rows} rows, "
                f"FlightInfo says {info.num_samples}"
            )
        return table

    # -- actions --

    def commit(self, step: int, timeout: float | None = None) -> dict[str, Any]:
        """Release ``step`` (once; a second commit raises :class:`StepCommitted`)."""
        return self._action("commit", {"step": int(step)}, timeout)

    def report(
        self,
        step: int,
        rank: int | None = None,
        peak_memory_bytes: int = 0,
        step_seconds: float = 0.0,
        wait_seconds: float = 0.0,
        timeout: float | None = None,
        pid: int | None = None,
        loss: float | None = None,
    ) -> dict[str, Any]:
        """Report one rank's measurements for a step. ``pid`` (default: this process's)
        lets floe attribute GPU utilization and memory to the trainer's processes; ``loss``
        (optional) goes into floe's benchmark timelines."""
        body: dict[str, Any] = {
            "step": int(step),
            "rank": self.rank if rank is None else int(rank),
            "peak_memory_bytes": int(peak_memory_bytes),
            "step_seconds": float(step_seconds),
            "wait_seconds": float(wait_seconds),
            "pid": os.getpid() if pid is None else int(pid),
        }
        if loss is not None:
            body["loss"] = float(loss)
        return self._action("report", body, timeout)

    def pause(self, timeout: float | None = None) -> dict[str, Any]:
        return self._action("pause", {}, timeout)

    def resume(self, policy_version: int, timeout: float | None = None) -> dict[str, Any]:
        return self._action("resume", {"policy_version": int(policy_version)}, timeout)

    def status(self, timeout: float | None = None) -> dict[str, Any]:
        return self._action("status", {}, timeout)

    def actions(self, timeout: float | None = None) -> list[str]:
        """ListActions: the action types the server accepts."""
        try:
            return [a.type for a in self._flight.list_actions(options=self._options(timeout))]
        except _FLIGHT_ERRORS as e:
            _raise(e, "ListActions")
