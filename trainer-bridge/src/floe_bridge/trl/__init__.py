"""floe as the rollout source of Hugging Face TRL's ``AsyncGRPOTrainer`` (TRL 1.16,
``trl.experimental.async_grpo``). See docs/trl.md.

* :class:`FloeRolloutWorker` implements TRL's ``RolloutWorkerProtocol``: it reads floe's
  steps over Flight and puts one ``RolloutSample`` per recorded call on ``rollout_buffer``.
* :class:`FloeWeightTransfer` wraps any ``WeightTransferProtocol`` (TRL's NCCL client, or a
  no-op) and pauses floe's proxy around it, so no harness call straddles a weight swap.
* :func:`to_trl_tree` converts a floe micro-batch into the tensors TRL's tree attention and
  ``compute_loss`` take (what ``TreeRow.pack()`` returns), and :class:`FloeAsyncGRPOTrainer`
  is the smallest subclass that trains ``AsyncGRPOTrainer`` on floe-packed rows.
* :func:`register_cpu_tree_attention` registers, under TRL's attention name, an SDPA
  implementation of TRL's tree attention (TRL's own one needs FA3 kernels from the Hub).

The worker and weight sync live in :mod:`.worker`, the converter in :mod:`.packing`, the
CPU attention in :mod:`.attention` and the trainer subclass in :mod:`.trainer`. Importing
this package needs neither trl nor torch (the extra ``trl`` brings them): the trainer
subclass, which subclasses TRL's, is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .attention import TREE_ATTENTION, cpu_tree_attention, register_cpu_tree_attention, use_cpu_tree_attention
from .packing import CallPath, TreeTensors, call_paths, mask_other_temperatures, to_trl_tree, tree_terms
from .worker import FloeRolloutWorker, FloeWeightTransfer, NoWeightTransfer

if TYPE_CHECKING:
    from .trainer import FloeAsyncGRPOTrainer

__all__ = [
    "CallPath",
    "TreeTensors",
    "call_paths",
    "to_trl_tree",
    "FloeRolloutWorker",
    "FloeWeightTransfer",
    "NoWeightTransfer",
    "FloeAsyncGRPOTrainer",
    "register_cpu_tree_attention",
    "use_cpu_tree_attention",
    "tree_terms",
    "cpu_tree_attention",
    "TREE_ATTENTION",
    "mask_other_temperatures",
]


def __getattr__(name: str) -> object:
    if name == "FloeAsyncGRPOTrainer":
        from .trainer import FloeAsyncGRPOTrainer

        return FloeAsyncGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
