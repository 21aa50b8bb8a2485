"""model.warm_start (controller/warm_start.py): demonstrations written by a solver through the real agent loop, the
supervised steps on them, the cache, the held-out report, and each wrong solver in one line.

Run alone: `python -m pytest tests/test_warm_start.py -q` (~30 s: two small warm starts of builtin:tiny).
"""

import asyncio
import json
from pathlib import Path

import pytest
import torch

from nanoverl_async.agents.env import env_factory
from nanoverl_async.agents.tool_parsers import FORMATS, parse_turn, write_calls
from nanoverl_async.agents.user_code import UserCodeError, load_object
from nanoverl_async.config import ConfigError, load_config
from nanoverl_async.models.load import load_tokenizer, resolve_model_path
from nanoverl_async.controller import warm_start
from nanoverl_async.controller.preflight import prepare

SOLVER = '''
def solve(sample, messages):
    if messages[-1]["role"] != "tool":
        return {"name": "calculator", "arguments": {"expression": f"{sample['a']}*{sample['b']}"}}
    return messages[-1]["content"]


def wrong_type(sample, messages):
    return 408


def no_arguments(sample, messages):
    return {"name": "calculator"}


def two_calls(sample, messages):
    call = {"name": "calculator", "arguments": {"expression": "1*2"}}
    return [call, call]


def rambles(sample, messages):
    return "408 " * 40


def never_right(sample, messages):
    return "0"


import threading

RELEASE = threading.Event()  # set by the test: no stuck thread outlives it


def hangs(sample, messages):
    RELEASE.wait(30)
'''


@pytest.fixture
def solver_file(tmp_path):
    path = tmp_path / "solver.py"
    path.write_text(SOLVER)
    return path


def config(tmp_path, solver_file, *overrides):
    return prepare(load_config("configs/agent_grpo.yaml", [
        f"model.warm_start.solver={solver_file}:solve", "model.warm_start.demos=24", "model.warm_start.epochs=1",
        "model.warm_start.eval_episodes=8", f"model.cache_dir={tmp_path / 'cache'}",
        f"run.output_dir={tmp_path / 'run'}", *overrides]))


@pytest.mark.parametrize("tool_format", FORMATS)
def test_written_calls_parse_back_as_those_calls(tool_format):
    call = {"name": "calculator", "arguments": {"expression": "12*34"}}
    calls = [call, {"name": "price", "arguments": {"item": "pear"}}] if tool_format == "hermes" else [call]
    content, parsed = parse_turn(write_calls(calls, tool_format), tool_format, "calculator", "expression")
    assert content == "" and [(p.name, p.arguments, p.error) for p in parsed] == \
        [(c["name"], c["arguments"], None) for c in calls]


@pytest.mark.parametrize("tool_format", ["builtin", "json"])
def test_a_one_call_format_refuses_two_calls_in_a_turn(tool_format):
    call = {"name": "calculator", "arguments": {"expression": "1*2"}}
    with pytest.raises(ValueError, match=f"the {tool_format} format writes one call a turn, not 2"):
        write_calls([call, call], tool_format)


def test_demonstrations_are_real_episodes_of_the_environment(tmp_path, solver_file):
    """The solver's turns become exactly the tokens an RL episode holds: the call in the environment's format,
    the tool's result appended with loss mask 0, the answer; the environment's reward."""
    cfg = config(tmp_path, solver_file)
    tokenizer = load_tokenizer(resolve_model_path("builtin:tiny"))
    sample = {"a": 12, "b": 34, "answer": "408", "messages": [{"role": "user", "content": "12*34?"}]}
    solver = load_object(f"{solver_file}:solve")
    [(ids, mask, reward)] = asyncio.run(warm_start.demonstrations(solver, [sample], env_factory(cfg.agent.env),
                                                                  tokenizer, cfg))
    assert tokenizer.decode(ids) == "<|user|>12*34?<|end|><|assistant|><call>12*34</call><res>408</res>408<|end|>"
    written = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert written == "<call>12*34</call>408<|end|>" and reward == 1.0


@pytest.mark.parametrize("name,problem", [
    ("wrong_type", r"returned int 408; return a final answer \(str\), or a tool call"),
    ("no_arguments", r"returned dict \{'name': 'calculator'\}; return a final answer"),
    ("two_calls", r": the builtin format writes one call a turn, not 2"),
    ("rambles", r"wrote a turn of \d+ tokens, more than the 16 that agent.max_new_tokens and max_total_tokens leave"),
])
def test_a_wrong_solver_is_named_with_its_line(tmp_path, solver_file, name, problem):
    cfg = config(tmp_path, solver_file)
    tokenizer = load_tokenizer(resolve_model_path("builtin:tiny"))
    sample = {"a": 1, "b": 2, "answer": "2", "messages": [{"role": "user", "content": "1*2?"}]}
    solver = load_object(f"{solver_file}:{name}")
    with pytest.raises(UserCodeError, match=rf"^model.warm_start.solver {name} \(defined at solver.py:\d+\)"
                                            rf"{'' if problem.startswith(':') else ' '}{problem}"):
        asyncio.run(warm_start.demonstrations(solver, [sample], env_factory(cfg.agent.env), tokenizer, cfg))


