"""The harness make learn trains: one calculator episode (learn/task.py) driven by the
official ``openai`` SDK, through floe's proxy in training and straight at the inference
server in held-out evaluation (which floe must never record, so never trains on).

Two chat calls per episode: the question, then the environment's RESULT line. The second
call's prompt is the first's plus its answer and the RESULT turn, so floe merges the two
into one path of the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import openai
from openai.types.chat import ChatCompletionMessageParam

import task

#: tokens each call may sample: the answers are one short line, and a 135M model that
#: rambles past this is cut (finish_reason "length"), and earns 0 for it
MAX_TOKENS = 32


@dataclass(frozen=True)
class Episode:
    problem: task.Problem
    reward: float
    first: str
    env: str
    final: str
    calc_used: bool


def run_episode(
    client: openai.OpenAI,
    model: str,
    problem: task.Problem,
    *,
    temperature: float,
    seed: int | None = None,
    max_tokens: int = MAX_TOKENS,
) -> Episode:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": task.SYSTEM},
        *task.DEMO,
        {"role": "user", "content": problem.question},
    ]
    first = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=temperature,
        max_tokens=max_tokens,
        seed=seed,
    )
    text1 = first.choices[0].message.content or ""
    env = task.calculate(text1)
    messages += [{"role": "assistant", "content": text1}, {"role": "user", "content": env}]
    second = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=temperature,
        max_tokens=max_tokens,
        seed=None if seed is None else seed + 1,
    )
    text2 = second.choices[0].message.content or ""
    return Episode(problem, task.reward(problem, text2), text1, env, text2, "CALC:" in text1)
