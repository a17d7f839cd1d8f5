#!/usr/bin/env bash
# floe's GPU checks and the end-to-end utilization benchmark on one NVIDIA GPU, in one go
# (about 10 minutes on an H200):
#   1. the GPU: nvidia-smi, torch sees it;
#   2. floe's NVML monitor against the real driver (TestSystemNVML, FLOE_REQUIRE_GPU=1);
#   3. the bridge's equivalence test on CUDA (FlexAttention BlockMask path);
#   4. floe-bench e2e: a Qwen2.5-0.5B-shaped model (random init, bf16, FlexAttention)
#      trained on the medium synthetic corpus with each strategy, NVML at 10 Hz.
#
# Usage, from the repository root:
#   bash benchmarks/gpu/run.sh                # builds floe and floe-bench with go
#   make gpu-bundle; bash benchmarks/gpu/run.sh   # on a machine without Go: bin/ prebuilt
# Results go to $OUT (default benchmarks/results): e2e-h200/REPORT.md, plots, runs/*.json,
# and gpu-checks.log. Tune the size with E2E_ARGS.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
LOG="$OUT/gpu-checks.log"
: >"$LOG"
export PYTHONPATH="$PWD/trainer-bridge/src:$PWD/refserver/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if command -v go >/dev/null; then
	mkdir -p bin
	go build -o bin/ ./cmd/floe ./cmd/floe-bench
	go test -c -o bin/gpu.test ./gpu
fi
[ -x bin/floe ] && [ -x bin/floe-bench ] || { echo "no bin/floe or bin/floe-bench: run 'make gpu-bundle' where Go is, or install Go" >&2; exit 1; }
export FLOE_BIN="$PWD/bin/floe"

step() { echo "== $*" | tee -a "$LOG"; }
command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this script is for a machine with an NVIDIA GPU" >&2; exit 1; }

step "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))' 2>&1 | tee -a "$LOG"

step "floe NVML monitor on the real driver"
if [ -x bin/gpu.test ]; then
	FLOE_REQUIRE_GPU=1 bin/gpu.test -test.run 'TestSystemNVML' -test.v 2>&1 | tee -a "$LOG"
else
	echo "no bin/gpu.test: skipped" | tee -a "$LOG"
fi

step "bridge equivalence on CUDA"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider trainer-bridge/tests/test_equivalence.py 2>&1 | tail -5 | tee -a "$LOG" || true

step "floe-bench e2e"
# shellcheck disable=SC2086 # E2E_ARGS is a list of flags
bin/floe-bench e2e -name e2e-h200 -out "$OUT/e2e-h200" -python "$PY" -device cuda \
	-corpus medium -groups 8 -groups-per-step 2 -token-budget 32768 -pad-multiple 128 -max-model-len 16384 \
	-concurrency 16 -trainer-args "--preset qwen2.5-0.5b --dtype bfloat16 --attn flex --block-size 128" \
	${E2E_ARGS:-} 2>&1 | tee -a "$LOG"
