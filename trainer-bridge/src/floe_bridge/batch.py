"""Trainer-side view of one floe micro-batch, and the tree-mask helpers.

Rows are tokens in DFS pre-order of a token forest. Row ``k`` is visible to row ``q`` iff
``k <= q < subtree_end[k]``; ``pred_idx[t]`` is the row whose output predicts token ``t``
(its parent), ``-1`` at roots and on padding rows. See docs/batcher.md, "Arrow".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from .schema import METADATA_FIELDS, METADATA_KEY, MICRO_BATCH_SCHEMA, OPTIONAL_COLUMNS, check_schema

__all__ = [
    "MicroBatch",
    "MicroBatchMeta",
    "dense_mask",
    "visible_rows",
    "context_rows",
    "validate_tree",
]

IntArray = npt.NDArray[np.int32]
#: Arrow key/value metadata: a pyarrow KeyValueMetadata or a plain mapping.
Metadata: TypeAlias = "Mapping[bytes, bytes] | Mapping[str, str] | pa.KeyValueMetadata"


@dataclass(frozen=True, slots=True)
class MicroBatchMeta:
    """The ``floe`` record-batch metadata of one micro-batch."""

    step: int
    rank: int
    micro_batch: int
    num_micro_batches: int
    #: loss rows of the whole step over all ranks (denominator of a token-mean loss)
    loss_tokens_global: int
    policy_version_min: int
    policy_version_max: int
    strategy: str
    #: rows before padding (absent from older servers: ``None``)
    rows: int | None = None

    @classmethod
    def from_json(cls, raw: str | bytes) -> MicroBatchMeta:
        """Parse the metadata JSON; raise ``ValueError`` on a missing or mistyped key.
        Unknown keys are ignored (forward compatibility)."""
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"floe metadata is not valid JSON: {e}") from e
        if not isinstance(obj, dict):
            raise ValueError(f"floe metadata must be a JSON object, got {type(obj).__name__}")
        values: dict[str, Any] = {}
        for key in METADATA_FIELDS:
            if key not in obj:
                raise ValueError(f"floe metadata is missing key {key!r}")
            v = obj[key]
            if key == "strategy":
                ok = isinstance(v, str)
            else:
                ok = isinstance(v, int) and not isinstance(v, bool)
            if not ok:
                want = "a string" if key == "strategy" else "an integer"
                raise ValueError(f"floe metadata key {key!r} must be {want}, got {v!r}")
            values[key] = v
        if "rows" in obj:  # optional: rows before padding
            rows = obj["rows"]
            if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
                raise ValueError(f"floe metadata key 'rows' must be a non-negative integer, got {rows!r}")
            values["rows"] = rows
        return cls(**values)

    @classmethod
    def from_metadata(cls, metadata: Metadata | None) -> MicroBatchMeta | None:
        """Read the ``floe`` key from Arrow key/value metadata; ``None`` when absent."""
        if metadata is None:
            return None
        for k, v in metadata.items():
            kb = k.encode() if isinstance(k, str) else k
            if kb == METADATA_KEY:
                return cls.from_json(v)
        return None

    def to_json(self) -> str:
        obj: dict[str, Any] = {k: getattr(self, k) for k in METADATA_FIELDS}
        if self.rows is not None:
            obj["rows"] = self.rows
        return json.dumps(obj, separators=(",", ":"))

    def to_metadata(self) -> dict[bytes, bytes]:
        """Key/value metadata carrying this object, for ``RecordBatch.from_arrays``."""
        return {METADATA_KEY: self.to_json().encode()}


def _column_view(batch: pa.RecordBatch, name: str) -> npt.NDArray[Any]:
    col = batch.column(name)
    if col.null_count:
        raise ValueError(f"column {name!r} has {col.null_count} null values; floe never sends nulls")
    # zero_copy_only=True: a view of the Arrow buffer (read-only), or an error, never a copy.
    view: npt.NDArray[Any] = col.to_numpy(zero_copy_only=True)
    return view


def _constant(n: int, value: float, dtype: Any) -> npt.NDArray[Any]:
    out = np.full(n, value, dtype=dtype)
    out.flags.writeable = False
    return out


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch as read-only numpy arrays that share memory with the Arrow buffers.

    Build with :meth:`from_record_batch`. The arrays keep the Arrow buffers alive.
    """

    input_ids: npt.NDArray[np.int32]
    position_ids: npt.NDArray[np.int32]
    subtree_end: npt.NDArray[np.int32]
    pred_idx: npt.NDArray[np.int32]
    loss_mask: npt.NDArray[np.uint8]
    old_logprobs: npt.NDArray[np.float32]
    advantages: npt.NDArray[np.float32]
    sample_idx: npt.NDArray[np.int32]
    #: sampling temperature of each loss row's call (1 elsewhere, and from a floe that
    #: does not send it): score with ``log_softmax(logits / temperature)``
    temperature: npt.NDArray[np.float32]
    meta: MicroBatchMeta | None
    record_batch: pa.RecordBatch

    @classmethod
    def from_record_batch(
        cls, batch: pa.RecordBatch, metadata: Metadata | None = None
    ) -> MicroBatch:
        """Validate ``batch`` against the micro-batch schema and wrap it without copying.

        ``metadata`` is the IPC message's custom metadata when the transport gives it
        separately (e.g. ``read_next_batch_with_custom_metadata``); otherwise the ``floe``
        key is looked up in the batch's schema metadata.
        """
        if not isinstance(batch, pa.RecordBatch):
            raise TypeError(f"expected a pyarrow.RecordBatch, got {type(batch).__name__}")
        check_schema(batch.schema, MICRO_BATCH_SCHEMA)
        meta = MicroBatchMeta.from_metadata(metadata)
        if meta is None:
            meta = MicroBatchMeta.from_metadata(batch.schema.metadata)
        cols = {
            f.name: _column_view(batch, f.name)
            if f.name in batch.schema.names
            else _constant(batch.num_rows, OPTIONAL_COLUMNS[f.name], f.type.to_pandas_dtype())
            for f in MICRO_BATCH_SCHEMA
        }
        return cls(meta=meta, record_batch=batch, **cols)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    def dense_mask(self) -> npt.NDArray[np.bool_]:
        """The N×N boolean attention mask of this micro-batch (see :func:`dense_mask`)."""
        return dense_mask(self.subtree_end)

    def validate(self) -> None:
        """Check the tree invariants (see :func:`validate_tree`); raise ``ValueError``."""
        validate_tree(self.subtree_end, self.pred_idx, self.position_ids, self.loss_mask)


