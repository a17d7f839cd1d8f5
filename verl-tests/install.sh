#!/usr/bin/env bash
# Installs verl from PyPI (pinned) into its own venv, .venv-verl, beside the bridge and the
# reference server from this checkout (editable). verl 0.9.1 caps transformers below 5.11,
# which the main .venv is above, so it cannot share that venv. make test-verl runs it; it is
# idempotent and skips everything when the stamp (keyed on this script's hash) is there.
#
# verl is installed with its verl-core extra (what the agent loop imports: cachetools,
# fastapi, TransferQueue, ...) and no other: its other extras (vllm, sglang, fsdp, megatron,
# cpu) pin torch 2.11, flash-attn, vLLM or SGLang, none of which the CPU test needs.
#
#   bash verl-tests/install.sh             # venv at .venv-verl beside the repo root
#   VERL_VENV=/some/dir bash verl-tests/install.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
VENV=${VERL_VENV:-$ROOT/.venv-verl}
PYTHON=${PYTHON:-python3}
VERL_VERSION=0.9.1
TORCH_VERSION=2.15.0
TRANSFORMERS_VERSION=5.10.4
RAY_VERSION=2.60.0

HASH=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)
STAMP=$VENV/.floe-verl-installed-$HASH

say() { printf '[install-verl %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [ -e "$STAMP" ]; then
	say "up to date: $VENV (stamp $HASH)"
	exit 0
fi

UV=""
if [ -x "$ROOT/.venv/bin/uv" ]; then
	UV=$ROOT/.venv/bin/uv
elif command -v uv >/dev/null 2>&1; then
	UV=$(command -v uv)
fi

if [ ! -x "$VENV/bin/python" ]; then
	say "creating $VENV"
	if [ -n "$UV" ]; then
		"$UV" venv --quiet --python "$PYTHON" "$VENV"
	else
		"$PYTHON" -m venv "$VENV"
	fi
fi
if [ -z "$UV" ]; then
	say "installing uv into $VENV"
	"$VENV/bin/python" -m pip install --quiet uv
	UV=$VENV/bin/uv
fi

say "installing verl==$VERL_VERSION (with its verl-core extra: the agent loop's imports, no engine), torch==$TORCH_VERSION, transformers==$TRANSFORMERS_VERSION, ray==$RAY_VERSION, the bridge and the reference server"
"$UV" pip install --python "$VENV/bin/python" \
	"verl[verl-core]==$VERL_VERSION" "torch==$TORCH_VERSION" "transformers==$TRANSFORMERS_VERSION" "ray[default]==$RAY_VERSION" \
	-e "$ROOT/trainer-bridge[torch,test]" -e "$ROOT/refserver[demo,test]" \
	"mypy==2.4.1" "ruff==0.17.6"
rm -f "$VENV"/.floe-verl-installed-*
touch "$STAMP"
say "done: $VENV"
