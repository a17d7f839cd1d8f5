#!/usr/bin/env python3
"""floe's demo: the whole loop on one machine, CPU only, in well under 3 minutes.

    make demo                      # = .venv/bin/python demo/run.py
    .venv/bin/python demo/run.py --groups 2 --quick --summary-json out.json

It builds the ``floe`` binary, then starts, each in its own process group:

1. the reference inference server (``python -m floe_refserver``: a tiny seeded Qwen2
   model, vLLM's wire format, scripted outputs),
2. ``floe serve`` on free ports with a temporary data dir, the ``tree`` strategy, groups of
   4 sessions and 1-2 groups per step,
3. the trainer (demo/trainer.py: GRPO on the same tiny model, consuming steps over Arrow
   Flight as floe forms them and committing each),

and runs the rollout driver (demo/agent.py) in this process: groups of 4 coding-agent
sessions on the official ``openai`` SDK with two tools, through floe's proxy, each finished
with a reward through the control API. A live progress line shows sessions, groups, steps
formed and trained and the trainer's data-wait; at the end a summary compares the rows floe
forwarded with ``tree`` against what ``per_request`` would forward for the same recorded
calls, read back from the Parquet archive floe wrote once each step was committed
(docs/archive.md). Everything is stopped (SIGTERM, then SIGKILL after a grace period) on
the way out, also on Ctrl-C, SIGTERM or an error; children also get SIGTERM if this
process dies (PR_SET_PDEATHSIG). The processes are started and stopped by ``floe_stack``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

import pyarrow.compute as pc
import pyarrow.dataset as ds

from floe_stack import Child, Stack, build_floe, refserver_argv

T = TypeVar("T")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import agent  # noqa: E402

TOKEN_BUDGET = 4096
PAD_MULTIPLE = 16
# floe archives a step right after its commit (docs/archive.md); one that fails to is tried
# again within a minute (there is no next commit after the last), so waiting longer than
# that means it will not come
ARCHIVE_WAIT_S = 90.0


class Interrupted(Exception):
    pass


def _on_signal(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


@dataclass
class State:
    steps_formed: int = 0
    step_lines: list[dict[str, Any]] = field(default_factory=list)
    floe_fill: dict[int, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def follow_floe_log(state: State, path: str, stop: threading.Event) -> None:
    """Count "step READY" lines in floe's log (its fill per step rides along)."""
    pat = re.compile(r'msg="step READY".*?\bstep=(\d+).*?\bfill=([0-9.]+)')
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = ""
        while True:
            chunk = f.read()
            if chunk:
                buf += chunk
                *lines, buf = buf.split("\n")
                for line in lines:
                    m = pat.search(line)
                    if m:
                        with state.lock:
                            state.steps_formed += 1
                            state.floe_fill[int(m.group(1))] = float(m.group(2))
            elif stop.is_set():
                return
            else:
                time.sleep(0.1)


def follow_trainer(state: State, c: Child, on_step: Any, ready: threading.Event) -> None:
    """The trainer's stdout: FLOE_READY once loaded, then one FLOE_STEP JSON line per step."""
    assert c.proc.stdout is not None
    for line in c.proc.stdout:
        if line.startswith("FLOE_READY"):
            ready.set()
        elif line.startswith("FLOE_STEP "):
            rec = json.loads(line[len("FLOE_STEP "):])
            with state.lock:
                state.step_lines.append(rec)
            on_step(rec)