def _as_1d(a: npt.ArrayLike, name: str) -> npt.NDArray[np.int64]:
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def dense_mask(subtree_end: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Boolean N×N mask with ``mask[q, k] = k <= q < subtree_end[k]`` (query rows, key
    columns). ``True`` means q may attend to k. O(N²) memory: for CPU and small N."""
    end = _as_1d(subtree_end, "subtree_end")
    rows = np.arange(end.shape[0], dtype=np.int64)
    q = rows[:, None]
    k = rows[None, :]
    return (k <= q) & (q < end[None, :])


def _check_row(q: int, n: int) -> int:
    q = int(q)
    if not 0 <= q < n:
        raise IndexError(f"row {q} out of range for {n} rows")
    return q


def visible_rows(subtree_end: npt.ArrayLike, q: int) -> npt.NDArray[np.int64]:
    """Rows visible to row ``q`` under the mask, ascending (root first, ``q`` last)."""
    end = _as_1d(subtree_end, "subtree_end")
    q = _check_row(q, end.shape[0])
    return np.flatnonzero(end[: q + 1] > q).astype(np.int64)


def context_rows(pred_idx: npt.ArrayLike, q: int) -> npt.NDArray[np.int64]:
    """The ancestors of row ``q``: walk ``pred_idx`` from q's parent to the root, returned
    root first (``q`` itself excluded). Raises ``ValueError`` on a parent that does not
    precede its child (which also rules out cycles)."""
    pred = _as_1d(pred_idx, "pred_idx")
    q = _check_row(q, pred.shape[0])
    chain: list[int] = []
    child, p = q, int(pred[q])
    while p != -1:
        if not 0 <= p < child:
            raise ValueError(f"pred_idx[{child}] = {p}: a parent must be -1 or a row before {child}")
        chain.append(p)
        child, p = p, int(pred[p])
    chain.reverse()
    return np.asarray(chain, dtype=np.int64)


def validate_tree(
    subtree_end: npt.ArrayLike,
    pred_idx: npt.ArrayLike,
    position_ids: npt.ArrayLike | None = None,
    loss_mask: npt.ArrayLike | None = None,
) -> None:
    """Check that the columns describe a forest laid out in DFS pre-order, consistently:

    - ``i < subtree_end[i] <= N`` and a child's subtree nests in its parent's;
    - ``pred_idx[i]`` is the nearest open ancestor (so the rows visible under the mask
      are exactly the ``pred_idx`` chain plus the row itself);
    - ``position_ids[i]`` is the depth (if given);
    - loss rows have a parent (a root token is predicted by nothing) (if given).

    Raises ``ValueError`` naming the first bad row. O(N), meant for tests and debugging.
    """
    end = _as_1d(subtree_end, "subtree_end")
    pred = _as_1d(pred_idx, "pred_idx")
    n = end.shape[0]
    if pred.shape[0] != n:
        raise ValueError(f"pred_idx has {pred.shape[0]} rows, subtree_end has {n}")
    pos = None if position_ids is None else _as_1d(position_ids, "position_ids")
    if pos is not None and pos.shape[0] != n:
        raise ValueError(f"position_ids has {pos.shape[0]} rows, subtree_end has {n}")
    if loss_mask is not None:
        loss = np.asarray(loss_mask)
        if loss.shape != (n,):
            raise ValueError(f"loss_mask has shape {loss.shape}, expected ({n},)")
        bad = np.flatnonzero((loss != 0) & (pred < 0))
        if bad.size:
            raise ValueError(f"row {int(bad[0])} carries loss but has no parent (pred_idx=-1)")
    stack: list[int] = []  # open ancestors of the current row, root first
    for i in range(n):
        e = int(end[i])
        if not i < e <= n:
            raise ValueError(f"subtree_end[{i}] = {e}, expected {i} < subtree_end <= {n}")
        while stack and int(end[stack[-1]]) <= i:
            stack.pop()
        parent = stack[-1] if stack else -1
        if int(pred[i]) != parent:
            raise ValueError(f"pred_idx[{i}] = {int(pred[i])}, but the mask makes row {parent} its parent")
        if stack and e > int(end[parent]):
            raise ValueError(
                f"subtree_end[{i}] = {e} runs past its parent's subtree_end[{parent}] = {int(end[parent])}"
            )
        if pos is not None and int(pos[i]) != len(stack):
            raise ValueError(f"position_ids[{i}] = {int(pos[i])}, expected depth {len(stack)}")
        stack.append(i)
