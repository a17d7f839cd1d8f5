"""floe as a detached Ray actor on a local multi-node Ray cluster (``ray.cluster_utils.Cluster``,
CPU only): sessions driven from a Ray task on a rollout node through floe's proxy to the
reference inference server, rewards through the control API, two trainer ranks (dp = 2)
as Ray actors on two other nodes reading their share of each step over Flight, and the
floe actor killed mid-run (a step read but not committed, a group with calls but not
finished). Ray restarts it on its node with the same data dir and ports; afterwards every
session is trained in exactly one committed step, with every call it made (before and
after the restart) and every sampled token of them as a loss row exactly once, as the
Parquet archive floe writes of each committed step (in the actor's data dir) records.
A restart whose saved port is taken meanwhile binds a fresh one and publishes it.

Tokens travel only in runtime envs: the workers are started before the driver has them,
and a task on the rollout node without the control token is refused.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import time
import urllib.error
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
import ray
from floe_stack import Stack, refserver_argv
from ray.cluster_utils import Cluster

from floe_bridge import FloeError
from floe_bridge import ray as floe_ray

NAME, NS = "floe", "floe-test"
MODEL = "floe-ref"
WORLD = 2
GROUP_SIZE = 2

# Ray ships the remote functions and the rank actor below to its workers; this module is
# not importable there (pytest put its directory on the driver's sys.path only).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- rollout side: Ray tasks on the "rollout" node ------------------------------------------


def _chat(proxy: str, api_key: str, turn: int) -> None:
    import json
    import urllib.request

    body = {"model": MODEL, "max_tokens": 6, "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": f"Fix the failing test, turn {turn}."}]}
    req = urllib.request.Request(f"{proxy}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert json.load(r)["choices"], "no choice"


@ray.remote(num_cpus=0, resources={"rollout": 1})
def rollout(groups: list[str], calls: int, finish: bool, resume: list[dict[str, Any]] | None = None) -> Any:
    """Create ``groups`` (GROUP_SIZE sessions each; ``resume``: sessions created earlier),
    make ``calls`` model calls per session through the proxy, and finish them with rewards
    that differ within the group when ``finish``. Finds floe by name."""
    addrs = floe_ray.lookup(NAME, NS)
    sessions = list(resume or [])
    for g in groups:
        for _ in range(GROUP_SIZE):
            s = floe_ray.control_request(f"{addrs.control}/floe/v1/sessions",
                                         {"task_id": g, "group_id": g, "group_size": GROUP_SIZE})
            sessions.append({"id": s["session_id"], "key": s["api_key"], "calls": 0})
    for s in sessions:
        for _ in range(calls):
            _chat(addrs.proxy, s["key"], s["calls"])
            s["calls"] += 1
    if finish:
        for i, s in enumerate(sessions):
            floe_ray.control_request(f"{addrs.control}/floe/v1/sessions/{s['id']}/finish",
                                     {"reward": float(i % GROUP_SIZE), "status": "completed"})
    return {"node": ray.get_runtime_context().get_node_id(), "sessions": sessions}


@ray.remote(num_cpus=0, resources={"rollout": 1})
def control_without_token() -> int:
    """A control call from a task that was given no token: floe's answer status."""
    addrs = floe_ray.lookup(NAME, NS)
    try:
        floe_ray.control_request(f"{addrs.control}/floe/v1/status")
    except urllib.error.HTTPError as e:
        return e.code
    return 200


# --- trainer side: one Ray actor per data-parallel rank -------------------------------------


