"""The agent loop: tokens in, tokens out, tool results as chat-template deltas with mask 0.

A scripted engine (it "samples" given texts) makes the tool paths deterministic; a tiny random Qwen2
behind the real BuiltinEngine checks that the behaviour logprobs are those of the very ids the
trajectory holds. Uses the built-in char-level tokenizer and chat template (tiny_model.build_tokenizer).
"""

import asyncio

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from nanoverl_async.agents import multiply_task
from nanoverl_async.config import AgentConfig
from nanoverl_async.agents.env import FunctionEnv, rollout_tools
from nanoverl_async.agents import agent_loop
from nanoverl_async.agents.agent_loop import PROMPTS_CACHED, render_prompt, run_episode
from nanoverl_async.agents.engine import Completion, SamplingParams
from nanoverl_async.generators.builtin_engine import BuiltinEngine
from nanoverl_async.models.tiny import build_tokenizer
from nanoverl_async.wire.trajectory import decode, encode, validate
from nanoverl_async.agents.user_code import UserCodeError, load_object


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


class ScriptedEngine:
    """Samples the given turn texts in order (cut to max_new_tokens); records what it was asked."""

    def __init__(self, tokenizer, turns: list[str], version: int = 3):
        self.turns = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
        self.version = version
        self.requests: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, input_ids, params, episode_id=None):
        self.requests.append((list(input_ids), params))
        ids = self.turns[len(self.requests) - 1]
        stop_at = next((i for i, t in enumerate(ids) if t in params.stop_token_ids), len(ids) - 1)
        ids = ids[: min(stop_at + 1, params.max_new_tokens)]
        reason = "stop" if ids[-1] in params.stop_token_ids else "length"
        return Completion(ids, [-0.5] * len(ids), [self.version] * len(ids), reason)

    def stage_weights(self, state_dict, version):
        self.version = version

    def in_flight(self):
        return 0


def episode(engine, tokenizer, sample, env=None, **agent):
    config = AgentConfig(**{"max_turns": 3, "max_new_tokens": 16, "max_total_tokens": 96, **agent})
    return asyncio.run(run_episode(engine, tokenizer, sample, env or multiply_task.MultiplyEnv(), config, 1.0,
                                   group_id=7, prompt_index=sample["index"], sample_index=2, generator_id=1))


def test_a_prompt_is_rendered_once_for_its_group_and_the_cache_keeps_the_newest(monkeypatch):
    tokenizer = build_tokenizer()  # its own: the cache keys on the tokenizer
    renders = []
    template = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: renders.append(1) or template(*a, **k))
    schemas = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate.",
                                                 "parameters": {"type": "object", "properties": {}}}}]
    prompts = [multiply_task.make_prompt(0, index)["messages"] for index in range(PROMPTS_CACHED + 1)]
    def ids(**kwargs):
        rendered = template(prompts[0], add_generation_prompt=True, **kwargs)
        return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)

    expected = ids(tools=schemas)
    for _ in range(8):  # a group: 8 copies of one prompt
        assert list(render_prompt(tokenizer, [dict(m) for m in prompts[0]], schemas)) == expected
    assert len(renders) == 1
    assert list(render_prompt(tokenizer, prompts[0], None)) == ids() != expected
    reordered = [{"type": "function", "function": dict(reversed(schemas[0]["function"].items()))}]
    render_prompt(tokenizer, prompts[0], reordered)  # the objects' order is part of the key: a template prints it
    assert len(renders) == 3
    for messages in prompts[1:]:  # PROMPTS_CACHED more prompts: prompts[0] with `schemas` is the oldest...
        render_prompt(tokenizer, messages, schemas)
    renders.clear()
    render_prompt(tokenizer, prompts[-1], schemas)  # ...the newest is kept
    assert renders == []
    render_prompt(tokenizer, prompts[0], schemas)  # ...and the oldest was let go at PROMPTS_CACHED + 1
    assert renders == [1] and len(agent_loop._PROMPTS) == PROMPTS_CACHED


