#!/usr/bin/env bash
# .ci/run on a fresh clone of this checkout's HEAD while BUSY other CPU-bound processes
# run (default 2, a busy loop each), as a user's loaded CI machine would: floe's tests
# wait on events, never on clocks, and this shows it. Writes the time and the load to
# benchmarks/ci-load/REPORT.md (or $OUT) and exits with .ci/run's status.
#
#   bash benchmarks/ci-load/run.sh            # 2 busy loops
#   BUSY=4 bash benchmarks/ci-load/run.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
busy="${BUSY:-2}"
out="${OUT:-$here/REPORT.md}"
work="$(mktemp -d /tmp/floe-ci-load.XXXXXX)"
log="$work/ci.log"

loops=()
stop_loops() { for p in "${loops[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap stop_loops EXIT

commit="$(git -C "$repo" rev-parse --short HEAD)"  # the clone's, not HEAD's when the report is written
echo "== fresh clone of $commit into $work/floe"
git clone --quiet "$repo" "$work/floe"

echo "== $busy busy loops"
for _ in $(seq "$busy"); do
	( while :; do :; done ) &
	loops+=("$!")
done

echo "== .ci/run (log: $log)"
start=$(date +%s)
rc=0
( cd "$work/floe" && CI=true bash .ci/run ) >"$log" 2>&1 || rc=$?
end=$(date +%s)
load=$(cut -d' ' -f1-3 /proc/loadavg)
stop_loops

secs=$((end - start))
{
	echo "# .ci/run under load"
	echo
	echo "\`bash benchmarks/ci-load/run.sh\` (BUSY=$busy): a fresh clone of $commit, .ci/run beside $busy busy loops on $(nproc) cores."
	echo
	echo "| exit status | wall time | load average at the end (1, 5, 15 min) |"
	echo "|---|---|---|"
	echo "| $rc | $((secs / 60)) min $((secs % 60)) s | $load |"
	echo
	echo "The last lines of its log:"
	echo
	echo '```'
	grep -E "passed|failed|^ok |^FAIL|^--- FAIL|error" "$log" | tail -25
	echo '```'
} >"$out"
cat "$out"
exit "$rc"
