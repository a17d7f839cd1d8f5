#!/usr/bin/env python3
"""The demo's trainer: GRPO on the reference server's own model, from a running floe.

The loop is trainer-bridge/examples/train_grpo.py's (read this rank's micro-batches with
``FloeClient.steps()`` prefetching the next step, one ``floe_bridge.recipe.train_step``:
score each with the tree mask, token-mean GRPO loss over the step, one optimizer step;
commit, report). The one difference: the model
is the reference inference server's (``floe_refserver.model.build_model``, same
vocabulary, same seed), so the rollout log-probabilities floe recorded are this model's own:
``mismatch`` (mean |logp - rollout logp| over the loss tokens) starts at float noise and
grows only as training moves the weights away from the (never re-synced) server.

One JSON line per step on stdout, prefixed ``FLOE_STEP``; logs on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--location", default="-", help="floe Flight location; - reads it from stdin (after start-up)"
    )
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--token-budget", type=int, required=True, help="floe -token-budget (for the fill)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0, help="the reference server's --seed")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds to wait for a step")
    args = p.parse_args(argv)

    import torch

    from floe_bridge.client import FloeClient
    from floe_bridge.recipe import train_step
    from floe_refserver.model import build_model
    from floe_refserver.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    model = build_model(len(load_tokenizer()), seed=args.seed)
    model.requires_grad_(True)
    model.train()  # attention_dropout is 0: train mode scores exactly like the server's eval mode
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # torch, transformers and the model are ready: the orchestrator may start the rollouts
    print("FLOE_READY", flush=True)
    location = sys.stdin.readline().strip() if args.location == "-" else args.location
    if not location:
        return 1

    done = 0
    with FloeClient(location, rank=0, world_size=1, timeout=args.timeout) as floe:
        t_ask = time.monotonic()
        for step in floe.steps(count=args.steps):  # commits each step when the next is asked for
            if done == 0:
                # steps() finds the first step with a blocking GetFlightInfo that its
                # wait_seconds does not count: count the whole wait for the first step here
                step.wait_seconds = time.monotonic() - t_ask
            done += 1
            f = train_step(model, opt, step.micro_batches, step.loss_tokens_global, attn="sdpa")
            floe.report(step.step, rank=0, step_seconds=f.step_seconds, wait_seconds=step.wait_seconds)
            line = {
                "step": step.step,
                "loss": f.loss,
                "loss_tokens": f.loss_tokens,
                "micro_batches": f.micro_batches,
                "rows": f.rows,  # forwarded, padding included
                "real_rows": f.real_rows,  # before padding
                "fill": f.real_rows / max(f.micro_batches * args.token_budget, 1),
                "samples": step.info.num_samples,
                "wait_s": step.wait_seconds,
                "step_s": f.step_seconds,
                "mismatch": f.mismatch,
            }
            print("FLOE_STEP " + json.dumps(line), flush=True)
    if done < args.steps:
        print(f"floe has no more steps: trained {done} of {args.steps}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
