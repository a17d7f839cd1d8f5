from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pytest

from floe_bridge import MicroBatch, context_rows, dense_mask, validate_tree, visible_rows

from conftest import HAND, HAND_PADDING, HAND_PARENT, RandomTree, make_batch


def naive_mask(subtree_end: np.ndarray) -> np.ndarray:
    n = len(subtree_end)
    m = np.zeros((n, n), dtype=bool)
    for q in range(n):
        for k in range(n):
            m[q, k] = k <= q < subtree_end[k]
    return m


def check_visibility(mb: MicroBatch, ancestors: list[list[int]], padding: list[int]) -> None:
    mask = mb.dense_mask()
    assert mask.dtype == np.bool_
    assert mask.shape == (mb.num_rows, mb.num_rows)
    np.testing.assert_array_equal(mask, naive_mask(mb.subtree_end))
    for q in range(mb.num_rows):
        seen = np.flatnonzero(mask[q]).tolist()
        chain = context_rows(mb.pred_idx, q).tolist()
        assert chain == ancestors[q], q
        assert seen == chain + [q], q  # root first, the row itself last
        assert visible_rows(mb.subtree_end, q).tolist() == seen, q
        assert mb.position_ids[q] == len(chain), q
    for q in padding:
        assert np.flatnonzero(mask[q]).tolist() == [q]
        assert not mask[q + 1:, q].any()  # and nothing after it sees it


def hand_ancestors() -> list[list[int]]:
    out = []
    for q in range(len(HAND_PARENT)):
        chain, p = [], HAND_PARENT[q]
        while p >= 0:
            chain.append(p)
            p = HAND_PARENT[p]
        out.append(chain[::-1])
    return out


def test_hand_batch_mask(hand_batch: pa.RecordBatch) -> None:
    mb = MicroBatch.from_record_batch(hand_batch)
    check_visibility(mb, hand_ancestors(), list(HAND_PADDING))
    mask = mb.dense_mask()
    # the branches share the prompt but never see each other
    assert mask[4, :5].tolist() == [True, True, True, True, True]
    assert not mask[5:8, 3:5].any()
    assert mask[7].tolist() == [True, True, True, False, False, True, True, True, False, False]


@pytest.mark.parametrize("seed", range(25))
def test_random_tree_mask(seed: int,
                          make_random_tree: Callable[[np.random.Generator, int, int], RandomTree]) -> None:
    rng = np.random.default_rng(seed)
    tree = make_random_tree(rng, int(rng.integers(1, 60)), int(rng.integers(0, 6)))
    mb = MicroBatch.from_record_batch(make_batch(tree.columns))
    mb.validate()
    check_visibility(mb, tree.ancestors, tree.padding)


def test_dense_mask_edge_cases() -> None:
    assert dense_mask(np.zeros(0, np.int32)).shape == (0, 0)
    # a plain packed batch: two sequences of 3 with constant subtree_end per sequence
    np.testing.assert_array_equal(
        dense_mask([3, 3, 3, 6, 6, 6]),
        np.kron(np.eye(2, dtype=bool), np.tril(np.ones((3, 3), dtype=bool))),
    )
    with pytest.raises(ValueError, match="1-D"):
        dense_mask(np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="integers"):
        dense_mask(np.zeros(2, np.float32))


def test_row_helpers_bounds_and_bad_pred() -> None:
    with pytest.raises(IndexError):
        visible_rows([1, 2], 2)
    with pytest.raises(IndexError):
        context_rows([-1, 0], -1)
    with pytest.raises(ValueError, match=r"pred_idx\[1\] = 1"):
        context_rows([-1, 1], 1)  # self-loop
    assert context_rows([-1, 0, 1], 2).tolist() == [0, 1]
    assert context_rows([-1], 0).tolist() == []


@pytest.mark.parametrize(
    ("column", "row", "value", "message"),
    [
        ("subtree_end", 3, 9, r"subtree_end\[3\] = 9 runs past its parent"),
        ("subtree_end", 9, 9, r"subtree_end\[9\] = 9, expected 9 < subtree_end <= 10"),
        ("pred_idx", 5, 4, r"pred_idx\[5\] = 4, but the mask makes row 2 its parent"),
        ("pred_idx", 8, 7, r"pred_idx\[8\] = 7, but the mask makes row -1"),
        ("position_ids", 6, 6, r"position_ids\[6\] = 6, expected depth 4"),
        ("pred_idx", 0, -1, None),  # unchanged: valid
    ],
)
def test_validate_tree_names_bad_row(column: str, row: int, value: int, message: str | None) -> None:
    cols = {k: np.asarray(v) for k, v in HAND.items()}
    cols[column] = cols[column].copy()
    cols[column][row] = value
    args = (cols["subtree_end"], cols["pred_idx"], cols["position_ids"], cols["loss_mask"])
    if message is None:
        validate_tree(*args)
    else:
        with pytest.raises(ValueError, match=message):
            validate_tree(*args)


def test_validate_tree_rejects_loss_on_root() -> None:
    loss = np.asarray(HAND["loss_mask"]).copy()
    loss[0] = 1
    with pytest.raises(ValueError, match="row 0 carries loss but has no parent"):
        validate_tree(HAND["subtree_end"], HAND["pred_idx"], loss_mask=loss)
