"""The reference server's model: a tiny seeded Qwen2 causal LM (fp32, CPU, eval mode),
teacher-forced scoring, a KV-cached sampler, and in-place weight reloads from a
``save_pretrained`` checkpoint (a trainer's weight sync)."""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 128
# Wider than transformers' default 0.02 so the next-token distribution is far from uniform
# (logit std ~1.6): log-probs differ visibly from token to token and sampling has structure.
INIT_RANGE = 0.2


def build_model(vocab_size: int, seed: int = 0, max_model_len: int = 4096) -> Qwen2ForCausalLM:
    """The seeded model. Same (vocab_size, seed, max_model_len, torch, transformers) -> same
    weights, in any process."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=max(max_model_len, 32),
        initializer_range=INIT_RANGE,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model: Any = Qwen2ForCausalLM(config)  # transformers' typing of to()/eval() is loose
    model.to(torch.float32)
    model.eval()
    model.requires_grad_(False)
    return cast(Qwen2ForCausalLM, model)


def _cache_kwarg(model: Qwen2ForCausalLM) -> str:
    # transformers renamed forward's past_key_values to cache (5.x); use whichever it takes.
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass
class TokenLogprob:
    """One emitted token: its id, its log-probability under the distribution it was sampled
    from (vLLM's ``--logprobs-mode processed_logprobs``: ``log_softmax(logits / T)``, then
    renormalised over what top-k/top-p keep; the raw distribution for greedy decoding), and
    the top-k alternatives under the same distribution."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def _top(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    vals, idx = torch.topk(row, min(k, row.shape[-1]))
    return [(int(i), float(v)) for v, i in zip(vals.tolist(), idx.tolist(), strict=True)]


