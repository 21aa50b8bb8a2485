"""A complete custom environment in one file: prompts, a typed tool, and the reward.

    nanoverl-async launch examples/arithmetic_env.yaml

The task: "A*B-C?" with A, B < 100 and C < 10. The model may call `calc` with an arithmetic
expression; the built-in tiny model writes calls as `<call>EXPR</call>` (tool_format "builtin"), a
Qwen or Llama model as `<tool_call>{"name": "calc", "arguments": {"expression": "..."}}</tool_call>`
(tool_format "hermes"). The YAML names this file twice: `data.task` (the prompts) and `agent.env`
(the environment class). Everything else (tokens, masks, tool errors, limits) is the agent loop's job.
"""

from __future__ import annotations

import ast
import operator
import random

from nanoverl_async import Environment, Step

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(expression: str) -> str:
    """Evaluate an integer expression with + - * and parentheses.

    Args:
        expression: e.g. "12*34-5".
    """
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and abs(node.value) < 10**6:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"unsupported expression {expression!r}")  # becomes "error: ..." for the model

    return str(value(ast.parse(expression, mode="eval").body))


def make_prompt(seed: int, index: int) -> dict:
    """The index-th prompt (a pure function of seed and index, JSON-able): `data.task` points here."""
    rng = random.Random(f"arithmetic:{seed}:{index}")
    a, b, c = rng.randrange(100), rng.randrange(100), rng.randrange(10)
    return {"messages": [{"role": "user", "content": f"{a}*{b}-{c}?"}], "answer": str(a * b - c)}


class ArithmeticEnv(Environment):
    """One instance per episode: `agent.env` points here."""

    tools = [calc]  # typed functions; their JSON schema comes from the signature and docstring
    tool_format = "builtin"  # "hermes" for Qwen/Llama-style models
    show_tools = False  # the tiny model's prompt stays "A*B-C?" (True renders the schemas in the prompt)
    max_observation_chars = 40  # tool results and error messages are cut to this

    async def step(self, sample: dict, message: dict) -> Step:
        """Called with the final (tool-free) assistant turn: reward 1 for the exact answer."""
        return Step(reward=float(message["content"].strip() == sample["answer"]))
