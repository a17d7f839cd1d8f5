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
port 0 and the actor saves the bound addresses in the data dir; every later start binds
the same ones, so rollout workers and ranks that hold the addresses keep working.

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

import ctypes
import json
import os
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

from .client import FloeClient

__all__ = [
    "TOKEN_ENVS",
    "FloeAddresses",
    "FloeServer",
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

# The flags the actor sets itself; -flight-token would put a token on a command line.
_OWN_FLAGS = ("-proxy-addr", "-control-addr", "-flight-addr", "-data-dir", "-flight-token")


@dataclass(frozen=True)
class FloeAddresses:
    """What ``floe serve`` prints once it listens: the proxy's and control API's base URLs
    (``http://host:port``) and the Flight location (``grpc+tcp://host:port``)."""

    proxy: str
    control: str
    flight: str


try:
    # Loaded here, not in the forked child: the actor's process has threads, and a child may
    # only do async-signal-safe work between fork and exec (no dlopen and its locks).
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None


def _pdeathsig() -> None:
    """In the child before exec: SIGTERM when the actor's process dies. Linux only."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _hostport(url: str) -> str:
    return url.split("://", 1)[1]


def _alive_floe(pid: int, data_dir: Path) -> bool:
    """Whether ``pid`` is a floe serving ``data_dir`` (a recycled pid is someone else's)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in argv and str(data_dir).encode() in argv


class FloeServer:
    """The actor: one ``floe serve`` child process (start it with :func:`start`)."""

    def __init__(
        self, floe_bin: str, data_dir: str, flags: Sequence[str], host: str | None, start_timeout: float
    ) -> None:
        self._data = Path(data_dir).resolve()
        self._data.mkdir(parents=True, exist_ok=True)
        self._stopping = False
        self._stop_left_over()
        host = host or ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        saved = self._data / ADDRESSES_FILE
        if saved.exists():
            old = FloeAddresses(**json.loads(saved.read_text()))
            binds = [_hostport(old.proxy), _hostport(old.control), _hostport(old.flight)]
        else:
            binds = [f"{host}:0"] * 3
        argv = [floe_bin, "serve", "-data-dir", str(self._data),
                "-proxy-addr", binds[0], "-control-addr", binds[1], "-flight-addr", binds[2], *flags]
        out = self._data / STDOUT_FILE
        with open(out, "w") as stdout, open(self._data / LOG_FILE, "a") as log:
            # stdout to a file, not a pipe: a Go program writing to a closed pipe on fd 1 dies.
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=log,
                                          start_new_session=True, preexec_fn=_pdeathsig)
        (self._data / PID_FILE).write_text(str(self._proc.pid))
        self._addrs = self._wait_for_addresses(out, start_timeout)
        tmp = saved.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self._addrs)))
        os.replace(tmp, saved)
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

    def _wait_for_addresses(self, out: Path, timeout: float) -> FloeAddresses:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in out.read_text().splitlines():
                if line.startswith("{") and line.endswith("}"):  # a whole line: floe prints it at once
                    d = json.loads(line)
                    return FloeAddresses(d["proxy"], d["control"], d["flight"])
            if self._proc.poll() is not None:
                break
            time.sleep(0.05)
        code = self._proc.poll()
        self.stop(grace=5)
        what = f"did not serve in {timeout:.0f}s" if code is None else f"exited with {code} before serving"
        log = (self._data / LOG_FILE).read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError(f"floe serve {what}; {self._data / LOG_FILE}:\n" + "\n".join(log))

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
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        return self._proc.returncode


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
    start_timeout: float = 60.0,
) -> Any:
    """Start ``floe serve`` as the detached actor ``name`` in ``namespace`` and wait until it
    serves; returns its handle. An actor of that name that exists already is returned as it
    is (a driver that runs again finds the floe it started).

    ``node_id``: the node to pin it to (default: the caller's); ``floe_bin`` and ``data_dir``
    are paths on that node. ``flags``: floe serve's other flags (``-upstream``,
    ``-dp-size``, ...; not the addresses, the data dir or a token). ``host``: the address the
    first start binds (default: the node's IP, which needs both tokens); later starts bind
    the addresses saved in ``data_dir``. The tokens are taken from this
    process's ``$FLOE_CONTROL_TOKEN`` and ``$FLOE_FLIGHT_TOKEN`` into the actor's
    ``runtime_env`` (``runtime_env["env_vars"]`` given here wins)."""
    bad = [f for f in flags if f.split("=", 1)[0].replace("--", "-") in _OWN_FLAGS]
    if bad:
        raise ValueError(f"floe_bridge.ray.start sets {', '.join(_OWN_FLAGS)} itself; drop {bad}")
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
        .remote(floe_bin, data_dir, list(flags), host, start_timeout)
    )
    ray.get(actor.addresses.remote(), timeout=start_timeout + 60)
    return actor


def _actor(name: str, namespace: str | None, address: str) -> Any:
    if not ray.is_initialized():
        # a torchrun rank or any process outside Ray: join the cluster as a driver
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    return ray.get_actor(name, namespace=namespace)


def lookup(name: str = "floe", namespace: str | None = None, *, timeout: float = 120.0,
           address: str = "auto") -> FloeAddresses:
    """The addresses of the floe actor ``name``; while it restarts, waits for it (at most
    ``timeout`` s). A process not in Ray joins the cluster at ``address`` first."""
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
