"""floe's micro-batches in TRL's tree layout (docs/trl.md): the sequences of a tree
micro-batch, the tensors ``TreeRow.pack()`` returns, and the rows TRL's one temperature
cannot score. Needs numpy; torch only for :func:`to_trl_tree`, imported when called.

How calls are recovered from a tree micro-batch
-----------------------------------------------
A micro-batch is a trie, not a list of sequences. A *leaf* is a loss row with no loss row of
the same sample (session) below it; walking ``pred_idx`` from a leaf to its root gives the
token path the inference server conditioned on. Each loss row is claimed by exactly one leaf
of its own sample (the first, in row order); on every other path it is context. So the
samples carry every loss term of the micro-batch exactly once, each with its exact context,
old log-prob and advantage: the same terms as ``per_request``. The walk works for every
strategy (``tree``, ``prefix_merging``, ``per_request``), so floe's default layout is kept
and nothing asks floe for ``per_request``. A recovered sample is not always one recorded
call: two calls of a session whose second prompt is exactly the first prompt + response
become one sample, and a call cut across micro-batches becomes two (its first part is the
second's context). The loss terms are the same either way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import numpy.typing as npt

from ..batch import MicroBatch

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: ``TreeRow.pack()``'s tensors by name (input_ids, position_ids, shift_labels, the tree_*
#: index tensors, token_index, old_log_probs, advantages, segment_id)
TreeTensors: TypeAlias = "dict[str, torch.Tensor]"

#: a row of the re-shaped trie: (floe row, its child nodes in pre-order)
_Node: TypeAlias = "tuple[int, list[_Node]]"


@dataclass(frozen=True)
class CallPath:
    """One recovered sequence: the rows root..leaf, and which of them it trains."""

    rows: npt.NDArray[np.int64]  # root first, the leaf last
    trained: npt.NDArray[np.bool_]  # per row of ``rows``: a loss term this sequence carries
    sample_idx: int  # floe's sample (session) index


def is_padding(mb: MicroBatch) -> npt.NDArray[np.bool_]:
    """The padding rows: alone (no predecessor, no descendant) and outside the loss."""
    n = mb.num_rows
    idx = np.arange(n)
    lone = (mb.subtree_end == idx + 1) & (mb.pred_idx < 0) & (mb.loss_mask == 0)
    return np.asarray(lone, dtype=bool)


def call_paths(mb: MicroBatch) -> list[CallPath]:
    """The sequences of a micro-batch, one per leaf (see the module doc), in row order."""
    pred = mb.pred_idx.astype(np.int64)
    loss = mb.loss_mask.astype(bool)
    sidx = mb.sample_idx.astype(np.int64)
    n = mb.num_rows
    # a loss row is a leaf when no loss row of the same sample has it as its predecessor
    has_child = np.zeros(n, dtype=bool)
    child = np.flatnonzero(loss & (pred >= 0))
    same = sidx[child] == sidx[pred[child]]
    has_child[pred[child][same & loss[pred[child]]]] = True
    leaves = np.flatnonzero(loss & ~has_child)
    claimed = np.zeros(n, dtype=bool)
    out: list[CallPath] = []
    for leaf in leaves.tolist():
        path = []
        r = leaf
        while r >= 0:
            path.append(r)
            r = int(pred[r])
        rows = np.asarray(path[::-1], dtype=np.int64)
        trained = loss[rows] & (sidx[rows] == sidx[leaf]) & ~claimed[rows]
        claimed[rows[trained]] = True
        out.append(CallPath(rows, trained, int(sidx[leaf])))
    if int(claimed.sum()) != int(loss.sum()):  # pragma: no cover - a malformed micro-batch
        raise ValueError(f"{int(loss.sum()) - int(claimed.sum())} loss rows are on no leaf's path")
    return out


# --- the converter: floe micro-batch -> TRL tree tensors ---------------------------------


def to_trl_tree(mb: MicroBatch) -> TreeTensors:
    """The tensors ``TreeRow.pack()`` returns, from a floe micro-batch (same keys, dtypes).

    floe's rows keep their DFS pre-order; segments are the maximal unary chains; each loss
    row's ``token_index`` is its ``pred_idx`` (as a packed position). TRL labels a position
    with one next token (``shift_labels``), while floe's trie may branch right after a row
    into two *trained* tokens (two sessions sampling differently after a shared prompt).
    Such a row is forwarded once per distinct trained next token (a copy at the same depth,
    on the same path), which is what ``TreeRow`` does by keying nodes on (token, next
    token). Padding rows are dropped. ``segment_id`` numbers the sequences of
    :func:`call_paths`.
    """
    import torch

    pad = is_padding(mb)
    n = mb.num_rows
    pred = mb.pred_idx.astype(np.int64)
    loss = mb.loss_mask.astype(bool)
    ids = mb.input_ids.astype(np.int64)
    children: list[list[int]] = [[] for _ in range(n)]
    roots: list[int] = []
    for r in range(n):
        if pad[r]:
            continue
        (roots if pred[r] < 0 else children[int(pred[r])]).append(r)
    # sequence (segment_id) of each loss term
    seq_of = np.full(n, -1, dtype=np.int64)
    for i, cp in enumerate(call_paths(mb)):
        seq_of[cp.rows[cp.trained]] = i

    # copies[r]: the nodes row r becomes; a node is (row, child nodes). Children follow
    # their parent in pre-order, so a reverse sweep builds every child before its parent.
    copies: list[list[_Node]] = [[] for _ in range(n)]
    for r in range(n - 1, -1, -1):
        if pad[r]:
            continue
        untrained: list[_Node] = []
        by_label: dict[int, list[_Node]] = {}
        for c in children[r]:
            (by_label.setdefault(int(ids[c]), []) if loss[c] else untrained).extend(copies[c])
        groups = list(by_label.values()) or [[]]
        groups[0] = untrained + groups[0] if untrained else groups[0]
        # keep pre-order among a copy's children
        copies[r] = [(r, sorted(g, key=lambda node: node[0])) for g in groups]
        for c in children[r]:
            copies[c] = []  # placed; free
    top = sorted((node for r in roots for node in copies[r]), key=lambda node: node[0])

    input_ids: list[int] = []
    position_ids: list[int] = []
    offsets, cu_k, kv_index = [0], [0], []
    paths: list[list[int]] = []
    terms: list[tuple[int, int]] = []  # (packed position of the predecessor, row)
    seen: set[int] = set()
    stack: list[tuple[_Node, int | None, int | None]] = [
        (node, None, None) for node in reversed(top)
    ]
    while stack:
        node, parent_seg, parent_pos = stack.pop()
        seg = len(paths)
        start = len(input_ids)
        prev = parent_pos
        while True:
            row, kids = node
            pos = len(input_ids)
            input_ids.append(int(ids[row]))
            position_ids.append(int(mb.position_ids[row]))
            if loss[row] and row not in seen:
                seen.add(row)
                assert prev is not None, "a loss row at a root"
                terms.append((prev, row))
            prev = pos
            if len(kids) != 1:
                break
            node = kids[0]
        offsets.append(len(input_ids))
        paths.append(
            (paths[parent_seg] if parent_seg is not None else []) + list(range(start, len(input_ids)))
        )
        kv_index.extend(paths[-1])
        cu_k.append(len(kv_index))
        stack.extend((kid, seg, prev) for kid in reversed(kids))

    shift_labels = [-100] * len(input_ids)
    for p, row in terms:
        shift_labels[p] = int(ids[row])
    terms.sort(key=lambda t: (seq_of[t[1]], t[1]))
    rows = [row for _, row in terms]
    return {
        "input_ids": torch.tensor(input_ids),
        "position_ids": torch.tensor(position_ids),
        "shift_labels": torch.tensor(shift_labels),
        "tree_kv_index": torch.tensor(kv_index, dtype=torch.long),
        "tree_cu_seqlens_q": torch.tensor(offsets, dtype=torch.int32),
        "tree_cu_seqlens_k": torch.tensor(cu_k, dtype=torch.int32),
        "tree_max_seqlens": torch.tensor(
            [max(b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)), max(map(len, paths))]
        ),
        "token_index": torch.tensor([p for p, _ in terms], dtype=torch.long),
        "old_log_probs": torch.tensor(mb.old_logprobs[rows].astype(np.float32)),
        "advantages": torch.tensor(mb.advantages[rows].astype(np.float32)),
        "segment_id": torch.tensor(seq_of[rows], dtype=torch.long),
    }


def tree_terms(packed: Mapping[str, torch.Tensor]) -> list[tuple[tuple[int, ...], int, float, float]]:
    """The loss terms of a ``TreeRow.pack()``-shaped dict: (context token ids, target,
    old log-prob, advantage) per term, the context read off the segment's K/V path."""
    ids = packed["input_ids"].tolist()
    kv = packed["tree_kv_index"].tolist()
    cq = packed["tree_cu_seqlens_q"].tolist()
    ck = packed["tree_cu_seqlens_k"].tolist()
    labels = packed["shift_labels"].tolist()
    seg_of = np.searchsorted(np.asarray(cq), np.arange(len(ids)), side="right") - 1
    out: list[tuple[tuple[int, ...], int, float, float]] = []
    for p, lp, adv in zip(
        packed["token_index"].tolist(),
        packed["old_log_probs"].tolist(),
        packed["advantages"].tolist(),
        strict=True,
    ):
        s = int(seg_of[p])
        end = ck[s + 1] - (cq[s + 1] - 1 - p)
        out.append((tuple(ids[i] for i in kv[ck[s]:end]), labels[p], lp, adv))
    return out


