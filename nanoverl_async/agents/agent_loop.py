"""One agent episode, tokens in and tokens out: prompt -> sampled turns and observations -> Trajectory.

    trajectory = await run_episode(engine, tokenizer, sample, MultiplyEnv(), AgentConfig(), temperature=1.0)

The episode (docs/design.md "Agents and tools"; environments in nanoverl_async/agents/env.py):
  1. messages = env.reset(sample); prompt ids = apply_chat_template(messages, tools, add_generation_prompt);
  2. sample a turn, stopping at eos (or the format's stop token, `</call>` for "builtin");
  3. parse tool calls (tool_parsers.py). If there are any, run each (tools.call_tool: argument checks,
     timeout, errors as observations, counted, the first kept in info["first_tool_error"]), render the
     tool messages as a chat-template DELTA and append it with loss mask 0, then go to 2;
  4. otherwise env.step(sample, message) -> Step: its reward ends the episode, or (done=False) its
     messages are appended like tool results and the episode goes on.
An error in the user's code names the class and method (`agent.env Calc.step()`) and the user's file:line;
so does a hook that runs past `agent.hook_timeout_s` (a rollout: `agent.rollout_timeout_s`), with the line it
was at (user_code.call_user, which runs a synchronous hook off the event loop).
An environment with a `rollout(episode, sample)` method drives `Episode` itself instead.

The delta: text(render(history + new, generation prompt)) minus text(render(history)), tokenized alone,
plus whatever the template puts between the turn's last sampled token (e.g. `<|im_end|>`) and the end of
its rendering of that turn when that is whitespace (the "\n" of Qwen/Hermes templates: verl#6501).
A template that is not prefix-consistent (rendering one more message changes earlier text, e.g. one
that drops the reasoning of earlier assistant turns) is handled explicitly: the delta is then rendered
after a neutral base (a one-character user message and the last assistant message with empty content,
its tool calls kept), the episode keeps the tokens the model really saw (its full earlier turns, which
a later full render would drop), and `info["template_fallbacks"]` counts it. Ids are never rewritten.

Invariants:
  - the history is never decoded and re-encoded: token_ids are exactly the ids the engine saw and
    sampled; loss mask 1 exactly on sampled tokens (with their version and logprob), 0 with version -1
    and logprob 0 on prompt and observation tokens;
  - with a prefix-consistent template, token_ids equal the template's rendering of the episode's
    messages up to the last sampled token (tests/test_agent_loop.py, tests/test_chat_templates.py);
  - len(token_ids) <= agent.max_total_tokens: the last turn is cut to fit, and observations that would
    leave no room to answer end the episode ("length") without being appended;
  - limits: agent.max_turns ("max_turns"), agent.max_tool_calls ("max_tool_calls"); an episode ended by
    a limit before env.step gets reward 0.

Run alone: `python -m pytest tests/test_agent_loop.py tests/test_chat_templates.py -q`.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any, Callable, Optional

import numpy as np

from nanoverl_async.config import AgentConfig
from nanoverl_async.agents.env import FunctionEnv, Step
from nanoverl_async.agents.rewards import is_reward
from nanoverl_async.agents.user_code import UserCodeError, broken_contract, call_user
from nanoverl_async.agents.engine import Completion, Engine, SamplingParams
from nanoverl_async.agents.tool_parsers import ParsedCall, describe_tools, parse_turn, stop_strings
from nanoverl_async.agents.tools import Tool, ToolResult, as_tool, call_tool
from nanoverl_async.wire.trajectory import Trajectory


class _Tokens:
    """The growing per-token record of one episode."""

    def __init__(self):
        self.ids = []  # per token
        self.mask = []
        self.logprobs = []
        self.versions = []
        self.cache = {"prefill_tokens": 0, "cached_tokens": 0, "preemptions": 0}  # the engine's, summed over turns

    def add_forced(self, ids: list[int]) -> None:
        """Prompt and observation tokens: not sampled (mask 0)."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_sampled(self, completion: Completion) -> None:
        """A sampled turn's tokens (mask 1), with their logprobs and versions, and the engine's counts."""
        self.ids += completion.token_ids
        self.mask += [1] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.versions += completion.versions
        for key in self.cache:
            self.cache[key] += getattr(completion, key)


