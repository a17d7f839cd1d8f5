"""floe on a Ray cluster: ``floe serve`` as a named, detached actor pinned to one node.

The driver (the trainer's launcher: verl's, OpenRLHF's, or your own) starts it once::

    import floe_bridge.ray as floe_ray
    # FLOE_CONTROL_TOKEN and FLOE_FLIGHT_TOKEN are set in this process's environment
    floe_ray.start("floe", namespace="rl", floe_bin="/opt/floe/bin/floe",
                   data_dir="/local/floe", flags=["-upstream", "http://10.0.0.7:8000", "-dp-size", "8"])

Rollout workers (Ray tasks or actors anywhere in the cluster) and trainer ranks find it by
name::

    addrs = floe_ray.lookup("floe", "rl")           # FloeAddresses(proxy=..., control=..., flight=...)
    floe = floe_ray.connect("floe", "rl")           # a FloeClient on this rank's share

The actor runs the floe binary as its child process, bound to the node's IP. Its data dir
is a path on that node's disk; the actor is pinned to the node (hard node affinity) and
restarted there without limit (``max_restarts=-1``), so a restarted floe opens the same
store, re-forms every step not yet committed and keeps its ports: the first start binds
port 0 (or the ``ports`` the caller gives) and the actor saves the bound addresses in the
data dir; every later start binds the same ones, so rollout workers and ranks that hold
the addresses keep working. A saved port that cannot be bound any more (an ephemeral port
an outgoing connection on the node took meanwhile) is replaced by a fresh one, and the
actor publishes the new addresses: :func:`lookup` returns them. Harnesses hold the proxy
URL their session was created with, so a changed proxy port means their sessions must look
floe up again.

Ray 2.60 does not restart an actor whose constructor raised (a creation-task error is a
user error, to which ``max_restarts`` does not apply): the constructor raises only for what
starting again cannot fix, and gives a floe that opens a large store time to do so
(``restart_timeout``).

Tokens never appear as arguments. ``start`` copies ``$FLOE_CONTROL_TOKEN`` and
``$FLOE_FLIGHT_TOKEN`` from the caller's environment into the actor's ``runtime_env``
``env_vars``, from which floe reads them; rollout workers get the control token and ranks
the Flight token the same way (their own ``runtime_env``), and :func:`control_request`
and :class:`~floe_bridge.FloeClient` read them from the environment. floe refuses to bind
its control and Flight listeners beyond loopback without them.

The floe process dies with the actor: it gets SIGTERM when the actor's process dies
(``PR_SET_PDEATHSIG``, also on ``ray.kill``), and a restarted actor first stops any floe
its previous incarnation left (its pid is kept in the data dir). If floe exits on its own,
the actor exits too, and Ray restarts both.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from . import launch
from .client import FloeClient

__all__ = [
    "TOKEN_ENVS",
    "FloeAddresses",
    "FloeServer",
    "launch_floe",
    "start",
    "lookup",
    "connect",
    "control_request",
    "stop",
]

#: The environment variables floe, FloeClient and control_request read their tokens from.
CONTROL_TOKEN_ENV = "FLOE_CONTROL_TOKEN"
FLIGHT_TOKEN_ENV = "FLOE_FLIGHT_TOKEN"
TOKEN_ENVS = (CONTROL_TOKEN_ENV, FLIGHT_TOKEN_ENV)

# Files the actor keeps in the data dir, beside floe's own store.
ADDRESSES_FILE = "ray-addresses.json"
PID_FILE = "ray-floe.pid"
STDOUT_FILE = "floe.out"
LOG_FILE = "floe.log"
# floe's own store: a data dir that has one is a restart, and opening a large store takes time.
STORE_FILE = "floe.db"
LISTENERS = ("proxy", "control", "flight")

# How floe serve says a listener could not be bound (its last line on stderr, exit code 1).
_BIND_ERROR = re.compile(
    r"^floe: (proxy|control|flight) listen: listen \S+ (\S+): bind: "
    r"(address already in use|cannot assign requested address)$", re.MULTILINE)

# The flags the actor sets itself; -flight-token would put a token on a command line.
_OWN_FLAGS = ("-proxy-addr", "-control-addr", "-flight-addr", "-data-dir", "-flight-token")


@dataclass(frozen=True)
class FloeAddresses:
    """What ``floe serve`` prints once it listens: the proxy's and control API's base URLs
    (``http://host:port``) and the Flight location (``grpc+tcp://host:port``)."""

    proxy: str
    control: str
    flight: str


def _hostport(url: str) -> str:
    return url.split("://", 1)[1]


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _alive_floe(pid: int, data_dir: Path) -> bool:
    """Whether ``pid`` is a floe serving ``data_dir`` (a recycled pid is someone else's)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in argv and str(data_dir).encode() in argv


def _stop_process(proc: subprocess.Popen[bytes], grace: float) -> int:
    """SIGTERM to floe's process group, SIGKILL after ``grace`` s; its exit code."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def _write_durably(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all, and durably: a power loss after this returns
    leaves the new content (tmp file fsynced, renamed, the directory fsynced)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _BindError(RuntimeError):
    def __init__(self, message: str, listener: str, addr: str, reason: str) -> None:
        super().__init__(message)
        self.listener, self.addr, self.reason = listener, addr, reason


def _serve_once(floe_bin: str, data: Path, binds: Mapping[str, str], flags: Sequence[str],
                deadline: float) -> tuple[subprocess.Popen[bytes], FloeAddresses]:
    """Start floe on ``binds`` and wait for the addresses it prints; a floe that exits or
    does not serve by ``deadline`` is stopped and raised (a :class:`_BindError` when it
    said a listener could not be bound)."""
    argv = [floe_bin, "serve", "-data-dir", str(data), "-proxy-addr", binds["proxy"],
            "-control-addr", binds["control"], "-flight-addr", binds["flight"], *flags]
    out, log_path = data / STDOUT_FILE, data / LOG_FILE
    log_from = log_path.stat().st_size if log_path.exists() else 0
    with open(out, "w") as stdout, open(log_path, "a") as log:
        # stdout to a file, not a pipe: a Go program writing to a closed pipe on fd 1 dies.
        proc = launch.start(argv, stdout=stdout, stderr=log)
    (data / PID_FILE).write_text(str(proc.pid))
    while True:
        for line in out.read_text().splitlines():
            if line.startswith("{") and line.endswith("}"):  # a whole line: floe prints it at once
                d = json.loads(line)
                return proc, FloeAddresses(d["proxy"], d["control"], d["flight"])
        if proc.poll() is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    code = proc.poll()
    _stop_process(proc, grace=5)
    with open(log_path, "rb") as f:
        f.seek(log_from)
        said = f.read().decode(errors="replace")
    what = "did not serve in time" if code is None else f"exited with {code} before serving"
    message = f"floe serve {what}; {log_path}:\n" + "\n".join(said.splitlines()[-20:])
    if code is not None and (m := _BIND_ERROR.search(said)):
        raise _BindError(message, m.group(1), m.group(2), m.group(3))
    raise RuntimeError(message)


def launch_floe(
    floe_bin: str,
    data_dir: str | os.PathLike[str],
    flags: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    timeout: float = 60.0,
) -> tuple[subprocess.Popen[bytes], FloeAddresses]:
    """Start ``floe serve`` on ``data_dir`` as this process's child (SIGTERM when this
    process dies) and wait until it serves; returns the process and its addresses, which
    are also saved to ``data_dir/ray-addresses.json`` (durably).

    Where it binds: ``ports`` (proxy, control, Flight) on ``host`` when given, waiting up
    to ``timeout`` for one that is taken; else the addresses saved by an earlier start,
    replacing one that cannot be bound any more (floe says "address already in use", or
    "cannot assign requested address" for an IP the node no longer has) by a fresh port
    on ``host``; else fresh ports (port 0) on ``host``. The :class:`FloeServer` actor runs
    this; it is public for a supervisor of its own (without Ray)."""
    data = Path(data_dir).resolve()
    data.mkdir(parents=True, exist_ok=True)
    saved = data / ADDRESSES_FILE
    fresh = _join(host, 0)
    if ports is not None:
        binds = {n: _join(host, p) for n, p in zip(LISTENERS, ports, strict=True)}
    elif saved.exists():
        old = json.loads(saved.read_text())
        binds = {n: _hostport(old[n]) for n in LISTENERS}
    else:
        binds = dict.fromkeys(LISTENERS, fresh)
    deadline = time.monotonic() + timeout
    while True:
        try:
            proc, addrs = _serve_once(floe_bin, data, binds, flags, deadline)
            break
        except _BindError as e:
            if ports is None and binds[e.listener] != fresh:
                # A saved address: bind a fresh port instead (every saved one, when the
                # node no longer has the saved IP), and publish the new addresses.
                print(f"floe: saved {e.listener} address {e.addr} cannot be bound ({e.reason}); "
                      f"binding a fresh port on {host}", flush=True)
                for n in LISTENERS if e.reason.startswith("cannot assign") else (e.listener,):
                    binds[n] = fresh
                continue
            if ports is not None and e.reason == "address already in use":
                if time.monotonic() + 2 < deadline:
                    time.sleep(2)  # the caller's port: it may be freed soon, and no other will do
                    continue
                taken = f"{e.listener} port {e.addr} still taken after {timeout:.0f}s"
                raise RuntimeError(f"{taken}: {e}") from None
            raise RuntimeError(str(e)) from None
    _write_durably(saved, json.dumps(asdict(addrs)))
    return proc, addrs


class FloeServer:
    """The actor: one ``floe serve`` child process (start it with :func:`start`)."""

    def __init__(
        self,
        floe_bin: str,
        data_dir: str,
        flags: Sequence[str],
        host: str | None,
        ports: Sequence[int] | None,
        start_timeout: float,
        restart_timeout: float,
    ) -> None:
        self._data = Path(data_dir).resolve()
        self._data.mkdir(parents=True, exist_ok=True)
        self._stopping = False
        self._stop_left_over()
        # floe opens its store before it serves: a large one (a long run's) takes longer.
        timeout = restart_timeout if (self._data / STORE_FILE).exists() else start_timeout
        host = host or ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self._proc, self._addrs = launch_floe(floe_bin, self._data, flags, host=host, ports=ports,
                                              timeout=timeout)
        threading.Thread(target=self._watch, name="floe-watch", daemon=True).start()

    def _stop_left_over(self, grace: float = 15.0) -> None:
        """Stop the floe a previous incarnation of this actor left running: it holds the
        store's lock and the ports this one must bind."""
        try:
            pid = int((self._data / PID_FILE).read_text())
        except (OSError, ValueError):
            return
        if not _alive_floe(pid, self._data):
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if not _alive_floe(pid, self._data):
                    return
                time.sleep(0.05)

    def _watch(self) -> None:
        """A floe that exits on its own takes the actor with it, so that Ray restarts both
        (a plain exit would leave a live actor publishing dead addresses)."""
        code = self._proc.wait()
        if not self._stopping:
            print(f"floe serve exited with {code}; exiting the actor for Ray to restart it", flush=True)
            os._exit(1)

    def addresses(self) -> FloeAddresses:
        return self._addrs

    def pid(self) -> int:
        """The floe process's id (on the actor's node)."""
        return self._proc.pid

    def stop(self, grace: float = 30.0) -> int | None:
        """Stop floe (SIGTERM, then SIGKILL after ``grace`` s); returns its exit code. The
        actor stays: kill it after this (:func:`stop` does both)."""
        self._stopping = True
        return _stop_process(self._proc, grace)


def start(
    name: str = "floe",
    *,
    namespace: str | None = None,
    floe_bin: str,
    data_dir: str,
    flags: Sequence[str] = (),
    node_id: str | None = None,
    host: str | None = None,
    num_cpus: float = 1,
    runtime_env: Mapping[str, Any] | None = None,
    ports: Sequence[int] | None = None,
    start_timeout: float = 60.0,
    restart_timeout: float = 900.0,
) -> Any:
    """Start ``floe serve`` as the detached actor ``name`` in ``namespace`` and wait until it
    serves; returns its handle. An actor of that name that exists already is returned as it
    is (a driver that runs again finds the floe it started).

    ``node_id``: the node to pin it to (default: the caller's); ``floe_bin`` and ``data_dir``
    are paths on that node. ``flags``: floe serve's other flags (``-upstream``,
    ``-dp-size``, ...; not the addresses, the data dir or a token). ``host``: the address
    floe binds (default: the node's IP, which needs both tokens). ``ports``: (proxy,
    control, Flight) ports to bind on every start, for static setups (a start waits for
    one that is taken, up to its timeout); without them the first start binds fresh ports
    and later starts bind the saved addresses, replacing a port that cannot be bound any
    more by a fresh one (:func:`lookup` then returns the new addresses). The tokens are
    taken from this process's ``$FLOE_CONTROL_TOKEN`` and ``$FLOE_FLIGHT_TOKEN`` into the
    actor's ``runtime_env`` (``runtime_env["env_vars"]`` given here wins).

    ``start_timeout``: how long a start on a data dir without a store may take to serve;
    ``restart_timeout``: the same on a data dir with floe's store (a restart, or a new
    actor on an old data dir), which floe opens before it serves: a long run's store can
    take minutes."""
    bad = [f for f in flags if f.split("=", 1)[0].replace("--", "-") in _OWN_FLAGS]
    if bad:
        raise ValueError(f"floe_bridge.ray.start sets {', '.join(_OWN_FLAGS)} itself; drop {bad}")
    if ports is not None:
        ports = [int(p) for p in ports]
        if len(ports) != len(LISTENERS) or not all(0 < p < 65536 for p in ports):
            raise ValueError(f"ports: want (proxy, control, flight) ports in 1..65535, got {ports}")
    env = dict(runtime_env or {})
    env_vars = {k: os.environ[k] for k in TOKEN_ENVS if os.environ.get(k, "").strip()}
    env_vars.update(env.get("env_vars") or {})
    if env_vars:
        env["env_vars"] = env_vars
    if not ray.is_initialized():
        ray.init(address="auto", namespace=namespace)
    actor: Any = (
        ray.remote(FloeServer)
        .options(
            name=name,
            namespace=namespace,
            get_if_exists=True,
            lifetime="detached",
            max_restarts=-1,
            # every method is a read or idempotent: retried across a restart
            max_task_retries=-1,
            num_cpus=num_cpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id or ray.get_runtime_context().get_node_id(), soft=False
            ),
            runtime_env=env or None,
        )
        .remote(floe_bin, data_dir, list(flags), host, ports, start_timeout, restart_timeout)
    )
    ray.get(actor.addresses.remote(), timeout=max(start_timeout, restart_timeout) + 60)
    return actor


