"""The demo end to end, reduced: 2 groups of 4 agent sessions, one group per step.

    .venv/bin/python -m pytest demo/tests -q

Runs ``demo/run.py --groups 2 --quick`` (builds floe with go, starts the reference
inference server, ``floe serve`` and the trainer) and checks its summary, and that no
process of the run is left: every process the demo starts inherits a marker in its
environment, and none may carry it afterwards. A second test interrupts a run with SIGINT
once training has started and checks the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "demo" / "run.py"
MARK = "FLOE_DEMO_TEST_MARK"


def marked_processes(mark: str) -> list[int]:
    """PIDs of live processes whose environment holds MARK=mark (zombies are gone)."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(d.name))
        except OSError:
            continue
    return found


def demo_env(mark: str) -> dict[str, str]:
    return dict(os.environ, **{MARK: mark})


@pytest.mark.timeout(240)
def test_demo_quick(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    out = tmp_path / "summary.json"
    r = subprocess.run(
        [sys.executable, str(RUN), "--groups", "2", "--quick", "--summary-json", str(out)],
        cwd=ROOT, env=demo_env(mark), capture_output=True, text=True, timeout=230,
    )
    assert r.returncode == 0, f"demo failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    s = json.loads(out.read_text())
    assert s["steps_trained"] >= 1 and s["steps_trained"] == s["steps_planned"] == 2
    assert s["sessions"] == 8 and s["sessions_completed"] == 8
    assert 3 * 8 <= s["trainable_calls"] <= 6 * 8  # 3 to 6 calls per session
    assert 0 < s["mean_reward"] < 1  # some sessions answer wrong
    assert 0 < s["tree_rows"] < s["per_request_rows"], s
    assert s["reduction"] > 2
    # floe's own counters agree with the demo's count, which it read from the archive
    m = s["floe_metrics"]
    assert m["floe_rows_forwarded_total"] == s["tree_rows"]
    assert m["floe_per_request_tokens_total"] == s["per_request_rows"]
    assert 0 < s["fill"] <= 1
    assert len(s["losses"]) == 2 and all(isinstance(x, float) for x in s["losses"])
    # the trainer scores with the server's own weights: step 0's rollout log-probs are its own
    assert s["mismatch"][0] < 1e-4
    assert s["stopped"] == {"trainer": 0, "floe": 0, "refserver": 0}
    assert s["left_running"] == []
    assert "| reduction" in r.stdout and "nothing left running" in r.stdout
    # it says what it is not: nothing learns here, make learn is where a model does
    assert "this demo shows floe's data path only" in r.stdout and "make learn" in r.stdout
    # floe on its defaults archived both committed steps and kept none of them in its store
    u = s["store"]
    assert (u["archived_steps"], u["archived_sessions"], u["archived_calls"]) == (2, 8, s["calls"]), u
    assert u["calls"] == 0 and u["sessions"] == 0, u
    assert s["archive"]["bytes"] > 0
    assert "| archive (Parquet)" in r.stdout
    assert f"archive (Parquet, docs/archive.md) was in {s['archive']['dir']}, removed on exit" in r.stdout
    assert not os.path.exists(s["archive"]["dir"])  # with the temporary directory
    assert marked_processes(mark) == [], "processes of the demo are still running"


@pytest.mark.timeout(240)
def test_demo_interrupted(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    p = subprocess.Popen(
        [sys.executable, str(RUN), "--groups", "8", "--quick"],
        cwd=ROOT, env=demo_env(mark), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert p.stdout is not None
        lines = []
        for line in p.stdout:  # wait until the first step is trained: everything is running
            lines.append(line)
            if line.lstrip().startswith("step 0"):
                break
        else:
            pytest.fail("the demo ended before training:\n" + "".join(lines))
        assert len(marked_processes(mark)) >= 4  # run.py, refserver, floe, trainer
        p.send_signal(signal.SIGINT)
        rest, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, "".join(lines) + rest
    assert "stopping everything" in rest
    assert marked_processes(mark) == [], "processes of the demo are still running after SIGINT"
