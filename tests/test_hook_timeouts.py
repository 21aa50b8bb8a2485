"""User hooks are bounded and named: an environment's reset() and step(), a rollout and a reward function that
hang past agent.hook_timeout_s (a rollout: agent.rollout_timeout_s) fail the episode in one line naming the
hook, where it is defined and the user's line it was stuck at; a synchronous hook runs off the event loop, so
one that blocks stalls no other episode; a reward function returning no finite number is blamed by its own
name and file:line, not on the environment's step() that called it.

Run alone: `python -m pytest tests/test_hook_timeouts.py -q` (~5 s).
"""

import asyncio
import time

import pytest

from nanoverl_async.agents import multiply_task
from nanoverl_async.agents.agent_loop import run_episode
from nanoverl_async.agents.user_code import UserCodeError, load_object
from nanoverl_async.config import AgentConfig
from nanoverl_async.models.tiny import build_tokenizer
from test_agent_loop import ScriptedEngine

TIMEOUT_S = 0.2
HOOKS = '''import asyncio
import math
import threading
import time

from nanoverl_async import Environment, Step

RELEASE = threading.Event()  # set by the test: no stuck thread outlives it


def wait_here():
    RELEASE.wait(30)


class SyncStepHangs(Environment):
    def step(self, sample, message):
        wait_here()  # step line
        return Step(reward=1.0)


class AsyncStepHangs(Environment):
    async def step(self, sample, message):
        await asyncio.sleep(30)  # async step line
        return Step(reward=1.0)


class SyncResetHangs(Environment):
    def reset(self, sample):
        RELEASE.wait(30)  # reset line
        return sample["messages"]


class AsyncResetHangs(Environment):
    async def reset(self, sample):
        await asyncio.sleep(30)  # async reset line


class RolloutHangs:
    async def rollout(self, episode, sample):
        episode.start(sample["messages"])
        await asyncio.sleep(30)  # rollout line
        return 1.0


def reward_hangs(data_source, solution_str, ground_truth, extra_info):
    RELEASE.wait(30)  # reward line
    return 1.0


class RewardHangs(Environment):
    reward_fn = staticmethod(reward_hangs)


async def async_reward_hangs(data_source, solution_str, ground_truth, extra_info):
    await asyncio.sleep(30)  # async reward line


class AsyncRewardHangs(Environment):
    reward_fn = staticmethod(async_reward_hangs)


class SyncStepInTime(Environment):
    def step(self, sample, message):
        time.sleep(0.25)
        return Step(reward=1.0)


class AsyncStepInTime(Environment):
    async def step(self, sample, message):
        await asyncio.sleep(0.25)
        return Step(reward=1.0)


class BlockingStep(Environment):
    def step(self, sample, message):
        time.sleep(0.5)  # blocks its thread, not the event loop
        return Step(reward=1.0)


def returns_none(data_source, solution_str, ground_truth, extra_info):
    return None


def returns_text(data_source, solution_str, ground_truth, extra_info):
    return "1.0"


def returns_bool(data_source, solution_str, ground_truth, extra_info):
    return solution_str != ""


def returns_nan(data_source, solution_str, ground_truth, extra_info):
    return math.nan


async def returns_no_score(data_source, solution_str, ground_truth, extra_info):
    return {"acc": 1.0}
'''


@pytest.fixture
def hooks(tmp_path):
    """The objects of HOOKS as the user's file hooks.py; its stuck threads are let go afterwards."""
    (tmp_path / "hooks.py").write_text(HOOKS)
    yield lambda name: load_object(f"{tmp_path}/hooks.py:{name}")
    load_object(f"{tmp_path}/hooks.py:RELEASE").set()


def one_episode(env, **limits):
    tokenizer = build_tokenizer()
    agent = AgentConfig(max_turns=2, max_new_tokens=12, max_total_tokens=64, **limits)
    return run_episode(ScriptedEngine(tokenizer, ["7<|end|>"]), tokenizer, multiply_task.make_prompt(0, 1), env,
                       agent, 1.0)


