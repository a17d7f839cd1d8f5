"""floe_bridge.verl's row layouts on hand-made call records: what a session row and call rows
hold where calls extend each other, where the harness rewrote its context, with an
untrainable call, and with an n > 1 call."""

from __future__ import annotations

from typing import Any

import pytest

from floe_bridge.verl import FloeSettings, call_rows, session_row


def call(
    index: int, prompt: list[int], resp: list[int], *, choice: int = 0, trainable: bool = True
) -> dict[str, Any]:
    return {"index": index, "choice": choice, "prompt_ids": prompt, "response_ids": resp,
            "logprobs": [-0.5 - t / 100 for t in resp], "trainable": trainable}


def test_session_row_merges_extending_calls() -> None:
    calls = [call(0, [1, 2], [3, 4]), call(1, [1, 2, 3, 4, 9, 9], [5]),
             call(2, [1, 2, 3, 4, 9, 9, 5, 8], [6, 7])]
    r = session_row(calls)
    assert r.prompt_ids == [1, 2]
    assert r.response_ids == [3, 4, 9, 9, 5, 8, 6, 7]
    assert r.response_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert r.logprobs == pytest.approx([-0.53, -0.54, 0, 0, -0.55, 0, -0.56, -0.57])
    assert r.calls == [0, 1, 2] and r.left_out == [] and r.num_turns == 7


def test_session_row_restarts_where_the_context_was_rewritten() -> None:
    # Call 1 dropped call 0's answer (a summarising harness): the row keeps the last chain.
    calls = [call(0, [1, 2], [3, 4]), call(1, [1, 2, 7], [5]), call(2, [1, 2, 7, 5, 6], [8])]
    r = session_row(calls)
    assert r.prompt_ids == [1, 2, 7] and r.response_ids == [5, 6, 8] and r.response_mask == [1, 0, 1]
    assert r.calls == [1, 2] and r.left_out == [0]


def test_untrainable_call_is_context_only() -> None:
    calls = [call(0, [1], [2, 3], trainable=False), call(1, [1, 2, 3, 4], [5])]
    r = session_row(calls)
    assert r.response_ids == [2, 3, 4, 5] and r.response_mask == [0, 0, 0, 1]
    assert r.logprobs == pytest.approx([0, 0, 0, -0.55])


def test_other_choices_are_left_out() -> None:
    calls = [call(0, [1], [2]), call(0, [1], [3], choice=1), call(1, [1, 2, 4], [5])]
    r = session_row(calls)
    assert r.response_ids == [2, 4, 5] and r.left_out == [0]  # choice 1 of call 0
    rows = call_rows(calls)
    assert [x.calls for x in rows] == [[0], [1]]
    assert rows[1].prompt_ids == [1, 2, 4] and rows[1].response_mask == [1]


def test_settings() -> None:
    s = FloeSettings.from_config({"control_url": "http://h:1", "layout": "call", "runner": "m:f"})
    assert (s.control_url, s.layout, s.runner) == ("http://h:1", "call", "m:f")
    with pytest.raises(ValueError, match="layout"):
        FloeSettings.from_config({"layout": "tree"})
    with pytest.raises(ValueError, match="unknown"):
        FloeSettings.from_config({"control": "x"})