def render(tokenizer, messages):
    rendered = tokenizer.apply_chat_template(messages)  # the full rendering, tokenized by the template call
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def test_tool_episode_is_the_template_rendering_of_its_messages(tokenizer):
    sample = multiply_task.make_prompt(0, 5)
    expression, answer = f"{sample['a']}*{sample['b']}", sample["answer"]
    engine = ScriptedEngine(tokenizer, [f"<call>{expression}</call>", f"{answer}<|end|>"])
    t = episode(engine, tokenizer, sample)

    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    messages = sample["messages"] + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                     {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]
    assert t.token_ids.tolist() == render(tokenizer, messages)  # prefix consistency, no re-encoding
    validate(t)
    assert (t.reward, t.num_turns, t.tool_calls, t.tool_errors, t.finish_reason) == (1.0, 2, 1, 0, "stop")
    assert (t.group_id, t.prompt_index, t.sample_index, t.generator_id) == (7, 5, 2, 1)
    # mask 1 exactly on the two sampled turns; the prompt and <res>...</res> are forced (mask 0, version -1)
    (prompt_ids, _), (second_input, _) = engine.requests
    sampled = np.zeros(len(t.token_ids), dtype=bool)
    sampled[len(prompt_ids): len(prompt_ids) + len(engine.turns[0])] = True
    sampled[len(second_input):] = True
    assert np.array_equal(t.loss_mask == 1, sampled)
    assert set(t.versions[sampled]) == {3} and set(t.versions[~sampled]) == {-1}
    assert np.all(t.behaviour_logprobs[sampled] == -0.5) and np.all(t.behaviour_logprobs[~sampled] == 0)
    tool_ids = t.token_ids[len(prompt_ids) + len(engine.turns[0]): len(second_input)].tolist()
    assert tokenizer.decode(tool_ids, skip_special_tokens=False) == f"<res>{answer}</res>"
    assert second_input == t.token_ids[: len(second_input)].tolist()  # the engine saw exactly these ids
    assert t.timings["episode"] >= t.timings["generate"] >= 0 and t.info["final_answer"] == answer
    assert decode(encode(t)).token_ids.tolist() == t.token_ids.tolist()


def test_malformed_and_raising_calls_become_error_observations(tokenizer):
    sample = multiply_task.make_prompt(0, 1)
    engine = ScriptedEngine(tokenizer, ["12</call>", "<call>1/2</call>", "<call></call>", "7<|end|>"])
    t = episode(engine, tokenizer, sample, max_turns=4, max_total_tokens=200)
    assert (t.num_turns, t.tool_calls, t.tool_errors, t.finish_reason, t.reward) == (4, 3, 3, "stop", 0.0)
    text = tokenizer.decode(t.token_ids.tolist(), skip_special_tokens=False)
    assert text.count("<res>error: ") == 3 and "<res>error: malformed call</res>" in text
    assert "<res>error: expected 'A*B'" in text  # the calculator's ValueError, cut to max_error_chars
    validate(t)


def test_slow_async_tool_times_out(tokenizer):
    async def slow_tool(expression: str) -> str:
        """Never answers in time."""
        await asyncio.sleep(10)

    class SlowEnv(multiply_task.MultiplyEnv):
        tools = [slow_tool]

    engine = ScriptedEngine(tokenizer, ["<call>2*3</call>", "6<|end|>"])
    t = episode(engine, tokenizer, multiply_task.make_prompt(0, 2), env=SlowEnv(), tool_timeout_s=0.05)
    assert t.tool_errors == 1 and "<res>error: timeout after 0.05s</res>" in tokenizer.decode(t.token_ids.tolist())
    assert t.timings["episode"] < 5


def test_turn_and_token_limits(tokenizer):
    sample = multiply_task.make_prompt(0, 3)
    engine = ScriptedEngine(tokenizer, ["<call>2*3</call>"] * 3)
    t = episode(engine, tokenizer, sample, max_turns=2, max_total_tokens=200)
    assert (t.num_turns, t.tool_calls, t.finish_reason) == (2, 2, "max_turns") and len(engine.requests) == 2

    long_turn = "1" * 30 + "<|end|>"
    engine = ScriptedEngine(tokenizer, [long_turn] * 3)
    t = episode(engine, tokenizer, sample, max_new_tokens=16, max_total_tokens=24)
    prompt_len = len(engine.requests[0][0])
    assert engine.requests[0][1].max_new_tokens == 24 - prompt_len  # the last turn is cut to fit
    assert len(t.token_ids) == 24 and (t.finish_reason, t.num_turns) == ("length", 1)

    engine = ScriptedEngine(tokenizer, ["<call>99*99</call>", "9801<|end|>"])  # the result would not fit
    t = episode(engine, tokenizer, sample, max_total_tokens=prompt_len + 13)
    assert (t.finish_reason, t.tool_calls, len(engine.requests)) == ("length", 1, 1)
    assert len(t.token_ids) <= prompt_len + 13 and t.loss_mask[-1] == 1


def test_prompt_too_long_fails_loudly(tokenizer):
    with pytest.raises(ValueError, match="no room"):
        episode(ScriptedEngine(tokenizer, []), tokenizer, multiply_task.make_prompt(0, 0), max_new_tokens=4,
                max_total_tokens=5)


def test_real_engine_logprobs_are_of_the_trajectory_ids(tokenizer, tmp_path):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    engine = BuiltinEngine(str(tmp_path), seed=0)
    agent = AgentConfig(max_turns=3, max_new_tokens=12, max_total_tokens=48)

    async def main():
        return await asyncio.gather(*(run_episode(engine, tokenizer, multiply_task.make_prompt(0, i), multiply_task.MultiplyEnv(),
                                                  agent, 0.8, sample_index=i) for i in range(6)))

    trajectories = asyncio.run(main())
    for t in trajectories:
        validate(t)
        assert len(t.token_ids) <= 48 and t.num_generated > 0 and t.version == 0
        ids = torch.tensor(t.token_ids[None].astype(np.int64))
        with torch.no_grad():
            logprobs = torch.log_softmax(engine.model(input_ids=ids).logits[0, :-1] / 0.8, dim=-1)
        recomputed = logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1).numpy()
        sampled = t.loss_mask[1:] == 1
        np.testing.assert_allclose(t.behaviour_logprobs[1:][sampled], recomputed[sampled], atol=1e-4)