class Display:
    """One live status line on a terminal; a plain line every few seconds otherwise."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.tty = out.isatty()
        self.lock = threading.Lock()
        self.last = ""
        self.last_plain = 0.0

    def status(self, text: str, new: bool = False) -> None:
        """Replace the status line. Off a terminal a line is written at most every 5 s
        (the progress line changes four times a second), except ``new``: the first line of
        a step, written at once so that no step goes unnamed."""
        with self.lock:
            if self.tty:
                self.out.write("\r\033[K" + text)
                self.out.flush()
            elif new or time.monotonic() - self.last_plain >= 5 or text.startswith("done"):
                self.out.write(text + "\n")
                self.out.flush()
                self.last_plain = time.monotonic()
            self.last = text

    def line(self, text: str) -> None:
        with self.lock:
            if self.tty:
                self.out.write("\r\033[K" + text + "\n" + self.last)
            else:
                self.out.write(text + "\n")
            self.out.flush()

    def end(self) -> None:
        with self.lock:
            if self.tty and self.last:
                self.out.write("\n")
                self.out.flush()
            self.last = ""

    def ticking(self, what: str, fn: Callable[[], T], every: float = 10.0) -> T:
        """fn(), with a status line naming ``what`` and the seconds spent, renewed every
        ``every`` seconds: a cold step (Go's first build of floe downloads modules and
        compiles Arrow) takes minutes, and silence looks like a hang."""
        done = threading.Event()
        t0 = time.monotonic()

        def tick() -> None:
            while not done.wait(every):
                self.status(f"{what} ({time.monotonic() - t0:.0f} s)")

        self.status(what, new=True)
        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            return fn()
        finally:
            done.set()
            ticker.join()


def fmt_rows(n: float) -> str:
    return f"{n:,.0f}"


def wait_archived(control: str, steps: int, timeout: float = ARCHIVE_WAIT_S) -> dict[str, Any]:
    """Wait until floe has archived ``steps`` committed steps; return the status's store.

    The trainer's last commit returns before floe archives that step (the archiver runs
    after the commit), so the archive is read only once the store's ``archived_steps``
    counts every committed step: a step row is written after its calls and sessions, and
    the counter moves after all three files are in place.
    """
    deadline = time.monotonic() + timeout
    while True:
        store = agent.get_json(f"{control}/floe/v1/status").get("store") or {}
        done = store.get("archived_steps", 0)
        if done >= steps:
            return store
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"floe archived {done} of {steps} committed steps within {timeout:g}s "
                "(its log says why: look for \"archiving committed steps\")")
        time.sleep(0.1)


@dataclass
class CallFigures:
    calls: int = 0  # calls recorded in the sessions (one row per choice)
    trainable: int = 0
    per_request_rows: int = 0  # Σ prompt + response over the trainable calls


def archived_call_figures(archive_dir: str, session_ids: list[str]) -> CallFigures:
    """Count the archived calls of these sessions (docs/archive.md, table ``calls``)."""
    out = CallFigures()
    if not session_ids:
        return out
    calls = ds.dataset(os.path.join(archive_dir, "calls"), format="parquet")
    t = calls.to_table(columns=["prompt_ids", "response_ids", "trainable"],
                       filter=ds.field("session_id").isin(session_ids))
    out.calls = t.num_rows
    t = t.filter(pc.field("trainable"))
    out.trainable = t.num_rows
    if t.num_rows:
        out.per_request_rows = sum(pc.sum(pc.list_value_length(t[c])).as_py() for c in ("prompt_ids", "response_ids"))
    return out


def archive_bytes(archive_dir: str) -> int:
    """The archive's size: every file under it."""
    total = 0
    for d, _, files in os.walk(archive_dir):
        for f in files:
            total += os.path.getsize(os.path.join(d, f))
    return total


def summarize(
    args: argparse.Namespace,
    state: State,
    results: list[agent.SessionResult],
    archive_dir: str,
    wall: float,
    trainer_wall: float,
) -> dict[str, Any]:
    steps = sorted(state.step_lines, key=lambda r: r["step"])
    trained_groups = len(steps) * args.groups_per_step
    # per_request forwards every trainable call as its own sequence: prompt + response rows.
    # Sessions of a group in no trained step, and failed sessions (floe trains none of
    # their tokens), are left out.
    trained = [r.session_id for r in results if r.group < trained_groups and r.status == "completed"]
    fig = archived_call_figures(archive_dir, trained)
    per_request = fig.per_request_rows
    tree_real = sum(s["real_rows"] for s in steps)
    tree_padded = sum(s["rows"] for s in steps)
    wait = sum(s["wait_s"] for s in steps)
    busy = sum(s["step_s"] for s in steps)
    rewards = [r.reward for r in results if r.group < trained_groups]
    return {
        "steps_trained": len(steps),
        "steps_planned": args.groups // args.groups_per_step,
        "groups": args.groups,
        "groups_per_step": args.groups_per_step,
        "sessions": len(results),
        "sessions_completed": sum(r.status == "completed" for r in results),
        "calls": fig.calls,
        "trainable_calls": fig.trainable,
        "mean_reward": sum(rewards) / max(len(rewards), 1),
        "per_request_rows": per_request,
        "tree_rows": tree_real,
        "tree_rows_padded": tree_padded,
        "reduction": per_request / tree_real if tree_real else 0.0,
        "data_wait_s": wait,
        "train_s": busy,
        "data_wait_share": wait / (wait + busy) if wait + busy > 0 else 0.0,
        "fill": (sum(s["real_rows"] for s in steps) / sum(s["micro_batches"] * args.token_budget for s in steps))
        if steps
        else 0.0,
        "imbalance": 1.0,  # one data-parallel rank
        "floe_fill": dict(state.floe_fill),
        "losses": [s["loss"] for s in steps],
        "mismatch": [s["mismatch"] for s in steps],
        "per_step": steps,
        "wall_s": wall,
        "trainer_wall_s": trainer_wall,
    }


