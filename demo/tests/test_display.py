"""The demo's status line keeps talking through a long step (a cold build of floe took
minutes in silence, and looked like a hang)."""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import run  # noqa: E402


class Terminal(io.StringIO):
    """A terminal for Display: every status write lands here, and a waiter is told."""

    def __init__(self) -> None:
        super().__init__()
        self.wrote = threading.Condition()

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> int:
        with self.wrote:
            n = super().write(s)
            self.wrote.notify_all()
            return n


def test_ticking_renews_the_status_while_the_step_runs() -> None:
    term = Terminal()
    disp = run.Display(term)

    def slow_step() -> str:
        # The step ends only once the status has been renewed twice with the time spent,
        # so the test waits on the ticks themselves, not on a clock.
        with term.wrote:
            assert term.wrote.wait_for(lambda: term.getvalue().count("building floe (") >= 2, timeout=60), \
                term.getvalue()
        return "built"

    assert disp.ticking("building floe", slow_step, every=0.01) == "built"
    out = term.getvalue()
    assert out.startswith("\r\x1b[Kbuilding floe")
    assert " s)" in out
    assert disp.last.startswith("building floe (")


def test_off_a_terminal_each_new_step_is_written_at_once() -> None:
    """Off a terminal (make demo > log, CI) progress lines are thinned to one per 5 s, but
    the first line of each step is never held back: a cold start of the reference server
    took 35 s behind a suppressed "starting ..." line, and printed nothing meanwhile."""
    out = io.StringIO()  # isatty() is False
    disp = run.Display(out)
    disp.status("sessions 0/64")
    disp.status("sessions 1/64")  # within 5 s of the last line: thinned out
    disp.status("starting the reference inference server ...", new=True)
    assert disp.ticking("waiting for the trainer to load ...", lambda: 7) == 7
    assert out.getvalue().splitlines() == [
        "sessions 0/64",
        "starting the reference inference server ...",
        "waiting for the trainer to load ...",
    ]
