from __future__ import annotations

import pyarrow as pa
import pytest

from floe_bridge import (
    METADATA_FIELDS,
    METADATA_KEY,
    MICRO_BATCH_SCHEMA,
    SAMPLE_SCHEMA,
    check_schema,
)


def test_micro_batch_schema_columns_in_order() -> None:
    assert [(f.name, f.type) for f in MICRO_BATCH_SCHEMA] == [
        ("input_ids", pa.int32()),
        ("position_ids", pa.int32()),
        ("subtree_end", pa.int32()),
        ("pred_idx", pa.int32()),
        ("loss_mask", pa.uint8()),
        ("old_logprobs", pa.float32()),
        ("advantages", pa.float32()),
        ("sample_idx", pa.int32()),
        ("temperature", pa.float32()),
    ]


def test_sample_schema_columns_in_order() -> None:
    assert [(f.name, f.type) for f in SAMPLE_SCHEMA] == [
        ("sample_idx", pa.int32()),
        ("session_id", pa.string()),
        ("group_id", pa.string()),
        ("task_id", pa.string()),
        ("reward", pa.float64()),
        ("advantage", pa.float32()),
        ("policy_version", pa.int64()),
        ("num_calls", pa.int32()),
        ("num_loss_tokens", pa.int64()),
        ("num_truncated_calls", pa.int32()),
    ]


def test_temperature_is_optional_and_defaults_to_one() -> None:
    """A floe from before 13.5 sends no temperature column: every row reads T = 1."""
    from floe_bridge import MicroBatch

    fields = [f for f in MICRO_BATCH_SCHEMA if f.name != "temperature"]
    arrays = [pa.array([0, 0], type=f.type) for f in fields]
    mb = MicroBatch.from_record_batch(pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields)))
    assert mb.temperature.tolist() == [1.0, 1.0] and not mb.temperature.flags.writeable


def test_metadata_key_and_fields() -> None:
    assert METADATA_KEY == b"floe"
    assert METADATA_FIELDS == (
        "step", "rank", "micro_batch", "num_micro_batches", "loss_tokens_global",
        "policy_version_min", "policy_version_max", "strategy",
    )


def test_check_schema_accepts_exact_reordered_and_extra() -> None:
    check_schema(MICRO_BATCH_SCHEMA)
    check_schema(SAMPLE_SCHEMA, SAMPLE_SCHEMA)
    fields = list(MICRO_BATCH_SCHEMA)
    check_schema(pa.schema(fields[::-1] + [pa.field("future_column", pa.int64())]))
    # nullability is not part of the contract (arrow-go fields are nullable by default)
    check_schema(pa.schema([f.with_nullable(False) for f in fields]))


def test_check_schema_rejects_wrong_type_naming_it() -> None:
    fields = [pa.field("loss_mask", pa.bool_()) if f.name == "loss_mask" else f
              for f in MICRO_BATCH_SCHEMA]
    with pytest.raises(ValueError, match=r"'loss_mask' has type bool, expected uint8"):
        check_schema(pa.schema(fields))


def test_check_schema_names_first_bad_column() -> None:
    fields = [f.with_type(pa.int64()) if f.name in ("position_ids", "sample_idx") else f
              for f in MICRO_BATCH_SCHEMA]
    with pytest.raises(ValueError, match="'position_ids'"):
        check_schema(pa.schema(fields))


def test_check_schema_rejects_missing_column_naming_it() -> None:
    schema = pa.schema([f for f in MICRO_BATCH_SCHEMA if f.name != "pred_idx"])
    with pytest.raises(ValueError, match=r"missing column 'pred_idx'"):
        check_schema(schema)


def test_check_schema_sample_table() -> None:
    schema = pa.schema([f for f in SAMPLE_SCHEMA if f.name != "reward"])
    with pytest.raises(ValueError, match="'reward'"):
        check_schema(schema, SAMPLE_SCHEMA)
    with pytest.raises(ValueError, match="'session_id'"):
        check_schema(MICRO_BATCH_SCHEMA, SAMPLE_SCHEMA)


def test_check_schema_rejects_duplicate_column() -> None:
    schema = pa.schema(list(MICRO_BATCH_SCHEMA) + [pa.field("input_ids", pa.int32())])
    with pytest.raises(ValueError, match="'input_ids' 2 times"):
        check_schema(schema)


def test_check_schema_rejects_non_schema() -> None:
    with pytest.raises(TypeError):
        check_schema(["input_ids"])
