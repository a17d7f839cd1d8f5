"""Child processes that die with their parent: every process floe's Python starts (floe
serve from a Ray actor, the reference server and floe in floe_stack, vLLM in the vLLM
suite) goes through :func:`start`, so a parent killed with SIGKILL, which runs no cleanup,
leaves no orphan holding ports, GPUs or a data directory.

:func:`start` is ``subprocess.Popen`` in a new session (a signal to the parent's process
group does not reach the child; the parent stops it on its own terms) with Linux's
``PR_SET_PDEATHSIG``: the kernel sends the child SIGTERM when the thread that started it
exits. Start long-lived children from a thread that lives as long as they should. Off
Linux the children start the same, without that guarantee.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from typing import IO, Literal, TypeAlias, overload

__all__ = ["Stream", "start"]

#: what Popen takes for stdin, stdout and stderr
Stream: TypeAlias = "int | IO[str] | IO[bytes] | None"

_PR_SET_PDEATHSIG = 1

try:
    # Loaded here, not in the forked child: the parent may have threads, and a child may
    # only do async-signal-safe work between fork and exec (no dlopen and its locks).
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None


def _child_setup(parent: int) -> None:
    """In the child, between fork and exec."""
    # a signal mask survives exec: the child must see SIGTERM whatever its parent blocks
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    if _LIBC is None:
        return
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl: no signal will come
        # _exit, not a signal to itself: a Python SIGTERM handler inherited from the parent
        # (Ray installs one) would run here, in the forked child, before exec
        os._exit(1)


@overload
def start(
    argv: Sequence[str],
    *,
    text: Literal[True],
    stdin: Stream = ...,
    stdout: Stream = ...,
    stderr: Stream = ...,
    cwd: str | os.PathLike[str] | None = ...,
    env: Mapping[str, str] | None = ...,
) -> subprocess.Popen[str]: ...


@overload
def start(
    argv: Sequence[str],
    *,
    text: Literal[False] = ...,
    stdin: Stream = ...,
    stdout: Stream = ...,
    stderr: Stream = ...,
    cwd: str | os.PathLike[str] | None = ...,
    env: Mapping[str, str] | None = ...,
) -> subprocess.Popen[bytes]: ...


def start(
    argv: Sequence[str],
    *,
    text: bool = False,
    stdin: Stream = subprocess.DEVNULL,
    stdout: Stream = None,
    stderr: Stream = None,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[str] | subprocess.Popen[bytes]:
    """Start ``argv`` in its own session, to get SIGTERM when this thread exits (see the
    module doc). stdin defaults to /dev/null; ``env`` None inherits this process's."""
    parent = os.getpid()
    return subprocess.Popen(
        list(argv),
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        text=text,
        cwd=cwd,
        env=dict(env) if env is not None else None,
        start_new_session=True,
        preexec_fn=lambda: _child_setup(parent),
    )
