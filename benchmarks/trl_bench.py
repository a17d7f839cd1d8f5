"""floe's packer against TRL's tree packing, side by side on the same calls (make bench-trl).

TRL's planner (`TokenBudgetBatcher`) and packer (`TreeRow`, `TreeRow.pack()`) are imported
from the installed trl package (trl==1.16.*, trl.experimental.async_grpo), never copied.
floe's half runs in `floe-bench trl` (cmd/floe-bench/trl.go): it writes a corpus's
trainable calls (prompt + response tokens, the response trained, the session's GRPO
advantage), and packs the same calls with floe's batcher under every setting. A second
floe-bench, built wholly at an earlier commit (--before-bin; make bench-trl builds it at the
parent of batcher.refine), packs them at the same pass cost for the before column.

Cost model: a pass (one micro-batch on one rank) costs c rows; the cost of a plan is
tokens forwarded + c × passes, over all ranks. floe is run at each c of a grid from 0 to
B/8, and its plan at c_i must cost at most TRL's at c_i and at c_{i+1}: costs are linear
in c, so the plan then costs at most TRL's over the whole interval.

TRL's planner runs forever on an endless rollout stream; here the stream ends, so dp
sentinel samples of B fresh tokens are fed after the calls to make it emit its last
micro-batch, and are removed from it (the rows holding them are rebuilt from their other
samples with TreeRow.add, as shipped).

Lockstep bound: no packer can split a call (its response needs its whole path in one
micro-batch), and two calls x, y whose union of paths exceeds B (len x + len y - their
common prefix > B) cannot share a micro-batch. A set H of such pairwise-exclusive calls
(taken greedily, longest first) puts each in its own micro-batch, so lockstep micro-batch k
costs at least its heaviest H call, and the sum over k is least when the dp heaviest share
one k, the next dp the next: L = Σ_j cost(h_(j·dp+1)), with H sorted by cost and cost(x) =
len + AttnCost·len(len+1)/2. Any plan of total cost at most T has lockstep imbalance
Σ_k max_r / (T/dp) ≥ dp·L/T; with T floe's plan's cost this bounds every plan forwarding no
more than floe's does, whatever its passes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ATTN_COST = 1.0 / 16384  # floe's default AttnCost: rank cost = rows + AttnCost·Σ(depth+1)
SENTINEL_BASE = 1 << 30


def trl_modules():
    """Import TRL's planner and packer as shipped; say what importing needed."""
    from trl.experimental.async_grpo.async_grpo_trainer import TokenBudgetBatcher
    from trl.experimental.async_grpo.packing import TreeRow

    return TokenBudgetBatcher, TreeRow


def load_calls(prefix: str):
    index = json.loads(Path(prefix + ".json").read_text())
    tokens = np.fromfile(prefix + ".tokens", dtype="<i4")
    samples = []
    for c in index:
        n = c["prompt"] + c["response"]
        ids = torch.from_numpy(tokens[c["offset"] : c["offset"] + n].astype(np.int64))
        mask = torch.zeros(n, dtype=torch.long)
        mask[c["prompt"] :] = 1
        samples.append(
            {
                "input_ids": ids,
                "completion_mask": mask,
                "old_log_probs": torch.zeros(n),
                "advantage": c["advantage"],
                "group_id": c["group"],
            }
        )
    return samples


