"""``floe-bench e2e`` end to end, reduced: the synthetic small corpus (2 groups of 4
sessions) replayed through a floe the command starts, against the reference inference
server in script mode, then trained once per strategy by
the example trainer on CPU; the report is written from the recorded runs.

    .venv/bin/python -m pytest demo/tests/test_bench_e2e.py -q

Checks what the runs recorded, not how long anything took: both strategies trained the
same samples (same steps, loss tokens, per-request rows and losses), ``tree`` forwarded
fewer rows, and REPORT.md and the plots hold those numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_bench_e2e_replays_and_trains(tmp_path: Path) -> None:
    floe = tmp_path / "floe-bench"
    subprocess.run(["go", "build", "-o", str(floe), "./cmd/floe-bench"], cwd=ROOT, check=True, timeout=300)
    out = tmp_path / "results"
    r = subprocess.run(
        [
            str(floe),
            "e2e",
            "-name",
            "e2e-test",
            "-out",
            str(out),
            "-groups",
            "2",
            "-groups-per-step",
            "1",
            "-strategies",
            "per_request,prefix_merging,tree",
            "-python",
            sys.executable,
            "-token-budget",
            "2048",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert r.returncode == 0, f"floe-bench e2e failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert "replay: " in r.stderr and "tree: step 1" in r.stderr  # progress while it runs

    runs = {
        s: json.loads((out / "runs" / f"{s}.json").read_text())
        for s in ("per_request", "prefix_merging", "tree")
    }
    pr, pm, tree = runs["per_request"], runs["prefix_merging"], runs["tree"]
    # A replayed call's prompt extends the previous call's prompt and response token for
    # token (the history renders as the model wrote it), so chains merge: were every
    # tool call to re-render differently, prefix_merging would gain almost nothing.
    rows = {name: sum(s["rows"] for s in r["steps"]) for name, r in runs.items()}
    assert rows["tree"] < rows["prefix_merging"] < 0.75 * rows["per_request"], rows
    assert [s["loss"] for s in pm["steps"]] == pytest.approx(
        [s["loss"] for s in pr["steps"]], rel=1e-4, abs=1e-6
    )
    assert pr["setup"]["sessions"] == tree["setup"]["sessions"] == 8
    assert pr["setup"]["calls"] == tree["setup"]["calls"] > 8
    assert [s["step"] for s in pr["steps"]] == [s["step"] for s in tree["steps"]] == [0, 1]
    for a, b in zip(pr["steps"], tree["steps"], strict=True):
        # the same samples: the same calls, the same loss tokens, the same loss
        assert a["per_request_rows"] == b["per_request_rows"] > 0
        assert a["loss_rows"] == b["loss_rows"] > 0
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert 0 < b["rows"] < a["rows"] <= a["per_request_rows"]
        assert a["step_seconds"] > 0 and b["step_seconds"] > 0 and b["train_start"] >= 0
    assert not pr.get("gpu") or pr["setup"]["device"] == "cuda"  # samples only where NVML sees a GPU

    report = (out / "REPORT.md").read_text()
    rows_pr = sum(s["rows"] for s in pr["steps"])
    rows_tree = sum(s["rows"] for s in tree["steps"])
    assert f"{rows_pr / rows_tree:.2f}x" in report  # the rows ratio, as recorded
    assert "floe-bench e2e -name e2e-test" in report
    assert "Same samples: every strategy trained per_request's loss tokens" in report
    for png in ("step_seconds.png", "rows_per_step.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(out / "REPORT.md") in r.stdout


def test_replay_words_are_single_tokens() -> None:
    """Every word the replay turns a corpus token into is one token of the reference
    server's tokenizer, so replayed turns keep their corpus lengths."""
    import re

    from floe_refserver.tokenizer import load_tokenizer

    src = (ROOT / "benchmarks" / "e2e" / "replay.go").read_text()
    m = re.search(r"var vocabulary = strings\.Fields\(`(.*?)`\)", src, re.S)
    assert m, "the replay's word list moved"
    words = m.group(1).split()
    tok = load_tokenizer()
    assert len(set(words)) == len(words) >= 128
    assert [w for w in words if len(tok.encode(" " + w)) != 1 or len(tok.encode(w)) != 1] == []
    assert len(tok.encode(" ".join(words))) == len(words)
