"""The Arrow schemas floe serves to the trainer (docs/batcher.md, "Arrow").

Declared once here; everything else in the bridge refers to these objects.
"""

from __future__ import annotations

import pyarrow as pa

__all__ = [
    "MICRO_BATCH_SCHEMA",
    "SAMPLE_SCHEMA",
    "METADATA_KEY",
    "METADATA_FIELDS",
    "OPTIONAL_COLUMNS",
    "check_schema",
]

#: One record batch = one micro-batch; one row per token, rows in DFS pre-order.
MICRO_BATCH_SCHEMA: pa.Schema = pa.schema(
    [
        pa.field("input_ids", pa.int32()),  # token id
        pa.field("position_ids", pa.int32()),  # depth in the tree, 0 at a root
        pa.field("subtree_end", pa.int32()),  # k visible to q iff k <= q < subtree_end[k]
        pa.field("pred_idx", pa.int32()),  # parent row (predicts this token), -1 at roots
        pa.field("loss_mask", pa.uint8()),  # 1 on sampled tokens to train
        pa.field("old_logprobs", pa.float32()),  # rollout logprob of the sampled token
        pa.field("advantages", pa.float32()),  # the sample's advantage, 0 elsewhere
        pa.field("sample_idx", pa.int32()),  # index into the sample table, -1 if no loss
        pa.field("temperature", pa.float32()),  # sampling temperature of a loss row's call, 1 elsewhere
    ]
)

#: The step's sample table (ticket kind ``samples``): one row per sample (session).
SAMPLE_SCHEMA: pa.Schema = pa.schema(
    [
        pa.field("sample_idx", pa.int32()),
        pa.field("session_id", pa.string()),
        pa.field("group_id", pa.string()),
        pa.field("task_id", pa.string()),
        pa.field("reward", pa.float64()),
        pa.field("advantage", pa.float32()),
        pa.field("policy_version", pa.int64()),
        pa.field("num_calls", pa.int32()),
        pa.field("num_loss_tokens", pa.int64()),
        pa.field("num_truncated_calls", pa.int32()),  # calls sampled with top_p < 1, top_k > 0 or greedily
    ]
)

#: Columns a floe from before they existed does not send, with the value that means what
#: that floe meant (every call scored at T = 1; nothing flagged).
OPTIONAL_COLUMNS: dict[str, float] = {"temperature": 1.0, "num_truncated_calls": 0}

#: Record-batch metadata key; its value is a JSON object with METADATA_FIELDS.
METADATA_KEY: bytes = b"floe"

#: The keys of the ``floe`` metadata JSON, in the order docs/batcher.md ("Arrow") lists them.
METADATA_FIELDS: tuple[str, ...] = (
    "step",
    "rank",
    "micro_batch",
    "num_micro_batches",
    "loss_tokens_global",
    "policy_version_min",
    "policy_version_max",
    "strategy",
)


def check_schema(schema: pa.Schema, expected: pa.Schema = MICRO_BATCH_SCHEMA) -> None:
    """Raise ``ValueError`` naming the first column of ``expected`` that ``schema`` lacks
    or has with another type.

    Columns are matched by name, so column order and extra columns are accepted (a newer
    floe may add columns). Nullability and metadata are not compared; null *values* are
    rejected where the data is read (``MicroBatch``).
    """
    if not isinstance(schema, pa.Schema):
        raise TypeError(f"check_schema: expected a pyarrow.Schema, got {type(schema).__name__}")
    for want in expected:
        idx = schema.get_all_field_indices(want.name)
        if not idx and want.name in OPTIONAL_COLUMNS:
            continue
        if not idx:
            raise ValueError(
                f"schema is missing column {want.name!r} (expected type {want.type}); "
                f"got columns {schema.names}"
            )
        if len(idx) > 1:
            raise ValueError(f"schema has column {want.name!r} {len(idx)} times")
        got = schema.field(idx[0])
        if not got.type.equals(want.type):
            raise ValueError(
                f"column {want.name!r} has type {got.type}, expected {want.type}"
            )