def render_delta(tokenizer, history: list[dict], new: list[dict], tools: Optional[list], stop_text: str
                 ) -> tuple[list[int], bool]:
    """Ids that `new` adds after `history` (whose last turn ended with `stop_text`) -> (ids, fallback)."""
    def text(messages, generation_prompt=False):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    before, after = text(history), text(history + new, True)
    fallback = not after.startswith(before)
    if fallback:  # not prefix-consistent: render against a neutral base (see the module docstring)
        base = [{"role": "user", "content": "."}, {**history[-1], "content": ""}]
        before, after = text(base), text(base + new, True)
        if not after.startswith(before):
            raise ValueError("the chat template is not prefix-consistent even for one assistant message "
                             f"followed by observations ({before[-40:]!r} vs {after[len(before) - 40:len(before)]!r})")
    tail = before[before.rfind(stop_text) + len(stop_text):] if stop_text and stop_text in before else ""
    tail = tail if not tail.strip() else ""  # only the separator after the turn's end token
    return tokenizer.encode(tail + after[len(before):], add_special_tokens=False), fallback


PROMPTS_CACHED = 256  # renderings render_prompt keeps (the newest): a generator's groups in flight, and more


def render_prompt(tokenizer, messages: list[dict], schemas: Optional[list[dict]]) -> tuple[int, ...]:
    """The chat template's ids of `messages` and the tools' `schemas`, ready for the first turn. The G episodes
    of a group start from one prompt: each rendering after the first is read from a cache (renderings showed in
    a generator's time: docs/benchmarks.md "Costs behind choices in the code"). The key is the JSON text, in the
    objects' own order (a template may print them), with the tokenizer itself."""
    try:
        key = (tokenizer, json.dumps([messages, schemas]))
    except (TypeError, ValueError):  # not plain JSON (an environment's own objects): rendered every time
        return _render(tokenizer, messages, schemas)
    ids = _PROMPTS.get(key)
    if ids is None:
        ids = _PROMPTS[key] = _render(tokenizer, messages, schemas)
        if len(_PROMPTS) > PROMPTS_CACHED:
            del _PROMPTS[next(iter(_PROMPTS))]  # the oldest
    return ids


_PROMPTS: dict[tuple, tuple[int, ...]] = {}


def _render(tokenizer, messages: list[dict], schemas: Optional[list[dict]]) -> tuple[int, ...]:
    rendered = tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True)
    return tuple(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_w7", "description": "Probe.",
                                              "parameters": {"type": "object", "properties": {}}}}