@ray.remote(num_cpus=0)
class Rank:
    """A trainer rank: reads its share of the next step over Flight, by floe's actor name;
    when floe is gone (restarting), connects again by name."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.client = floe_ray.connect(NAME, NS, rank=rank, world_size=WORLD, timeout=30)
        self.reconnects = 0

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def read(self, step: int | None = None) -> dict[str, Any]:
        """The step's number and, per session, its number of calls (sample table) and the
        loss rows in this rank's micro-batches."""
        for attempt in range(20):
            try:
                st = self.client.read_step(step, timeout=60)
                samples = st.samples().to_pylist()
                break
            except FloeError:
                if attempt == 19:
                    raise
                self.client.close()
                self.reconnects += 1
                time.sleep(0.5)
                self.client = floe_ray.connect(NAME, NS, rank=self.rank, world_size=WORLD, timeout=30)
        sid = {s["sample_idx"]: s["session_id"] for s in samples}
        rows: Counter[str] = Counter()
        for mb in st.micro_batches:
            for i in mb.sample_idx[mb.loss_mask != 0].tolist():
                rows[sid[i]] += 1
        return {"step": st.step, "calls": {s["session_id"]: s["num_calls"] for s in samples},
                "loss_rows": dict(rows), "reconnects": self.reconnects}

    def commit(self, step: int) -> None:
        self.client.commit(step)


# --- the cluster and the inference server -----------------------------------------------------


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The reference inference server's base URL."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with Stack(tmp_path_factory.mktemp("ray-ref") / "logs", grace=20) as procs:
        argv = refserver_argv("--port", "0", "--threads", "1", "--log-level", "WARNING")
        _, hello = procs.start_server("refserver", argv, 120, env=env)
        yield hello["base_url"].removesuffix("/v1")


def _start_cluster() -> Cluster:
    """Head (resource "floe") + nodes "rollout", "rank0", "rank1", one CPU each. Ray waits a
    fixed 30 s for a node to register; on a heavily loaded machine (a load average of 19 on
    2 cores) that was seen to run out once, so a failed start is tried once more."""
    for attempt in (1, 2):
        c = Cluster()
        try:
            c.add_node(num_cpus=1, resources={"floe": 1}, include_dashboard=False)
            for r in ("rollout", "rank0", "rank1"):
                c.add_node(num_cpus=1, resources={r: 1})
            return c
        except Exception:
            c.shutdown()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def cluster(upstream: str) -> Iterator[float]:
    """The Ray cluster, started once the inference server serves (their start-ups do not
    compete for the CPUs), shut down also on failure; yields Ray's start-up time in s."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        for k in floe_ray.TOKEN_ENVS:  # the workers inherit no token from the driver's environment
            mp.delenv(k, raising=False)
        t0 = time.monotonic()
        c = _start_cluster()
        try:
            ray.init(address=c.address, namespace=NS, log_to_driver=False)
            c.wait_for_nodes()
            yield time.monotonic() - t0
        finally:
            ray.shutdown()
            c.shutdown()


def _node_with(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            return True
        time.sleep(0.1)
    return False


def _archived(control: str, archive: Path, steps: int, within: float = 30.0) -> dict[str, list[Any]]:
    """The archive's sessions (id, step, calls) and calls (session, step, index, trainable,
    sampled tokens), once floe's status says ``steps`` steps are archived."""
    deadline = time.monotonic() + within
    while (n := floe_ray.control_request(f"{control}/floe/v1/status").get("store", {})
           .get("archived_steps", 0)) < steps:
        assert time.monotonic() < deadline, f"{n} of {steps} committed steps archived after {within:.0f}s"
        time.sleep(0.2)
    sessions = ds.dataset(archive / "sessions", format="parquet").to_table(
        columns=["session_id", "step", "calls"]).to_pylist()
    calls = ds.dataset(archive / "calls", format="parquet").to_table(
        columns=["session_id", "step", "call_index", "trainable", "response_ids"]).to_pylist()
    return {"sessions": [(r["session_id"], r["step"], r["calls"]) for r in sessions],
            "calls": [{**c, "sampled": len(c.pop("response_ids"))} for c in calls]}


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _hold(port: int, within: float = 10.0) -> socket.socket:
    """Listen on 127.0.0.1:``port`` (as floe binds it, with SO_REUSEADDR), so that no one
    else can bind it; retried while a dying process may still hold it."""
    deadline = time.monotonic() + within
    while True:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _kill_for_good(name: str) -> None:
    try:
        ray.kill(ray.get_actor(name, namespace=NS), no_restart=True)
    except ValueError:
        pass  # no such actor (any more)


