"""The task make learn trains on: arithmetic with a calculator tool, two model calls per
episode with the environment's answer between them (docs/learn.md).

An episode: the model is asked a sum, a difference or a product of two numbers, half the
time bare ("What is 38 * 84?") and half as a word problem ("A shelf holds 38 pens. How
many pens do 84 shelves hold?"). The system prompt says how to call the calculator (one
line ``CALC: <expression>``) and one worked exchange shows it. Its first answer is
parsed, the expression evaluated, and ``RESULT: <value>`` comes back as the next user
turn; its second answer should be ``ANSWER: <number>``. The reward is 1 when that number
is the true value, else 0, whether or not the calculator was used.

Why this task: untrained SmolLM2-135M-Instruct sampled at T = 1 solves about 0.7 of the
bare problems and about 0.1 of the word problems (it rambles, drops minus signs, picks
the wrong operation), so the success rate starts well inside (0, 1) and every failure is
a behaviour the reward can reach (docs/learn.md has the measurement).

Problems are a pure function of (split, seed, index); the held-out split is the problems
whose operands hash into a fifth of the space the training split never draws from, so no
held-out problem is ever trained on.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

SYSTEM = (
    "You are a math assistant with a calculator. To use it, reply with one line: "
    "CALC: <expression>. The user replies RESULT: <value>. Then reply with one line: "
    "ANSWER: <number>."
)

#: the worked exchange every episode starts with, after the system prompt
DEMO: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is 21 * 43?"},
    {"role": "assistant", "content": "CALC: 21 * 43"},
    {"role": "user", "content": "RESULT: 903"},
    {"role": "assistant", "content": "ANSWER: 903"},
]

_WORDED: dict[str, tuple[str, ...]] = {
    "*": (
        "{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have?",
        "A shelf holds {a} {item}. How many {item} do {b} shelves hold?",
    ),
    "+": (
        "{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
        "A shop sold {a} {item} on Monday and {b} on Tuesday. How many {item} did it sell in total?",
    ),
    "-": (
        "{name} has {a} {item} and gives away {b}. How many {item} are left?",
        "A shop had {a} {item} and sold {b}. How many {item} does it have left?",
    ),
}
_NAMES = ("Tom", "Ana", "Raj", "Mia", "Leo", "Zoe")
_ITEMS = ("pens", "apples", "stamps", "cards", "books", "coins")

OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_AST_OPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}

CALC_RE = re.compile(r"CALC:\s*([0-9+\-*/() xX×.]+)")
ANSWER_RE = re.compile(r"ANSWER:\s*(-?[0-9][0-9,]*)")


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int
    #: "" for a bare problem, else the word problem's text
    worded: str = ""

    @property
    def question(self) -> str:
        return self.worded or f"What is {self.a} {self.op} {self.b}?"

    @property
    def answer(self) -> int:
        return OPS[self.op](self.a, self.b)

    @property
    def key(self) -> str:
        return f"{self.a}{self.op}{self.b}"


def _held_out(a: int, op: str, b: int) -> bool:
    # A fixed fifth of all (a, op, b), independent of any seed: the training split never
    # draws one, whatever seed a run uses.
    return (a * 7919 + b * 104729 + ord(op)) % 5 == 0


def _draw(rng: random.Random) -> tuple[int, str, int]:
    op = rng.choice("+-*")
    if op == "*":
        return rng.randint(12, 99), op, rng.randint(12, 99)
    return rng.randint(100, 999), op, rng.randint(100, 999)


def _worded(rng: random.Random, a: int, op: str, b: int) -> str:
    template = rng.choice(_WORDED[op])
    return template.format(name=rng.choice(_NAMES), item=rng.choice(_ITEMS), a=a, b=b)


def problems(split: str, seed: int, n: int) -> list[Problem]:
    """n problems of split "train" or "held_out"; distinct within a call."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be train or held_out, not {split!r}")
    rng = random.Random(f"floe-learn/{split}/{seed}")
    want_held = split == "held_out"
    out: list[Problem] = []
    seen: set[tuple[int, str, int]] = set()
    while len(out) < n:
        a, op, b = _draw(rng)
        worded = rng.random() < 0.5
        if worded and op == "-" and a < b:
            a, b = b, a  # nobody gives away more than they have
        if _held_out(a, op, b) != want_held or (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        out.append(Problem(a, op, b, _worded(rng, a, op, b) if worded else ""))
    return out


def is_held_out(p: Problem) -> bool:
    return _held_out(p.a, p.op, p.b)


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
        left, right = _eval(node.left), _eval(node.right)
        if abs(left) > 10**9 or abs(right) > 10**9:
            raise ValueError("operand too large")
        return _AST_OPS[type(node.op)](left, right)
    raise ValueError("only integers with + - * and parentheses")


def calculate(text: str) -> str:
    """The environment's reply to the model's first answer: the calculator's result for
    its first CALC line, or what went wrong. The expression is parsed, never executed:
    the policy's text is untrusted."""
    m = CALC_RE.search(text)
    if not m:
        return "RESULT: no calculator call found. Reply with ANSWER: <number>."
    expr = m.group(1).strip().replace("×", "*").replace("x", "*").replace("X", "*")
    try:
        value = _eval(ast.parse(expr[:200], mode="eval"))
    except (SyntaxError, ValueError, RecursionError):
        return "RESULT: error, the expression could not be evaluated. Reply with ANSWER: <number>."
    return f"RESULT: {value}"


def reward(p: Problem, final_text: str) -> float:
    """1.0 when the final answer's ANSWER line carries the true value, else 0.0."""
    m = ANSWER_RE.search(final_text)
    if not m:
        return 0.0
    try:
        return 1.0 if int(m.group(1).replace(",", "")) == p.answer else 0.0
    except ValueError:
        return 0.0
