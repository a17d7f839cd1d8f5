"""floe_bridge.launch: a child started through it dies when its parent is killed, while one
started by plain Popen (the control) outlives it; streams, cwd and env reach the child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from floe_bridge import launch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

SRC = str(Path(__file__).resolve().parents[1] / "src")

# The parent: starts one `sleep` through the launcher and one by plain Popen in a new
# session (the control), prints both pids, then waits to be killed.
PARENT = """
import subprocess, time
from floe_bridge import launch
argv = ["sleep", "600"]
print(launch.start(argv).pid, subprocess.Popen(argv, start_new_session=True).pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan may wait unreaped under a pid 1
    that reaps nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_child_dies_with_its_parent() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env)
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2, f"the parent printed {line!r}, exit {parent.poll()}"
        launched, control = pids
        assert _alive(launched) and _alive(control)
        parent.kill()  # SIGKILL: no cleanup of the parent's runs
        parent.wait()
        # the bound only ends a hung test; the child dies as soon as the kernel signals it
        deadline = time.monotonic() + 30
        while _alive(launched) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(launched), f"child {launched} outlived its SIGKILLed parent"
        # both children saw the same parent exit: what killed the first was PR_SET_PDEATHSIG,
        # not the parent's death or the new session
        assert _alive(control), "a plain Popen child died with its parent too"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_start_passes_streams_and_env(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with out.open("w") as f:
        p = launch.start(
            ["sh", "-c", 'echo "$FLOE_LAUNCH_TEST"; pwd'],
            stdout=f,
            cwd=tmp_path,
            env={"FLOE_LAUNCH_TEST": "x", "PATH": os.environ["PATH"]},
        )
        assert p.wait(timeout=30) == 0
    assert out.read_text().split() == ["x", str(tmp_path)]
    q = launch.start(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    got, _ = q.communicate("text in, text out", timeout=30)
    assert got == "text in, text out"
