"""floe's reference inference server: a small OpenAI-compatible server that speaks vLLM's
wire format exactly (token ids, log-probs, reasoning and hermes tool-call parsing), backed
by a real tiny model (a seeded Qwen2 over a byte-level BPE trained on a shipped corpus).

Run it with ``python -m floe_refserver``; see ``__main__`` for the flags. Needs the
``torch`` extra (torch, transformers, tokenizers).
"""

from __future__ import annotations

from .model import Engine, TokenLogprob, build_model
from .parser import OutputParser, Parsed
from .server import RefServer, ScriptQueue, make_server
from .tokenizer import (
    CHAT_TEMPLATE,
    load_tokenizer,
    render,
    render_assistant_turn,
    tokenizer_json_path,
    train_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "Engine",
    "OutputParser",
    "Parsed",
    "RefServer",
    "ScriptQueue",
    "TokenLogprob",
    "build_model",
    "load_tokenizer",
    "make_server",
    "render",
    "render_assistant_turn",
    "tokenizer_json_path",
    "train_tokenizer",
]
