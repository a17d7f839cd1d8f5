"""Train Hugging Face TRL's AsyncGRPOTrainer from a running floe (docs/trl.md).

    python examples/train_trl.py --flight grpc+tcp://127.0.0.1:8815 --steps 2 --cpu

floe is the rollout source: harnesses call floe's proxy, floe records every call and serves
GRPO steps over Flight. By default TRL packs floe's calls with its own ``TreeRow``
(``FloeRolloutWorker``); ``--floe-packing`` trains on floe's own packed rows instead
(``FloeAsyncGRPOTrainer``). Weight syncs pause floe's proxy around the transfer
(``FloeWeightTransfer``); here the transfer itself is a no-op (wrap TRL's
``WeightTransferClient`` to push weights into vLLM). ``--model`` is a local model
directory; the default builds the reference inference server's tiny Qwen2 (its vocabulary,
``--seed``), so calls recorded from ``floe_refserver`` start at ratio 1.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--flight", default="grpc+tcp://127.0.0.1:8815", help="floe's Flight address")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps")
    ap.add_argument("--model", default=None, help="local model directory (default: the refserver's model)")
    ap.add_argument("--seed", type=int, default=0, help="the reference server's --seed (default model only)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per TRL micro-batch (TRL's own packing)")
    ap.add_argument(
        "--floe-packing", action="store_true", help="train on floe's packed rows (FloeAsyncGRPOTrainer)"
    )
    ap.add_argument(
        "--cpu", action="store_true", help="CPU: SDPA tree attention under TRL's name, no FA3 kernels"
    )
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from floe_bridge.trl import (
        FloeRolloutWorker,
        FloeWeightTransfer,
        NoWeightTransfer,
        use_cpu_tree_attention,
    )

    if args.cpu:
        use_cpu_tree_attention()
    from transformers import AutoTokenizer

    if args.model is None:
        from floe_refserver.model import build_model
        from floe_refserver.tokenizer import load_tokenizer

        tok = load_tokenizer()
        args.model = tempfile.mkdtemp(prefix="floe-trl-model-")
        build_model(len(tok), seed=args.seed).save_pretrained(args.model)
        tok.save_pretrained(args.model)
    else:
        tok = AutoTokenizer.from_pretrained(args.model)

    config = AsyncGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="floe-trl-out-"),
        max_steps=args.steps,
        learning_rate=args.lr,
        per_device_train_batch_size=args.batch,
        # TRL's fixed-count planner (its token-budget planner waits for an overflowing sample)
        token_budget=0,
        logging_steps=1,
        report_to=[],
        use_cpu=args.cpu,
        dtype="float32",
        bf16=False,  # fp32 like the reference server: bf16 autocast would move the ratio off 1
        temperature=1.0,  # floe records the sampling distribution's log-probs; score under the same
        weight_sync_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    weight_transfer = FloeWeightTransfer(NoWeightTransfer(), args.flight)
    if args.floe_packing:
        from floe_bridge.trl import FloeAsyncGRPOTrainer

        trainer = FloeAsyncGRPOTrainer(
            args.model,
            flight_uri=args.flight,
            args=config,
            processing_class=tok,
            weight_transfer=weight_transfer,
        )
    else:
        from datasets import Dataset

        worker = FloeRolloutWorker(args.flight)
        trainer = AsyncGRPOTrainer(
            args.model,
            args=config,
            processing_class=tok,
            train_dataset=Dataset.from_dict(
                {"prompt": [[{"role": "user", "content": ""}]]}
            ),  # unused: floe feeds it
            rollout_worker=worker,
            weight_transfer=weight_transfer,
        )
    trainer.train()
    for h in trainer.state.log_history:
        if "loss" in h:
            keys = ("loss", "ratio", "batch/forwarded_tokens_per_step", "batch/trained_tokens_per_step",
                    "floe/tokens_saved", "floe/data_wait_s")
            print(f"step {h['step']} " + " ".join(f"{k} {h[k]:.4g}" for k in keys if k in h))
    print(f"floe policy version {weight_transfer.policy_version}")


if __name__ == "__main__":
    main()
