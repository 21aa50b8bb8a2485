"""Environments by import/file path, verl-format datasets (parquet, jsonl) and verl-style reward functions."""

import asyncio
import concurrent.futures
import json
import math

import numpy as np
import pytest

from nanoverl_async.config import AgentConfig, ConfigError, load_config
from nanoverl_async.agents.data import DatasetPrompts
from nanoverl_async.agents.env import Environment, FunctionEnv, Step, env_factory
from nanoverl_async.controller.preflight import prepare
from nanoverl_async.agents.agent_loop import run_episode
from nanoverl_async.agents.engine import Completion
from nanoverl_async.agents.multiply_task import MultiplyEnv
from nanoverl_async.agents.rewards import load_reward, math_compute_score, score_sample
from nanoverl_async.models.tiny import build_tokenizer
from nanoverl_async.agents.user_code import UserCodeError, load_object

ROWS = [{"data_source": "toy", "prompt": [{"role": "user", "content": f"{i}+{i}?"}],
         "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i}} for i in range(5)]
REWARD_FILE = '''
async def compute_score(data_source, solution_str, ground_truth, extra_info):
    return {"score": float(solution_str.strip() == ground_truth), "length": len(solution_str)}
'''
ENV_FILE = '''
from nanoverl_async import Environment, Step
class Echo(Environment):
    async def step(self, sample, message):
        return Step(reward=0.5)
async def rollout(episode, sample):
    return 0.25
'''


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def write_parquet(path, rows):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_load_object_by_module_and_file(tmp_path):
    assert load_object("nanoverl_async.agents.multiply_task:MultiplyEnv") is MultiplyEnv
    (tmp_path / "my_env.py").write_text(ENV_FILE)
    echo = load_object(f"{tmp_path}/my_env.py:Echo")
    assert issubclass(echo, Environment)
    for spec, why in [("nomodule", "is not of the form"), (f"{tmp_path}/nope.py:X", "does not exist"),
                      ("nanoverl_async.agents.env:Nope", "has no attribute 'Nope'")]:
        with pytest.raises(ValueError, match=why):
            load_object(spec)


def test_env_factory_classes_functions_and_reward(tmp_path):
    (tmp_path / "my_env.py").write_text(ENV_FILE)
    assert isinstance(env_factory("builtin:multiply")(), MultiplyEnv)
    make = env_factory(f"{tmp_path}/my_env.py:rollout")
    assert isinstance(make(), FunctionEnv) and make() is not make()  # one per episode

    def reward(*args):
        return 1.0

    assert env_factory("builtin:chat", reward)().reward_fn is reward
    with pytest.raises(ValueError, match="neither a class"):
        env_factory("nanoverl_async.agents.multiply_task:score")


def test_the_builtin_format_takes_one_tool_exactly(tmp_path):
    """`<call>EXPR</call>` names no tool: with two the model could only ever call the first, so two are refused
    at start, and one (the built-in task's calculator) is taken."""
    (tmp_path / "two.py").write_text(
        "from nanoverl_async import Environment\n\n\n"
        "def add(a: int) -> int:\n    \"\"\"Add one.\"\"\"\n    return a + 1\n\n\n"
        "def double(a: int) -> int:\n    \"\"\"Double.\"\"\"\n    return 2 * a\n\n\n"
        "class Two(Environment):\n    tools = [add, double]\n    tool_format = 'builtin'\n\n\n"
        "class TwoHermes(Two):\n    tool_format = 'hermes'\n")
    with pytest.raises(ValueError, match=r"declares 2 tools in the builtin format, whose <call>EXPR</call> names "
                                         r"none: use one tool, or tool_format = \"hermes\""):
        env_factory(f"{tmp_path}/two.py:Two")
    assert len(env_factory(f"{tmp_path}/two.py:TwoHermes").tools) == 2
    assert [tool.name for tool in env_factory("builtin:multiply").tools] == ["calculator"]  # builtin, one tool


@pytest.mark.parametrize("writer,suffix", [(write_jsonl, "jsonl"), (write_parquet, "parquet")])
def test_dataset_prompts(tmp_path, writer, suffix):
    path = writer(tmp_path / f"train.{suffix}", ROWS)
    prompts = DatasetPrompts([path], seed=3)
    first_epoch = [prompts(i) for i in range(5)]
    assert sorted(s["row"] for s in first_epoch) == list(range(5))  # every row once per epoch
    sample = first_epoch[0]
    assert sample["messages"][0]["role"] == "user" and sample["index"] == 0 and "prompt" not in sample
    assert sample["reward_model"]["ground_truth"] == str(2 * sample["row"])
    again = DatasetPrompts([path], seed=3)
    assert [again(i) for i in range(7)] == [prompts(i) for i in range(7)]  # pure in (files, seed, index)
    json.dumps(sample)  # JSON-able (travels as msgpack)


def test_bad_rows_fail_loudly(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "not messages"}])
    with pytest.raises(ValueError, match="bad.jsonl row 0: column 'prompt' must be a list"):
        DatasetPrompts([path], 0)(0)


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_bad_dataset_row_stops_the_launch_naming_file_row_and_columns(tmp_path, suffix):
    """Checked when the run starts (it used to kill the buffer mid-run, buried in a Ray traceback)."""
    rows = ROWS + [{"question": "2+2?", "reward_model": {"ground_truth": "4"}}]  # the last row has no prompt
    path = (write_jsonl if suffix == "jsonl" else write_parquet)(tmp_path / f"train.{suffix}", rows)
    with pytest.raises(ConfigError, match=rf"'data.train_files': .*train.{suffix} row {len(ROWS)}: no 'prompt' "
                                          r"column \(the row has .*'reward_model'"):
        prepare(load_config(None, [f"data.train_files={path}"]))
    (tmp_path / "val.jsonl").write_text('{"prompt": [{"role": "user", "content": "hi"}]}\n{"prompt": [\n')
    with pytest.raises(ConfigError, match=r"'data.val_files': .*val.jsonl line 2: not JSON"):
        prepare(load_config(None, [f"data.val_files={tmp_path}/val.jsonl", "run.eval_every=1"]))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(ConfigError, match=r"'data.train_files': .*broken.parquet: not a readable parquet file"):
        prepare(load_config(None, [f"data.train_files={tmp_path}/broken.parquet"]))


