"""The built-in workloads: slow tools (agents/slow_tool_task.py), long tails (agents/long_tail_task.py) and code
(agents/code_task.py): the latency sampler, each environment's reward and step logic through the real agent
loop (a scripted engine), the warm-start demos against the rendering the loop makes, `agent.env_args`; and
(slow, under the heavy lock) that the tiny model learns each in a short run of its config.

Run alone: `python -m pytest tests/test_workloads.py -q -m "not slow"`; the learning runs (~3 min on 2 cores,
with the models built): `python -m pytest tests/test_workloads.py -q -m slow`.
"""

import asyncio
import json
import random
import statistics
import time

import pytest
from test_agent_loop import ScriptedEngine, episode

from nanoverl_async.agents import code_task, long_tail_task, multiply_task, sandbox
from nanoverl_async.agents.agent_loop import run_episode
from nanoverl_async.agents.env import env_factory
from nanoverl_async.agents.slow_tool_task import Lognormal, SlowToolEnv
from nanoverl_async.agents.tools import as_tool, call_tool
from nanoverl_async.config import AgentConfig, ConfigError, load_config
from nanoverl_async.launcher import launch
from nanoverl_async.models.cache import recipe_digest
from nanoverl_async.models.tiny import TinyRecipe, build_tokenizer, demo_batch, demo_pieces
from nanoverl_async.controller.preflight import prepare


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_lognormal_quantiles_are_exact_and_the_sampler_draws_them():
    latency = Lognormal()  # the default: median 0.2 s, p99 2 s
    assert latency.quantile(0.5) == pytest.approx(0.2, rel=1e-12)
    assert latency.quantile(0.99) == pytest.approx(2.0, rel=1e-12)
    assert latency.sigma == pytest.approx(0.98979, abs=1e-5)  # ln(10) / 2.32635
    rng = random.Random(0)
    draws = sorted(latency.sample(rng) for _ in range(100_000))
    assert statistics.median(draws) == pytest.approx(0.2, rel=0.02)
    assert draws[98_999] == pytest.approx(2.0, rel=0.05)  # the empirical 99th percentile
    assert draws[0] > 0
    fixed = Lognormal(0.3, 0.3)  # p99 == median: no spread
    assert {fixed.sample(rng) for _ in range(10)} == {0.3}


@pytest.mark.parametrize("median_s, p99_s", [(0.0, 1.0), (-0.1, 1.0), (0.2, 0.19999)])
def test_lognormal_refuses_what_has_no_such_quantiles(median_s, p99_s):
    with pytest.raises(ValueError, match="0 < median_s <= p99_s"):
        Lognormal(median_s, p99_s)


def delays(env: SlowToolEnv, episode_id: str, calls: int) -> list[float]:
    """The delays `env` waits in an episode with this id."""
    env.reseed(episode_id)
    return [env.latency.sample(env.rng) for _ in range(calls)]


@pytest.mark.parametrize("blocking", [False, True])
def test_slow_tool_episode_waits_its_seeded_delays_then_answers(tokenizer, blocking):
    env = SlowToolEnv(median_s=0.05, p99_s=0.2, blocking=blocking, seed=3)
    tool = as_tool(env.tools[0])
    assert tool.schema == as_tool(multiply_task.calculator).schema  # the model sees the same calculator
    assert asyncio.iscoroutinefunction(tool.fn) is not blocking
    sample = multiply_task.make_prompt(0, 1)
    engine = ScriptedEngine(tokenizer, [f"<call>{sample['a']}*{sample['b']}</call>", f"{sample['answer']}<|end|>"])
    started = time.perf_counter()
    trajectory = episode(engine, tokenizer, sample, env)  # trajectory id 1-7-2
    took = time.perf_counter() - started
    assert (trajectory.reward, trajectory.tool_calls, trajectory.tool_errors) == (1.0, 1, 0)
    expected = delays(SlowToolEnv(median_s=0.05, p99_s=0.2, seed=3), "1-7-2", 1)[0]
    assert trajectory.timings["tool"] >= expected and took >= expected
    assert trajectory.timings["tool"] < expected + 0.5


