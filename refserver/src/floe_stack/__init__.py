"""One launcher for floe's process stack: the reference inference server, a ``floe``
binary (``serve``, ``proxy``, ``corpus-serve``) and a trainer, as the demo and the test
fixtures run them.

    with Stack(log_dir) as st:
        ref, hello = st.start_server("refserver", refserver_argv("--port", "0"))
        floe, addrs = st.start_server("floe", [str(build_floe(tmp, root)), "serve", ...])
        ...
    # everything stopped here, also on an exception

Each child runs in its own process group (Ctrl-C at a terminal reaches only the parent,
which stops the children in order) and gets SIGTERM if the parent dies (Linux
``PR_SET_PDEATHSIG``): floe_bridge.launch starts them. Its stderr goes to
``LOG_DIR/NAME.log``, its stdout is a pipe: a server prints one JSON line there once it
listens (``start_server`` waits for it with a timeout), a trainer its progress lines.
Stopping sends SIGTERM to the group, waits a grace period, then SIGKILLs what is left of
the group.

The standard library and floe_bridge (it ships with the reference server,
``floe-refserver``, but importing it imports neither torch nor the server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from floe_bridge import launch

__all__ = ["Child", "Stack", "build_floe", "refserver_argv", "tail"]


def refserver_argv(*flags: str) -> list[str]:
    """The command line of the reference inference server in this interpreter."""
    return [sys.executable, "-m", "floe_refserver", *flags]


_built: dict[tuple[str, str], Path] = {}
_build_lock = threading.Lock()


# The variable `floe version` prints, stamped at build time (internal/cli).
VERSION_VAR = "github.com/floe-rl/floe/internal/cli.version"


def _describe(root: str | os.PathLike[str]) -> str:
    """The checkout's ``git describe --always --dirty``, so that a built floe names the
    commit it came from; "(devel)" outside a git checkout."""
    try:
        r = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True, text=True
        )
    except FileNotFoundError:
        return "(devel)"
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "(devel)"


def build_floe(out_dir: str | os.PathLike[str], root: str | os.PathLike[str], go: str | None = None) -> Path:
    """The floe binary: ``$FLOE_BIN`` when set, else ``go build ./cmd/floe`` of the module at
    ``root`` into ``out_dir``, once per process and checkout (later calls return the first
    build). ``go`` defaults to ``$GO``, then ``go``."""
    if env := os.environ.get("FLOE_BIN"):
        return Path(env)
    go = go or os.environ.get("GO", "go")
    key = (str(Path(root).resolve()), go)
    with _build_lock:
        if key in _built and _built[key].exists():
            return _built[key]
        out = Path(out_dir) / "floe"
        try:
            r = subprocess.run(
                [go, "build", "-ldflags", f"-X {VERSION_VAR}={_describe(root)}", "-o", str(out),
                 "./cmd/floe"],
                cwd=root, capture_output=True, text=True,
            )
        except FileNotFoundError as e:
            raise RuntimeError(f"building floe needs Go ({go}: {e}) or FLOE_BIN set to a floe binary") from e
        if r.returncode != 0:
            raise RuntimeError(f"go build ./cmd/floe failed:\n{r.stderr}")
        _built[key] = out
        return out


def tail(path: str | os.PathLike[str], n: int = 25) -> str:
    """The last ``n`` lines of a log file ("" if unreadable)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