def run_trl(samples, budget: int, dp: int):
    TokenBudgetBatcher, TreeRow = trl_modules()
    fitting = [s for s in samples if len(s["input_ids"]) <= budget]
    sentinels = []
    for r in range(dp):
        ids = torch.arange(SENTINEL_BASE + r * budget, SENTINEL_BASE + (r + 1) * budget, dtype=torch.long)
        sentinels.append(
            {
                "input_ids": ids,
                "completion_mask": torch.zeros(budget, dtype=torch.long),
                "old_log_probs": torch.zeros(budget),
                "advantage": 0.0,
                "group_id": ("sentinel", r),
            }
        )
    metrics = defaultdict(list)
    start = time.perf_counter()
    batches = []
    for rows in TokenBudgetBatcher(fitting + sentinels, dp, budget, metrics):
        if any(isinstance(s["group_id"], tuple) for row in rows for s in row.samples):
            real = []
            for row in rows:
                kept = TreeRow()
                for s in row.samples:
                    if not isinstance(s["group_id"], tuple):
                        kept.add(s)
                real.append(kept)
            if any(row.samples for row in real):
                batches.append(real)
            break
        batches.append(rows)
    tokens = kv = loss = padded = 0
    depth = 0
    costs = []  # per micro-batch, per rank
    for rows in batches:
        padded += dp * max(len(row.tokens) for row in rows)  # the collator pads every rank's row to the longest
        mb = []
        for row in rows:
            if not row.samples:
                mb.append(0.0)
                continue
            packed = row.pack()
            n = len(row.tokens)
            tokens += n
            depth += row.load
            kv += len(packed["tree_kv_index"])
            loss += len(packed["token_index"])
            mb.append(n + ATTN_COST * row.load)
        costs.append(mb)
    seconds = time.perf_counter() - start
    passes = len(batches)
    rank = [sum(mb[r] for mb in costs) for r in range(dp)]
    total = sum(rank)
    mean = total / dp if dp else 0
    return {
        "rows": tokens,
        "padded_rows": padded,
        "micro_batches": passes * dp,
        "passes_per_rank": passes,
        "fill": tokens / (passes * dp * budget) if passes else 0,
        "imbalance": max(rank) / mean if mean else 0,
        "lockstep_imbalance": sum(max(mb) for mb in costs) / mean if mean else 0,
        "depth_sum": depth,
        "kv_gather": kv,
        "loss_terms": loss,
        "seconds": seconds,
        "dropped": len(samples) - len(fitting),
    }


def floe_bench(binary: str, corpus: str, groups: int, seed: int, budgets, dps, costs, calls: str | None, out: str,
               optional: bool = False):
    """floe's results; with optional, [] when this build cannot run the corpus (a preset
    added after the before commit)."""
    cmd = [binary, "trl", "-corpus", corpus, "-groups", str(groups), "-seed", str(seed), "-budgets",
           ",".join(map(str, budgets)), "-dp", ",".join(map(str, dps)), "-pass-costs", ",".join(costs),
           "-out", out, "-repeats", "3"]
    if calls:
        cmd += ["-calls", calls]
    env = dict(os.environ, GOMAXPROCS="1")
    done = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        # only a corpus preset the build lacks is expected; any other failure is the
        # benchmark's, and hiding it would only shrink the before column
        if optional and "unknown corpus" in done.stderr:
            print(f"  {binary}: no {corpus} corpus in this build: no before column for it", file=sys.stderr)
            return []
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(Path(out).read_text())