@pytest.mark.parametrize("blocking", [False, True])
def test_64_episodes_waiting_on_a_2s_tool_hold_back_none_of_the_others(tokenizer, blocking):
    """64 episodes of one generator's loop at once, each calling a tool that takes 2 s (as `async def` and as a
    blocking function): the calls overlap, so all 64 end in under 3x the tool's latency, each with its answer."""
    latency_s, episodes = 2.0, 64
    agent = AgentConfig(max_turns=3, max_new_tokens=16, max_total_tokens=96, tool_timeout_s=5.0)
    samples = [multiply_task.make_prompt(0, index) for index in range(episodes)]

    async def one(sample: dict):
        engine = ScriptedEngine(tokenizer, [f"<call>{sample['a']}*{sample['b']}</call>", f"{sample['answer']}<|end|>"])
        env = SlowToolEnv(median_s=latency_s, p99_s=latency_s, blocking=blocking)
        return await run_episode(engine, tokenizer, sample, env, agent, 1.0, sample_index=sample["index"])

    async def all_at_once():
        return await asyncio.gather(*(one(sample) for sample in samples))

    started = time.perf_counter()
    trajectories = asyncio.run(all_at_once())
    took = time.perf_counter() - started
    assert [(t.reward, t.tool_calls, t.tool_errors) for t in trajectories] == [(1.0, 1, 0)] * episodes
    assert min(t.timings["tool"] for t in trajectories) >= latency_s
    assert latency_s <= took < 3 * latency_s, took


def test_slow_tool_delays_repeat_per_episode_and_differ_between_episodes():
    env = SlowToolEnv(seed=0)
    first = delays(env, "0-4-1", 5)
    assert delays(SlowToolEnv(seed=0), "0-4-1", 5) == first
    assert delays(SlowToolEnv(seed=0), "0-4-2", 5) != first  # the group's other episodes
    assert delays(SlowToolEnv(seed=1), "0-4-1", 5) != first  # another seed
    assert len(set(first)) == 5


def test_slow_tool_timeout_is_an_error_observation():
    env = SlowToolEnv(median_s=1.0, p99_s=1.0, blocking=False)
    result = asyncio.run(call_tool(as_tool(env.tools[0]), {"expression": "2*3"}, timeout_s=0.05))
    assert (result.text, result.error) == ("error: timeout after 0.05s", True)


def test_env_args_reach_every_instance_and_bad_ones_are_refused(tmp_path):
    make = env_factory("builtin:slow-tool", env_args={"median_s": 0.5, "p99_s": 4.0, "blocking": True})
    env = make()
    assert env.latency == Lognormal(0.5, 4.0) and not asyncio.iscoroutinefunction(env.tools[0])
    assert make().latency == env.latency and make() is not env
    assert env_factory("builtin:slow-tool")().latency == Lognormal(0.2, 2.0)
    for args, message in [({"median": 0.5}, "unexpected keyword argument 'median'"),
                          ({"median_s": 3.0}, "0 < median_s <= p99_s"),
                          ({"blocking": "no"}, "blocking must be true or false, got 'no'")]:
        with pytest.raises(ValueError, match=f"^agent.env_args .*{message}"):
            env_factory("builtin:slow-tool", env_args=args)
    (tmp_path / "fn_env.py").write_text("async def rollout(episode, sample):\n    return 0.0\n")
    with pytest.raises(ValueError, match="is a rollout function, which takes none"):
        env_factory(f"{tmp_path}/fn_env.py:rollout", env_args={"x": 1})
    cfg = load_config("configs/slow_tool.yaml", ["agent.env_args.blocking=true"])
    assert cfg.agent.env_args == {"median_s": 0.2, "p99_s": 2.0, "blocking": True, "seed": 0}
    with pytest.raises(ConfigError, match=r"^config key 'agent.env': agent.env_args \{'median_s': 0.2, 'p99_s': 0.1, "):
        prepare(load_config("configs/slow_tool.yaml", ["agent.env_args.p99_s=0.1"]))  # one line, before any role


