"""floe serve's Parquet archive (docs/archive.md), read as users read it.

A real ``floe serve`` records sessions through the reference server; the trainer reads and
commits two steps over Flight, and floe archives them. The archive is then opened with
pyarrow.dataset, pandas, DuckDB and Hugging Face ``datasets``, and checked against what floe
recorded and what the trainer was served (advantages included). ``floe export`` then writes
the calls still in the store (a step formed, not committed) in the same schema."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# duckdb, pandas and datasets are in the bridge's test extra: a missing one fails the test.
import datasets
import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

pytest.importorskip("torch")  # the reference server's model

from floe_stack import Stack, refserver_argv  # noqa: E402

from floe_bridge import FloeClient  # noqa: E402

CALL_COLUMNS = [
    "step", "group_id", "session_id", "task_id", "call_index", "choice", "api", "started", "finished",
    "upstream_latency_ns", "prompt_ids", "response_ids", "logprobs", "policy_version", "temperature", "top_p",
    "top_k", "finish_reason", "trainable", "untrainable_reason", "request", "upstream_request", "response",
]


def _post(url: str, body: dict[str, Any], key: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.load(r)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def refserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("archive-ref")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with Stack(tmp / "logs", grace=20) as procs:
        _, hello = procs.start_server(
            "refserver", refserver_argv("--port", "0", "--threads", "1", "--log-level", "WARNING"), 120,
            env=env,
        )
        yield hello["base_url"].removesuffix("/v1")


def _drive(proxy: str, control: str, group: str) -> list[tuple[str, str, str]]:
    """One group of two sessions of two turns; returns (session id, key, group) of each."""
    out = []
    for s in range(2):
        code, sess = _post(f"{control}/floe/v1/sessions",
                           {"task_id": f"task-{group}", "group_id": group, "group_size": 2})
        assert code == 200, sess
        msgs = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"Task {group}: fix tests/test_{group}.py"}]
        for t in range(2):
            code, r = _post(f"{proxy}/v1/chat/completions",
                            {"model": "floe-ref", "messages": msgs, "max_tokens": 6}, sess["api_key"])
            assert code == 200, r
            msgs += [{"role": "assistant", "content": r["choices"][0]["message"]["content"] or ""},
                     {"role": "user", "content": f"tool output {t}"}]
        code, r = _post(f"{control}/floe/v1/sessions/{sess['session_id']}/finish",
                        {"reward": float(s), "status": "completed"})
        assert code == 200, r
        out.append((sess["session_id"], sess["api_key"], group))
    return out


def _wait(what: str, cond: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_archive_opens_in_pyarrow_pandas_duckdb_and_datasets(
    floe_bin: Path, refserver: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    archive = data / "archive"
    recorded: dict[tuple[str, int, int], dict[str, Any]] = {}
    advantages: dict[str, float] = {}
    group_of: dict[str, str] = {}
    with Stack(tmp_path / "logs", grace=20) as procs:
        floe, addrs = procs.start_server("floe", [
            str(floe_bin), "serve", "-proxy-addr", "127.0.0.1:0", "-control-addr", "127.0.0.1:0",
            "-flight-addr", "127.0.0.1:0", "-data-dir", str(data), "-upstream", refserver,
            "-group-size", "2", "-groups-per-step", "1", "-steps-ahead", "3", "-token-budget", "4096",
            "-pad-multiple", "16"], 60)
        proxy, control = addrs["proxy"], addrs["control"]
        sessions = []
        for g in ("g0", "g1", "g2"):
            sessions += _drive(proxy, control, g)
        for sid, _, group in sessions:
            group_of[sid] = group
            for c in _get(f"{control}/floe/v1/sessions/{sid}")["calls"]:
                recorded[(sid, c["index"], c["choice"])] = c
        with FloeClient(addrs["flight"], timeout=60) as client:
            for n in (0, 1):
                st = client.read_step(n)
                for row in st.samples().to_pylist():
                    advantages[row["session_id"]] = row["advantage"]
                client.commit(n)
            client.read_step(2)  # formed and served, never committed: it stays in the store
        step1 = archive / "steps" / "step-000001" / "part-0.parquet"
        _wait("steps 0 and 1 archived", step1.exists)
        # the archived sessions' keys are refused, as a finished session's are
        for sid, key, _ in sessions[:4]:
            code, r = _post(f"{proxy}/v1/chat/completions", {"model": "floe-ref", "messages": [
                {"role": "user", "content": "again"}]}, key)
            assert code == 401, (sid, r)
        procs.stop(floe)

    archived = {k: v for k, v in recorded.items() if group_of[k[0]] != "g2"}
    assert len(archived) == 8

    # pyarrow.dataset: every archived call once, with its tokens
    calls = ds.dataset(archive / "calls", format="parquet").to_table()
    assert calls.column_names == CALL_COLUMNS
    assert calls.schema.field("prompt_ids").type == pa.list_(pa.int32())
    assert calls.schema.field("logprobs").type == pa.list_(pa.float32())
    # the JSON columns have 64-bit offsets (a row group may hold more than 2 GiB of JSON)
    for col in ("request", "upstream_request", "response"):
        assert calls.schema.field(col).type == pa.large_string()
    rows = calls.to_pylist()
    got = {(r["session_id"], r["call_index"], r["choice"]): r for r in rows}
    assert len(got) == len(rows) == len(archived)
    for k, want in archived.items():
        r = got[k]
        assert r["prompt_ids"] == want["prompt_ids"]
        assert r["response_ids"] == want["response_ids"]
        assert r["logprobs"] == pytest.approx(want["logprobs"], rel=1e-6, abs=1e-6)
        assert r["group_id"] == group_of[k[0]] and r["step"] == int(r["group_id"][1:])
        assert json.loads(r["request"])["messages"]
        assert r["trainable"] is want["trainable"]
    assert ds.dataset(archive / "calls").to_table(filter=ds.field("step") == 1).num_rows == 4

    # pandas: sessions with the advantages the trainer was served
    sess = pd.read_parquet(archive / "sessions")
    assert len(sess) == 4 and set(sess["session_id"]) == set(advantages)
    pcalls = pd.read_parquet(archive / "calls")
    assert all(json.loads(r)["messages"] for r in pcalls["request"])
    for r in sess.itertuples():
        assert r.advantage == pytest.approx(advantages[r.session_id], abs=1e-6)
        assert r.status == "completed" and r.calls == 2
    steps = pd.read_parquet(archive / "steps").sort_values("step")
    assert steps["step"].tolist() == [0, 1]
    assert [list(g) for g in steps["groups"]] == [["g0"], ["g1"]]
    assert (steps["committed"] >= steps["saved"]).all()

    # DuckDB: a join of calls and sessions
    q = duckdb.sql(f"""
        select s.step, s.session_id, s.advantage, count(*) as calls, sum(len(c.response_ids)) as sampled
        from read_parquet('{archive}/sessions/*/*.parquet') s
        join read_parquet('{archive}/calls/*/*.parquet') c using (session_id)
        group by all order by s.step, s.session_id""").fetchall()
    assert [(step, sid) for step, sid, *_ in q] == sorted((int(group_of[sid][1:]), sid) for sid in advantages)
    assert all(n == 2 and sampled > 0 for *_, n, sampled in q)
    # DuckDB reads the large_string JSON columns as text, and its JSON functions take them
    models = duckdb.sql(f"""
        select distinct json_extract_string(request, '$.model')
        from read_parquet('{archive}/calls/*/*.parquet')""").fetchall()
    assert models == [("floe-ref",)]

    # Hugging Face datasets, from the files
    files = str(archive / "calls" / "*" / "*.parquet")
    hf = datasets.load_dataset("parquet", data_files=files, split="train")
    assert hf.num_rows == len(archived) and hf.column_names == CALL_COLUMNS
    assert json.loads(hf[0]["response"])["role"] == "assistant"

    # floe export: the calls still in the store (step 2, formed, not committed)
    out = tmp_path / "export"
    r = subprocess.run([str(floe_bin), "export", "-data-dir", str(data), "-out", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "wrote 4 calls of 2 sessions" in r.stderr
    exp = pd.read_parquet(out / "calls")
    assert list(exp.columns) == CALL_COLUMNS
    assert set(exp["group_id"]) == {"g2"} and (exp["step"] == 2).all()
    for r2 in exp.itertuples():
        assert list(r2.prompt_ids) == recorded[(r2.session_id, r2.call_index, r2.choice)]["prompt_ids"]
