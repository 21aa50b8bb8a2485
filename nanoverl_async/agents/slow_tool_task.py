"""Built-in workload `builtin:slow-tool`: the multiply task with its calculator behind a remote API's latency.

    agent:
      env: builtin:slow-tool
      env_args: {median_s: 0.2, p99_s: 2.0, blocking: false, seed: 0}    # the defaults

Why: asynchronous RL pays off where episodes are uneven, and a search engine or a remote API answers in
anything from milliseconds to seconds. Each call first waits a delay drawn from a lognormal distribution
with the given median and 99th percentile (p99_s == median_s: always the median), then computes as
`builtin:multiply`'s calculator does; prompts, reward and the tiny model are multiply's (configs/slow_tool.yaml).
`blocking: true` waits with time.sleep in a plain function, as a synchronous client library would (the
agent loop runs it in a thread of its own, nanoverl_async/agents/tools.py); the default waits with
asyncio.sleep in an `async def` tool.

Invariants: `Lognormal(median_s, p99_s).quantile(q)` is exact (median_s at 0.5, p99_s at 0.99); the delays of
an episode are a pure function of (seed, the episode's id, the call's number in the episode), so a run
that repeats its episodes repeats its delays, and the episodes of one group draw different ones.

Run alone: `python -m pytest tests/test_workloads.py -q -k slow`.
"""

from __future__ import annotations

import asyncio
import functools
import math
import random
import time
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Callable

from nanoverl_async.agents.agent_loop import drive
from nanoverl_async.agents.multiply_task import MultiplyEnv, calculator
from nanoverl_async.agents.tools import as_tool

CALCULATOR = as_tool(calculator)  # the slow calculator's schema and hints: the calculator's own
Z99 = NormalDist().inv_cdf(0.99)  # the standard normal's 99th percentile, 2.326


@dataclass(frozen=True)
class Lognormal:
    """Delays whose log is normal, fixed by two quantiles: the median and the 99th percentile (seconds)."""

    median_s: float = 0.2
    p99_s: float = 2.0

    def __post_init__(self):
        if not 0 < self.median_s <= self.p99_s:
            raise ValueError(f"latency needs 0 < median_s <= p99_s, got median_s={self.median_s}, p99_s={self.p99_s}")

    @property
    def sigma(self) -> float:
        """The log's standard deviation: p99 / median = exp(sigma * z99)."""
        return math.log(self.p99_s / self.median_s) / Z99

    def quantile(self, q: float) -> float:
        return self.median_s * math.exp(self.sigma * NormalDist().inv_cdf(q))

    def sample(self, rng: random.Random) -> float:
        return self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))


def delayed(tool: Callable, delay: Callable[[], float], blocking: bool) -> Callable:
    """`tool` (synchronous) after a wait of `delay()` seconds: an `async def` tool, or a blocking function."""
    if blocking:
        @functools.wraps(tool)  # the same name, docstring and type hints: the same schema for the model
        def call(*args, **kwargs):
            time.sleep(delay())
            return tool(*args, **kwargs)
        return call

    @functools.wraps(tool)
    async def call_async(*args, **kwargs):
        await asyncio.sleep(delay())
        return tool(*args, **kwargs)
    return call_async


class SlowToolEnv(MultiplyEnv):
    """`builtin:multiply` with a slow calculator (see the module docstring for the arguments)."""

    def __init__(self, median_s: float = 0.2, p99_s: float = 2.0, blocking: bool = False, seed: int = 0):
        if not isinstance(blocking, bool):  # YAML's `blocking: "no"` is a string, and a string is true
            raise ValueError(f"blocking must be true or false, got {blocking!r}")
        self.latency = Lognormal(median_s, p99_s)
        self.seed = seed
        self.rng = random.Random(seed)  # reseeded per episode; an unseeded Random reads 2.5 KB of os.urandom
        # an environment per episode: the schema is calculator's, read once (as_tool caches by function)
        self.tools = [replace(CALCULATOR, fn=delayed(calculator, lambda: self.latency.sample(self.rng),
                                                                 blocking))]

    def reseed(self, episode_id: str) -> None:
        """Draw this episode's delays from (seed, episode id)."""
        self.rng = random.Random(f"nanoverl_async.slow_tool:{self.seed}:{episode_id}")

    async def rollout(self, episode, sample: dict) -> float:
        """The usual episode (reset, turns, step), its delays seeded by its id: a rollout method is where an
        environment learns the id."""
        self.reseed(episode.episode_id)
        episode.start(await self.reset(sample))
        return (await drive(episode, self, sample))[0]