def parse_spec(spec: str, all_budgets):
    """config:groups[:seed][@B;B...]: a corpus, its seed (default 1), and the budgets it runs
    at (default all; @ restricts it to those, e.g. where its paths are longer than the others)."""
    spec, _, only = spec.partition("@")
    name, groups, *rest = spec.split(":")
    seed = int(rest[0]) if rest else 1
    budgets = [int(b) for b in only.split(";")] if only else all_budgets
    return spec, name, int(groups), seed, budgets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="floe-bench built from this tree")
    ap.add_argument("--before-bin", help="floe-bench built wholly at an earlier commit (make bench-trl: the parent of "
                                         "batcher.refine), run at the same c = 1024 for the before column")
    ap.add_argument("--before-ref", default="", help="that commit, for the report")
    ap.add_argument("--corpora",
                    default="cpu:32,medium:4,medium:16,default:4@65536,default:8@65536,medium:6:7@16384,longtool:2@65536",
                    help="config:groups[:seed][@B;B...], comma-separated; @ restricts a corpus to those budgets")
    ap.add_argument("--floe-only", default="default:32@65536",
                    help="corpora packed by floe alone, before and after (too large for TRL's Python planner here)")
    ap.add_argument("--budgets", default="16384,65536")
    ap.add_argument("--dp", default="1,8,16")
    ap.add_argument("--work", default="/tmp/floe-trl-bench")
    ap.add_argument("--out", default="benchmarks/results/trl/REPORT.md")
    ap.add_argument("--json", default="benchmarks/results/trl/results.json")
    ap.add_argument("--core", type=int, default=-1, help="the core to pin TRL and floe to (default: the lowest)")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from --json")
    ap.add_argument("--reuse-trl", default="",
                    help="an earlier results JSON: take TRL's figures from it for every setting it has on the same "
                         "calls (same corpus, call and token counts), instead of running TRL's planner again")
    args = ap.parse_args()
    if args.report_only:
        Path(args.out).write_text(report(json.loads(Path(args.json).read_text()), args))
        return 0
    try:
        core = args.core if args.core >= 0 else min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})  # one core, as floe-bench's GOMAXPROCS=1
    except (AttributeError, OSError):
        pass
    budgets = [int(b) for b in args.budgets.split(",")]
    dps = [int(d) for d in args.dp.split(",")]
    fracs = ["0", "1/64", "1/32", "1/16", "1/8"]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    import trl

    results = {"trl_version": trl.__version__, "before_ref": args.before_ref, "settings": []}
    earlier = {}
    if args.reuse_trl:
        old = json.loads(Path(args.reuse_trl).read_text())
        if old["trl_version"] == trl.__version__:
            earlier = {(o["corpus"], o["calls"], o["tokens"], o["budget"], o["dp"]): o["trl"] for o in old["settings"]}
    all_budgets = budgets
    for spec in args.corpora.split(","):
        spec, name, groups, seed, budgets = parse_spec(spec, all_budgets)
        prefix = str(work / spec.replace(":", "-"))
        after = floe_bench(args.bin, name, groups, seed, budgets, dps, fracs + ["1024"], prefix, prefix + ".after.json")
        before = floe_bench(args.before_bin, name, groups, seed, budgets, dps, ["1024"], None, prefix + ".before.json",
                            optional=True) if args.before_bin else []
        samples = load_calls(prefix)
        exclusive = {b: exclusive_costs(samples, b) for b in budgets}
        ntok = sum(len(s["input_ids"]) for s in samples)
        print(f"{spec}: {len(samples)} calls, {ntok} tokens", file=sys.stderr)
        for b in budgets:
            for dp in dps:
                t = earlier.get((spec, len(samples), ntok, b, dp))
                if t is not None:
                    t = dict(t, reused=True)  # TRL's planner is deterministic: the same calls give the same plan
                else:
                    t = run_trl(samples, b, dp)
                f = [r for r in after if r["budget"] == b and r["dp"] == dp]
                bf = [r for r in before if r["budget"] == b and r["dp"] == dp]
                print(f"  B={b} dp={dp}: trl {t['rows']} rows {t['passes_per_rank']} passes {t['seconds']:.1f}s; "
                      f"floe {f[0]['rows']} rows {f[0]['passes_per_rank']} passes", file=sys.stderr)
                bound = lockstep_bound(exclusive[b], dp, next((r for r in f if r["pass_cost"] == 1024), None))
                results["settings"].append({"corpus": spec, "calls": len(samples), "tokens": ntok, "budget": b, "dp": dp,
                                            "trl": t, "floe": f, "before": bf, "lockstep_bound": bound})
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(results, indent=1))
    for spec in filter(None, args.floe_only.split(",")):
        spec, name, groups, seed, bs = parse_spec(spec, all_budgets)
        prefix = str(work / spec.replace(":", "-"))
        after = floe_bench(args.bin, name, groups, seed, bs, dps, ["0", "1024", "1/8"], None, prefix + ".after.json")
        before = floe_bench(args.before_bin, name, groups, seed, bs, dps, ["0", "1024", "1/8"], None,
                            prefix + ".before.json", optional=True) if args.before_bin else []
        results.setdefault("floe_only", []).append({"corpus": spec, "after": after, "before": before})
        Path(args.json).write_text(json.dumps(results, indent=1))
    Path(args.out).write_text(report(results, args))
    return 0