def test_tool_call_limit_ends_the_episode(tokenizer):
    engine = ScriptedEngine(tokenizer, ["<call>2*3</call>", "<call>2*3</call>", "6<|end|>"])
    t = episode(engine, tokenizer, multiply_task.make_prompt(0, 4), max_tool_calls=1, max_total_tokens=200)
    assert (t.finish_reason, t.tool_calls, t.num_turns, t.reward) == ("max_tool_calls", 1, 2, 0.0)
    validate(t)


USER_ENV = '''
from nanoverl_async import Environment, Step


def lookup(sample):
    return sample["answr"]  # the user's typo


class Typo(Environment):
    async def step(self, sample, message):
        return Step(reward=float(message["content"] == lookup(sample)))


class ReturnsFloat(Environment):
    def step(self, sample, message):
        return 1.0
'''


def test_user_errors_name_the_hook_and_the_users_own_frames(tokenizer, tmp_path):
    """A user's bug stops the episode with one line: the hook, the exception, and file:line of the user's
    frames only (the framework's are left out); a step returning a float is told to return a Step."""
    (tmp_path / "my_env.py").write_text(USER_ENV)
    sample = multiply_task.make_prompt(0, 5)
    with pytest.raises(UserCodeError) as raised:
        episode(ScriptedEngine(tokenizer, ["42<|end|>"]), tokenizer, sample,
                env=load_object(f"{tmp_path}/my_env.py:Typo")())
    message = str(raised.value)
    assert message.startswith("agent.env Typo.step() raised KeyError: 'answr' at my_env.py:6 in lookup <- "
                              "my_env.py:11 in step"), message
    assert "agent_loop" not in message and "\n" not in message
    with pytest.raises(UserCodeError, match=r"^agent.env ReturnsFloat.step\(\) \(defined at my_env.py:15\) returned "
                                            r"float 1.0; return a nanoverl_async.agents.env.Step"):
        episode(ScriptedEngine(tokenizer, ["42<|end|>"]), tokenizer, sample,
                env=load_object(f"{tmp_path}/my_env.py:ReturnsFloat")())


def test_a_rollout_function_runs_the_tools_it_declares(tokenizer):
    """A plain rollout function gets tools and their call format from @rollout_tools; one that calls
    run_tools without declaring any is refused (it used to parse no call and run nothing, silently)."""
    sample = multiply_task.make_prompt(0, 5)
    expression = f"{sample['a']}*{sample['b']}"

    async def rollout(episode, sample):
        episode.start(sample["messages"])
        message = await episode.generate()
        observations = await episode.run_tools(message.get("parsed_calls", []))
        return float(observations[0]["content"] == sample["answer"])

    declared = rollout_tools(multiply_task.calculator, tool_format="builtin")(rollout)
    engine = ScriptedEngine(tokenizer, [f"<call>{expression}</call>"])
    t = episode(engine, tokenizer, sample, env=FunctionEnv(declared))
    assert (t.reward, t.tool_calls, t.tool_errors) == (1.0, 1, 0)

    async def undeclared(episode, sample):
        episode.start(sample["messages"])
        return float(len(await episode.run_tools([])))
    with pytest.raises(UserCodeError, match=r"run_tools\(\) called, but the environment has no tools") as raised:
        episode(ScriptedEngine(tokenizer, ["x"]), tokenizer, sample, env=FunctionEnv(undeclared))
    assert str(raised.value).startswith("agent.env: episode.run_tools()")  # reported once, not re-wrapped


def test_keep_messages_records_the_chat_for_samples(tokenizer):
    """run.log_samples asks generators for the message history: the call with its arguments, the result."""
    sample = multiply_task.make_prompt(0, 5)
    expression, answer = f"{sample['a']}*{sample['b']}", sample["answer"]
    config = AgentConfig(max_turns=3, max_new_tokens=16, max_total_tokens=96)
    engine = ScriptedEngine(tokenizer, [f"<call>{expression}</call>", f"{answer}<|end|>"])
    t = asyncio.run(run_episode(engine, tokenizer, sample, multiply_task.MultiplyEnv(), config, 1.0,
                                keep_messages=True))
    roles = [m["role"] for m in t.info["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert t.info["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"expression": expression}
    assert t.info["messages"][2]["content"] == answer and decode(encode(t)).info["messages"] == t.info["messages"]
    assert "messages" not in episode(ScriptedEngine(tokenizer, [f"{answer}<|end|>"]), tokenizer, sample).info
