"""Word problems with a calculator for a real pretrained model (SmolLM2-135M-Instruct), in one file.

    nanoverl-async launch configs/smollm2_tools.yaml      # model.warm_start.solver: examples/smollm2_tools.py:solve

The task: a two-sentence story around a product of a 2-digit and a 2-3-digit number, sometimes with a
sum or difference on top ("Mia buys 23 boxes of 47 pencils and gives away 15. How many pencils does she
keep?"). A 135M model cannot multiply such numbers itself, so the reward (math-verify of the final
answer against the true number, the default of nanoverl_async/agents/rewards.py) rewards calling the tool.
The tool is `calc` from examples/arithmetic_env.py, called in Hermes form:

    <tool_call>{"name": "calc", "arguments": {"expression": "23*47-15"}}</tool_call>

SmolLM2's chat template renders no tools (it only joins role and content), so this environment turns
`show_tools` off and describes its tools in a system message instead (`describe_tools`): that is what to
do for any model whose template ignores `tools`. The sampled call stays in the episode's token ids
whatever the template does with `tool_calls` (tokens in, tokens out); tool results come back as
`<|im_start|>tool ... <|im_end|>` turns with loss mask 0.

The base model never calls the tool, so the config's `model.warm_start` gives it a short supervised warm
start (controller/warm_start.py) on demonstrations that `solve` writes: the call, then its result as the answer.
The launch prints what it measured on held-out episodes (the tool-call rate and the reward, before and after).
"""

from __future__ import annotations

import json
import random

from arithmetic_env import calc  # the same calculator (+ - * and parentheses); examples/ is importable

from nanoverl_async import Environment
from nanoverl_async.agents.tools import as_tool

STORIES = [  # (story with {a} {b} {c}, the expression it asks for)
    ("A bakery fills {a} trays with {b} rolls each. How many rolls does it bake?", "{a}*{b}"),
    ("A school has {a} classes of {b} pupils. How many pupils are there?", "{a}*{b}"),
    ("A farmer plants {a} rows of {b} trees. How many trees does he plant?", "{a}*{b}"),
    ("Mia buys {a} boxes of {b} pencils and gives away {c}. How many pencils does she keep?", "{a}*{b}-{c}"),
    ("A train carries {b} people on each of {a} trips, and {c} more on a last trip. How many people "
     "does it carry?", "{a}*{b}+{c}"),
]


def make_prompt(seed: int, index: int) -> dict:
    """The index-th problem (pure in seed and index, JSON-able): `data.task` points here."""
    rng = random.Random(f"smollm2_tools:{seed}:{index}")
    story, expression = rng.choice(STORIES)
    numbers = {"a": rng.randrange(12, 100), "b": rng.randrange(12, 1000), "c": rng.randrange(2, 100)}
    expression = expression.format(**numbers)
    return {"messages": [{"role": "user", "content": story.format(**numbers)}],
            "answer": calc(expression), "expression": expression}


def describe_tools(tools: list) -> str:
    """A system message that teaches a model whose chat template ignores `tools` the Hermes call form:
    one line per tool from its schema, then an example call (short: every prompt token costs CPU)."""
    lines = [f"{t.name}({', '.join(t.parameters)}): {t.schema['function']['description']}" for t in map(as_tool, tools)]
    first = as_tool(tools[0])
    example = json.dumps({"name": first.name, "arguments": {first.parameters[0]: "12*34"}})
    return ("You have tools:\n" + "\n".join(lines) + "\nTo call a tool, reply with only\n"
            f"<tool_call>{example}</tool_call>\nThen you get its result. End with the final answer as a number.")


class WordProblemEnv(Environment):
    """One instance per episode: `agent.env` points here. The reward is the default: math-verify."""

    tools = [calc]
    tool_format = "hermes"  # <tool_call>{"name": ..., "arguments": {...}}</tool_call>, tool_parsers.py
    show_tools = False  # SmolLM2's template would drop them: reset() describes the tools instead
    max_observation_chars = 200

    async def reset(self, sample: dict) -> list[dict]:
        return [{"role": "system", "content": describe_tools(self.tools)}, *sample["messages"]]


def solve(sample: dict, messages: list[dict]) -> str | dict:
    """model.warm_start.solver: the call with the right expression, then its result as the answer."""
    if messages[-1]["role"] != "tool":
        return {"name": "calc", "arguments": {"expression": sample["expression"]}}
    return f"The answer is {sample['answer']}."
