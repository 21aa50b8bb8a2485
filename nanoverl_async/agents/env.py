"""Environments: what a user writes to define a task. One instance per episode.

    class Calculator(Environment):
        tools = [calculator]                  # typed functions, sync or async (nanoverl_async/agents/tools.py)
        tool_format = "hermes"                # how the model writes calls (nanoverl_async/agents/tool_parsers.py)

        async def reset(self, sample):        # the prompt messages (default: sample["messages"])
            return [{"role": "user", "content": sample["question"]}]

        async def step(self, sample, message):  # after an assistant turn without tool calls
            return Step(reward=float(message["content"].strip() == sample["answer"]))

or, for full control, one function (or an Environment method) driving the episode itself:

    @rollout_tools(calculator, tool_format="builtin")  # the tools it runs and how calls are written
    async def rollout(episode, sample) -> float:   # episode: nanoverl_async.agents.agent_loop.Episode
        episode.start(sample["messages"])            # the prompt (mask 0)
        message = await episode.generate()           # one sampled assistant turn (mask 1), into the history;
                                                     # None: out of room
        episode.observe([{"role": "user", "content": "Are you sure?"}])   # rendered delta, mask 0
        ...                                          # episode.run_tools(calls) runs parsed tool calls
        return reward

YAML names either with `agent.env: package.module:Name` or `agent.env: path/to/file.py:Name`, and
`agent.env_args` gives the class keyword arguments; the built-in task is `builtin:multiply`
(multiply_task.MultiplyEnv), the built-in workloads `builtin:slow-tool`, `builtin:long-tail` and `builtin:code`
(slow_tool_task.py, long_tail_task.py, code_task.py), and `builtin:chat` is this base class:
single-turn, no tools, scored by the verl-style reward function (`reward.path` / `reward.name`, default
a math-verify scorer; nanoverl_async/agents/rewards.py).

Invariants: `reset` and `step` may be sync or async; `step` returning `done=False` appends its
`messages` (e.g. a user follow-up) with mask 0 and the episode goes on; an episode cut by a limit
(turns, tokens, tool calls) before any `step` gets reward 0. A Step's reward is a finite number
(`Step(reward=None)` raises where it is written, so the error names that line); the tools an environment
class or rollout function declares are built when `env_factory` loads it, so one without a docstring or
type hints is refused before any role starts (tools.as_tool).

Run alone: `python -m pytest tests/test_env_data.py -q`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from nanoverl_async.agents.rewards import is_reward, score_sample
from nanoverl_async.agents.tools import as_tool
from nanoverl_async.agents.user_code import load_object


@dataclass
class Step:
    """What `Environment.step` returns after a final (tool-free) assistant turn."""

    reward: float = 0.0
    done: bool = True  # False: append `messages` (mask 0) and sample another turn
    messages: list = field(default_factory=list)  # observations, e.g. [{"role": "user", "content": ...}]
    info: dict = field(default_factory=dict)  # JSON-able extras, kept in trajectory.info["reward_info"]

    def __post_init__(self):  # runs in the user's step(): the error's traceback ends at their line
        if not is_reward(self.reward):
            raise ValueError(f"Step(reward={self.reward!r:.40}): the reward must be a finite number, "
                             f"not {type(self.reward).__name__}")


class Environment:
    """Base class (duck typing works too): single turn, no tools, scored by `reward_fn`."""

    tools: Sequence[Any] = ()  # functions or tools.Tool the model may call
    tool_format: str = "hermes"  # "hermes" (<tool_call>{json}</tool_call>) | "builtin" (<call>EXPR</call>)
    max_observation_chars: int = 2000  # tool results and errors are cut to this many characters
    # pass the tools' JSON schemas to the chat template (it renders them in the prompt; a template that drops
    # them, such as SmolLM2's, gets them in the system message instead: tool_parsers.describe_tools)
    show_tools: bool = True
    reward_fn: Optional[Callable] = None  # verl compute_score(data_source, solution_str, ground_truth, extra_info)

    async def reset(self, sample: dict) -> list[dict]:
        """The prompt messages of this episode (the sample's `messages`, or verl's `prompt`)."""
        return [dict(m) for m in (sample.get("messages") or sample["prompt"])]

    async def step(self, sample: dict, message: dict) -> Step:
        """Score the final answer with the verl-style reward function (default: math-verify)."""
        reward, info = await score_sample(self.reward_fn, sample, message["content"])
        return Step(reward=reward, info=info)


def rollout_tools(*tools: Any, tool_format: str = "hermes") -> Callable:
    """Declare the tools a plain `rollout` function runs (`episode.run_tools`) and the format the model
    writes calls in; without it the function has none, and run_tools refuses to run."""
    def declare(rollout: Callable) -> Callable:
        rollout.tools, rollout.tool_format = list(tools), tool_format
        return rollout
    return declare


class FunctionEnv(Environment):
    """Wraps a plain `async def rollout(episode, sample) -> float` as an environment, with the tools
    `rollout_tools` declared on it."""

    def __init__(self, rollout: Callable):
        self.rollout = rollout  # the user's function itself, so errors name it (agent_loop.call_hook)
        self.tools, self.tool_format = getattr(rollout, "tools", ()), getattr(rollout, "tool_format", "hermes")


def env_factory(spec: str, reward_fn: Optional[Callable] = None, env_args: Optional[dict] = None
                ) -> Callable[[], Any]:
    """`agent.env` -> a no-argument callable making one environment per episode; its `tools` are the
    declared tools, built.

    A class is instantiated with `env_args` (`agent.env_args`) as keyword arguments; a function becomes a
    FunctionEnv. `reward_fn` (from `reward.path`) is set on every instance that has no reward function of its own."""
    target, env_args = load_object(spec, "agent.env"), env_args or {}
    if not inspect.isclass(target) and not inspect.iscoroutinefunction(target):
        raise ValueError(f"agent.env '{spec}' is neither a class nor an async rollout function")
    if env_args:  # one instance now: a wrong name or value is a config error before any role starts
        if not inspect.isclass(target):
            raise ValueError(f"agent.env_args is set, but agent.env '{spec}' is a rollout function, which takes none")
        try:
            target(**env_args)
        except (TypeError, ValueError) as error:
            raise ValueError(f"agent.env_args {env_args}: {error}") from None

    def new_env():
        env = target(**env_args) if inspect.isclass(target) else FunctionEnv(target)
        if reward_fn is not None and getattr(env, "reward_fn", None) is None:
            env.reward_fn = reward_fn
        return env

    # The class's (or @rollout_tools's) tools, built now: a ValueError names an undocumented or untyped tool
    # before any role starts, not in every episode (preflight.py reads them; tools set in __init__ come later).
    tools = getattr(target, "tools", ())
    new_env.tools = [as_tool(tool) for tool in tools] if isinstance(tools, (list, tuple)) else []
    if getattr(target, "tool_format", "hermes") == "builtin" and len(new_env.tools) > 1:
        # <call>EXPR</call> names no tool: the model could only ever call the first
        raise ValueError(f"agent.env '{spec}' declares {len(new_env.tools)} tools in the builtin format, whose "
                         f"<call>EXPR</call> names none: use one tool, or tool_format = \"hermes\"")
    return new_env
