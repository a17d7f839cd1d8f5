#!/bin/bash
# Issue 22 changed who owns the training lifecycle and was to change no figure. This runs the
# packing, proxy and Flight benchmarks with the binaries of two commits alternately on one
# machine (old, then new, twice each), so the machine's drift falls on both alike.
#
#   bash benchmarks/results/node-side-by-side/run.sh [OLD_REF] [NEW_REF] [WORK]
#
# Each commit is built wholly from its own tree (git archive, go build). The outputs land in
# WORK (default /tmp/floe-node-sbs); REPORT.md beside this file tabulates one such run.
set -euo pipefail
OLD_REF=${1:-9eafcf5}
NEW_REF=${2:-HEAD}
WORK=${3:-/tmp/floe-node-sbs}
ROOT=$(git rev-parse --show-toplevel)
PY=${PY:-$ROOT/.venv/bin/python}
export GOFLAGS=-buildvcs=false

build() { # ref dir
  rm -rf "$WORK/src-$2" && mkdir -p "$WORK/src-$2" "$WORK/$2"
  git -C "$ROOT" archive "$1" | tar -x -C "$WORK/src-$2"
  (cd "$WORK/src-$2" && go build -o "$WORK/$2/" ./cmd/floe ./cmd/floe-bench)
  git -C "$ROOT" rev-parse --short "$1" > "$WORK/$2/ref"
  rm -rf "$WORK/src-$2"
}
mkdir -p "$WORK"
echo "== building $OLD_REF and $NEW_REF"
build "$OLD_REF" old
build "$NEW_REF" new

PACK="-seed 1 -groups 32 -groups-per-step 0 -token-budget 65536 -pad-multiple 128 -dp-size 8 -advantage grpo -repeats 3"
PROXY="-request-bytes 65536 -requests 500 -chunks 64 -concurrency 256 -duration 10s"
for i in 1 2; do
  for side in old new; do
    echo "== packing $side $i"
    "$WORK/$side/floe-bench" $PACK > "$WORK/pack-$side-$i.txt" 2>&1
  done
done
for i in 1 2; do
  for side in old new; do
    echo "== proxy $side $i"
    "$WORK/$side/floe-bench" proxy $PROXY > "$WORK/proxy-$side-$i.txt" 2>&1
  done
done
for i in 1 2; do
  for side in old new; do
    echo "== flight $side $i"
    "$PY" "$ROOT/benchmarks/flight_bench.py" --floe "$WORK/$side/floe" --repeats 30 > "$WORK/flight-$side-$i.txt" 2>&1
  done
done
echo "== done: $WORK (old $(cat "$WORK/old/ref"), new $(cat "$WORK/new/ref"))"