@pytest.mark.timeout(240)
def test_floe_actor_restart_mid_run_loses_nothing(
    upstream: str, cluster: float, floe_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t0 = time.monotonic()
    data = tmp_path / "floe-data"
    tokens = {k: secrets.token_hex(16) for k in floe_ray.TOKEN_ENVS}
    # The driver holds the tokens; start() hands them to the actor in its runtime env.
    for k, v in tokens.items():
        monkeypatch.setenv(k, v)
    floe_node = _node_with("floe")
    actor = floe_ray.start(
        NAME, namespace=NS, floe_bin=str(floe_bin), data_dir=str(data), node_id=floe_node, num_cpus=0,
        flags=["-upstream", upstream, "-group-size", str(GROUP_SIZE), "-groups-per-step", "1",
               "-steps-ahead", "2", "-dp-size", str(WORLD), "-token-budget", "4096", "-pad-multiple", "16"])
    try:
        addrs = floe_ray.lookup(NAME, NS)
        # bound to the node's IP, not loopback: floe takes that only with both tokens
        assert not addrs.control.startswith("http://127.") and not addrs.flight.startswith("grpc+tcp://127.")
        pid = ray.get(actor.pid.remote())
        cmdline = Path(f"/proc/{pid}/cmdline").read_text()
        assert all(t not in cmdline for t in tokens.values()), "a token on floe's command line"

        rollout_env = {"env_vars": {floe_ray.CONTROL_TOKEN_ENV: tokens[floe_ray.CONTROL_TOKEN_ENV]}}
        assert ray.get(control_without_token.remote()) == 401
        ranks = [Rank.options(resources={f"rank{r}": 1}, runtime_env={
            "env_vars": {floe_ray.FLIGHT_TOKEN_ENV: tokens[floe_ray.FLIGHT_TOKEN_ENV]}}).remote(r)
            for r in range(WORLD)]
        nodes = ray.get([r.node.remote() for r in ranks])
        run = rollout.options(runtime_env=rollout_env)

        def read(step: int | None = None) -> list[dict[str, Any]]:
            got = ray.get([r.read.remote(step) for r in ranks], timeout=120)
            assert got[0]["step"] == got[1]["step"] and got[0]["calls"] == got[1]["calls"]
            return got

        committed: list[list[dict[str, Any]]] = []

        def commit(step_reads: list[dict[str, Any]]) -> None:
            ray.get(ranks[0].commit.remote(step_reads[0]["step"]))
            committed.append(step_reads)

        # Phase 1: two groups finished; the first step trains and is committed, the
        # second is read by both ranks but not committed when floe goes down.
        first = ray.get(run.remote(["g0", "g1"], 2, True))
        assert first["node"] == _node_with("rollout") != floe_node
        assert len({floe_node, *nodes, first["node"]}) == 4
        commit(read())
        in_flight = read()
        # Phase 2: a group with recorded calls, not finished.
        open_group = ray.get(run.remote(["g2"], 2, False))["sessions"]

        # The restart: the actor's process is killed; Ray starts it again on its node.
        t_kill = time.monotonic()
        ray.kill(actor, no_restart=False)
        reread = [r.read.remote(in_flight[0]["step"]) for r in ranks]  # ranks find floe gone
        assert _gone(pid, 30), "floe outlived its actor"
        assert floe_ray.lookup(NAME, NS) == addrs, "the addresses changed across the restart"
        new_pid = ray.get(actor.pid.remote())
        restart_s = time.monotonic() - t_kill
        assert new_pid != pid

        # Phase 3: the re-formed step is the one read before, byte for byte in what the
        # ranks see; the open group's sessions call again and finish; a new group runs.
        again = ray.get(reread, timeout=120)
        reconnects = sum(a.pop("reconnects") for a in again)
        assert again == [{k: v for k, v in r.items() if k != "reconnects"} for r in in_flight]
        commit(again)
        later = ray.get(run.remote([], 1, True, open_group))["sessions"]
        last = ray.get(run.remote(["g3"], 2, True))["sessions"]
        commit(read())
        commit(read())

        # Every session in exactly one committed step, with all its calls; every
        # sampled token of every trainable call a loss row exactly once.
        made = {s["id"]: s["calls"] for s in first["sessions"] + later + last}
        assert len(made) == 4 * GROUP_SIZE and made[open_group[0]["id"]] == 3
        steps = [reads[0]["step"] for reads in committed]
        assert len(set(steps)) == len(steps) == 4
        trained: Counter[str] = Counter()
        calls: dict[str, int] = {}
        rows: Counter[str] = Counter()
        for reads in committed:
            trained.update(reads[0]["calls"].keys())
            calls.update(reads[0]["calls"])
            for rd in reads:
                rows.update(rd["loss_rows"])
        assert dict(trained) == dict.fromkeys(made, 1)
        assert calls == made
        # floe archived each committed step (the first floe some, the restarted one the
        # rest) and removed it from its store: the record is the archive in its data dir.
        archive = _archived(addrs.control, data / "archive", len(steps))
        step_of = {sid: reads[0]["step"] for reads in committed for sid in reads[0]["calls"]}
        assert {sid: (st, n) for sid, st, n in archive["sessions"]} == {
            sid: (step_of[sid], made[sid]) for sid in made}
        assert len(archive["sessions"]) == len(made), "a session archived twice"
        made_calls = Counter((c["session_id"], c["step"], c["call_index"]) for c in archive["calls"])
        assert made_calls == Counter((sid, step_of[sid], i) for sid, n in made.items() for i in range(n))
        assert all(c["trainable"] for c in archive["calls"]), "an untrainable call"
        want_rows: Counter[str] = Counter()
        for c in archive["calls"]:
            want_rows[c["session_id"]] += c["sampled"]
        assert dict(rows) == dict(want_rows) and all(n > 0 for n in want_rows.values())

        code = floe_ray.stop(NAME, NS)
        assert code == 0 and _gone(new_pid, 10)
    except BaseException:
        print("floe log:\n" + "".join((data / floe_ray.LOG_FILE).read_text().splitlines(True)[-40:]))
        _kill_for_good(NAME)
        raise
    print(f"\nray cluster start-up {cluster:.1f}s, test body {time.monotonic() - t0:.1f}s, "
          f"floe actor restart {restart_s:.1f}s, steps {steps}, rank reconnects {reconnects}")


@pytest.mark.timeout(120)
def test_floe_dies_with_its_actor_and_the_actor_with_floe(
    upstream: str, cluster: float, floe_bin: Path, tmp_path: Path
) -> None:
    """floe killed on its own: the actor exits and Ray restarts both; the restarted floe
    binds the saved ports, but one that another process took meanwhile (the proxy's here)
    is replaced by a fresh port, which the actor publishes. The actor killed for good:
    floe goes with it (nothing restarts it, nothing is left)."""
    name = "floe-lifecycle"
    data = tmp_path / "data"
    actor = floe_ray.start(name, namespace=NS, floe_bin=str(floe_bin), data_dir=str(data),
                           host="127.0.0.1", num_cpus=0, flags=["-upstream", upstream])
    held = None
    try:
        addrs, pid = floe_ray.lookup(name, NS), ray.get(actor.pid.remote())
        assert addrs.flight.startswith("grpc+tcp://127.0.0.1:")
        os.kill(pid, 9)
        assert _gone(pid, 10)
        held = _hold(_port(addrs.proxy))  # before Ray has restarted the actor (seconds)
        deadline = time.monotonic() + 60
        while (new_pid := ray.get(actor.pid.remote(), timeout=60)) == pid and time.monotonic() < deadline:
            time.sleep(0.2)  # the dead incarnation may still answer until its watchdog exits
        assert new_pid != pid
        moved = floe_ray.lookup(name, NS)
        assert (moved.control, moved.flight) == (addrs.control, addrs.flight)
        assert moved.proxy != addrs.proxy and moved.proxy.startswith("http://127.0.0.1:")
        assert json.loads((data / floe_ray.ADDRESSES_FILE).read_text()) == {
            "proxy": moved.proxy, "control": moved.control, "flight": moved.flight}
        assert f"listen tcp {_hostport(addrs.proxy)}: bind: address already in use" in (
            data / floe_ray.LOG_FILE).read_text()

        ray.kill(actor, no_restart=True)
        assert _gone(new_pid, 30), "floe outlived its actor"
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace=NS)
    finally:
        if held is not None:
            held.close()
        _kill_for_good(name)


