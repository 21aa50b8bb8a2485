"""One agent episode, tokens in and tokens out: prompt -> sampled turns and tool results -> Trajectory.

    trajectory = await run_episode(engine, tokenizer, sample, builtin_env(), AgentConfig(), temperature=1.0)

The episode (DESIGN.md "Agents and tools"; the built-in format is in multiply_task.py):
  1. prompt ids = tokenizer.apply_chat_template(sample["messages"], add_generation_prompt=True);
  2. sample a turn, stopping at eos or at the `</call>` token;
  3. if the turn ends with `</call>`, parse `<call>EXPR</call>`, run the tool (with a timeout, off the
     event loop when it is synchronous), render its result as a chat-template DELTA (the text of
     render(history + [tool message]) minus the text of render(history), tokenized alone) and append
     it with loss mask 0; then go to 2 and continue the same assistant turn;
  4. otherwise the turn is the final answer: reward = env.score(sample, text of that turn, eos removed).

Invariants:
  - the history is never decoded and re-encoded: token_ids are exactly the ids the engine saw and
    sampled; loss mask 1 exactly on sampled tokens (which carry their version and logprob), 0 with
    version -1 and logprob 0 on prompt and tool tokens;
  - with a prefix-consistent chat template and well-formed calls, token_ids equal the template's
    rendering of the episode's messages (tests/test_agent_loop.py checks it);
  - len(token_ids) <= agent.max_total_tokens: the last turn's max_new_tokens is cut to fit, and a tool
    result that would leave no room to answer ends the episode ("length") without being appended;
  - a malformed call, or a tool that raises or times out, becomes an error observation
    `<res>error: ...</res>` (counted in tool_errors), never an exception.

finish_reason: "stop" (eos), "length" (a turn or the episode ran out of tokens), "max_turns" (the last
allowed turn was a tool call). Run alone: see tests/test_agent_loop.py.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Union

import numpy as np

from nanoverl_async.config import AgentConfig
from nanoverl_async.generators.engine import Completion, Engine, SamplingParams
from nanoverl_async.trajectory import Trajectory

CALL, CALL_END = "<call>", "</call>"


@dataclass
class ToolEnv:
    """What an episode needs from its task: one tool and a reward function."""

    tool: Callable[[str], Union[str, Awaitable[str]]]  # EXPR -> result text; sync or async; raises on bad input
    score: Callable[[dict, str], float]  # (sample, final answer text) -> reward
    tool_name: str = "calculator"  # the function name in the assistant message's tool_calls
    tool_timeout_s: float = 5.0  # a slower call becomes the observation "error: timeout ..."
    max_error_chars: int = 40  # error observations are cut to this (every character costs a token here)


def builtin_env(tool_timeout_s: float = 5.0) -> ToolEnv:
    """The built-in "A*B?" task with its calculator (nanoverl_async/multiply_task.py)."""
    from nanoverl_async import multiply_task

    return ToolEnv(tool=multiply_task.calculator, score=multiply_task.score, tool_timeout_s=tool_timeout_s)


class _Tokens:
    """The growing per-token record of one episode."""

    def __init__(self):
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    def add_forced(self, ids: list[int]) -> None:  # prompt and tool tokens: not sampled
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_sampled(self, completion: Completion) -> None:
        self.ids += completion.token_ids
        self.mask += [1] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.versions += completion.versions


def render_ids(tokenizer, messages: list[dict], tools: Optional[list] = None) -> list[int]:
    """The prompt ids: apply_chat_template(messages, add_generation_prompt=True), as a plain list."""
    rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def render_delta(tokenizer, history: list[dict], message: dict, tools: Optional[list] = None) -> list[int]:
    """Ids of what `message` adds to the rendering of `history` (plus the generation prompt after it)."""
    before = tokenizer.apply_chat_template(history, tools=tools, tokenize=False)
    after = tokenizer.apply_chat_template(history + [message], tools=tools, tokenize=False,
                                          add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template is not prefix-consistent: rendering one more message changed "
                         f"the earlier text ({before[-40:]!r} vs {after[len(before) - 40:len(before)]!r})")
    return tokenizer.encode(after[len(before):], add_special_tokens=False)


def parse_call(text: str, tool_name: str) -> tuple[dict, Optional[str]]:
    """A turn ending with `</call>` -> (assistant message, EXPR or None if malformed)."""
    body = text[: -len(CALL_END)] if text.endswith(CALL_END) else text
    start = body.rfind(CALL)
    expression = body[start + len(CALL):] if start >= 0 else ""
    content = body[:start] if start >= 0 else body
    call = {"type": "function", "function": {"name": tool_name, "arguments": {"expression": expression}}}
    message = {"role": "assistant", "content": content, "tool_calls": [call]}
    return message, (expression if start >= 0 and expression.strip() else None)


async def call_tool(env: ToolEnv, expression: Optional[str]) -> tuple[str, bool]:
    """Run the tool -> (observation text, is_error). Never raises (except cancellation)."""
    if expression is None:
        return "error: malformed call", True
    try:
        if inspect.iscoroutinefunction(env.tool):
            pending = env.tool(expression)
        else:  # a thread keeps the event loop (and the other episodes) running; it cannot be killed on timeout
            pending = asyncio.to_thread(env.tool, expression)
        return str(await asyncio.wait_for(pending, env.tool_timeout_s)), False
    except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
        return f"error: timeout after {env.tool_timeout_s:g}s", True
    except Exception as error:  # a bad call is an observation for the model, not a crash
        return f"error: {error}"[: env.max_error_chars] if str(error) else f"error: {type(error).__name__}", True


async def run_episode(engine: Engine, tokenizer, sample: dict, env: ToolEnv, agent: AgentConfig,
                      temperature: float, *, group_id: int = 0, prompt_index: int = 0, sample_index: int = 0,
                      generator_id: int = 0) -> Trajectory:
    started = time.perf_counter()
    eos_id, call_end_id = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(CALL_END)
    tools: Optional[list[Any]] = sample.get("tools")
    messages = [dict(m) for m in sample["messages"]]
    record = _Tokens()
    record.add_forced(render_ids(tokenizer, messages, tools))
    if len(record.ids) >= agent.max_total_tokens:
        raise ValueError(f"prompt {prompt_index} has {len(record.ids)} tokens, no room under "
                         f"agent.max_total_tokens={agent.max_total_tokens}")
    turns = calls = errors = 0
    spent = {"generate": 0.0, "tool": 0.0}
    finish, answer = "max_turns", ""
    while turns < agent.max_turns:
        budget = min(agent.max_new_tokens, agent.max_total_tokens - len(record.ids))
        tick = time.perf_counter()
        completion = await engine.generate(record.ids, SamplingParams(budget, temperature, (eos_id, call_end_id)))
        spent["generate"] += time.perf_counter() - tick
        record.add_sampled(completion)
        turns += 1
        ends_with_eos = completion.token_ids[-1] == eos_id
        answer = tokenizer.decode(completion.token_ids[:-1] if ends_with_eos else completion.token_ids,
                                  skip_special_tokens=False)
        if completion.token_ids[-1] != call_end_id:
            finish = completion.finish_reason
            messages.append({"role": "assistant", "content": answer})
            break
        call_message, expression = parse_call(answer, env.tool_name)
        tick = time.perf_counter()
        observation, failed = await call_tool(env, expression)
        spent["tool"] += time.perf_counter() - tick
        calls, errors = calls + 1, errors + failed
        tool_message = {"role": "tool", "content": observation}
        delta = render_delta(tokenizer, messages + [call_message], tool_message, tools)
        if len(record.ids) + len(delta) >= agent.max_total_tokens:  # no room left to answer after it
            finish = "length"
            break
        messages += [call_message, tool_message]
        record.add_forced(delta)
    reward = float(env.score(sample, answer))
    return Trajectory(
        id=f"{generator_id}-{group_id}-{sample_index}-{uuid.uuid4().hex[:8]}", group_id=group_id,
        prompt_index=prompt_index, sample_index=sample_index,
        token_ids=np.asarray(record.ids, dtype=np.int32), loss_mask=np.asarray(record.mask, dtype=np.uint8),
        behaviour_logprobs=np.asarray(record.logprobs, dtype=np.float32),
        versions=np.asarray(record.versions, dtype=np.int32), reward=reward, num_turns=turns,
        tool_calls=calls, tool_errors=errors, finish_reason=finish, generator_id=generator_id,
        timings={"episode": time.perf_counter() - started, **spent}, info={"final_answer": answer},
    )
