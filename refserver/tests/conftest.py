"""Shared fixtures of the reference server's tests: the floe binary, built once."""

from __future__ import annotations

from pathlib import Path

import pytest

from floe_stack import build_floe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def floe_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The floe binary: $FLOE_BIN, or built from this checkout once per test session."""
    try:
        return build_floe(tmp_path_factory.mktemp("bin"), REPO)
    except RuntimeError as e:
        pytest.fail(f"the proxy tests need floe: {e}")