def _hostport(url: str) -> str:
    return url.split("://", 1)[1]


# --- launch_floe, the actor's start of floe, without Ray ----------------------------------


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.timeout(60)
def test_launch_rebinds_saved_ports_and_replaces_a_taken_one(floe_bin: Path, tmp_path: Path) -> None:
    """A start binds the saved addresses; a saved port that is taken is replaced by a fresh
    one (the others kept) and the new addresses are saved, for the next start to bind."""
    flags = ["-upstream", "http://127.0.0.1:9"]
    proc, first = floe_ray.launch_floe(str(floe_bin), tmp_path, flags)
    assert floe_ray._stop_process(proc, 10) == 0
    proc, again = floe_ray.launch_floe(str(floe_bin), tmp_path, flags)
    assert again == first
    assert floe_ray._stop_process(proc, 10) == 0
    with _hold(_port(first.flight)):
        proc, moved = floe_ray.launch_floe(str(floe_bin), tmp_path, flags)
        try:
            assert (moved.proxy, moved.control) == (first.proxy, first.control)
            assert moved.flight != first.flight and moved.flight.startswith("grpc+tcp://127.0.0.1:")
            saved = json.loads((tmp_path / floe_ray.ADDRESSES_FILE).read_text())
            assert saved == {"proxy": moved.proxy, "control": moved.control, "flight": moved.flight}
        finally:
            assert floe_ray._stop_process(proc, 10) == 0
    assert not list(tmp_path.glob(".*.tmp")), "a temporary addresses file left"