def test_a_single_data_path_is_a_one_file_list(tmp_path):
    """data.train_files=path.parquet, as every verl command line writes it (a config error before)."""
    assert load_config(None, ["data.train_files=train.parquet"]).data.train_files == ["train.parquet"]
    (tmp_path / "c.yaml").write_text("data:\n  train_files: a.jsonl\n  val_files: [b.jsonl, c.jsonl]\n")
    data = load_config(str(tmp_path / "c.yaml")).data
    assert data.train_files == ["a.jsonl"] and data.val_files == ["b.jsonl", "c.jsonl"]


def test_reward_functions(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    fn = load_reward(str(tmp_path / "reward.py"), "compute_score")
    sample = {**ROWS[2], "messages": ROWS[2]["prompt"]}
    assert asyncio.run(score_sample(fn, sample, "4")) == (1.0, {"length": 1.0})
    assert asyncio.run(score_sample(None, sample, "so \\boxed{4}")) == (1.0, {})
    with pytest.raises(UserCodeError, match="returned float nan; return a finite number"):
        asyncio.run(score_sample(lambda *a: math.nan, sample, "4"))
    assert math_compute_score("", "\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_compute_score("", "\\boxed{3}", "4") == 0.0
    assert load_reward("", "compute_score") is None


def test_a_reward_is_a_finite_number_wherever_it_comes_from():
    """Step, a rollout and a reward function share one rule (rewards.is_reward): numpy numbers pass, and
    None, text, a bool, NaN and inf are refused where they are made."""
    sample = {"reward_model": {"ground_truth": "4"}}
    for good in (1, 0.5, np.float32(0.25), np.int64(-1)):
        assert Step(reward=good).reward == good and asyncio.run(score_sample(lambda *a: good, sample, "")) == (good, {})
    for bad in (None, "1", True, math.nan, -math.inf):
        with pytest.raises(ValueError, match="the reward must be a finite number"):
            Step(reward=bad)
        with pytest.raises(UserCodeError, match="; return a finite number, or a dict with a finite number as 'score'"):
            asyncio.run(score_sample(lambda *a: bad, sample, ""))


class OneTurnEngine:
    def __init__(self, tokenizer, text):
        self.ids, self.version = tokenizer.encode(text, add_special_tokens=False), 0

    async def generate(self, input_ids, params, episode_id=None):
        return Completion(self.ids, [-0.1] * len(self.ids), [0] * len(self.ids), "stop")


def test_the_default_reward_works_off_the_main_thread():
    """A generator's event loop runs in a Ray actor's thread, where math-verify's signal timeouts raise."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        scores = pool.submit(lambda: [math_compute_score("", "The answer is 1081.", "1081"),
                                      math_compute_score("", "\\boxed{3}", "4")]).result()
    assert scores == [1.0, 0.0]


def test_dataset_episode_with_custom_reward(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    tokenizer = build_tokenizer()
    env = env_factory("builtin:chat", load_reward(str(tmp_path / "reward.py"), "compute_score"))()
    sample = DatasetPrompts([write_jsonl(tmp_path / "t.jsonl", ROWS[3:4])], 0)(0)
    t = asyncio.run(run_episode(OneTurnEngine(tokenizer, "6<|end|>"), tokenizer, sample, env,
                                AgentConfig(max_total_tokens=64), 1.0))
    assert (t.reward, t.num_turns, t.tool_calls, t.info["reward_info"]) == (1.0, 1, 0, {"length": 1.0})


def test_preflight_names_the_bad_key(tmp_path, monkeypatch):
    for override, key in ((f"data.train_files=[{tmp_path}/missing.parquet]", "data.train_files.*does not exist"),
                          ("agent.env=nanoverl_async.agents.env:Nope", "agent.env"),
                          ("agent.env=builtin:nope", "agent.env.*the built-ins are builtin:multiply, "
                           "builtin:slow-tool, builtin:long-tail, builtin:code, builtin:chat"),
                          (f"reward.path={tmp_path}/none.py", "reward.path"),
                          ("data.task=builtin:nope", "data.task")):
        cfg = load_config(None, [override])  # values are fine: only launching looks at files and user code
        with pytest.raises(ConfigError, match=key):
            prepare(cfg)
    with pytest.raises(ConfigError, match="agent.max_tool_calls"):
        load_config(None, ["agent.max_tool_calls=0"])
    (tmp_path / "sub").mkdir()
    path = write_jsonl(tmp_path / "sub" / "t.jsonl", ROWS)
    (tmp_path / "sub" / "r.py").write_text(REWARD_FILE)
    monkeypatch.chdir(tmp_path)
    cfg = prepare(load_config(None, ["data.train_files=[sub/t.jsonl]", "reward.path=sub/../sub/r.py"]))
    assert cfg.data.train_files == [path] and cfg.agent.env == "builtin:chat"  # absolute; the default filled in
    assert cfg.reward.path == str(tmp_path / "sub" / "r.py")


def test_a_user_file_imports_the_module_beside_it(tmp_path):
    (tmp_path / "helper_mod_beside.py").write_text("VALUE = 41\n")
    (tmp_path / "env_with_helper.py").write_text("import helper_mod_beside\nANSWER = helper_mod_beside.VALUE + 1\n")
    assert load_object(f"{tmp_path}/env_with_helper.py:ANSWER") == 42


def test_full_control_rollout_function():
    tokenizer = build_tokenizer()

    async def rollout(episode, sample):
        episode.start(sample["messages"])
        first = await episode.generate()
        assert episode.observe([{"role": "user", "content": "sure?"}])
        second = await episode.generate()
        return float(second["content"] == "6")

    engine = OneTurnEngine(tokenizer, "6<|end|>")
    t = asyncio.run(run_episode(engine, tokenizer, {"messages": [{"role": "user", "content": "2*3?"}]},
                                FunctionEnv(rollout), AgentConfig(max_total_tokens=64), 1.0))
    text = tokenizer.decode(t.token_ids.tolist(), skip_special_tokens=False)
    assert text == "<|user|>2*3?<|end|><|assistant|>6<|end|><|user|>sure?<|end|><|assistant|>6<|end|>"
    assert (t.reward, t.num_turns, int(t.loss_mask.sum())) == (1.0, 2, 4)
