"""The packing adapter (docs/trl.md): :class:`FloeAsyncGRPOTrainer` trains TRL's
``AsyncGRPOTrainer`` on floe's packed rows instead of TRL's ``TreeRow``. This module imports
trl and torch; ``floe_bridge.trl`` imports it on first use of the class."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterable, Iterator, Sequence
from multiprocessing.queues import Queue as MPQueue
from typing import Any

import torch
from datasets import Dataset
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, IterableDataset
from transformers import (
    PreTrainedTokenizerBase,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, WeightTransferProtocol

from ..client import FloeClient, FloeError, StepNotFound
from .attention import register_cpu_tree_attention
from .packing import TreeTensors, mask_other_temperatures, to_trl_tree
from .worker import FloeWeightTransfer, NoWeightTransfer

#: a collated batch, as ``DataCollatorForRollout`` makes it
Batch = dict[str, torch.Tensor]


def _collate(packed: Sequence[TreeTensors], pad_token_id: int, global_n_tokens: float) -> Batch:
    """What ``DataCollatorForRollout`` makes of packed rows (one per data-parallel rank)."""
    padding = {
        "input_ids": pad_token_id,
        "shift_labels": -100,
        "token_index": -1,
        "tree_kv_index": -1,
        "tree_cu_seqlens_q": -1,
        "tree_cu_seqlens_k": -1,
    }
    batch = {
        key: pad_sequence([p[key] for p in packed], batch_first=True, padding_value=padding.get(key, 0))
        for key in packed[0]
    }
    batch["attention_mask"] = pad_sequence(
        [torch.ones_like(p["input_ids"]) for p in packed], batch_first=True, padding_value=0
    )
    n = len(packed)
    forward = sum(p["input_ids"].numel() for p in packed)
    seqs = sum(int(p["segment_id"].max()) + 1 if p["segment_id"].numel() else 0 for p in packed)
    batch["global_n_tokens"] = torch.full((n,), float(global_n_tokens))
    batch["global_n_forward_tokens"] = torch.full((n,), float(forward))
    batch["mean_seq_len"] = torch.full((n,), forward / max(seqs, 1))
    return batch


class _FloeStepSource:
    """The rollout worker :class:`FloeAsyncGRPOTrainer` hands TRL: it produces nothing on
    ``rollout_buffer`` (the trainer's dataloader reads floe directly) and only keeps the
    protocol's other duties."""

    def __init__(self) -> None:
        # typed as TRL's RolloutWorkerProtocol declares them (its attributes are invariant)
        self.rollout_buffer: queue.Queue[Any] | MPQueue[Any] = queue.Queue()
        self.metrics_queue: queue.Queue[Any] | MPQueue[Any] = queue.Queue()
        self.model_version = 0

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def update_model_version(self, model_version: int) -> None:
        self.model_version = int(model_version)

    def check_health(self, stale_after_s: float) -> None:
        pass


class _FloeBatches:
    """Iterable of collated TRL batches, one per floe micro-batch index of each step (its
    rows: that micro-batch of every rank). Commits a step when the next is asked for."""

    def __init__(self, trainer: FloeAsyncGRPOTrainer) -> None:
        self.trainer = trainer

    def __iter__(self) -> Iterator[Batch]:
        t = self.trainer
        client = t.floe_client
        ga = t.args.gradient_accumulation_steps
        world = t.accelerator.num_processes
        tok = t.processing_class
        if not isinstance(tok, PreTrainedTokenizerBase) or tok.pad_token_id is None:
            raise TypeError(f"FloeAsyncGRPOTrainer pads with a tokenizer's pad token, not {tok!r}")
        pad_token_id = tok.pad_token_id
        n: int | None = None
        while True:
            t0 = time.monotonic()
            try:
                info = client.step_info(n, timeout=t.floe_timeout)
            except StepNotFound:
                return
            n = info.step + 1  # read ahead by the dataloader: the step is not committed yet
            steps = [
                client.read_step(info.step, rank=r, timeout=t.floe_timeout) for r in range(info.num_ranks)
            ]
            if info.num_ranks != world or info.micro_batches_per_rank != ga:
                raise FloeError(
                    f"floe step {info.step} has {info.num_ranks} ranks x {info.micro_batches_per_rank} "
                    f"micro-batches; this trainer runs {world} processes x gradient_accumulation_steps={ga}: "
                    "start floe with "
                    f"-dp-size {world} and a token budget that forms {ga} micro-batch(es) per rank"
                )
            mbs = [
                [mask_other_temperatures(mb, t.temperature, info.step) for mb in s.micro_batches]
                for s in steps
            ]
            t.floe_wait_s += time.monotonic() - t0
            # TRL divides each micro-batch's term sum by global_n_tokens / world_size and by the
            # accumulation steps; L / ga makes the step's loss floe's token-mean over the step.
            g = info.loss_tokens_global / ga
            t.floe_pending.append(info.step)  # one optimizer step trains it; committed after it
            for k in range(ga):
                yield _collate([to_trl_tree(rank[k]) for rank in mbs], pad_token_id, g)


class _Batches(IterableDataset[Batch]):
    def __init__(self, batches: Iterable[Batch]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)


class _Wait:
    """Stands in for TRL's ``RolloutQueueDataset`` in ``_log_step_metrics`` (``wait_s``)."""

    def __init__(self, trainer: FloeAsyncGRPOTrainer) -> None:
        self.trainer = trainer

    @property
    def wait_s(self) -> float:
        return float(self.trainer.floe_wait_s)

    @wait_s.setter
    def wait_s(self, v: float) -> None:
        self.trainer.floe_wait_s = v


class _Commit(TrainerCallback):
    """Commits the oldest floe step handed out once the optimizer step that trained it ends."""

    def __init__(self, trainer: FloeAsyncGRPOTrainer) -> None:
        self.trainer = trainer

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        t = self.trainer
        if t.floe_pending and t.accelerator.is_main_process:
            step = t.floe_pending.pop(0)
            t.floe_client.commit(step)
            t.floe_committed.append(step)


class FloeAsyncGRPOTrainer(AsyncGRPOTrainer):
    """``AsyncGRPOTrainer`` trained on floe's packed rows instead of TRL's ``TreeRow``.

    The one override is ``get_train_dataloader`` (a ``transformers.Trainer`` method): it
    yields :func:`to_trl_tree` of each floe micro-batch, collated as TRL's collator does,
    so ``compute_loss`` (TRL's loss, unchanged) takes floe's layout. TRL 1.16 has no
    documented hook for a custom packer; this subclass is the smallest one. Each floe
    micro-batch is one TRL micro-batch: floe must form ``gradient_accumulation_steps``
    micro-batches per rank and ``-dp-size`` = the number of processes. The step is
    committed after its optimizer step. ``rollout_worker`` is a stub; ``weight_transfer``
    defaults to :class:`FloeWeightTransfer` around :class:`NoWeightTransfer`. ``kwargs`` go
    to ``AsyncGRPOTrainer`` (``args``, ``processing_class``, ...).
    """

    def __init__(
        self,
        model: str,
        *,
        flight_uri: str,
        floe_token: str | None = None,
        floe_timeout: float = 60.0,
        cpu_tree_attention: bool = False,
        weight_transfer: WeightTransferProtocol | None = None,
        **kwargs: Any,
    ) -> None:
        self.floe_client = FloeClient(flight_uri, floe_token, rank=0, world_size=None, timeout=floe_timeout)
        self.floe_timeout = floe_timeout
        self.floe_wait_s = 0.0
        self.floe_pending: list[int] = []  # floe steps handed to the dataloader, in order
        self.floe_committed: list[int] = []
        if weight_transfer is None:
            weight_transfer = FloeWeightTransfer(NoWeightTransfer(), flight_uri, floe_token)
        # TRL requires a dataset; the dataloader below never reads it
        kwargs.setdefault("train_dataset", Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]]}))
        super().__init__(model, rollout_worker=_FloeStepSource(), weight_transfer=weight_transfer, **kwargs)
        if cpu_tree_attention:
            register_cpu_tree_attention()
        self.add_callback(_Commit(self))

    def get_train_dataloader(self) -> DataLoader[Batch]:
        # TRL leaves the attribute unannotated (inferred None); _log_step_metrics reads its wait_s
        self._rollout_dataset = _Wait(self)  # type: ignore[assignment]
        src: Iterable[Batch] = _FloeBatches(self) if self.accelerator.is_main_process else []
        loader: DataLoader[Batch] = self.accelerator.prepare(
            DataLoader(_Batches(src), batch_size=1, collate_fn=lambda xs: xs[0], num_workers=0)
        )
        return loader
