"""Flight delivery benchmark: floe's Go Flight server -> pyarrow client on one machine.

Starts `floe corpus-serve` (tree strategy) with 65,536-row micro-batches (default corpus)
and 16,384-row ones (small corpus), over TCP loopback and over a Unix socket, and for each
measures, side by side in one run:

- throughput: MB/s of Arrow buffers delivered by DoGet for a whole READY step, against a
  plain memory copy (numpy) of the same bytes;
- latency: from the DoGet call to the first record batch in hand, for a READY step.

Usage: python benchmarks/flight_bench.py [--floe PATH] [--repeats N] [--out REPORT.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from floe_stack import Stack, build_floe

REPO = Path(__file__).resolve().parents[1]


# Micro-batch sizes to measure: (label, corpus, groups, token budget). The default corpus's
# contexts reach 48k tokens, so 16k-row micro-batches come from the small corpus.
SIZES = [("64k rows", "default", 8, 65536), ("16k rows", "small", 96, 16384)]


def corpus_serve(floe: str, addr: str, corpus: str, groups: int, budget: int) -> list[str]:
    return [
        floe,
        "corpus-serve",
        "-corpus",
        corpus,
        "-groups",
        str(groups),
        "-groups-per-step",
        str(groups),
        "-token-budget",
        str(budget),
        "-flight-addr",
        addr,
    ]


def batch_bytes(batch: pa.RecordBatch) -> int:
    return sum(buf.size for col in batch.columns for buf in col.buffers() if buf is not None)


def measure(location: str, repeats: int) -> dict[str, float]:
    client = flight.connect(location)
    ticket = flight.Ticket(json.dumps({"step": 0, "rank": 0}).encode())
    # Wait for the step, and warm the connection.
    client.get_flight_info(
        flight.FlightDescriptor.for_path("step", "0"), flight.FlightCallOptions(timeout=120)
    )
    batches = client.do_get(ticket).read_all().to_batches()
    nbytes = sum(batch_bytes(b) for b in batches)
    rows = [b.num_rows for b in batches]

    seconds, firsts = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        reader = client.do_get(ticket)
        chunk = reader.read_chunk()
        firsts.append(time.perf_counter() - t0)
        got = batch_bytes(chunk.data)
        for chunk in reader:
            got += batch_bytes(chunk.data)
        seconds.append(time.perf_counter() - t0)
        assert got == nbytes, (got, nbytes)

    # The same bytes copied once in memory, as the yardstick.
    src = [
        np.frombuffer(buf, dtype=np.uint8)
        for b in batches
        for col in b.columns
        for buf in col.buffers()
        if buf
    ]
    dst = [np.empty_like(a) for a in src]
    copies = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for s, d in zip(src, dst, strict=True):
            np.copyto(d, s)
        copies.append(time.perf_counter() - t0)
    client.close()
    mb = nbytes / 1e6
    return {
        "batches": len(batches),
        "rows_min": min(rows),
        "rows_max": max(rows),
        "mb": mb,
        "flight_mb_s": mb / statistics.median(seconds),
        "memcpy_mb_s": mb / statistics.median(copies),
        "first_ms_p50": 1e3 * statistics.median(firsts),
        "first_ms_p90": 1e3 * sorted(firsts)[int(0.9 * (len(firsts) - 1))],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--floe", help="floe binary (default: go build ./cmd/floe)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", help="write a Markdown report here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        floe = args.floe or str(build_floe(tmp, REPO))
        results = {}
        for size, corpus, groups, budget in SIZES:
            for name, addr in [
                ("tcp loopback", "127.0.0.1:0"),
                ("unix socket", "unix:" + os.path.join(tmp, "floe.sock")),
            ]:
                print(f"{size}, {name}: serving {groups} groups of the {corpus} corpus ...", file=sys.stderr)
                with Stack(Path(tmp) / "logs") as procs:
                    _, hello = procs.start_server("floe", corpus_serve(floe, addr, corpus, groups, budget))
                    results[(size, name)] = measure(hello["flight"], args.repeats)

    lines = [
        "| micro-batches | transport | count | rows each | MB per step | Flight MB/s | memcpy MB/s | Flight / memcpy | first batch p50 ms | p90 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (size, name), r in results.items():
        lines.append(
            f"| {size} | {name} | {r['batches']} | {r['rows_min']}-{r['rows_max']} | {r['mb']:.1f} | {r['flight_mb_s']:.0f} | "
            f"{r['memcpy_mb_s']:.0f} | {r['flight_mb_s'] / r['memcpy_mb_s']:.3f} | {r['first_ms_p50']:.2f} | {r['first_ms_p90']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        cmd = f"python benchmarks/flight_bench.py --repeats {args.repeats}"
        machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}, pyarrow {pa.__version__}"
        Path(args.out).write_text(
            f"# Flight delivery benchmark\n\nCommand: `{cmd}` (`make bench-flight`)\n\nMachine: {machine}\n\n"
            f"Medians over {args.repeats} reads of one READY step (rank 0) by a pyarrow client; "
            "memcpy copies the same Arrow buffers with numpy in the same run.\n\n" + table + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
