"""floe_stack's build of floe stamps the checkout's commit, so that `floe version` and
floe's start-up line name what is running."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import REPO


def test_built_floe_names_its_commit(floe_bin: Path) -> None:
    if os.environ.get("FLOE_BIN"):
        return  # a given binary was built elsewhere; there is nothing of ours to check
    want = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    got = subprocess.run([str(floe_bin), "version"], capture_output=True, text=True, check=True).stdout
    assert got == f"floe {want}\n"
