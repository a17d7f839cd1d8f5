"""``python -m floe_refserver``: serve the reference model.

Prints one JSON line ``{"base_url": "http://HOST:PORT/v1"}`` on stdout once it accepts
connections (``--port 0`` picks a free port), logs to stderr, exits cleanly on SIGTERM or
SIGINT.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

import torch

from .model import Engine, build_model
from .server import RefServer, make_server
from .tokenizer import load_tokenizer

log = logging.getLogger("floe_refserver")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m floe_refserver", description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    ap.add_argument("--model-name", default="floe-ref", help="the served model name")
    ap.add_argument("--seed", type=int, default=0, help="model weights and the default sampling stream")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--cache-dir", default=None, help="tokenizer cache (default ~/.cache/floe-refserver)")
    ap.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="a Hugging Face tokenizer directory (its tokenizer.json) to use instead of the shipped BPE",
    )
    ap.add_argument("--script", default=None, help="JSON list of scripted assistant outputs to queue")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s refserver %(levelname)s %(message)s",
    )
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    try:
        tok = load_tokenizer(args.cache_dir, args.tokenizer)
    except ValueError as e:
        raise SystemExit(f"--tokenizer: {e}") from e
    t1 = time.monotonic()
    model = build_model(len(tok), seed=args.seed, max_model_len=args.max_model_len)
    ref = RefServer(tok, Engine(model, seed=args.seed), args.model_name, args.max_model_len)
    if args.script:
        with open(args.script, encoding="utf-8") as f:
            outputs: Any = json.load(f)
        if not isinstance(outputs, list):
            raise SystemExit("--script: the file must hold a JSON list of outputs")
        ref.script.push(outputs)
    # Warm the model once so the first request is not the one paying for lazy init.
    ref.engine.score(ref.encode("warm up"), ref.encode(" ok"))
    srv = make_server(ref, args.host, args.port)
    host, port = srv.server_address[:2]
    log.info(
        "tokenizer %d tokens (%.2fs), model %s params (%.2fs total), %d scripted outputs",
        len(tok),
        t1 - t0,
        sum(p.numel() for p in model.parameters()),
        time.monotonic() - t0,
        len(ref.script),
    )

    def stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        threading.Thread(target=srv.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(json.dumps({"base_url": f"http://{host!s}:{port}/v1"}), flush=True)
    try:
        srv.serve_forever(poll_interval=0.1)
    finally:
        srv.server_close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
