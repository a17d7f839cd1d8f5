#!/bin/bash
# Side by side: the previous commit's binary (old) and this one's (new), alternating.
cd /tmp/sbs
PACK="-seed 1 -groups 32 -groups-per-step 0 -token-budget 65536 -pad-multiple 128 -dp-size 8 -advantage grpo -repeats 3"
PROXY="-request-bytes 65536 -requests 500 -chunks 64 -concurrency 256 -duration 10s"
for i in 1 2; do
  /tmp/old/floe bench $PACK > pack-old-$i.txt 2>&1
  /tmp/new/floe-bench $PACK > pack-new-$i.txt 2>&1
done
for i in 1 2; do
  /tmp/old/floe bench-proxy $PROXY > proxy-old-$i.txt 2>&1
  /tmp/new/floe-bench proxy $PROXY > proxy-new-$i.txt 2>&1
done
cd /work/main
for i in 1; do
  .venv/bin/python benchmarks/flight_bench.py --floe /tmp/old/floe --repeats 30 > /tmp/sbs/flight-old-$i.txt 2>&1
  .venv/bin/python benchmarks/flight_bench.py --floe /tmp/new/floe --repeats 30 > /tmp/sbs/flight-new-$i.txt 2>&1
done
echo done > /tmp/sbs/DONE