# --- one temperature --------------------------------------------------------------------


def mask_other_temperatures(mb: MicroBatch, temperature: float, step: int) -> MicroBatch:
    """``mb`` with its loss rows sampled at another temperature than ``temperature`` (TRL's
    ``args.temperature``) taken out of the loss: TRL divides every row's logits by that one
    value, so such a row's ratio would compare two different distributions. They are
    masked, with a warning, rather than refused: under ``-sampling record`` the harness
    picks its temperature, and a refused step would be served again after every restart,
    so one call could stop training for good (docs/security.md). Their tokens still count
    in the step's ``loss_tokens_global``."""
    loss = mb.loss_mask.astype(bool)
    # the column is float32: compare at its precision
    off = loss & ~np.isclose(mb.temperature.astype(np.float64), temperature, rtol=1e-6, atol=0.0)
    if not bool(off.any()):
        return mb
    got = ", ".join(f"{x:.6g}" for x in sorted(set(mb.temperature[off].astype(np.float64).tolist())))
    log.warning(
        "floe step %d: %d loss tokens were sampled at temperature %s, but TRL scores every sample at its "
        "args.temperature = %g: they are left out of the loss (run floe with -sampling force, or set TRL's "
        "temperature to the harnesses')", step, int(off.sum()), got, temperature,
    )
    mask = mb.loss_mask.copy()
    mask[off] = 0
    return dataclasses.replace(mb, loss_mask=mask)
