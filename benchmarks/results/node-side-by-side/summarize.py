"""Tabulate one run of run.sh (beside this file): python summarize.py WORK > tables.md.

Reads the packing, proxy and Flight outputs of both builds and prints the rows the report
compares, run by run, in the order they ran."""

from __future__ import annotations

import sys
from pathlib import Path


def rows(path: Path, first: str) -> list[list[str]]:
    """The Markdown table rows of path whose first cell is first."""
    out = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells and cells[0] == first:
            out.append(cells)
    return out


def main() -> None:
    work = Path(sys.argv[1])
    refs = {side: (work / side / "ref").read_text().strip() for side in ("old", "new")}
    runs = [(i, side) for i in (1, 2) for side in ("old", "new")]
    print(f"old = {refs['old']}, new = {refs['new']}\n")

    print("| run | tree rows | tree micro-batches | tree reconstruct tok/s | tree full path tok/s | "
          "prefix_merging full path tok/s | per_request full path tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for i, side in runs:
        f = work / f"pack-{side}-{i}.txt"
        by = {r[0]: r for r in rows(f, "tree") + rows(f, "prefix_merging") + rows(f, "per_request")}
        t = by["tree"]
        print(f"| {side} {i} | {t[1]} | {t[7]} | {t[10]} | {t[11]} | {by['prefix_merging'][11]} | {by['per_request'][11]} |")

    print("\n| run | dialect | added p50 ms, non-streaming / streaming | added p99 ms | req/s, 256 streams | CPU ms per request |")
    print("|---|---|---:|---:|---:|---:|")
    for i, side in runs:
        for r in rows(work / f"proxy-{side}-{i}.txt", "floe"):
            if len(r) == 9:  # the summary table
                print(f"| {side} {i} | {r[1]} | {r[3]} | {r[4]} | {r[5]} | {r[6]} |")

    print("\n| run | 64k rows TCP MB/s | 64k rows Unix MB/s | 16k rows TCP MB/s | 16k rows Unix MB/s | memcpy MB/s (64k TCP) |")
    print("|---|---:|---:|---:|---:|---:|")
    for i, side in runs:
        f = work / f"flight-{side}-{i}.txt"
        mbs = {(r[0], r[1]): r for r in rows(f, "64k rows") + rows(f, "16k rows")}
        cells = [mbs[(s, t)][5] for s in ("64k rows", "16k rows") for t in ("tcp loopback", "unix socket")]
        print(f"| {side} {i} | {' | '.join(cells)} | {mbs[('64k rows', 'tcp loopback')][6]} |")


if __name__ == "__main__":
    main()
