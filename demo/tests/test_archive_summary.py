"""The demo's summary reads the trained sessions' calls from floe's Parquet archive
(docs/archive.md) once floe has archived every committed step; these check that reading
and that wait on hand-made archives and a stand-in status endpoint, without starting floe.

    .venv/bin/python -m pytest demo/tests/test_archive_summary.py -q
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import run  # noqa: E402

CALLS = pa.schema([
    ("step", pa.int64()),
    ("session_id", pa.string()),
    ("call_index", pa.int32()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("trainable", pa.bool_()),
])


def call(
    step: int | None, session: str, i: int, prompt: int, response: int, trainable: bool = True
) -> dict[str, Any]:
    return {"step": step, "session_id": session, "call_index": i, "prompt_ids": list(range(prompt)),
            "response_ids": list(range(response)), "trainable": trainable}


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=CALLS), path)


def test_archived_call_figures_counts_only_the_given_sessions(tmp_path: Path) -> None:
    step0 = [
        call(0, "a", 0, 10, 3),
        call(0, "a", 1, 16, 4),
        call(0, "b", 0, 10, 2),
        call(0, "b", 1, 15, 5, trainable=False),
    ]
    step1 = [call(1, "c", 0, 12, 6)]
    write(tmp_path / "calls" / "step-000000" / "part-0.parquet", step0)
    write(tmp_path / "calls" / "step-000001" / "part-0.parquet", step1)
    # a dropped group's session (never trained) and a file floe is still writing: neither counts
    write(tmp_path / "calls" / "dropped-0123456789abcdef" / "part-0.parquet", [call(None, "d", 0, 50, 50)])
    write(tmp_path / "calls" / "step-000002" / ".part-0.parquet.tmp", [call(2, "a", 2, 99, 99)])

    got = run.archived_call_figures(str(tmp_path), ["a", "b", "c"])
    trainable = [c for c in step0 + step1 if c["trainable"]]
    assert got.calls == len(step0) + len(step1)
    assert got.trainable == len(trainable)
    assert got.per_request_rows == sum(len(c["prompt_ids"]) + len(c["response_ids"]) for c in trainable)

    only_b = run.archived_call_figures(str(tmp_path), ["b"])
    assert (only_b.calls, only_b.trainable, only_b.per_request_rows) == (2, 1, 12)
    assert run.archived_call_figures(str(tmp_path), []) == run.CallFigures()


class Status:
    """A stand-in for floe's GET /floe/v1/status whose archived_steps rises with each poll."""

    def __init__(self, archived: list[int]) -> None:
        self.archived = archived  # archived_steps at each poll; the last one repeats
        self.polls = 0
        self.lock = threading.Lock()

    def next(self) -> dict[str, Any]:
        with self.lock:
            n = self.archived[min(self.polls, len(self.archived) - 1)]
            self.polls += 1
        return {"store": {"calls": 0, "sessions": 0, "archived_steps": n}}


@pytest.fixture
def status_server() -> Iterator[tuple[Status, str]]:
    status = Status([0])

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path != "/floe/v1/status":
                self.send_error(404)
                return
            body = json.dumps(status.next()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield status, f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join()


def test_wait_archived_returns_once_every_committed_step_is_archived(
    status_server: tuple[Status, str],
) -> None:
    status, url = status_server
    status.archived = [0, 1, 1, 2]
    store = run.wait_archived(url, 2, timeout=30)
    assert store["archived_steps"] == 2
    assert status.polls == 4  # it polled until the counter reached the committed steps


def test_wait_archived_gives_up_with_a_clear_error(status_server: tuple[Status, str]) -> None:
    status, url = status_server
    status.archived = [1]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"floe archived 1 of 2 committed steps within 0.5s"):
        run.wait_archived(url, 2, timeout=0.5)
    assert time.monotonic() - t0 < 10  # bounded: it gave up rather than waiting on
    assert status.polls >= 2
