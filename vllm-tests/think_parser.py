"""vLLM reasoning parser plugin ``floe_think``: plain-text ``<think>…</think>`` reasoning
for SmolLM2, loaded by ``vllm serve --reasoning-parser-plugin THIS --reasoning-parser
floe_think`` (vllm-tests/vllm_server.py).

Why a plugin: vLLM's built-in ``<think>`` parsers (deepseek_r1, qwen3, …) look the markers
up as single tokens of the vocabulary and refuse to start without them; SmolLM2 has no
such tokens (``</think>`` is ``</`` ``think`` ``>``). The built-in text-based one
(olmo3) disagrees with itself: streamed, an answer without ``</think>`` is all reasoning,
not streamed, all content. floe's tests need vLLM to return ``message.reasoning``
consistently either way.

What it decides, as the chat template (vllm-tests/chat_template.jinja) renders: with
``chat_template_kwargs.enable_thinking`` true the generation prompt ends with an open
``<think>``, so what the model writes up to its first ``</think>`` is reasoning and the
rest content; an answer cut off before ``</think>`` is reasoning only. Without it the
template opens no block and everything is content.

This file runs inside vLLM's venv and is imported by vLLM only, so it is not part of the
test suite's type checks (vLLM's classes are untyped there).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.reasoning import ReasoningParser, ReasoningParserManager

START = "<think>"
END = "</think>"
# How far back in a prompt to look for the generation prompt's open <think> (a few tokens).
PROMPT_TAIL_TOKENS = 16


def _held(text: str) -> int:
    """Length of the longest suffix of text that could begin END: streamed text is held
    back by that much so that a marker split over two deltas never leaks as reasoning."""
    for n in range(min(len(END) - 1, len(text)), 0, -1):
        if END.startswith(text[-n:]):
            return n
    return 0


def _split(text: str) -> tuple[str, str]:
    """(reasoning, content) of a streamed prefix, the possible start of END held back."""
    if END in text:
        reasoning, content = text.split(END, 1)
        return reasoning, content
    return text[: len(text) - _held(text)], ""


@ReasoningParserManager.register_module("floe_think")
class FloeThinkReasoningParser(ReasoningParser):
    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)

    @property
    def reasoning_start_str(self) -> str:
        return START

    @property
    def reasoning_end_str(self) -> str:
        return END

    def _text(self, ids: Sequence[int]) -> str:
        return str(self.model_tokenizer.decode(list(ids)))

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        # Called on the prompt (is reasoning still open where generation starts?) and by
        # structured outputs: open iff the last <think> in the tail comes after the last
        # </think>.
        tail = self._text(list(input_ids)[-PROMPT_TAIL_TOKENS:])
        return tail.rfind(START) <= tail.rfind(END)

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Iterable[int]) -> bool:
        # input_ids here are the generated ids only: reasoning ends with their first </think>.
        return END in self._text(input_ids)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        # Only structured outputs ask, and they constrain from the end of reasoning on,
        # which is_reasoning_end already tells them; no content ids are carried over.
        return []

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        kwargs = getattr(request, "chat_template_kwargs", None) or {}
        if not kwargs.get("enable_thinking", False):
            return None, model_output
        if END not in model_output:
            return model_output or None, None
        reasoning, content = model_output.split(END, 1)
        return reasoning or None, content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        # Called only while vLLM holds reasoning open (the prompt ended inside <think>), so
        # the stream starts in reasoning; the deltas are the differences of the splits.
        r0, c0 = _split(previous_text)
        r1, c1 = _split(current_text)
        reasoning, content = r1[len(r0) :], c1[len(c0) :]
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning=reasoning or None, content=content or None)