def test_long_tail_prompts_draw_one_to_three_questions_in_their_proportions():
    samples = [long_tail_task.make_prompt(0, i) for i in range(3000)]
    assert samples[7] == long_tail_task.make_prompt(0, 7) and json.loads(json.dumps(samples[7])) == samples[7]
    counts = [sum(len(s["questions"]) == k for s in samples) for k in (1, 2, 3)]
    assert sum(counts) == 3000
    for count, weight in zip(counts, long_tail_task.WEIGHTS):
        assert count / 3000 == pytest.approx(weight, abs=0.03)
    for s in samples[:50]:
        assert s["messages"] == [{"role": "user", "content": s["questions"][0]}]
        for question, answer in zip(s["questions"], s["answers"]):
            a, b = question.rstrip("?").split("*")
            assert answer == str(int(a) * int(b)) and int(a) < 100 and int(b) < 100


def three_questions() -> dict:
    return next(s for s in map(lambda i: long_tail_task.make_prompt(0, i), range(100)) if len(s["questions"]) == 3)


def test_long_tail_episode_asks_each_question_after_the_last_answer(tokenizer):
    sample = three_questions()
    (q1, q2, q3), (a1, a2, a3) = sample["questions"], sample["answers"]
    turns = [f"<call>{q1[:-1]}</call>", f"{a1}<|end|>", "7<|end|>", f"<call>{q3[:-1]}</call>", f"{a3}<|end|>"]
    engine = ScriptedEngine(tokenizer, turns)
    t = episode(engine, tokenizer, sample, long_tail_task.LongTailEnv(), max_turns=6, max_total_tokens=160)
    assert (t.num_turns, t.tool_calls, t.finish_reason) == (5, 2, "stop")
    assert t.reward == pytest.approx(2 / 3)  # the second answer is wrong (unless it is 7)
    text = tokenizer.decode(t.token_ids, skip_special_tokens=False)
    assert text == (f"<|user|>{q1}<|end|><|assistant|><call>{q1[:-1]}</call><res>{a1}</res>{a1}<|end|>"
                    f"<|user|>{q2}<|end|><|assistant|>7<|end|><|user|>{q3}<|end|><|assistant|>"
                    f"<call>{q3[:-1]}</call><res>{a3}</res>{a3}<|end|>")
    assert a2 != "7"


def test_long_tail_step_rewards_the_share_so_far_and_ends_after_the_last_question():
    sample = three_questions()
    env = long_tail_task.LongTailEnv()
    steps = [asyncio.run(env.step(sample, {"role": "assistant", "content": content}))
             for content in (f" {sample['answers'][0]}\n", "wrong", sample["answers"][2])]
    assert [(s.reward, s.done) for s in steps] == [(1 / 3, False), (1 / 3, False), (2 / 3, True)]
    assert [s.messages for s in steps] == [[{"role": "user", "content": sample["questions"][1]}],
                                           [{"role": "user", "content": sample["questions"][2]}], []]


def test_long_tail_cut_by_turns_earns_nothing(tokenizer):
    sample = three_questions()
    turns = [f"{sample['answers'][0]}<|end|>", f"{sample['answers'][1]}<|end|>", "1<|end|>"]
    t = episode(ScriptedEngine(tokenizer, turns), tokenizer, sample, long_tail_task.LongTailEnv(), max_turns=2)
    assert (t.reward, t.num_turns, t.finish_reason) == (0.0, 2, "max_turns")


def test_code_values_are_pythons():
    rng = random.Random(0)
    texts = [code_task.expression(rng) for _ in range(3000)]
    assert all(code_task.value(text) == eval(text) for text in texts)  # noqa: S307 - our own integer expressions
    assert {len(text.replace("*", "+").replace("-", "+").split("+")) for text in texts} == {2, 3}
    sample = code_task.make_prompt(0, 3)
    assert sample == code_task.make_prompt(0, 3)
    assert sample["answer"] == str(code_task.value(sample["messages"][0]["content"].rstrip("?")))


@pytest.mark.skipif(bool(sandbox.unavailable()), reason="bubblewrap cannot isolate here")
def test_code_episode_runs_the_models_program_in_the_sandbox(tokenizer):
    sample = code_task.make_prompt(0, 3)
    program = f"print({sample['messages'][0]['content'][:-1]})"
    engine = ScriptedEngine(tokenizer, [f"<call>{program}</call>", f"{sample['answer']}<|end|>"])
    t = episode(engine, tokenizer, sample, env_factory("builtin:code")(), max_new_tokens=24)
    assert (t.reward, t.tool_calls, t.tool_errors) == (1.0, 1, 0)
    assert f"<res>{sample['answer']}\n</res>" in tokenizer.decode(t.token_ids, skip_special_tokens=False)
    wrong = episode(ScriptedEngine(tokenizer, ["<call>1/0</call>", "0<|end|>"]), tokenizer, sample,
                    code_task.CodeEnv())
    assert (wrong.reward, wrong.tool_errors) == (0.0, 0)  # a program that fails is output, not a tool error