class WeightsLock:
    """A readers-writer lock over the model's weights: requests hold it shared for their
    whole length (every choice, every sampled token), a weight reload holds it exclusive, so
    no request sees half old, half new weights. A waiting writer blocks new readers, so a
    steady stream of requests cannot starve a reload. Not reentrant: a thread holding it
    shared must not take it again (with a writer waiting it would deadlock)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.readers = 0
        self.writer = False
        self.writers_waiting = 0  # read under cond; tests wait on it to see a reload queued

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self.cond:
            self.cond.wait_for(lambda: not self.writer and not self.writers_waiting)
            self.readers += 1
        try:
            yield
        finally:
            with self.cond:
                self.readers -= 1
                self.cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self.cond:
            self.writers_waiting += 1
            self.cond.notify_all()  # observers of writers_waiting
            try:
                self.cond.wait_for(lambda: not self.writer and not self.readers)
            finally:
                self.writers_waiting -= 1
            self.writer = True
        try:
            yield
        finally:
            with self.cond:
                self.writer = False
                self.cond.notify_all()


class WeightsError(ValueError):
    """A checkpoint that does not fit the served model (the client's error, HTTP 400)."""


def read_checkpoint(model: torch.nn.Module, path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of the ``*.safetensors`` file(s) in directory ``path`` (as
    ``save_pretrained(path, safe_serialization=True)`` writes them, sharded or not), checked
    against ``model``: every name known, every shape equal, every dtype floating; returned
    cast to the parameter's dtype, keyed by the model's state-dict names, so that copying
    them cannot fail half way. Tied parameters (``lm_head.weight`` is ``embed_tokens.weight``
    with ``tie_word_embeddings``) are one tensor: like transformers, the checkpoint may hold
    any one of the names (save_pretrained omits the tied copy); if it holds several they
    must be equal, since the served model cannot give them different values.

    Raises WeightsError for what the client got wrong, OSError for I/O failures."""
    d = Path(path)
    if not d.is_dir():
        raise WeightsError(f"weights_path {str(d)!r} is not a directory")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors file in weights_path {str(d)!r}")
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(f, device="cpu")
        except SafetensorError as e:  # a truncated or foreign file, not an I/O failure
            raise WeightsError(f"{f.name}: not a readable safetensors file: {e}") from e
        dup = sorted(set(tensors) & set(loaded))
        if dup:
            raise WeightsError(f"{f.name}: tensors also in another file: {dup[:5]}")
        loaded.update(tensors)

    state = model.state_dict()
    # Group aliases (tied weights) by storage: one group per distinct tensor.
    groups: dict[tuple[int, int], list[str]] = {}
    for name, t in state.items():
        groups.setdefault((t.untyped_storage().data_ptr(), t.storage_offset()), []).append(name)
    unexpected = sorted(set(loaded) - set(state))
    if unexpected:
        raise WeightsError(f"unexpected tensors (not in the served model): {unexpected[:10]}")
    out: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for names in groups.values():
        present = [n for n in names if n in loaded]
        if not present:
            missing.append(names[0])
            continue
        target = state[names[0]]
        for n in present:
            src = loaded[n]
            if tuple(src.shape) != tuple(target.shape):
                raise WeightsError(
                    f"tensor {n!r}: shape {list(src.shape)} in the checkpoint, "
                    f"{list(target.shape)} in the model"
                )
            if not src.is_floating_point():
                raise WeightsError(f"tensor {n!r}: dtype {src.dtype} is not a floating-point type")
        first = loaded[present[0]].to(target.dtype)
        for n in present[1:]:
            if not torch.equal(loaded[n].to(target.dtype), first):
                raise WeightsError(
                    f"tensors {present[0]!r} and {n!r} are tied in the model but differ in the checkpoint"
                )
        out[names[0]] = first
    if missing:
        raise WeightsError(f"tensors missing from the checkpoint: {sorted(missing)[:10]}")
    return out


class Engine:
    """Serializes access to the model (one forward at a time). ``weights`` is the
    request-level lock: callers that need consistent weights across several forwards (a
    whole request) hold ``weights.shared()``; ``reload_weights`` holds it exclusive."""

    def __init__(self, model: Qwen2ForCausalLM, seed: int = 0) -> None:
        self.model = model
        self.lock = threading.Lock()
        self.weights = WeightsLock()
        self.generator = torch.Generator().manual_seed(seed)
        self._cache_kw = _cache_kwarg(model)

    def reload_weights(self, weights_path: str | Path) -> None:
        """Load the model's weights in place from a save_pretrained checkpoint directory.
        Everything is read and checked before the first tensor is copied, so a bad
        checkpoint leaves the model as it was. Waits for running requests to finish."""
        new = read_checkpoint(self.model, weights_path)  # outside the lock: requests go on meanwhile
        state = self.model.state_dict()
        # self.lock too, for callers that run a forward without holding weights (the warm-up).
        with self.weights.exclusive(), self.lock, torch.no_grad():
            for name, t in new.items():
                state[name].copy_(t)

    @torch.no_grad()
    def score(
        self, prompt_ids: list[int], output_ids: list[int], top_k: int = 0, temperature: float = 1.0
    ) -> list[TokenLogprob]:
        """Teacher forcing: one forward pass over prompt + output; the log-prob of each output
        token given everything before it, at ``temperature`` (``log_softmax(logits / T)``;
        greedy, T <= 1e-5, scores the raw distribution)."""
        if not output_ids:
            return []
        ids = torch.tensor([prompt_ids + output_ids], dtype=torch.long)
        with self.lock:
            logits = self.model(input_ids=ids).logits[0]
        p = len(prompt_ids)
        rows = logits[p - 1 : p - 1 + len(output_ids)].float()
        if temperature > 1e-5:
            rows = rows / temperature
        logp = torch.log_softmax(rows, dim=-1)
        tgt = torch.tensor(output_ids, dtype=torch.long)
        lp = logp.gather(1, tgt[:, None])[:, 0].tolist()
        return [
            TokenLogprob(t, float(v), _top(logp[i], top_k))
            for i, (t, v) in enumerate(zip(output_ids, lp, strict=True))
        ]

    @torch.no_grad()
    def sample(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        stop_ids: set[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        logprob_k: int = 0,
        seed: int | None = None,
    ) -> Iterator[TokenLogprob]:
        """Sample up to max_tokens tokens, yielding each as it is produced; stops after a
        token in stop_ids (which is yielded)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else self.generator
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        past = None
        for _ in range(max_tokens):
            with self.lock:
                out = self.model(input_ids=ids, use_cache=True, **{self._cache_kw: past})
            past = out["cache"] if "cache" in out else out["past_key_values"]
            logits = out.logits[0, -1].float()
            logp = torch.log_softmax(logits, dim=-1)  # greedy: the raw distribution
            if temperature <= 1e-5:
                tok = int(torch.argmax(logits))
            else:
                scaled = logits / temperature
                if 0 < top_k < scaled.shape[-1]:
                    kth = torch.topk(scaled, top_k).values[-1]
                    scaled = scaled.masked_fill(scaled < kth, -math.inf)
                probs = torch.softmax(scaled, dim=-1)
                if top_p < 1.0:
                    sp, si = torch.sort(probs, descending=True)
                    cum = torch.cumsum(sp, dim=-1)
                    drop = cum - sp > top_p  # keep the smallest prefix reaching top_p
                    sp = sp.masked_fill(drop, 0.0)
                    probs = torch.zeros_like(probs).scatter_(0, si, sp)
                # processed log-probs: the distribution the token is drawn from
                logp = torch.log(probs / probs.sum()).clamp(min=-9999.0)
                with self.lock:  # the shared generator's draws stay in one order
                    tok = int(torch.multinomial(probs, 1, generator=gen))
            yield TokenLogprob(tok, float(logp[tok]), _top(logp, logprob_k))
            if tok in stop_ids:
                return
            ids = torch.tensor([[tok]], dtype=torch.long)
