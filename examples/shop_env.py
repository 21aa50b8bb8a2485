"""Two tools for a real model, and the solver that warm-starts it: a shop's prices and a calculator.

    nanoverl-async launch configs/smollm2_shop.yaml      # builtin:smollm2-135m, warm-started by `solve`

The task: "Ana buys 23 pears and 12 plums. How many cents does Ana pay?" (one item or two). The prices
are the shop's (`price`, a lookup the model cannot guess) and the total needs arithmetic the model cannot
do (`calc`), so the reward (math-verify of the final answer, the default) is earned by calling both, in
Hermes form:

    <tool_call>{"name": "price", "arguments": {"item": "pear"}}</tool_call><tool_call>{"name": "price", ...
    <tool_call>{"name": "calc", "arguments": {"expression": "23*37+12*14"}}</tool_call>     -> 1019
    The answer is 1019.

Nothing here describes the tools to the model: SmolLM2's chat template drops the `tools=` it is given, so
the agent loop describes them in the system message (tool_parsers.describe_tools). The base model never
calls them; `model.warm_start.solver: examples/shop_env.py:solve` writes the demonstrations of a warm start
(controller/warm_start.py) from the messages so far: a call while a tool result is missing, then the answer.
"""

from __future__ import annotations

import random

from arithmetic_env import calc  # the calculator of the one-file example; examples/ is importable

from nanoverl_async import Environment

PRICES = {"apple": 23, "pear": 37, "lemon": 19, "melon": 86, "plum": 14, "mango": 58, "peach": 41, "kiwi": 27}
NAMES = ("Ana", "Ben", "Chloe", "Dev", "Emma", "Femi", "Gus", "Hana")


def price(item: str) -> str:
    """The shop's price of one item, in cents.

    Args:
        item: the fruit, singular and lower case, e.g. "pear".
    """
    key = item.strip().lower().removesuffix("s")
    if key not in PRICES:
        raise ValueError(f"the shop sells {', '.join(PRICES)}, not {item!r}")
    return str(PRICES[key])


def make_prompt(seed: int, index: int) -> dict:
    """The index-th question (pure in seed and index, JSON-able): `data.task` points here."""
    rng = random.Random(f"shop:{seed}:{index}")
    items, name = rng.sample(sorted(PRICES), rng.choice([1, 2])), rng.choice(NAMES)
    counts = [rng.randrange(12, 100) for _ in items]
    bought = " and ".join(f"{count} {item}s" for count, item in zip(counts, items))
    return {"messages": [{"role": "user", "content": f"{name} buys {bought}. How many cents does {name} pay?"}],
            "items": items, "counts": counts, "answer": str(sum(c * PRICES[i] for c, i in zip(counts, items)))}


class ShopEnv(Environment):
    """One instance per episode (`agent.env`); the reward is the default: math-verify of the final answer."""

    tools = [price, calc]
    tool_format = "hermes"
    max_observation_chars = 200


def solve(sample: dict, messages: list[dict]) -> str | dict | list[dict]:
    """model.warm_start.solver: the next assistant turn, given the sample and the messages so far: every price
    in one turn, then the total's expression, then its result."""
    results = [m["content"] for m in messages if m["role"] == "tool"]
    if not results:
        return [{"name": "price", "arguments": {"item": item}} for item in sample["items"]]
    if len(results) == len(sample["items"]):
        total = "+".join(f"{count}*{cost}" for count, cost in zip(sample["counts"], results))
        return {"name": "calc", "arguments": {"expression": total}}
    return f"The answer is {results[-1]}."