def exclusive_costs(samples, budget: int) -> list[float]:
    """Costs of a set of calls no two of which fit one micro-batch of budget rows (see the
    module's docstring), heaviest first."""
    seqs = sorted((s["input_ids"].numpy() for s in samples if len(s["input_ids"]) <= budget), key=len, reverse=True)
    chosen: list = []
    for x in seqs:
        if 2 * len(x) <= budget and chosen and 2 * len(chosen[-1]) <= budget:
            break  # two calls of at most B/2 always fit together: H holds at most one
        exclusive = True
        for h in chosen:
            n = len(x)  # chosen calls are at least as long
            diff = np.flatnonzero(h[:n] != x)
            common = int(diff[0]) if len(diff) else n
            if len(x) + len(h) - common <= budget:
                exclusive = False
                break
        if exclusive:
            chosen.append(x)
    return sorted((len(x) + ATTN_COST * len(x) * (len(x) + 1) / 2 for x in chosen), reverse=True)


def lockstep_bound(exclusive: list[float], dp: int, floe) -> float | None:
    """The lockstep imbalance no plan of at most floe's cost can go below (module docstring)."""
    if floe is None or floe.get("error") or dp < 2:
        return None
    # floe's cost: padded rows, plus AttnCost·Σ(depth+1) with each padding row counted once.
    total = floe["padded_rows"] + ATTN_COST * (floe["depth_sum"] + floe["padded_rows"] - floe["rows"])
    lower = sum(exclusive[j] for j in range(0, len(exclusive), dp))
    return max(1.0, dp * lower / total)


def cost(r, c, padded=False):
    return (r.get("padded_rows", r["rows"]) if padded else r["rows"]) + c * r["micro_batches"]


def dominance(s, padded=False):
    """floe's plan at c_i costs at most TRL's at c_i and c_{i+1} (so over [c_i, c_{i+1}])."""
    t = s["trl"]
    grid = sorted((r for r in s["floe"] if r["pass_cost"] <= s["budget"] / 8 and not r.get("error")),
                  key=lambda r: r["pass_cost"])
    ok = True
    worst = float("inf")
    for i, r in enumerate(grid):
        ends = [r["pass_cost"]] + ([grid[i + 1]["pass_cost"]] if i + 1 < len(grid) else [])
        for c in ends:
            margin = cost(t, c, padded) / cost(r, c, padded)
            worst = min(worst, margin)
            ok &= cost(r, c, padded) <= cost(t, c, padded)
    return ok, worst