@pytest.mark.timeout(60)
def test_launch_binds_explicit_ports_and_waits_for_a_taken_one(floe_bin: Path, tmp_path: Path) -> None:
    """Explicit ports are bound as given, never replaced: one that stays taken is an error
    (with floe's message) once the timeout has passed."""
    flags = ["-upstream", "http://127.0.0.1:9"]
    ports = _free_ports(3)
    proc, addrs = floe_ray.launch_floe(str(floe_bin), tmp_path, flags, ports=ports)
    try:
        assert [_port(a) for a in (addrs.proxy, addrs.control, addrs.flight)] == ports
    finally:
        assert floe_ray._stop_process(proc, 10) == 0
    taken = f"floe: control listen: listen tcp 127.0.0.1:{ports[1]}: bind: address already in use"
    with _hold(ports[1]):
        with pytest.raises(RuntimeError, match=rf"control port 127\.0\.0\.1:{ports[1]} still taken after 4s"
                           rf"(.|\n)*bind: address already in use"):
            floe_ray.launch_floe(str(floe_bin), tmp_path, flags, ports=ports, timeout=4)
    # it tried again while the port was taken, and never bound another one
    assert (tmp_path / floe_ray.LOG_FILE).read_text().count(taken) >= 2
    assert json.loads((tmp_path / floe_ray.ADDRESSES_FILE).read_text()) == {
        "proxy": addrs.proxy, "control": addrs.control, "flight": addrs.flight}
