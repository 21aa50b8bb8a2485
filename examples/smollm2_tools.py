"""Word problems with a calculator for a real pretrained model (SmolLM2-135M-Instruct), in one file.

    nanoverl-async launch configs/smollm2_tools.yaml      # model.path: examples/smollm2_tools.py:warm_started

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

The base model never calls the tool, so `warm_started` (what the config's `model.path` names: a function
that makes a model directory once and caches it) gives it a short supervised warm start on synthetic
demos, made by the real agent loop with a scripted engine (`Teacher`) so their tokens are RL's own.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import torch
from arithmetic_env import calc  # the same calculator (+ - * and parentheses); examples/ is importable
from transformers import AutoModelForCausalLM

from nanoverl_async import Environment
from nanoverl_async.config import AgentConfig
from nanoverl_async.agents.agent_loop import run_episode
from nanoverl_async.generators.engine import Completion
from nanoverl_async.models.cache import build_once
from nanoverl_async.models.load import load_tokenizer, resolve_model_path
from nanoverl_async.agents.tools import as_tool

# The warm start (model.path: examples/smollm2_tools.py:warm_started). Measured at temperature 1: the base
# model never calls the tool (0 of 48 episodes, whatever the system message); after these 4 steps it calls
# it in 97% of 32 episodes and 31% succeed (drafts: 75% and 6% after 3 steps, 100% and 81% after 8). Four
# steps leave RL the most to learn from: groups that disagree, and the arguments still to get right.
WARM_START = {"demos": 16, "batch": 4, "lr": 5e-5, "seed": -1}  # seed -1: prompts RL never sees (seeds >= 0)
DEMO_TURNS = ("<tool_call>{call}</tool_call>", "The answer is {answer}.")  # what a demo's two turns say

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


class Teacher:
    """An engine that writes given turns: demos are real agent-loop episodes, so their tokens, masks and
    template deltas are exactly those RL trains on."""

    def __init__(self, turns: list[list[int]]):
        self.turns = list(turns)

    async def generate(self, input_ids, params, episode_id=None) -> Completion:
        ids = self.turns.pop(0)
        return Completion(ids, [0.0] * len(ids), [0] * len(ids), "stop")


async def demos(tokenizer, count: int, seed: int) -> list:
    """`count` episodes that call the tool with the right expression, then state its result."""
    async def demo(sample: dict):
        call = json.dumps({"name": "calc", "arguments": {"expression": sample["expression"]}})
        texts = [DEMO_TURNS[0].format(call=call), DEMO_TURNS[1].format(answer=sample["answer"])]
        turns = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
        agent = AgentConfig(max_turns=2, max_new_tokens=64, max_total_tokens=512)
        return await run_episode(Teacher(turns), tokenizer, sample, WordProblemEnv(), agent, 1.0)
    return await asyncio.gather(*(demo(make_prompt(seed, i)) for i in range(count)))


def warm_start(base: str, directory: Path) -> str:
    """Supervised steps on the demos' sampled tokens (loss mask 1), from `base` into `directory`."""
    tokenizer = load_tokenizer(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    episodes = asyncio.run(demos(tokenizer, WARM_START["demos"], WARM_START["seed"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_START["lr"])
    model.train()
    for start in range(0, len(episodes), WARM_START["batch"]):
        rows = episodes[start:start + WARM_START["batch"]]
        width = max(len(t.token_ids) for t in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels, attention = torch.full((len(rows), width), -100), torch.zeros((len(rows), width), dtype=torch.long)
        for i, t in enumerate(rows):
            row = torch.as_tensor(t.token_ids, dtype=torch.long)
            ids[i, :len(row)], attention[i, :len(row)] = row, 1
            labels[i, :len(row)] = torch.where(torch.as_tensor(t.loss_mask) == 1, row, -100)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval().save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return f"{len(episodes)} demos, final loss {loss.item():.3f}"


def warm_started(cache_dir: str = "") -> str:
    """`model.path` points here: builtin:smollm2-135m after the warm start, built once and cached."""
    base = resolve_model_path("builtin:smollm2-135m", cache_dir)
    recipe = {**WARM_START, "base": Path(base).name, "system": describe_tools(WordProblemEnv.tools), "stories": STORIES,
              "demo": DEMO_TURNS}
    with torch.random.fork_rng(devices=[]):  # seeded, and the caller's RNG stream stays untouched
        torch.manual_seed(0)
        return build_once("smollm2-135m-calc", recipe, lambda directory: warm_start(base, directory), cache_dir,
                          note="one-time warm start on 16 tool demos, ~45 s")