HUNG = [  # environment -> its one line: the hook, where it is defined, the key, where it was stuck
    ("SyncStepHangs", "agent.env SyncStepHangs.step() (defined at hooks.py:16) did not return within 0.2 s "
                      "(agent.hook_timeout_s); it was at hooks.py:12 in wait_here <- hooks.py:17 in step"),
    ("AsyncStepHangs", "agent.env AsyncStepHangs.step() (defined at hooks.py:22) did not return within 0.2 s "
                       "(agent.hook_timeout_s); it was at hooks.py:23 in step"),
    ("SyncResetHangs", "agent.env SyncResetHangs.reset() (defined at hooks.py:28) did not return within 0.2 s "
                       "(agent.hook_timeout_s); it was at hooks.py:29 in reset"),
    ("AsyncResetHangs", "agent.env AsyncResetHangs.reset() (defined at hooks.py:34) did not return within 0.2 s "
                        "(agent.hook_timeout_s); it was at hooks.py:35 in reset"),
    ("RolloutHangs", "agent.env RolloutHangs.rollout() (defined at hooks.py:39) did not return within 0.2 s "
                     "(agent.rollout_timeout_s); it was at hooks.py:41 in rollout"),
    # called by the built-in environment's step(): the reward function is named, not that step
    ("RewardHangs", "reward function reward_hangs (defined at hooks.py:45) did not return within 0.2 s "
                    "(agent.hook_timeout_s); it was at hooks.py:46 in reward_hangs"),
    ("AsyncRewardHangs", "reward function async_reward_hangs (defined at hooks.py:54) did not return within 0.2 s "
                         "(agent.hook_timeout_s); it was at hooks.py:55 in async_reward_hangs"),
]


@pytest.mark.parametrize("name,expected", HUNG, ids=[case[0] for case in HUNG])
def test_a_hung_hook_fails_its_episode_within_the_timeout_naming_its_line(hooks, name, expected):
    started = time.monotonic()
    with pytest.raises(UserCodeError) as raised:
        asyncio.run(one_episode(hooks(name)(), hook_timeout_s=TIMEOUT_S, rollout_timeout_s=TIMEOUT_S))
    assert str(raised.value) == expected
    assert time.monotonic() - started < TIMEOUT_S + 2  # not the 30 s the hook would take


@pytest.mark.parametrize("name", ["SyncStepInTime", "AsyncStepInTime"])
def test_a_hook_returning_within_its_timeout_passes(hooks, name):
    """0.25 s of a 0.5 s bound: the timer is the deadline, not a poll that could fire early."""
    assert asyncio.run(one_episode(hooks(name)(), hook_timeout_s=0.5)).reward == 1.0


def test_a_blocking_synchronous_hook_stalls_no_other_episode(hooks):
    """8 episodes whose step() blocks 0.5 s end together: the steps run on threads, not on the event loop."""
    async def eight():
        return await asyncio.gather(*(one_episode(hooks("BlockingStep")()) for _ in range(8)))

    started = time.monotonic()
    assert [t.reward for t in asyncio.run(eight())] == [1.0] * 8
    assert time.monotonic() - started < 2.0  # one after another: 4 s


CONTRACTS = [  # reward function -> what its line says it returned
    ("returns_none", 80, "NoneType None"), ("returns_text", 84, "str '1.0'"), ("returns_bool", 88, "bool True"),
    ("returns_nan", 92, "float nan"), ("returns_no_score", 96, "dict {'acc': 1.0}"),
]


@pytest.mark.parametrize("name,defined,returned", CONTRACTS, ids=[case[0] for case in CONTRACTS])
def test_a_reward_function_returning_no_number_is_named_not_the_step_calling_it(hooks, name, defined, returned):
    env = hooks("Environment")()  # the built-in chat environment: its step() calls the reward function
    env.reward_fn = hooks(name)
    with pytest.raises(UserCodeError) as raised:
        asyncio.run(one_episode(env))
    assert str(raised.value) == (f"reward function {name} (defined at hooks.py:{defined}) returned {returned}; "
                                 f"return a finite number, or a dict with a finite number as 'score'")