@dataclass
class Child:
    """A started process: its own process group, stderr in ``log_path``, stdout a text pipe."""

    name: str
    proc: subprocess.Popen[str]
    log_path: Path
    #: set once stopped: it ignored SIGTERM for the grace period and was killed
    killed: bool = False
    #: set once ``Stack.stop`` has run for it (a second stop does nothing)
    stopped: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def running(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 25) -> str:
        return tail(self.log_path, n)

    def write_line(self, text: str) -> None:
        """One line to the child's stdin (started with ``stdin=True``)."""
        assert self.proc.stdin is not None, f"{self.name} was started without stdin"
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def first_json_line(self, timeout: float) -> dict[str, Any]:
        """The JSON object a server prints on stdout once it listens (lines before it that do
        not start with ``{`` are skipped). Raises RuntimeError with the log's tail if none
        comes within ``timeout`` seconds or the child exits first."""
        out: dict[str, Any] = {}
        done = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            try:
                for line in self.proc.stdout:
                    line = line.strip()
                    if line.startswith("{"):
                        out.update(json.loads(line))
                        break
            except (ValueError, OSError):
                pass
            done.set()

        threading.Thread(target=read, name=f"{self.name}-hello", daemon=True).start()
        if not done.wait(timeout) or not out:
            raise RuntimeError(
                f"{self.name} did not start within {timeout:.0f}s (exit {self.proc.poll()}); "
                f"log:\n{self.tail()}"
            )
        return out


@dataclass
class Stack:
    """The children of one run, stopped together: ``stop_all()``, or leaving the ``with``
    block (normally or by an exception).

    ``stop_order``: names stopped first, in this order (consumers before producers, e.g.
    trainer, floe, refserver); the others follow, the latest started first. ``label``
    prefixes the launcher's own messages on stderr."""

    log_dir: str | os.PathLike[str]
    cwd: str | os.PathLike[str] | None = None
    env: Mapping[str, str] | None = None
    stop_order: Sequence[str] = ()
    grace: float = 10.0
    label: str = "stack"
    children: list[Child] = field(default_factory=list)

    def __post_init__(self) -> None:
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: bool = False,
        cwd: str | os.PathLike[str] | None = None,
    ) -> Child:
        """Start ``argv`` as ``name`` (log ``LOG_DIR/NAME.log``; a second child of the same
        name gets ``NAME-2.log``)."""
        n = sum(c.name == name for c in self.children)
        log_path = Path(self.log_dir) / (f"{name}.log" if n == 0 else f"{name}-{n + 1}.log")
        e = env if env is not None else self.env
        with open(log_path, "w", encoding="utf-8") as log:
            proc = launch.start(
                argv,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=cwd if cwd is not None else self.cwd,
                env=e,
            )
        c = Child(name, proc, log_path)
        self.children.append(c)
        return c

    def start_server(
        self, name: str, argv: Sequence[str], timeout: float = 120.0, **kw: Any
    ) -> tuple[Child, dict[str, Any]]:
        """``start`` and wait for the child's first JSON line (its addresses)."""
        c = self.start(name, argv, **kw)
        return c, c.first_json_line(timeout)

    def stop(self, child: Child) -> int | None:
        """SIGTERM the child's process group, wait ``grace`` seconds, SIGKILL it if still
        there; then SIGKILL whatever of the group outlived its leader. Returns the exit code
        (negative: the signal that ended it)."""
        if child.stopped:
            return child.proc.returncode
        child.stopped = True
        if child.proc.poll() is None:
            _killpg(child.pid, signal.SIGTERM)
            try:
                child.proc.wait(self.grace)
            except subprocess.TimeoutExpired:
                msg = f"{self.label}: {child.name} ignored SIGTERM for {self.grace:.0f}s; killing it"
                print(msg, file=sys.stderr)
                child.killed = True
                _killpg(child.pid, signal.SIGKILL)
                child.proc.wait()
        _killpg(child.pid, signal.SIGKILL)  # a process group can outlive its leader
        for pipe in (child.proc.stdin, child.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        return child.proc.returncode

    def stop_all(self) -> list[tuple[str, int | None]]:
        """Stop every child (``stop_order`` first); returns (name, exit code) in stop order."""
        rank = {name: i for i, name in enumerate(self.stop_order)}
        latest_first = list(reversed(self.children))
        order = sorted(latest_first, key=lambda c: rank.get(c.name, len(rank)))
        return [(c.name, self.stop(c)) for c in order]

    def __enter__(self) -> Stack:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
