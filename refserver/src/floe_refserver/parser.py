"""Output parsing, token by token: reasoning (vLLM's qwen3 reasoning parser), hermes tool
calls (vLLM's hermes tool parser) and content.

One incremental parser serves both response kinds: a streaming response sends its deltas
as they come, a non-streaming one is the concatenation of the same deltas, so the two agree
by construction.

- ``<think>`` (first one, before any content) opens reasoning, ``</think>`` closes it; the
  text between is ``reasoning_content`` exactly as generated (vLLM keeps the newlines
  around it; the chat template strips them when the turn is rendered back).
- With tool parsing on (the request has tools and tool_choice is not "none"), each
  ``<tool_call>{json}</tool_call>`` block is a tool call; text before the first block is
  content, text after it (the newlines between blocks) is dropped, as vLLM's hermes parser
  does. Arguments are ``json.dumps(arguments, ensure_ascii=False)``.
- ``<|im_end|>``, ``<|endoftext|>`` and ``<|im_start|>`` produce no text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerFast

from .tokenizer import SPECIAL_TOKENS, THINK, THINK_END, TOOL_CALL, TOOL_CALL_END

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_HOLD = re.compile(r"\s*\}?\s*\Z")

Delta = dict[str, Any]


def _id(tok: PreTrainedTokenizerFast, token: str) -> int:
    i = tok.convert_tokens_to_ids(token)
    assert isinstance(i, int)
    return i


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class _ToolState:
    index: int
    buf: str = ""
    header_sent: bool = False
    args_start: int = 0
    args_sent: str = ""


@dataclass
class Parsed:
    """The parsed message, accumulated from deltas."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, delta: Delta) -> None:
        self.content += delta.get("content") or ""
        self.reasoning += delta.get("reasoning_content") or ""
        for tc in delta.get("tool_calls") or []:
            i = tc["index"]
            while len(self.tool_calls) <= i:
                self.tool_calls.append(
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
            cur = self.tool_calls[i]
            if tc.get("id"):
                cur["id"] = tc["id"]
            fn = tc.get("function") or {}
            cur["function"]["name"] += fn.get("name") or ""
            cur["function"]["arguments"] += fn.get("arguments") or ""

    def message(self) -> dict[str, Any]:
        return {
            "role": "assistant",
            "content": self.content or None,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": self.tool_calls,
            "reasoning_content": self.reasoning or None,
        }


class OutputParser:
    def __init__(self, tok: PreTrainedTokenizerFast, parse_tools: bool) -> None:
        self.backend = tok.backend_tokenizer
        self.parse_tools = parse_tools
        ids = {t: _id(tok, t) for t in [THINK, THINK_END, TOOL_CALL, TOOL_CALL_END]}
        self.think, self.think_end = ids[THINK], ids[THINK_END]
        self.tool_call, self.tool_call_end = ids[TOOL_CALL], ids[TOOL_CALL_END]
        self.control = {_id(tok, t) for t in SPECIAL_TOKENS}
        self.added = {int(i): t.content for i, t in tok.added_tokens_decoder.items()}
        self.mode = "content"  # content | reasoning | tool | after_tools
        self.think_seen = False
        self.seg: list[int] = []
        self.seg_emitted = 0
        self.tool: _ToolState | None = None
        self.n_tools = 0
        self.parsed = Parsed()

    @property
    def tools_called(self) -> bool:
        return self.n_tools > 0

    # --- public ---------------------------------------------------------------

    def feed(self, token_id: int) -> Delta:
        """The delta for one more token ({} when it shows nothing yet)."""
        out: list[Delta] = []
        if token_id in self.added:
            self._flush_segment(out, final=True)
            self._special(token_id, out)
        else:
            self.seg.append(token_id)
            self._flush_segment(out, final=False)
        return self._merge(out)

    def finish(self) -> Delta:
        """Anything held back, at the end of the output."""
        out: list[Delta] = []
        self._flush_segment(out, final=True)
        if self.mode == "tool":
            self._end_tool(out, closed=False)
        return self._merge(out)

    # --- internals ------------------------------------------------------------

    def _merge(self, deltas: list[Delta]) -> Delta:
        merged: Delta = {}
        for d in deltas:
            for key in ("content", "reasoning_content"):
                if key in d:
                    merged[key] = merged.get(key, "") + d[key]
            for tc in d.get("tool_calls", []):
                calls = merged.setdefault("tool_calls", [])
                same = [c for c in calls if c["index"] == tc["index"]]
                if same:
                    same[0]["function"]["arguments"] = same[0]["function"].get("arguments", "") + tc[
                        "function"
                    ].get("arguments", "")
                else:
                    calls.append(tc)
        self.parsed.add(merged)
        return merged

    def _flush_segment(self, out: list[Delta], final: bool) -> None:
        if not self.seg:
            return
        text = self.backend.decode(self.seg, skip_special_tokens=False)
        end = len(text)
        if not final:
            while end > self.seg_emitted and text[end - 1] == "\ufffd":
                end -= 1  # an incomplete UTF-8 sequence: wait for its next byte
        if end > self.seg_emitted:
            self._route(text[self.seg_emitted : end], out)
            self.seg_emitted = end
        if final:
            self.seg, self.seg_emitted = [], 0

    def _special(self, tid: int, out: list[Delta]) -> None:
        if tid in self.control:
            return
        if tid == self.think and self.mode == "content" and not self.think_seen and not self.parsed.content:
            self.think_seen = True
            self.mode = "reasoning"
        elif tid == self.think_end and self.mode == "reasoning":
            self.mode = "content"
        elif tid == self.tool_call and self.parse_tools and self.mode in ("content", "after_tools"):
            self.mode = "tool"
            self.tool = _ToolState(index=self.n_tools)
        elif tid == self.tool_call_end and self.mode == "tool":
            self._end_tool(out, closed=True)
        else:
            self._route(self.added[tid], out)

    def _route(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        if self.mode == "content":
            out.append({"content": text})
        elif self.mode == "reasoning":
            out.append({"reasoning_content": text})
        elif self.mode == "tool":
            assert self.tool is not None
            self.tool.buf += text
            self._progress_tool(out)
        # after_tools: dropped (vLLM's hermes parser keeps only the content before the first call)

    def _header(self, st: _ToolState, name: str) -> Delta:
        st.header_sent = True
        self.n_tools += 1
        return {
            "tool_calls": [
                {
                    "index": st.index,
                    "id": tool_call_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            ]
        }

    def _args(self, st: _ToolState, frag: str) -> Delta:
        st.args_sent += frag
        return {"tool_calls": [{"index": st.index, "function": {"arguments": frag}}]}

    def _progress_tool(self, out: list[Delta]) -> None:
        st = self.tool
        assert st is not None
        if not st.header_sent:
            m = _HEADER.match(st.buf)
            if m is None:
                return
            try:
                name = json.loads('"' + m.group(1) + '"')
            except ValueError:
                return
            st.args_start = m.end()
            out.append(self._header(st, name))
            return  # arguments follow from the next token on
        pending = st.buf[st.args_start :].lstrip()  # the space after "arguments": may come late
        hold = _HOLD.search(pending)
        safe = pending[: hold.start()] if hold else pending
        if len(safe) > len(st.args_sent) and safe.startswith(st.args_sent):
            out.append(self._args(st, safe[len(st.args_sent) :]))

    def _end_tool(self, out: list[Delta], closed: bool) -> None:
        st = self.tool
        assert st is not None
        self.tool = None
        self.mode = "after_tools"
        try:
            obj = json.loads(st.buf)
            name, args = obj["name"], obj["arguments"]
            if not isinstance(name, str):
                raise ValueError("name")
            final = json.dumps(args, ensure_ascii=False)
        except (ValueError, KeyError, TypeError):
            if not st.header_sent:  # not a tool call after all: its text is content
                raw = TOOL_CALL + st.buf + (TOOL_CALL_END if closed else "")
                if self.n_tools == 0:
                    self.mode = "content"
                    out.append({"content": raw})
            return
        if not st.header_sent:
            out.append(self._header(st, name))
        if final.startswith(st.args_sent) and len(final) > len(st.args_sent):
            out.append(self._args(st, final[len(st.args_sent) :]))