@pytest.mark.parametrize("task, module", [("long-tail", long_tail_task), ("code", code_task)])
def test_warm_start_demos_are_what_the_environment_renders(tokenizer, task, module):
    """A demo that calls the tool on every question is, token for token, the episode the agent loop makes of
    the same turns (so the warm start teaches the format RL sees), trained exactly on the sampled tokens."""
    if task == "code" and sandbox.unavailable():
        pytest.skip("bubblewrap cannot isolate here")
    recipe = TinyRecipe(task=task, tool_fraction=0.999, call_rate=0.999, batch_size=1)  # every <call> trained
    rows = demo_batch(tokenizer, [demo_pieces(tokenizer, False)] * 2, recipe, random.Random(2))
    ids, labels = rows[0]["input_ids"][0].tolist(), rows[0]["labels"][0].tolist()
    drawn = module.demo(random.Random(2))  # the demo's questions: demo_batch draws them first
    assert task == "code" or len(drawn) == 3  # this seed's demo asks three questions
    sample = {"index": 0, "messages": [{"role": "user", "content": drawn[0][0]}],
              "questions": [q for q, *_ in drawn], "answers": [a for *_, a in drawn], "answer": drawn[0][3]}
    turns = [text for _, call, _, answer in drawn for text in (f"<call>{call}</call>", f"{answer}<|end|>")]
    env = env_factory(f"builtin:{task}")()
    t = episode(ScriptedEngine(tokenizer, turns), tokenizer, sample, env, max_turns=6, max_total_tokens=200,
                max_new_tokens=24)
    assert t.reward == 1.0 and ids == t.token_ids.tolist()
    assert [label != -100 for label in labels] == [bool(m) for m in t.loss_mask.tolist()]


def test_each_task_has_its_model_and_multiply_keeps_its_cache_directory():
    assert [TinyRecipe(task=task).kind for task in ("multiply", "long-tail", "code")] == \
        ["tiny", "tiny-long-tail", "tiny-code"]
    # the task names the directory; the digest is the recipe's, so builtin:tiny's directory is the one it had
    assert recipe_digest(TinyRecipe(task="code").contents()) == recipe_digest(TinyRecipe().contents())
    assert "task" not in TinyRecipe().contents()
    with pytest.raises(ValueError, match="TinyRecipe task 'chain' is not one of multiply, long-tail, code"):
        TinyRecipe(task="chain")


LEARNING_STEPS = 16


@pytest.mark.slow
@pytest.mark.parametrize("config", ["slow_tool", "long_tail", "code"])
def test_the_tiny_model_learns_the_workload(ray_session, tmp_path, config):
    """Its config for 16 steps (~30-60 s each on 2 cores, once the model is built): the mean reward of the last
    3 steps is at least 0.2 above that of the first 3 (it was ~0.2 -> ~0.6 in 16 steps, ~0.85 in 30)."""
    if config == "code" and sandbox.unavailable():
        pytest.skip("bubblewrap cannot isolate here")
    cfg = load_config(f"configs/{config}.yaml", [f"run.total_steps={LEARNING_STEPS}", f"run.output_dir={tmp_path}",
                                                 "run.progress=false"])
    launch(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, LEARNING_STEPS + 1))
    first, last = (statistics.mean(row["reward/mean"] for row in part) for part in (rows[:3], rows[-3:]))
    assert last >= first + 0.2, [round(row["reward/mean"], 2) for row in rows]
    calls = [row for row in rows if row["episodes/tool_calls"]]
    if config == "slow_tool":  # every call waited its delay: the batch means sit around the lognormal's 0.33 s
        assert statistics.mean(row["episodes/tool_latency_s"] for row in calls) >= 0.2
    if config == "long_tail":  # episodes of several questions, and with tool calls two turns each
        assert max(row["episodes/turns_mean"] for row in rows) > 2.0