@functools.lru_cache(maxsize=16)
def template_shows_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template puts the `tools=` schemas in the prompt (Qwen2.5's and Llama 3.1's
    do; SmolLM2's drops them, and its model would never see the tools it is trained to call)."""
    messages = [{"role": "user", "content": "Hello"}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[PROBE_TOOL], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails on tools shows none: they are described instead
        return False
    return PROBE_TOOL["function"]["name"] in text


def with_system_text(messages: list[dict], text: str) -> list[dict]:
    """`messages` with `text` closing the system message (one is put first if there is none)."""
    if not text:
        return messages
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{text}".lstrip()}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


class Episode:
    """The token record and message history of one episode, with the steps an environment drives."""

    def __init__(self, engine: Engine, tokenizer, agent: AgentConfig, temperature: float, env: Any,
                 episode_id: Optional[str] = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.agent = agent
        self.temperature = temperature
        self.tools: list[Tool] = [as_tool(t) for t in getattr(env, "tools", ())]
        self.tool_format: str = getattr(env, "tool_format", "hermes")
        self.max_chars: int = getattr(env, "max_observation_chars", 2000)
        self.schemas = [t.schema for t in self.tools] if getattr(env, "show_tools", True) and self.tools else None
        self.tools_described = ""  # the tools in the system message instead, for a template that drops them
        if self.schemas and not template_shows_tools(tokenizer):
            self.tools_described, self.schemas = describe_tools(self.schemas, self.tool_format), None
        self.stop_ids = (tokenizer.eos_token_id, *map(tokenizer.convert_tokens_to_ids, stop_strings(self.tool_format)))
        self.record, self.messages = _Tokens(), []
        self.turns = self.tool_calls = self.tool_errors = self.fallbacks = 0
        self.first_tool_error = ""  # the episode's first failed call, "name: error: ...", for metrics.py's warning
        self.spent = {"generate": 0.0, "tool": 0.0}
        # Its calls' spans for run.trace: the wall clock at the start, then the monotonic clock, so they stay
        # inside the episode's span (Trajectory.spans) even if the wall clock is stepped meanwhile.
        self.wall_origin, self.calls = time.time() - time.perf_counter(), []
        self.finish = ""
        self.answer = ""
        self.last_stop_text = ""
        self.episode_id = episode_id  # lets a server pool keep an episode's turns on one server (prefix cache)

    def start(self, messages: list[dict]) -> None:
        """Render the prompt (mask 0)."""
        self.messages = with_system_text([dict(m) for m in messages], self.tools_described)
        self.record.add_forced(list(render_prompt(self.tokenizer, self.messages, self.schemas)))
        if len(self.record.ids) >= self.agent.max_total_tokens:
            raise ValueError(f"the prompt has {len(self.record.ids)} tokens, no room under "
                             f"agent.max_total_tokens={self.agent.max_total_tokens}")

    async def generate(self) -> Optional[dict]:
        """Sample one assistant turn (mask 1) and add it to the history -> its message with parsed `tool_calls`
        (and `parsed_calls`, for run_tools) (None: no room/turns)."""
        budget = min(self.agent.max_new_tokens, self.agent.max_total_tokens - len(self.record.ids))
        if self.turns >= self.agent.max_turns or budget <= 0:
            self.finish = "max_turns" if budget > 0 else "length"
            return None
        tick = time.perf_counter()
        params = SamplingParams(budget, self.temperature, self.stop_ids)
        completion = await self.engine.generate(self.record.ids, params, episode_id=self.episode_id)
        self._spent("generate", tick)
        self.record.add_sampled(completion)
        self.turns += 1
        last = completion.token_ids[-1]
        stopped = last in self.stop_ids
        self.last_stop_text = self.tokenizer.convert_ids_to_tokens(last) if stopped else ""
        ids = completion.token_ids[:-1] if last == self.tokenizer.eos_token_id else completion.token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        self.finish, self.answer = completion.finish_reason, text
        first = self.tools[0] if self.tools else None
        default_tool = first.name if first else ""
        default_arg = first.parameters[0] if first and first.parameters else ""
        content, calls = (text, []) if not stopped else parse_turn(text, self.tool_format, default_tool, default_arg)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in calls]
        self.messages.append(message)
        return {**message, "parsed_calls": calls} if calls else dict(message)  # a copy: the history stays as is

    async def run_tools(self, calls: list[ParsedCall]) -> list[dict]:
        """Run the calls in order -> tool messages (errors included, counted)."""
        if not self.tools:  # the calls could only have been parsed in the wrong format, and would all fail
            raise UserCodeError("agent.env: episode.run_tools() called, but the environment has no tools "
                                "(a rollout function declares them with @rollout_tools(...))")
        by_name = {t.name: t for t in self.tools}
        results: list[ToolResult] = []
        for call in calls:
            if call.error is not None:
                results.append(ToolResult(f"error: {call.error}", True))
            elif call.name not in by_name:
                results.append(ToolResult(f"error: unknown tool '{call.name}'", True))
            else:
                tick = time.perf_counter()
                results.append(await call_tool(by_name[call.name], call.arguments, self.agent.tool_timeout_s,
                                               self.max_chars))
                self._spent("tool", tick)
        self.tool_calls += len(calls)
        self.tool_errors += sum(r.error for r in results)
        failed = (f"{c.name}: {r.text}"[:200] for c, r in zip(calls, results) if r.error)
        self.first_tool_error = self.first_tool_error or next(failed, "")
        return [{"role": "tool", "name": c.name, "content": r.text[: self.max_chars]} for c, r in zip(calls, results)]

    def _spent(self, kind: str, tick: float) -> None:
        """A model or tool call that began at perf_counter `tick` has just ended."""
        now = time.perf_counter()
        self.spent[kind] += now - tick
        self.calls.append([kind, self.wall_origin + tick, self.wall_origin + now])

    def observe(self, new: list[dict]) -> bool:
        """Append messages after the last turn as a rendered delta (mask 0); False (and "length") if
        they would leave no room to answer."""
        delta, fallback = render_delta(self.tokenizer, self.messages, new, self.schemas, self.last_stop_text)
        self.fallbacks += fallback
        if len(self.record.ids) + len(delta) >= self.agent.max_total_tokens:
            self.finish = "length"
            return False
        self.messages += new
        self.record.add_forced(delta)
        return True


async def drive(episode: Episode, env: Any, sample: dict) -> tuple[float, dict]:
    """The reset/step loop of module docstring steps 2-4 -> (reward, reward info)."""
    while True:
        message = await episode.generate()
        if message is None:
            return 0.0, {}
        calls = message.get("parsed_calls", [])
        if calls:
            if episode.tool_calls + len(calls) > episode.agent.max_tool_calls:
                episode.finish = "max_tool_calls"
                return 0.0, {}
            if not episode.observe(await episode.run_tools(calls)):
                return 0.0, {}
            continue
        # Step checks its reward, unless it is set afterwards
        step = await call_hook(episode.agent, env, "step", sample, message,
                               valid=lambda value: isinstance(value, Step) and is_reward(value.reward),
                               expected="return a nanoverl_async.agents.env.Step with a finite reward (e.g. "
                                        "Step(reward=1.0))")
        if step.done or not step.messages or not episode.observe(list(step.messages)):
            return float(step.reward), dict(step.info)


async def call_hook(agent: AgentConfig, env: Any, method: str, *args, valid: Callable[[Any], bool] = lambda _: True,
                    expected: str = "") -> Any:
    """`env.method(*args)` -> what it returned; a UserCodeError naming the hook as 'agent.env Calc.step()' (a
    FunctionEnv's rollout: 'agent.env my_rollout()') if it raised, returned what `valid` refuses, or ran past
    agent.hook_timeout_s (a rollout, the whole episode: agent.rollout_timeout_s)."""
    function = getattr(env, method)
    name = getattr(function, "__name__", method) if isinstance(env, FunctionEnv) else f"{type(env).__name__}.{method}"
    hook, limit = f"agent.env {name}()", "rollout_timeout_s" if method == "rollout" else "hook_timeout_s"
    value = await call_user(hook, function, *args, timeout_s=getattr(agent, limit), key=f"agent.{limit}")
    if not valid(value):
        raise broken_contract(hook, function, value, expected)
    return value


async def play(episode: Episode, env: Any, sample: dict) -> tuple[float, dict]:
    """`env` on `sample` through `episode`, by its own rollout or by reset and the step loop -> (reward, info)."""
    if hasattr(env, "rollout"):
        return float(await call_hook(episode.agent, env, "rollout", episode, sample, valid=is_reward,
                                     expected="return the episode's reward as a finite number")), {}
    episode.start(await call_hook(episode.agent, env, "reset", sample))
    return await drive(episode, env, sample)


async def run_episode(engine: Engine, tokenizer, sample: dict, env: Any, agent: AgentConfig, temperature: float,
                      *, group_id: int = 0, prompt_index: int = 0, sample_index: int = 0,
                      generator_id: int = 0, keep_messages: bool = False, trajectory_id: str = "",
                      trace: bool = False) -> Trajectory:
    """One episode of `env` on `sample` -> its Trajectory; with keep_messages, info["messages"] holds
    the chat history (tool calls with their arguments, tool results and errors) for run.log_samples;
    with trace, `spans` holds the wall-clock intervals of the episode and of its calls for run.trace.
    The id defaults to generator-group-sample: unique in a run (a group id is one lease's) and the same
    in every run, so a lockstep engine can order its waves by it."""
    started = time.perf_counter()
    trajectory_id = trajectory_id or f"{generator_id}-{group_id}-{sample_index}"
    episode = Episode(engine, tokenizer, agent, temperature, env, episode_id=trajectory_id)
    reward, info = await play(episode, env, sample)
    record = episode.record
    ended = time.perf_counter()
    origin = episode.wall_origin
    return Trajectory(
        id=trajectory_id, group_id=group_id, prompt_index=prompt_index, sample_index=sample_index,
        token_ids=np.asarray(record.ids, dtype=np.int32), loss_mask=np.asarray(record.mask, dtype=np.uint8),
        behaviour_logprobs=np.asarray(record.logprobs, dtype=np.float32),
        versions=np.asarray(record.versions, dtype=np.int32), reward=reward, num_turns=episode.turns,
        tool_calls=episode.tool_calls, tool_errors=episode.tool_errors, finish_reason=episode.finish or "stop",
        generator_id=generator_id, timings={"episode": ended - started, **episode.spent},
        info={"final_answer": episode.answer, "reward_info": info, "template_fallbacks": episode.fallbacks,
              "engine": record.cache,
              **({"first_tool_error": episode.first_tool_error} if episode.first_tool_error else {}),
              **({"messages": episode.messages} if keep_messages else {})},
        spans=[["episode", origin + started, origin + ended], *episode.calls] if trace else [],
    )
