"""floe_bridge: the trainer side of floe.

This package needs only pyarrow and numpy: the Arrow schemas, the micro-batch view and the
Flight client. The torch parts are submodules that import torch: ``floe_bridge.torch_ops``
(tensors, tree masks, log-prob gather, GRPO loss), ``floe_bridge.hf`` (scoring with a
Hugging Face ``transformers`` causal LM) and ``floe_bridge.recipe`` (one GRPO training step
over a step's micro-batches).
"""

from .batch import (
    MicroBatch,
    MicroBatchMeta,
    context_rows,
    dense_mask,
    validate_tree,
    visible_rows,
)
from .client import (
    BadRequest,
    FloeClient,
    FloeError,
    NotReady,
    ProtocolError,
    Step,
    StepCommitted,
    StepInfo,
    StepNotFound,
    Unauthenticated,
    translate_error,
)
from .schema import (
    METADATA_FIELDS,
    METADATA_KEY,
    MICRO_BATCH_SCHEMA,
    SAMPLE_SCHEMA,
    check_schema,
)

__all__ = [
    "MICRO_BATCH_SCHEMA",
    "SAMPLE_SCHEMA",
    "METADATA_KEY",
    "METADATA_FIELDS",
    "check_schema",
    "MicroBatch",
    "MicroBatchMeta",
    "dense_mask",
    "visible_rows",
    "context_rows",
    "validate_tree",
    "FloeClient",
    "StepInfo",
    "Step",
    "FloeError",
    "StepCommitted",
    "StepNotFound",
    "NotReady",
    "Unauthenticated",
    "BadRequest",
    "ProtocolError",
    "translate_error",
]

__version__ = "0.1.0"