def _metrics_row(s: dict[str, Any]) -> list[tuple[str, str]]:
    m = s.get("floe_metrics") or {}
    if "floe_rows_forwarded_total" not in m or "floe_per_request_tokens_total" not in m:
        return []
    return [("floe's own count (/metrics)",
             f"{fmt_rows(m['floe_rows_forwarded_total'])} rows forwarded, "
             f"{fmt_rows(m['floe_per_request_tokens_total'])} per_request")]


def _archive_row(s: dict[str, Any]) -> list[tuple[str, str]]:
    u, a = s.get("store") or {}, s.get("archive") or {}
    n = u.get("archived_calls")
    if not n or not a.get("bytes"):
        return []
    return [("archive (Parquet)",
             f"{a['bytes'] / 1024:.0f} KiB for {u['archived_steps']} steps, {u['archived_sessions']} sessions, "
             f"{n} calls ({a['bytes'] / n / 1024:.1f} KiB/call); the store holds {u.get('calls', 0)} calls, "
             f"{u.get('disk_bytes', 0) / 1024:.0f} KiB on disk")]


def print_summary(s: dict[str, Any], out: IO[str]) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("")
    p("| step | groups | samples | micro-batches | rows (tree) | fill  | loss      | mismatch | wait_s | step_s |")
    p("|------|--------|---------|---------------|-------------|-------|-----------|----------|--------|--------|")
    for r in s["per_step"]:
        p(
            f"| {r['step']:>4} | {s['groups_per_step']:>6} | {r['samples']:>7} | {r['micro_batches']:>13} | "
            f"{fmt_rows(r['real_rows']):>11} | {r['fill']:.3f} | {r['loss']:>9.6f} | {r['mismatch']:>8.5f} | "
            f"{r['wait_s']:>6.2f} | {r['step_s']:>6.2f} |"
        )
    p("")
    rows = [
        ("steps trained", f"{s['steps_trained']} of {s['steps_planned']}"),
        ("sessions / model calls", f"{s['sessions']} sessions ({s['sessions_completed']} completed), "
                                   f"{s['calls']} calls ({s['trainable_calls']} trainable), mean reward {s['mean_reward']:.2f}"),
        ("rows per_request would forward", f"{fmt_rows(s['per_request_rows'])}  (Σ prompt + response over the trainable calls)"),
        ("rows tree forwarded", f"{fmt_rows(s['tree_rows'])}  ({fmt_rows(s['tree_rows_padded'])} with padding to {PAD_MULTIPLE})"),
        ("reduction", f"{s['reduction']:.2f}x fewer rows with tree"),
        *_metrics_row(s),
        *_archive_row(s),
        ("data-wait share", f"{100 * s['data_wait_share']:.1f}% of trainer time "
                            f"({s['data_wait_s']:.1f}s waiting, {s['train_s']:.1f}s training)"),
        ("fill", f"{s['fill']:.3f}  (rows / (micro-batches x token budget {s['token_budget']}))"),
        ("imbalance", f"{s['imbalance']:.3f}  (heaviest rank / mean rank; one data-parallel rank here)"),
        ("loss per step", " ".join(f"{x:.4f}" for x in s["losses"])),
        ("wall time", f"{s['wall_s']:.1f}s"),
    ]
    w = max(len(k) for k, _ in rows)
    p(f"| {'':<{w}} | |")
    p(f"|{'-' * (w + 2)}|---|")
    for k, v in rows:
        p(f"| {k:<{w}} | {v} |")


