#!/usr/bin/env python3
"""Train a tiny Qwen-architecture model with GRPO from a running floe.

    python examples/train_grpo.py --location grpc+tcp://127.0.0.1:8815 --steps 3 --vocab 512

The model is built from a config (seeded, no download); use ``floe corpus-serve
-fold-vocab N`` with the same ``--vocab N`` so every token id fits. Per step it reads this
rank's micro-batches, scores each as one sequence with the tree mask
(``floe_bridge.hf.score_logprobs``), accumulates the token-mean GRPO loss over the
micro-batches (``grpo_loss`` divides by the step's ``loss_tokens_global``), takes one
optimizer step (all of it ``floe_bridge.recipe.train_step``), commits the step and reports
its timings. One line per step:

    step 0 loss 0.012345 loss_tokens 1463 rows 3120 wait_s 0.004 step_s 0.812 mismatch 5.1234

(``rows``: rows forwarded, padding included; ``wait_s``: seconds waiting for the data;
``mismatch``: mean |logp - old_logprobs| over the step's loss tokens).

torch and transformers are imported only after the arguments are parsed, so ``--help`` is
instant.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--location", default="grpc+tcp://127.0.0.1:8815", help="floe Flight location")
    p.add_argument("--token", default=None, help="floe --flight-token, if set")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (floe steps) to train")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size (floe -fold-vocab)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--attn", choices=["sdpa", "flex"], default="sdpa", help="attention implementation")
    p.add_argument(
        "--preset",
        choices=[*sorted(PRESETS), "refserver"],
        default=None,
        help="a model shape (sets --vocab --hidden --intermediate --layers --heads --kv-heads); "
        "qwen2.5-0.5b is Qwen2.5-0.5B's architecture, randomly initialised; refserver is the reference "
        "inference server's own model (its tokenizer's vocabulary, weights from --seed as the server's "
        "--seed), so rollout log-probs recorded from it match the trainer's at step 0",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="parameter dtype")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 2 x --hidden)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28)
    p.add_argument(
        "--tis-cap", type=float, default=None, help="truncated importance sampling cap (default: off)"
    )
    p.add_argument("--dual-clip", type=float, default=3.0,
                   help="dual-clip constant c for negative advantages (0: off)")
    p.add_argument("--normalizer", type=float, default=None,
                   help="divide the step's summed token losses by this constant (Dr. GRPO's: sessions "
                        "per step x max tokens per call) instead of by the step's loss tokens (the "
                        "default: step-global token mean)")
    p.add_argument("--block-size", type=int, default=128, help="FlexAttention block size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a step")
    args = p.parse_args(argv)
    if args.preset in PRESETS:
        for k, v in PRESETS[args.preset].items():
            setattr(args, k, v)
    return args


# Model shapes for --preset: Qwen2.5-0.5B's config (hidden 896, 24 layers, 14 heads, 2 KV
# heads, MLP 4864, vocabulary 151936), and the tests' tiny one.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2},
    "qwen2.5-0.5b": {
        "vocab": 151_936, "hidden": 896, "intermediate": 4864, "layers": 24, "heads": 14, "kv_heads": 2,
    },
}


def build_model(args: argparse.Namespace, device: Any) -> Any:
    import torch
    import transformers

    if args.preset == "refserver":
        from floe_refserver.model import build_model as server_model
        from floe_refserver.tokenizer import load_tokenizer

        ref = server_model(len(load_tokenizer()), seed=args.seed)
        ref.config._attn_implementation = {"sdpa": "sdpa", "flex": "flex_attention"}[args.attn]
        ref.requires_grad_(True)
        return ref.to(device=device, dtype=getattr(torch, args.dtype)).train()

    torch.manual_seed(args.seed)
    # a plain dict: transformers 4.x takes rope_theta, 5.x folds it into rope_parameters
    cfg_kwargs: dict[str, Any] = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=32_768,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )
    cfg = transformers.Qwen2Config(**cfg_kwargs)
    impl = {"sdpa": "sdpa", "flex": "flex_attention"}[args.attn]
    model = transformers.Qwen2ForCausalLM._from_config(  # type: ignore[no-untyped-call]
        cfg, attn_implementation=impl, dtype=getattr(torch, args.dtype)
    )
    return model.to(device).train()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import torch

    from floe_bridge.client import FloeClient
    from floe_bridge.recipe import LossSettings, train_step

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = build_model(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    world_size = 1  # one process; under DDP pass the world size and read this rank's share
    settings = LossSettings(
        clip_low=args.clip_low, clip_high=args.clip_high, tis_cap=args.tis_cap, world_size=world_size,
        dual_clip=args.dual_clip or None, normalizer=args.normalizer,
    )

    with FloeClient(args.location, args.token, rank=0, world_size=world_size, timeout=args.timeout) as floe:
        # steps() reads the next step while this one trains, and commits each step when the
        # loop asks for the next; it ends early if floe has no more steps.
        done = 0
        for step in floe.steps(count=args.steps):
            done += 1
            f = train_step(
                model, opt, step.micro_batches, step.loss_tokens_global,
                loss=settings, device=device, attn=args.attn, block_size=args.block_size,
            )
            floe.report(
                step.step,
                rank=0,
                peak_memory_bytes=f.peak_memory_bytes,
                step_seconds=f.step_seconds,
                wait_seconds=step.wait_seconds,
                loss=f.loss,
            )
            print(
                f"step {step.step} loss {f.loss:.6f} loss_tokens {f.loss_tokens} rows {f.rows} "
                f"wait_s {step.wait_seconds:.3f} step_s {f.step_seconds:.3f} mismatch {f.mismatch:.4f}",
                flush=True,
            )
    if done < args.steps:
        print(f"floe has no more steps: trained {done} of {args.steps}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
