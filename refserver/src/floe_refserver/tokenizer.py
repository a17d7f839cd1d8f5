"""The reference server's tokenizer: a byte-level BPE trained on a shipped corpus, with a
Qwen-style ChatML chat template (hermes tool calls, ``<think>`` reasoning).

Training is deterministic (same corpus bytes and parameters -> the same tokenizer.json,
byte for byte) and takes well under a second; the result is cached under a directory named
by a hash of the corpus, the parameters and the ``tokenizers`` version, so it is trained
once per machine and reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
THINK = "<think>"
THINK_END = "</think>"

# Control tokens: never part of decoded text (skip_special_tokens), ids 0..2.
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
# Markup tokens: single tokens that decode to their literal text (as in Qwen's vocabulary).
MARKUP_TOKENS = [TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END, THINK, THINK_END]

BPE_VOCAB_SIZE = 4096  # merges + byte alphabet + the 3 control tokens; markup tokens follow
MIN_FREQUENCY = 2
# Qwen2's pre-tokenization regex (GPT-4 style, digits split one by one).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3-style ChatML template. Differences from Qwen3's own: an assistant turn's reasoning
# is rendered for every assistant turn that has one (not only those after the last user
# query), so a conversation re-renders exactly as the model saw it; a tool call after
# content that already ends in a newline adds no second newline (vLLM returns the content
# before <tool_call> with its trailing newline, harnesses often strip it: both render alike).
CHAT_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{- c -}}"
    "{%- elif c is iterable and c is not mapping -%}"
    "{%- for p in c -%}{%- if p is string -%}{{- p -}}{%- elif p.text is defined and p.text is string -%}"
    "{{- p.text -}}{%- endif -%}{%- if not loop.last %}{{- '\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- text(messages[0].content) + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = text(message.content) %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}"
    "{%- elif message.reasoning is string %}{%- set reasoning = message.reasoning %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if reasoning %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- set content = content.lstrip('\\n') %}"
    "{%- endif %}"
    "{{- content }}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if (not loop.first) or (content and not content.endswith('\\n')) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def corpus_bytes() -> bytes:
    """The shipped training text."""
    return resources.files("floe_refserver").joinpath("data/corpus.txt").read_bytes()


def _params() -> dict[str, Any]:
    return {
        "vocab_size": BPE_VOCAB_SIZE,
        "min_frequency": MIN_FREQUENCY,
        "special": SPECIAL_TOKENS,
        "markup": MARKUP_TOKENS,
        "regex": PRETOKENIZE_REGEX,
        "tokenizers": tokenizers.__version__,
    }


def tokenizer_hash() -> str:
    h = hashlib.sha256()
    h.update(corpus_bytes())
    h.update(json.dumps(_params(), sort_keys=True).encode())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "floe-refserver"


def train_tokenizer() -> Tokenizer:
    """Train the byte-level BPE from the shipped corpus. Deterministic."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus_bytes().decode("utf-8")], trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


def tokenizer_json_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of the cached tokenizer.json, training and writing it first when absent."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / tokenizer_hash() / "tokenizer.json"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    data = train_tokenizer().to_str(pretty=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tokenizer.", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(data)
    os.replace(tmp, path)  # atomic: concurrent first runs write identical bytes
    return path


def tokenizer_from_dir(directory: str | os.PathLike[str]) -> Tokenizer:
    """A model's own tokenizer: the ``tokenizer.json`` of a Hugging Face tokenizer directory
    (a model's folder, as vLLM loads it). The server's chat template and parser need the
    ChatML control tokens and the markup tokens as single tokens; those the vocabulary
    lacks are appended after it, as a fine-tune that adds them would, and those it has keep
    their ids. Raises ValueError, naming the directory, when it holds no readable
    tokenizer.json."""
    d = Path(directory)
    path = d / "tokenizer.json"
    if not d.is_dir():
        raise ValueError(f"tokenizer directory {d}: not a directory")
    if not path.is_file():
        raise ValueError(f"tokenizer directory {d}: no tokenizer.json (want a Hugging Face tokenizer's)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"tokenizer directory {d}: tokenizer.json does not load: {e}") from e
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


def load_tokenizer(
    cache_dir: str | os.PathLike[str] | None = None, tokenizer_dir: str | os.PathLike[str] | None = None
) -> PreTrainedTokenizerFast:
    """The server's tokenizer as a transformers fast tokenizer with the ChatML template: the
    shipped BPE, or with ``tokenizer_dir`` a model's own (``tokenizer_from_dir``)."""
    if tokenizer_dir is not None:
        backend = tokenizer_from_dir(tokenizer_dir)
    else:
        backend = Tokenizer.from_file(str(tokenizer_json_path(cache_dir)))
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def render(
    tok: PreTrainedTokenizerFast,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """The chat template's text for a conversation (what vLLM tokenizes)."""
    out = tok.apply_chat_template(
        messages,
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **template_kwargs,
    )
    assert isinstance(out, str)
    return out


def render_assistant_turn(tok: PreTrainedTokenizerFast, message: dict[str, Any]) -> str:
    """Exactly what the template renders for one assistant turn after
    ``<|im_start|>assistant\\n``, through its closing ``<|im_end|>`` (without the newline
    that follows it): the text a model emits when it produces that turn."""
    ctx: list[dict[str, Any]] = [{"role": "user", "content": ""}]
    head = render(tok, ctx, add_generation_prompt=True)
    full = render(tok, ctx + [message], add_generation_prompt=False)
    if not full.startswith(head) or not full.endswith(IM_END + "\n"):
        raise ValueError("chat template does not render the assistant turn as a suffix")
    return full[len(head) : -1]


@lru_cache(maxsize=8)
def _byte_decoder() -> dict[str, int]:
    # GPT-2 bytes_to_unicode, inverted.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes(tok: PreTrainedTokenizerFast, token_id: int) -> bytes:
    """The raw bytes a token stands for."""
    piece = tok.convert_ids_to_tokens(token_id)
    assert isinstance(piece, str)
    if piece in SPECIAL_TOKENS or piece in MARKUP_TOKENS:
        return piece.encode()
    dec = _byte_decoder()
    try:
        return bytes(dec[c] for c in piece)
    except KeyError:
        # Not a byte-level piece (a model's tokenizer from a directory may be another kind).
        return tok.backend_tokenizer.decode([token_id], skip_special_tokens=False).encode()