def test_a_hung_solver_is_named_with_its_line_at_the_hook_timeout(tmp_path, solver_file):
    cfg = config(tmp_path, solver_file, "agent.hook_timeout_s=0.2")
    tokenizer = load_tokenizer(resolve_model_path("builtin:tiny"))
    sample = {"a": 1, "b": 2, "answer": "2", "messages": [{"role": "user", "content": "1*2?"}]}
    try:
        with pytest.raises(UserCodeError, match=r"^model.warm_start.solver hangs \(defined at solver.py:\d+\) did not "
                                                r"return within 0.2 s \(agent.hook_timeout_s\); it was at solver.py:"
                                                r"\d+ in hangs$"):
            asyncio.run(warm_start.demonstrations(load_object(f"{solver_file}:hangs"), [sample],
                                                  env_factory(cfg.agent.env), tokenizer, cfg))
    finally:
        load_object(f"{solver_file}:RELEASE").set()


def test_a_solver_whose_demonstrations_all_fail_is_refused_before_training(tmp_path, solver_file):
    cfg = config(tmp_path, solver_file, f"model.warm_start.solver={solver_file}:never_right")
    with pytest.raises(ConfigError, match=r"^config key 'model.warm_start.solver': model.warm_start.solver "
                                          r"never_right \(defined at solver.py:\d+\): none of its 24 demonstrations "
                                          r"earned a reward > 0 from agent.env$"):
        warm_start.start_model(cfg, resolve_model_path("builtin:tiny"))
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # nothing half-built is left


def test_a_missing_solver_is_refused_at_preflight(tmp_path, solver_file):
    with pytest.raises(ConfigError, match=r"^config key 'model.warm_start.solver': .*solver.py has no attribute "
                                          r"'missing'"):
        config(tmp_path, solver_file, f"model.warm_start.solver={solver_file}:missing")


@pytest.mark.parametrize("key", ["demos", "epochs", "batch_size", "lr", "eval_episodes"])
def test_its_counts_must_be_positive(tmp_path, solver_file, key):
    with pytest.raises(ConfigError, match=rf"^config key 'model.warm_start.{key}': must be > 0"):
        config(tmp_path, solver_file, f"model.warm_start.{key}=0")
    smallest = "1.0e-9" if key == "lr" else "1"
    assert getattr(config(tmp_path, solver_file, f"model.warm_start.{key}={smallest}").model.warm_start, key) \
        == float(smallest)


def test_off_by_default_and_the_base_is_used(tmp_path):
    cfg = load_config("configs/agent_grpo.yaml", [f"run.output_dir={tmp_path}"])
    assert cfg.model.warm_start.solver == "" and warm_start.warm_started(cfg, "/some/base") == "/some/base"


def test_warm_started_once_then_cached_and_reported(tmp_path, solver_file, capfd):
    """The model trains on the demonstrations (its loss on them falls), is saved with what it measured, and a
    second call finds it; a changed setting or an edited solver makes another."""
    cfg, base = config(tmp_path, solver_file), resolve_model_path("builtin:tiny")
    path = warm_start.warm_started(cfg, base)
    assert Path(path).parent == tmp_path / "cache"
    assert "building the warm start of builtin:tiny" in capfd.readouterr().err
    results = json.loads((Path(path) / warm_start.RESULTS).read_text())
    assert results["demos"] == results["trained"] == 24 and results["loss"] < 0.5
    assert all(results[m]["episodes"] == 8 and 0 <= results[m]["tool_call_rate"] <= 1 for m in ("base", "warm_started"))
    line = warm_start.report(path)
    assert line.startswith("warm start: trained on 24 of 24 demonstrations (final loss ") and path in line
    assert "on 8 held-out episodes, tool calls in " in line and "(base model " in line
    assert warm_start.warm_started(cfg, base) == path and "building" not in capfd.readouterr().err
    assert warm_start.warm_started(config(tmp_path, solver_file, "model.warm_start.lr=1e-4"), base) != path
    solver_file.write_text(SOLVER + "\n# edited\n")
    assert warm_start.warm_started(config(tmp_path, solver_file), base) != path
    assert warm_start.report(base) == ""


def test_training_lowers_the_loss_on_the_written_tokens():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny"))
    ids = list(range(5, 25))
    losses = [warm_start.train(model, [(ids, [0] * 10 + [1] * 10)], 1, 1, 1e-3, 0) for _ in range(5)]
    assert losses[-1] < losses[0] and not model.training