def report(res, args) -> str:
    out = ["# floe's packer against TRL's tree packing", ""]
    out.append(f"Command: `make bench-trl` (`benchmarks/trl_bench.py --corpora {args.corpora} --floe-only {args.floe_only} --budgets {args.budgets} "
               f"--dp {args.dp}`), trl {res['trl_version']} as installed (TokenBudgetBatcher + TreeRow.pack(), imported, "
               f"not copied). Before: floe-bench built wholly at {res['before_ref'] or '(none)'} (git archive, unmodified), "
               f"run at the same c = 1024 as after.")
    out.append("")
    out.append("Tokens are rows forwarded over all ranks, padding excluded (with padding in brackets); "
               "passes are micro-batches per rank; cost = tokens + c × passes over all ranks; imbalance is rank cost "
               "max/mean over the step, lockstep imbalance Σ_k max_r cost(rank r's micro-batch k) / Σ_k mean_r, both "
               "on cost = rows + Σ(depth+1)/16384 (floe's default rank cost). K/V gather: TRL's len(tree_kv_index). "
               "Pack time: planning and packing (TRL: TokenBudgetBatcher + TreeRow.pack(); floe: reconstruct, pack, "
               "encode every Arrow micro-batch), one core each, in one run.")
    reused = sum(bool(s["trl"].get("reused")) for s in res["settings"])
    if reused:
        out.append("")
        out.append(f"TRL's figures for {reused} of the {len(res['settings'])} settings (their time ratio marked †) come from "
                   "an earlier run's results (`--reuse-trl`): the same TRL version on the same calls (corpus, call "
                   "and token counts checked), and TRL's planner is deterministic, so only its time is from another run.")
    out.append("")
    doms = [dominance(s) for s in res["settings"] if any(not r.get("error") for r in s["floe"])]
    lock = []
    for s in res["settings"]:
        for r in s["floe"]:
            if not r.get("error") and s["dp"] > 1 and r["passes_per_rank"] >= 4:
                lock.append((r["lockstep_imbalance"], r["pass_cost"], s["corpus"], s["budget"], s["dp"]))
    out.append("## Summary")
    out.append("")
    out.append(f"- Dominance: in {sum(ok for ok, _ in doms)} of {len(doms)} settings floe's cost (tokens + c × passes) "
               f"is at most TRL's for every c in [0, B/8]; the smallest TRL/floe cost ratio over all settings and c is "
               f"{min((w for _, w in doms), default=float('nan')):.3f}.")
    dflt = list({(x[2], x[3], x[4]): x for x in lock if x[1] == 1024}.values())  # one per setting
    worst = max(dflt, default=None)
    per_dp = "; ".join(f"dp {dp}: max {max(x[0] for x in dflt if x[4] == dp):.3f} over "
                       f"{sum(x[4] == dp for x in dflt)} settings" for dp in sorted({x[4] for x in dflt}))
    over = [x for x in dflt if x[0] > 1.05]
    bounds = {(s["corpus"], s["budget"], s["dp"]): s.get("lockstep_bound") for s in res["settings"]}
    why = "; ".join(f"{x[2]} B = {x[3]} dp {x[4]}: {x[0]:.3f}, bound {bounds[x[2:]]:.3f}" for x in over
                    if bounds.get(x[2:]) is not None)
    out.append(f"- Lockstep imbalance where ranks get ≥ 4 micro-batches each, at the default c = 1024: {per_dp}"
               + (f" (the worst: {worst[2]}, B = {worst[3]}, dp {worst[4]})" if worst else "")
               + f"; {len(over)} above the 1.05 target" + (f" ({why}: the lower bound below, which no plan "
                                                           f"forwarding at most floe's cost can beat)" if why else "")
               + f". Over every c of the grid, max "
               f"{max((x[0] for x in lock), default=float('nan')):.3f} (c = 0 never splits a tree "
               f"that fits, so levelling there moves only whole pieces).")
    trl_lock = [(s["trl"]["lockstep_imbalance"], f["lockstep_imbalance"]) for s in res["settings"] if s["dp"] > 1
                for f in s["floe"][-1:] if f["pass_cost"] == 1024 and not f.get("error") and f["passes_per_rank"] >= 4]
    out.append(f"- floe's lockstep imbalance (c = 1024) is at most TRL's in {sum(f <= t for t, f in trl_lock)} of "
               f"{len(trl_lock)} of those settings.")
    # One pair per setting: at B = 65536 the grid's 1/64 is c = 1024 again.
    pairs = [(b, f) for s in res["settings"] if s["dp"] > 1 for b in s["before"][:1]
             for f in [next((r for r in s["floe"] if r["pass_cost"] == 1024), None)]
             if f is not None and not f.get("error") and not b.get("error")]
    if pairs:
        out.append(f"- Before → after at c = 1024 ({len(pairs)} settings with dp > 1 that both builds run): lockstep "
                   f"imbalance lower in {sum(f['lockstep_imbalance'] < b['lockstep_imbalance'] - 5e-4 for b, f in pairs)}, "
                   f"equal (±0.0005) in {sum(abs(f['lockstep_imbalance'] - b['lockstep_imbalance']) <= 5e-4 for b, f in pairs)}, "
                   f"higher in {sum(f['lockstep_imbalance'] > b['lockstep_imbalance'] + 5e-4 for b, f in pairs)}; "
                   f"tokens at most before's in {sum(f['rows'] <= b['rows'] for b, f in pairs)}, passes equal in "
                   f"{sum(f['passes_per_rank'] == b['passes_per_rank'] for b, f in pairs)}.")
    padded = [dominance(s, True) for s in res["settings"] if any(not r.get("error") for r in s["floe"])]
    out.append(f"- Counting padding as forwarded tokens (floe pads each micro-batch to a multiple of 128; TRL's collator "
               f"pads every rank's row to the micro-batch's longest): {sum(ok for ok, _ in padded)} of "
               f"{len(padded)} settings dominate (smallest ratio {min((w for _, w in padded), default=float('nan')):.3f}).")
    eq = sum(all(r["loss_terms"] == s["trl"]["loss_terms"] for r in s["floe"] if not r.get("error")) for s in res["settings"])
    out.append(f"- Loss terms: TRL's `token_index` count equals floe's loss rows (every c) in {eq} of "
               f"{len(res['settings'])} settings; `go test ./batcher/` proves floe's multiset equal to per_request's.")
    out.append("- TRL's packing module and planner import on a CPU-only machine without stubs: the FA3 kernel is "
               "fetched only when `tree_attention` runs, which this benchmark never calls.")
    out.append("- TRL's planner never closes its last micro-batch on a finite stream; dp sentinel samples of B fresh "
               "tokens flush it and are removed (rows rebuilt with `TreeRow.add`).")
    out.append("")
    out.append("## Dominance: floe (after, c = default 1024) against TRL")
    out.append("")
    out.append("| corpus | B | dp | TRL tokens (padded) | floe tokens (padded) | TRL passes/rank | floe passes/rank | TRL fill | floe fill | "
               "TRL imb. | floe imb. | TRL lockstep | floe lockstep | TRL Σ(depth+1) | floe Σ(depth+1) | TRL K/V gather | "
               "loss terms TRL = floe | TRL time / floe time | cost ≤ TRL for all c in [0, B/8] (worst TRL/floe) |")
    out.append("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|---|")
    for s in res["settings"]:
        t = s["trl"]
        f = next((r for r in s["floe"] if r["pass_cost"] == 1024), None)
        if f is None or f.get("error"):
            out.append(f"| {s['corpus']} | {s['budget']} | {s['dp']} | {t['rows']} | error: {f and f.get('error')} |")
            continue
        ok, worst = dominance(s)
        eq = "yes" if t["loss_terms"] == f["loss_terms"] else f"NO ({t['loss_terms']} vs {f['loss_terms']})"
        out.append(f"| {s['corpus']} | {s['budget']} | {s['dp']} | {t['rows']} ({t.get('padded_rows', '-')}) | {f['rows']} ({f['padded_rows']}) | "
                   f"{t['passes_per_rank']} | {f['passes_per_rank']} | {t['fill']:.3f} | {f['fill']:.3f} | "
                   f"{t['imbalance']:.3f} | {f['imbalance']:.3f} | {t['lockstep_imbalance']:.3f} | {f['lockstep_imbalance']:.3f} | "
                   f"{t['depth_sum']:.3g} | {f['depth_sum']:.3g} | {t['kv_gather']:.3g} | {eq} ({t['loss_terms']}) | "
                   f"{t['seconds'] / max(f['seconds'], 1e-9):.0f}×{'†' if t.get('reused') else ''} | {'yes' if ok else 'NO'} ({worst:.3f}) |")
    out.append("")
    out.append("## floe's plan at each pass cost c against TRL (tokens + c × passes, over all ranks)")
    out.append("")
    out.append("| corpus | B | dp | c | TRL cost | floe cost | TRL/floe | floe tokens | floe passes/rank | floe lockstep |")
    out.append("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for s in res["settings"]:
        seen = set()
        for f in sorted(s["floe"], key=lambda r: r["pass_cost"]):
            if f.get("error") or f["pass_cost"] in seen:
                continue
            seen.add(f["pass_cost"])
            c = f["pass_cost"]
            tc, fc = cost(s["trl"], c), cost(f, c)
            out.append(f"| {s['corpus']} | {s['budget']} | {s['dp']} | {c:g} | {tc:.0f} | {fc:.0f} | {tc / fc:.3f} | "
                       f"{f['rows']} | {f['passes_per_rank']} | {f['lockstep_imbalance']:.3f} |")
    out.append("")
    out.append("## Lockstep imbalance at c = 1024 beside TRL, before, and the lower bound")
    out.append("")
    out.append("The bound (module docstring of benchmarks/trl_bench.py): calls no two of which fit one micro-batch "
               "each take one, so lockstep micro-batch k costs at least its heaviest such call; dp·L/T, with L the "
               "least sum of those maxima and T floe's plan's cost, bounds every plan forwarding at most floe's cost. "
               "It uses the calls only, not floe's plan.")
    out.append("")
    out.append("| corpus | B | dp | floe passes/rank | TRL lockstep | before lockstep | after lockstep | lower bound | after / bound |")
    out.append("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for s in res["settings"]:
        f = next((r for r in s["floe"] if r["pass_cost"] == 1024 and not r.get("error")), None)
        if s["dp"] < 2 or f is None:
            continue
        b = next((r for r in s["before"] if not r.get("error")), None)
        bound = s.get("lockstep_bound")
        before = f"{b['lockstep_imbalance']:.3f}" if b else "-"
        lb, ratio = (f"{bound:.3f}", f"{f['lockstep_imbalance'] / bound:.3f}") if bound else ("-", "-")
        out.append(f"| {s['corpus']} | {s['budget']} | {s['dp']} | {f['passes_per_rank']} | "
                   f"{s['trl']['lockstep_imbalance']:.3f} | {before} | {f['lockstep_imbalance']:.3f} | {lb} | {ratio} |")
    if any(s["before"] for s in res["settings"]):
        out.append("")
        out.append(f"## Before (floe-bench built at {res['before_ref']}) and after, both at c = 1024")
        out.append("")
        out.append("| corpus | B | dp | before tokens | after tokens | before passes/rank | after passes/rank | "
                   "before lockstep | after lockstep | before imb. | after imb. | before: cost ≤ TRL at c = 1024 | "
                   "after: cost ≤ TRL for all c in [0, B/8] |")
        out.append("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|---|")
        for s in res["settings"]:
            if not s["before"]:
                continue
            b = s["before"][0]
            f = next((r for r in s["floe"] if r["pass_cost"] == 1024), None)
            if b.get("error") or f is None:
                continue
            t = s["trl"]
            ok, _ = dominance(s)
            out.append(f"| {s['corpus']} | {s['budget']} | {s['dp']} | {b['rows']} | {f['rows']} | {b['passes_per_rank']} | "
                       f"{f['passes_per_rank']} | {b['lockstep_imbalance']:.3f} | {f['lockstep_imbalance']:.3f} | "
                       f"{b['imbalance']:.3f} | {f['imbalance']:.3f} | {'yes' if cost(b, 1024) <= cost(t, 1024) else 'NO'} | "
                       f"{'yes' if ok else 'NO'} |")
    if res.get("floe_only"):
        out.append("")
        out.append("## floe alone on the full default corpus, before and after (TRL's Python planner would take too long here)")
        out.append("")
        out.append("| corpus | B | dp | packer | c | tokens | passes/rank | fill | imbalance | lockstep imbalance |")
        out.append("|---|--:|--:|---|--:|--:|--:|--:|--:|--:|")
        for fo in res["floe_only"]:
            for label, rows in (("before", fo["before"]), ("after", fo["after"])):
                for r in rows:
                    if r.get("error"):
                        continue
                    out.append(f"| {fo['corpus']} | {r['budget']} | {r['dp']} | {label} | {r['pass_cost']:g} | {r['rows']} | "
                               f"{r['passes_per_rank']} | {r['fill']:.3f} | {r['imbalance']:.3f} | {r['lockstep_imbalance']:.3f} |")
    out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
