from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from floe_bridge import MICRO_BATCH_SCHEMA, MicroBatch, MicroBatchMeta

from conftest import HAND, HAND_META, make_batch

DTYPES = {
    "input_ids": np.int32, "position_ids": np.int32, "subtree_end": np.int32,
    "pred_idx": np.int32, "loss_mask": np.uint8, "old_logprobs": np.float32,
    "advantages": np.float32, "sample_idx": np.int32, "temperature": np.float32,
}


def test_columns_match_input(hand_batch: pa.RecordBatch) -> None:
    mb = MicroBatch.from_record_batch(hand_batch)
    assert mb.num_rows == 10
    assert mb.num_loss_tokens == 3
    for f in MICRO_BATCH_SCHEMA:
        arr = getattr(mb, f.name)
        assert arr.dtype == DTYPES[f.name], f.name
        np.testing.assert_array_equal(arr, np.asarray(HAND[f.name], dtype=arr.dtype))
    mb.validate()


def test_columns_are_zero_copy_and_read_only(hand_batch: pa.RecordBatch) -> None:
    mb = MicroBatch.from_record_batch(hand_batch)
    for f in MICRO_BATCH_SCHEMA:
        arr = getattr(mb, f.name)
        col = hand_batch.column(f.name)
        data_buf = col.buffers()[1]
        assert data_buf is not None
        arrow_view = np.frombuffer(data_buf, dtype=arr.dtype)
        assert np.shares_memory(arr, arrow_view), f.name
        assert arr.ctypes.data == data_buf.address + col.offset * arr.itemsize, f.name
        assert not arr.flags.writeable, f.name
        with pytest.raises(ValueError):
            arr[0] = 1


def test_zero_copy_survives_ipc_round_trip(hand_batch: pa.RecordBatch) -> None:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, hand_batch.schema) as w:
        w.write_batch(hand_batch)
    buf = sink.getvalue()
    read = pa.ipc.open_stream(buf).read_next_batch()
    mb = MicroBatch.from_record_batch(read)
    stream_bytes = np.frombuffer(buf, dtype=np.uint8)
    assert np.shares_memory(mb.input_ids, stream_bytes)
    assert mb.meta == HAND_META


def test_metadata_parsed(hand_batch: pa.RecordBatch) -> None:
    mb = MicroBatch.from_record_batch(hand_batch)
    assert mb.meta == HAND_META
    assert mb.meta is not None
    assert mb.meta.loss_tokens_global == 12
    assert mb.meta.strategy == "tree"


def test_metadata_absent_is_none() -> None:
    assert MicroBatch.from_record_batch(make_batch(HAND)).meta is None


def test_explicit_custom_metadata_wins(hand_batch: pa.RecordBatch) -> None:
    other = MicroBatchMeta(**{**json.loads(HAND_META.to_json()), "micro_batch": 1})
    mb = MicroBatch.from_record_batch(hand_batch, metadata={"floe": other.to_json()})
    assert mb.meta == other


def test_metadata_round_trip_and_extra_keys_ignored() -> None:
    obj = json.loads(HAND_META.to_json())
    assert list(obj) == ["step", "rank", "micro_batch", "num_micro_batches",
                         "loss_tokens_global", "policy_version_min",
                         "policy_version_max", "strategy"]
    obj["added_later"] = [1, 2]
    assert MicroBatchMeta.from_json(json.dumps(obj)) == HAND_META


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({k: v for k, v in json.loads(HAND_META.to_json()).items() if k != "rank"}),
         "missing key 'rank'"),
        (json.dumps({**json.loads(HAND_META.to_json()), "step": "7"}), "'step' must be an integer"),
        (json.dumps({**json.loads(HAND_META.to_json()), "step": True}), "'step' must be an integer"),
        (json.dumps({**json.loads(HAND_META.to_json()), "strategy": 3}), "'strategy' must be a string"),
    ],
)
def test_bad_metadata_rejected(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MicroBatch.from_record_batch(make_batch(HAND, {b"floe": raw.encode()}))


def test_wrong_schema_rejected() -> None:
    arrays = [pa.array(HAND[f.name], type=pa.int64() if f.name == "input_ids" else f.type)
              for f in MICRO_BATCH_SCHEMA]
    batch = pa.RecordBatch.from_arrays(arrays, names=MICRO_BATCH_SCHEMA.names)
    with pytest.raises(ValueError, match="'input_ids' has type int64, expected int32"):
        MicroBatch.from_record_batch(batch)


def test_nulls_rejected() -> None:
    cols: dict[str, list[float | None]] = {k: list(v) for k, v in HAND.items()}
    cols["advantages"][4] = None
    with pytest.raises(ValueError, match="'advantages' has 1 null"):
        MicroBatch.from_record_batch(make_batch(cols))


def test_sliced_batch_is_still_zero_copy(hand_batch: pa.RecordBatch) -> None:
    part = hand_batch.slice(8, 2)  # the two padding rows: a valid forest on its own
    mb = MicroBatch.from_record_batch(part)
    np.testing.assert_array_equal(mb.input_ids, [0, 0])
    assert np.shares_memory(mb.input_ids,
                            np.frombuffer(hand_batch.column("input_ids").buffers()[1], np.int32))
