#!/bin/bash
# One timed `make demo` in a clone, with the caches it is given (empty dirs: a cold run).
#
#   benchmarks/setup/measure.sh LABEL CLONE UV_CACHE_DIR GOCACHE GOMODCACHE PIP_CACHE_DIR
#
# Writes $LOGDIR/LABEL.log (default /tmp/floe-setup-logs): the caches' and the venv's sizes,
# `uptime` before and after, every output line of make demo stamped with the seconds since
# the start, the exit status and wall time; /usr/bin/time -v's figures in LABEL.time.
# benchmarks/results/setup/REPORT.md gives the runs made with it.
set -u
label=$1 dir=$2
LOGDIR=${LOGDIR:-/tmp/floe-setup-logs}
mkdir -p "$LOGDIR"
log=$LOGDIR/$label.log
export UV_CACHE_DIR=$3 GOCACHE=$4 GOMODCACHE=$5 PIP_CACHE_DIR=$6 GOFLAGS=-buildvcs=false
mkdir -p "$UV_CACHE_DIR" "$GOCACHE" "$GOMODCACHE" "$PIP_CACHE_DIR"
sizes() { du -sh "$UV_CACHE_DIR" "$GOCACHE" "$GOMODCACHE" "$PIP_CACHE_DIR" 2>/dev/null | awk '{print $2"="$1}' | tr '\n' ' '; }
{
echo "label $label dir $dir commit $(git -C "$dir" rev-parse --short HEAD)"
echo "UV_CACHE_DIR=$UV_CACHE_DIR GOCACHE=$GOCACHE GOMODCACHE=$GOMODCACHE PIP_CACHE_DIR=$PIP_CACHE_DIR GOFLAGS=$GOFLAGS"
echo "cache sizes before: $(sizes)"
echo "venv before: $(du -sh "$dir/.venv" 2>/dev/null | cut -f1)"
echo "start $(date -u +%FT%TZ)  uptime: $(uptime)"
} > "$log"
t0=$(date +%s.%N)
stamp='import sys, time
t0 = float(sys.argv[1])
for line in sys.stdin:
    sys.stdout.write(f"{time.time() - t0:8.1f} {line}")
    sys.stdout.flush()'
cd "$dir" && /usr/bin/time -v -o "$LOGDIR/$label.time" make demo 2>&1 | python3 -u -c "$stamp" "$t0" >> "$log"
rc=${PIPESTATUS[0]}
t1=$(date +%s.%N)
{
echo "end $(date -u +%FT%TZ)  uptime: $(uptime)"
echo "rc $rc wall $(python3 -c "print(f'{$t1 - $t0:.1f}')") s"
echo "venv after: $(du -sh "$dir/.venv" | cut -f1) ($(du -s --block-size=1M "$dir/.venv" | cut -f1) MiB)"
echo "cache sizes after: $(sizes)"
} >> "$log"
exit "$rc"
