"""The reference server's tokenizer loader on the real SmolLM2 tokenizer that vLLM serves
with: the ids of its ChatML markers and tool-call tokens come through unchanged (floe's
replay bench and the reference server's -tokenizer read it this way)."""

from __future__ import annotations

from floe_refserver import load_tokenizer

from vllmstack import model_dir


def test_tokenizer_smollm2_keeps_its_chatml_ids() -> None:
    tok = load_tokenizer(tokenizer_dir=model_dir())
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.convert_tokens_to_ids("<tool_call>") == 49152 and len(tok) == 49158