def _actor(name: str, namespace: str | None, address: str) -> Any:
    if not ray.is_initialized():
        # a torchrun rank or any process outside Ray: join the cluster as a driver
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    return ray.get_actor(name, namespace=namespace)


def lookup(name: str = "floe", namespace: str | None = None, *, timeout: float = 120.0,
           address: str = "auto") -> FloeAddresses:
    """The addresses of the floe actor ``name``; while it restarts, waits for it (at most
    ``timeout`` s). A process not in Ray joins the cluster at ``address`` first.

    Look up again after floe was unreachable: a restart keeps the addresses unless a saved
    port could not be bound, and then publishes new ones."""
    handle = _actor(name, namespace, address)
    addrs: FloeAddresses = ray.get(handle.addresses.remote(), timeout=timeout)
    return addrs


def connect(name: str = "floe", namespace: str | None = None, *, rank: int | None = None,
            world_size: int | None = None, timeout: float = 60.0, address: str = "auto") -> FloeClient:
    """A :class:`~floe_bridge.FloeClient` on the floe actor ``name``'s Flight service; its
    token comes from ``$FLOE_FLIGHT_TOKEN`` (set it in the rank's ``runtime_env``)."""
    addrs = lookup(name, namespace, address=address)
    return FloeClient(addrs.flight, rank=rank, world_size=world_size, timeout=timeout)


def control_request(url: str, body: Mapping[str, Any] | None = None, *, timeout: float = 30.0) -> Any:
    """One control API call (``POST`` with a JSON body, ``GET`` without), bearing
    ``$FLOE_CONTROL_TOKEN`` when set; returns the decoded JSON answer."""
    headers = {"Content-Type": "application/json"}
    if token := os.environ.get(CONTROL_TOKEN_ENV, "").strip():
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(dict(body)).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def stop(name: str = "floe", namespace: str | None = None, *, grace: float = 30.0) -> int | None:
    """Stop floe (gracefully) and kill its actor for good; returns floe's exit code."""
    handle = ray.get_actor(name, namespace=namespace)
    code: int | None = ray.get(handle.stop.remote(grace))
    ray.kill(handle, no_restart=True)
    return code