def floe_metrics(control: str) -> dict[str, float]:
    """floe's own counters from GET /metrics (Prometheus text), where this floe has them."""
    import urllib.request

    want = ("floe_rows_forwarded_total", "floe_per_request_tokens_total", "floe_step_imbalance",
            "floe_steps_committed_total", "floe_calls_recorded_total")
    try:
        with urllib.request.urlopen(f"{control}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in want:
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=None, help="GRPO groups of 4 sessions (default 16, 2 with --quick)")
    ap.add_argument("--groups-per-step", type=int, default=None, help="groups per step (default 2, 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="a short run for tests")
    ap.add_argument("--token-budget", type=int, default=TOKEN_BUDGET, help="floe -token-budget (rows per micro-batch)")
    ap.add_argument("--summary-json", default=None, help="also write the summary as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, data dir)")
    args = ap.parse_args(argv)
    if args.groups is None:
        args.groups = 2 if args.quick else 16
    if args.groups_per_step is None:
        args.groups_per_step = 1 if args.quick else 2
    if args.groups < args.groups_per_step or args.groups_per_step not in (1, 2):
        ap.error("--groups-per-step must be 1 or 2 and at most --groups")
    n_steps = args.groups // args.groups_per_step

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    t_start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="floe-demo-")
    log_dir = os.path.join(tmp, "logs")
    os.makedirs(log_dir)
    state = State()
    # the children, each in its own process group (Ctrl-C reaches only this process, which
    # stops the others in order: the trainer first, floe serve's graceful stop waits for a
    # Flight call blocked on a step that is not READY yet)
    procs = Stack(log_dir, cwd=ROOT, stop_order=("trainer", "floe", "refserver"), label="demo")
    disp = Display(sys.stdout)
    stop = threading.Event()
    results: list[agent.SessionResult] = []
    rc = 1
    summary: dict[str, Any] | None = None
    pids: list[int] = []
    data_dir = os.path.join(tmp, "floe-data")
    archive_dir = os.path.join(data_dir, "archive")  # floe serve's default -archive-dir
    try:
        print(f"floe demo: {args.groups} groups x {agent.GROUP_SIZE} sessions, {args.groups_per_step} group(s) per step, "
              f"{n_steps} steps, strategy tree, token budget {args.token_budget}; logs in {log_dir}", flush=True)
        print("this demo shows floe's data path only: scripted rewards, a tiny random model, no weight sync, so "
              "nothing learns; `make learn` closes the loop (SmolLM2 on a real vLLM, rewards from a task, "
              "the weights pushed back each step: docs/learn.md)", flush=True)
        floe_bin = str(disp.ticking("building floe (go build; the first build downloads Go modules and compiles "
                                    "Arrow: minutes on 2 cores) ...", lambda: build_floe(tmp, ROOT)))

        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        # the trainer imports torch and builds its model while the servers start; it reads
        # floe's Flight location from stdin
        trainer = procs.start("trainer", [
            sys.executable, os.path.join(HERE, "trainer.py"), "--steps", str(n_steps),
            "--token-budget", str(args.token_budget),
        ], env=env, stdin=True)
        # importing torch and transformers and building the tiny model, while the trainer
        # does the same: 10-50 s on 2 cores
        ref, hello = disp.ticking(
            "starting the reference inference server (imports torch, builds the tiny model) ...",
            lambda: procs.start_server("refserver", refserver_argv("--port", "0", "--threads", "1",
                                                                    "--log-level", "WARNING"), 120, env=env))
        ref_url = hello["base_url"]
        upstream = ref_url[: -len("/v1")] if ref_url.endswith("/v1") else ref_url

        disp.status("starting floe serve ...", new=True)
        floe, addrs = procs.start_server("floe", [
            floe_bin, "serve", "-proxy-addr", "127.0.0.1:0", "-control-addr", "127.0.0.1:0", "-flight-addr", "127.0.0.1:0",
            "-data-dir", data_dir, "-upstream", upstream,
            "-strategy", "tree", "-group-size", str(agent.GROUP_SIZE), "-groups-per-step", str(args.groups_per_step),
            "-steps-ahead", "2", "-token-budget", str(args.token_budget), "-pad-multiple", str(PAD_MULTIPLE),
        ], 60)
        # Sessions are created and finished on the control address; harnesses get the
        # proxy's address in each session's base_urls, and never the control address.
        control, flight = addrs["control"], addrs["flight"]
        threading.Thread(target=follow_floe_log, args=(state, floe.log_path, stop), daemon=True).start()

        trainer.write_line(flight)
        pids = [c.pid for c in procs.children]

        def on_step(r: dict[str, Any]) -> None:
            disp.line(f"  step {r['step']}  loss {r['loss']:+.6f}  loss_tokens {r['loss_tokens']}  rows {r['real_rows']} "
                      f"({r['micro_batches']} mb, fill {r['fill']:.3f})  wait_s {r['wait_s']:.2f}  step_s {r['step_s']:.2f}  "
                      f"mismatch {r['mismatch']:.5f}")

        ready = threading.Event()
        tf = threading.Thread(target=follow_trainer, args=(state, trainer, on_step, ready), daemon=True)
        tf.start()

        def trainer_loaded() -> None:
            while not ready.wait(0.2):
                if trainer.proc.poll() is not None:
                    raise RuntimeError(f"trainer exited with {trainer.proc.returncode}; log:\n{trainer.tail()}")

        disp.ticking("waiting for the trainer to load (imports torch, builds the model) ...", trainer_loaded)
        t_trainer = time.monotonic()

        progress = agent.Progress(args.groups * agent.GROUP_SIZE, args.groups)
        repo = os.path.join(tmp, "repo")
        box: dict[str, Any] = {}

        def drive() -> None:
            try:
                box["results"] = agent.drive(control, upstream, repo, args.groups, progress, stop, wave=args.groups_per_step)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                box["error"] = e

        driver = threading.Thread(target=drive, name="driver", daemon=True)
        driver.start()

        def line() -> str:
            with state.lock:
                formed, trained = state.steps_formed, len(state.step_lines)
                wait = sum(r["wait_s"] for r in state.step_lines)
            return (f"sessions {progress.sessions_done}/{progress.sessions_total}  calls {progress.calls}  "
                    f"groups {progress.groups_done}/{progress.groups_total}  steps formed {formed}/{n_steps}  "
                    f"trained {trained}/{n_steps}  data-wait {wait:.1f}s  [{time.monotonic() - t_start:.0f}s]")

        while driver.is_alive() or trainer.proc.poll() is None:
            disp.status(line())
            for c in (ref, floe):
                if c.proc.poll() is not None:
                    raise RuntimeError(f"{c.name} exited with {c.proc.returncode}; log:\n{c.tail()}")
            if "error" in box:
                raise RuntimeError(f"rollout driver failed: {box['error']!r}")
            if trainer.proc.poll() not in (None, 0):
                raise RuntimeError(f"trainer exited with {trainer.proc.returncode}; log:\n{trainer.tail()}")
            time.sleep(0.25)
        tf.join(5)
        trainer_wall = time.monotonic() - t_trainer
        if "error" in box:
            raise RuntimeError(f"rollout driver failed: {box['error']!r}")
        with state.lock:
            committed = len(state.step_lines)  # the trainer commits each step it reports
        store = disp.ticking(f"waiting for floe to archive {committed} committed steps ...",
                             lambda: wait_archived(control, committed))
        disp.status(line())
        disp.end()
        results = box["results"]
        failed = [r for r in results if r.status != "completed"]
        for r in failed[:5]:
            print(f"demo: session {r.session_id} (group {r.group}) {r.status}: {r.error}", file=sys.stderr)
        summary = summarize(args, state, results, archive_dir, time.monotonic() - t_start, trainer_wall)
        summary["token_budget"] = args.token_budget
        summary["floe_metrics"] = floe_metrics(control)
        summary["store"] = store
        summary["archive"] = {"dir": archive_dir, "bytes": archive_bytes(archive_dir)}
        if "floe_step_imbalance" in summary["floe_metrics"]:
            summary["imbalance"] = summary["floe_metrics"]["floe_step_imbalance"]  # floe's, of the last step
        rc = 0 if trainer.proc.returncode == 0 and summary["steps_trained"] == n_steps else 1
    except Interrupted as e:
        disp.end()
        print(f"\ndemo: {e}: stopping everything", file=sys.stderr)
        rc = 130
    except Exception as e:  # noqa: BLE001
        disp.end()
        print(f"\ndemo: error: {e}", file=sys.stderr)
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop.set()  # the driver starts no more groups; its calls in flight end with the servers
        codes = procs.stop_all()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    alive = [p for p in pids if _alive(p)]
    stopped = ", ".join(f"{n} (exit {c})" for n, c in codes)
    if summary is not None:
        summary["stopped"] = dict(codes)
        summary["child_pids"] = pids
        summary["left_running"] = alive
        print_summary(summary, sys.stdout)
        print(f"\nstopped: {stopped}; nothing left running" if not alive else f"\nstill running: {alive}")
        kept = args.keep or rc not in (0, 130)
        print(f"archive (Parquet, docs/archive.md): {archive_dir}" if kept else
              f"archive (Parquet, docs/archive.md) was in {archive_dir}, removed on exit: --keep keeps it")
        print("packing benchmark on the synthetic corpus (the former `make demo`): make bench-report  or  go run ./cmd/floe-bench")
        print("a model that learns through floe, with a reward curve: make learn (docs/learn.md)")
        if args.summary_json:
            with open(args.summary_json, "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1)
    else:
        print(f"stopped: {stopped}", file=sys.stderr)
    if alive:
        rc = rc or 1
    if args.keep or rc not in (0, 130):
        print(f"demo: logs kept in {log_dir}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return rc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is gone for our purposes only once reaped; Stack.stop_all reaped our children
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
