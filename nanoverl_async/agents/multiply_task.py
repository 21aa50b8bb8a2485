"""The built-in task: "A*B?" with a calculator tool (A, B uniform in [0, 100)).

Why this task: a tiny CPU model cannot multiply two-digit numbers itself, so it must learn to call
the tool; the tool syntax is a few characters long, so a character-level model learns the format in
seconds. See docs/design.md "The embedded default model and task" for the reasons behind the choice.

Token-level episode, with the built-in chat template (nanoverl_async/models/tiny.py):

    prompt        <|user|>12*34?<|end|><|assistant|>
    tool call     <call>12*34</call>        sampled; generation stops at </call>
    tool result   <res>408</res>            appended by the environment, loss mask 0
    final answer  408<|end|>                sampled; <|end|> is the eos token

A direct answer without the tool is `408<|end|>` right after the prompt.

`MultiplyEnv` is the environment: one tool, the "builtin" call format, exact-match reward.

Invariants: `make_prompt` is a pure function of (seed, index) and returns JSON-able data;
`calculator` accepts exactly "<int> <op> <int>" with non-negative integers and op in + - *, and
raises ValueError on anything else.

Run alone: `python -m pytest tests/test_tiny_model.py -q -k multiply_task`.
"""

from __future__ import annotations

import operator
import random
import re

from nanoverl_async.agents.env import Environment, Step

MAX_OPERAND = 100  # operands are drawn from [0, MAX_OPERAND)
_MAX_DIGITS = 12  # the tool refuses longer operands: keeps a bad call from building a huge number
_EXPRESSION = re.compile(r"^\s*(\d+)\s*([+\-*])\s*(\d+)\s*$")
OPERATIONS = {"*": operator.mul, "+": operator.add, "-": operator.sub}


def make_prompt(seed: int, index: int) -> dict:
    """The index-th sample of the stream seeded by `seed` (pure, JSON-able)."""
    # A string seed is hashed with sha512 by `random`, so the stream is stable across runs and
    # Python versions, and (seed, index) pairs never collide the way seed * K + index could.
    rng = random.Random(f"nanoverl_async.multiply:{seed}:{index}")
    a, b = rng.randrange(MAX_OPERAND), rng.randrange(MAX_OPERAND)
    return {"index": index, "a": a, "b": b, "messages": [{"role": "user", "content": f"{a}*{b}?"}],
            "answer": str(a * b)}


def demo(rng: random.Random) -> list[tuple[str, str, str, str]]:
    """One warm-start demo (nanoverl_async/models/tiny.py): [(question, tool call, tool result, answer)]."""
    a, b = rng.randrange(MAX_OPERAND), rng.randrange(MAX_OPERAND)
    return [(f"{a}*{b}?", f"{a}*{b}", str(a * b), str(a * b))]


def calculator(expression: str) -> str:
    """Evaluate one arithmetic operation on two non-negative integers.

    Args:
        expression: "A*B", "A+B" or "A-B" with non-negative integers A and B, e.g. "12*34".
    """
    match = _EXPRESSION.match(expression) if isinstance(expression, str) else None
    if match is None:
        raise ValueError(f"expected 'A*B', 'A+B' or 'A-B' with non-negative integers, got {expression!r}")
    left, op, right = match.groups()
    if len(left) > _MAX_DIGITS or len(right) > _MAX_DIGITS:
        raise ValueError(f"operands longer than {_MAX_DIGITS} digits: {expression!r}")
    return str(OPERATIONS[op](int(left), int(right)))


def score(sample: dict, final_answer: str) -> float:
    """1.0 if the final answer is exactly the product (surrounding whitespace ignored), else 0.0."""
    return 1.0 if final_answer.strip() == sample["answer"] else 0.0


class MultiplyEnv(Environment):
    """The built-in environment (`agent.env: builtin:multiply`): the calculator in the compact format."""

    tools = [calculator]
    tool_format = "builtin"  # <call>EXPR</call>, then <res>RESULT</res> (the tiny model's template)
    max_observation_chars = 40  # every character of an error costs a token of the tiny model's context
    show_tools = False  # the prompt is just "A*B?" (docs/design.md "The embedded default model and task")

    async def step(self, sample: dict, message: dict) -> Step:
        return Step(reward=score(sample, message["content"]))
