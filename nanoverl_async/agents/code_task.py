"""Built-in workload `builtin:code`: the model answers "12*34-56?" by writing Python for the sandboxed `python` tool.

Why: code execution is the other common agent tool, and an expensive one: each call starts an isolated
interpreter (nanoverl_async/agents/sandbox.py), tens to hundreds of milliseconds. The prompt is an integer
expression of two or three operands below 100 with + - * (Python's precedence); the calculator of
`builtin:multiply` takes one operation only, and the model cannot compute a product itself, so it must
write the program. The tiny model for it, `builtin:tiny-code` (configs/code.yaml), is warm-started on demos
of this format (models/tiny.py); at first it writes the program about a quarter of the time.

    <|user|>12*34-56?<|end|><|assistant|><call>print(12*34-56)</call><res>352
    </res>352<|end|>                                                      reward 1 for the exact value

Invariants: `make_prompt` is a pure function of (seed, index) and JSON-able; `value` evaluates exactly
the expressions `expression` writes, with Python's precedence, without running code.

Run alone: `python -m pytest tests/test_workloads.py -q -k code`.
"""

from __future__ import annotations

import math
import random
import re

from nanoverl_async.agents.multiply_task import MAX_OPERAND, MultiplyEnv
from nanoverl_async.agents.sandbox import python


def expression(rng: random.Random) -> str:
    """Two or three operands below MAX_OPERAND joined by + - or *, e.g. "12*34-56"."""
    operands = [str(rng.randrange(MAX_OPERAND)) for _ in range(rng.choice((2, 3)))]
    text = operands[0]
    for operand in operands[1:]:
        text += rng.choice("+-*") + operand
    return text


def value(text: str) -> int:
    """The value of an `expression`: a sum of signed products, as Python evaluates it."""
    return sum((-1 if sign == "-" else 1) * math.prod(map(int, term.split("*")))
               for sign, term in re.findall(r"([+-]?)([\d*]+)", text))


def make_prompt(seed: int, index: int) -> dict:
    """The index-th sample of the stream seeded by `seed`."""
    text = expression(random.Random(f"nanoverl_async.code:{seed}:{index}"))
    return {"index": index, "messages": [{"role": "user", "content": f"{text}?"}], "answer": str(value(text))}


def demo(rng: random.Random) -> list[tuple[str, str, str, str]]:
    """One warm-start demo (models/tiny.py): [(question, program, what it prints, answer)]."""
    text = expression(rng)
    return [(f"{text}?", f"print({text})", f"{value(text)}\n", str(value(text)))]


class CodeEnv(MultiplyEnv):
    """`builtin:multiply`'s format and reward with the sandboxed `python` tool instead of the calculator."""

    tools = [python]
