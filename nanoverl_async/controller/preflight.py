"""Before anything starts: check what the config points at, and pin it down for the roles.

    cfg = prepare(load_config("configs/agent_grpo.yaml", overrides))   # launch and `validate` both do this

`validation.py` checks values and touches nothing; this module checks the world the config names:
data files exist and every row has a chat `prompt` that leaves room under agent.max_total_tokens
(`check_prompt_lengths`), the environment, the prompt function and the reward function load (user code
runs here, once, in the launching process), the model paths name models whose positions hold
agent.max_total_tokens (`check_model`), `run.resume` names a checkpoint, `wire.host` can be bound, and the
learner's predicted peak fits in the memory of its devices (fit_check.py; launch checks a builder's model
once it has made it).
Each failure is one ConfigError naming the key. The returned config has `agent.env`'s default filled in,
every user path absolute, so roles in other processes (and a later resume) load exactly the same code, the
rows left out in data.skip_rows, and `wire.host` placed (wire_auth.placed_host: "auto" is loopback on one
machine, each role's own node address on a cluster).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import functools
import importlib.util
import json
import socket
from pathlib import Path
from typing import Any, Callable, Optional

from nanoverl_async import checkpoint

from nanoverl_async.agents import sandbox
from nanoverl_async.config import Config, ConfigError
from nanoverl_async.agents.data import prompt_source, read_samples
from nanoverl_async.agents.env import env_factory
from nanoverl_async.agents.rewards import load_reward
from nanoverl_async.agents.user_code import BUILTINS, UserCodeError, absolute_spec, load_object
from nanoverl_async.controller.fit_check import check_learner_fits
from nanoverl_async.validation import get_key
from nanoverl_async.wire.auth import placed_host


def prepare(cfg: Config) -> Config:
    """`cfg` with user paths made absolute, after checking every file and piece of user code it names."""
    rows = {}  # key -> (file, row number, sample) of its every row
    for key in ("data.train_files", "data.val_files"):
        files = getattr(cfg.data, key.split(".")[1])
        try:  # every file and row, now: a bad one deep in a file would otherwise kill the buffer mid-run
            rows[key] = read_samples(files) if files else []
        except ValueError as error:
            raise ConfigError(f"config key '{key}': {error}") from None
    default_env = "builtin:chat" if cfg.data.train_files else "builtin:multiply"  # a dataset: score its answers
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=absolute_spec(cfg.model.path),  # a builder file.py:fn
                                  warm_start=dataclasses.replace(cfg.model.warm_start,
                                                                 solver=absolute_spec(cfg.model.warm_start.solver))),
        agent=dataclasses.replace(cfg.agent, env=absolute_spec(cfg.agent.env or default_env)),
        reward=dataclasses.replace(cfg.reward, path=absolute_spec(cfg.reward.path)),
        data=dataclasses.replace(cfg.data, task=absolute_spec(cfg.data.task),
                                 train_files=[str(Path(p).resolve()) for p in cfg.data.train_files],
                                 val_files=[str(Path(p).resolve()) for p in cfg.data.val_files]))
    loaded = {}
    for key, load in (("reward.path", lambda: load_reward(cfg.reward.path, cfg.reward.name)),
                      ("agent.env", lambda: env_factory(cfg.agent.env, env_args=cfg.agent.env_args)),
                      ("data.task", lambda: prompt_source(cfg.data, cfg.run.seed)),
                      ("model.warm_start.solver", lambda: cfg.model.warm_start.solver and load_object(
                          cfg.model.warm_start.solver, "model.warm_start.solver"))):
        try:
            loaded[key] = load()
        except (ValueError, ImportError, SyntaxError) as error:
            raise ConfigError(f"config key '{key}': {error}") from None
    # The `python` tool is refused now, not in every episode, where bubblewrap cannot isolate model-written
    # code on this machine (unless agent.sandbox=unsafe_no_isolation).
    uses_python = any(tool.fn is sandbox.python for tool in loaded["agent.env"].tools)
    why = sandbox.unavailable() if cfg.agent.sandbox == "bwrap" and uses_python else None
    if why:
        raise ConfigError(f"config key 'agent.sandbox': {sandbox.refusal(why)}")
    check_model(cfg)
    cfg = check_prompt_lengths(cfg, loaded["agent.env"], rows)
    check_task_prompts(cfg, loaded["agent.env"])
    checkpoint.find_checkpoint(cfg.run)  # a run.resume path that is not a checkpoint fails here
    checkpoint.check_output_dir(cfg.run.output_dir)  # a file, or a folder this process cannot write in
    if cfg.wire.host != "auto":  # one address for every role (auto: each binds on its own node, wire/auth.py)
        try:
            with socket.socket(socket.AF_INET6 if ":" in cfg.wire.host else socket.AF_INET) as probe:
                probe.bind((cfg.wire.host, 0))
        except (OSError, UnicodeError) as error:
            raise ConfigError(f"config key 'wire.host': cannot bind {cfg.wire.host!r} on this machine "
                              f"({error})") from None
    check_learner_fits(cfg)
    return dataclasses.replace(cfg, wire=dataclasses.replace(cfg.wire, host=placed_host(cfg.wire.host,
                                                                                      bool(cfg.ray.address))))


def check_model(cfg: Config) -> None:
    """model.path, reference.path and critic.path name models (a file, or a folder without config.json, is
    refused now, not by every role later), and agent.max_total_tokens fits model.path's positions where they
    are known here: a built-in's, and a directory's (launch checks a builder's, once it has made it)."""
    for key in ("model.path", "reference.path", "critic.path"):
        path = get_key(cfg, key)
        local = Path(path).expanduser()
        if path and (local.is_file() or local.is_dir() and not (local / "config.json").is_file()):
            raise ConfigError(f"config key '{key}': '{path}' is {'a file' if local.is_file() else 'a folder'}, not "
                              f"a model: give a Hugging Face model directory (with config.json), a Hub id"
                              + (", builtin:NAME or a builder file.py:fn" if key == "model.path" else ""))
    path, budget = cfg.model.path, cfg.agent.max_total_tokens
    if path in BUILTINS["model.path"]:
        positions = builtin_positions(path)
        if budget > positions:
            raise ConfigError(f"config key 'agent.max_total_tokens': {budget} is more than the model's {positions} "
                              f"positions (max_position_embeddings of {path})")
    elif Path(path).expanduser().is_dir():
        from nanoverl_async.models.load import check_positions  # torch: imported for a directory's size anyway

        with contextlib.suppress(OSError, ValueError):  # an unreadable config: launch says why
            check_positions(path, budget)


def builtin_positions(spec: str) -> int:
    """A built-in model's MAX_POSITIONS, read from its builder module's source: importing the module imports
    torch (seconds), building it takes a minute."""
    module = importlib.util.find_spec(BUILTINS["model.path"][spec].split(":")[0])
    for node in ast.parse(Path(module.origin).read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["MAX_POSITIONS"]:
            return ast.literal_eval(node.value)
    raise LookupError(f"{module.origin} sets no MAX_POSITIONS")


def check_prompt_lengths(cfg: Config, new_env: Callable, rows: dict[str, list]) -> Config:
    """Every dataset row's prompt, as the run renders it (agent_loop.Episode.start), leaves room under
    agent.max_total_tokens; one that does not is refused, naming its file and row (else the run dies when
    that row comes up, maybe hours in), or, with data.skip_long_prompts, added to data.skip_rows. Cheap: a
    row is rendered only if it `could_overflow`, and tokenized only if its rendering could fit
    (`prompt_overflow`). An environment with its own rollout renders its own prompt: not checked."""
    env = new_env() if any(rows.values()) else None
    if env is None or hasattr(env, "rollout"):
        return cfg
    budget, skip, listed = cfg.agent.max_total_tokens, list(cfg.data.skip_rows), set(cfg.data.skip_rows)
    tools = shown_tool_bytes(env, new_env.tools)
    for key, samples in rows.items():
        left_out = 0
        for path, i, sample in samples:
            where = f"{Path(path).resolve()} row {i}"
            if where in listed:
                left_out += 1
            elif could_overflow(sample, tools, budget):
                why = prompt_overflow(cfg, env, sample)
                if why and not cfg.data.skip_long_prompts:
                    raise ConfigError(f"config key '{key}': {path} row {i}: {why} (data.skip_long_prompts=true "
                                      f"leaves such rows out)")
                skip += [where] if why else []
                left_out += bool(why)
        if samples and left_out == len(samples):
            raise ConfigError(f"config key '{key}': every row is left out (data.skip_rows, or a prompt that "
                              f"leaves no room under agent.max_total_tokens={budget})")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, skip_rows=skip))


def shown_tool_bytes(env: Any, tools: list) -> int:
    """The UTF-8 bytes of the tools' schemas in `env`'s prompts (rendered by the template or described in the
    system message): 0 if it shows none (show_tools = False)."""
    return len(json.dumps([tool.schema for tool in tools]).encode()) if getattr(env, "show_tools", True) else 0


def could_overflow(sample: dict, tool_bytes: int, budget: int) -> bool:
    """Whether `sample`'s prompt may leave no room under `budget` tokens, so it must be rendered to tell: its
    messages and tools hold half the budget in bytes (the other half is left to the chat template)."""
    return 2 * (tool_bytes + sum(len(str(m.get("content", "")).encode()) for m in sample["messages"])) >= budget


TASK_PROMPTS_CHECKED = 8  # data.task's first prompts rendered at start (a prompt function writes alike prompts)


def check_task_prompts(cfg: Config, new_env: Callable) -> None:
    """data.task's first TASK_PROMPTS_CHECKED prompts, as the run renders them (the tools in the prompt
    included), leave room under agent.max_total_tokens: else one line saying how many tokens the prompt has and
    what an episode needs beside it, before anything starts (not 30 s into the run, when the first one fails).
    As cheap as `check_prompt_lengths`: a short prompt is not rendered."""
    env = new_env()
    if cfg.data.train_files or hasattr(env, "rollout"):
        return
    prompts, agent, tools = prompt_source(cfg.data, cfg.run.seed), cfg.agent, shown_tool_bytes(env, new_env.tools)
    for index in range(TASK_PROMPTS_CHECKED):
        sample = prompts(index)
        why = could_overflow(sample, tools, agent.max_total_tokens) and prompt_overflow(cfg, env, sample)
        if why:
            raise ConfigError(f"config key 'agent.max_total_tokens': prompt {index} of data.task {cfg.data.task}: "
                              f"{why}; an episode adds up to agent.max_turns x agent.max_new_tokens = "
                              f"{agent.max_turns * agent.max_new_tokens} sampled tokens to it, and its tool results")


def tools_notice(cfg: Config, tokenizer) -> str:
    """One line if model.path's chat template drops the tools it is given (then every episode describes
    agent.env's tools in its system message, agent_loop.Episode), else ""."""
    from nanoverl_async.agents.agent_loop import Episode  # numpy: only once the model is known

    episode = Episode(None, tokenizer, cfg.agent, 1.0, env_factory(cfg.agent.env, env_args=cfg.agent.env_args)())
    if not episode.tools_described:
        return ""
    names = ", ".join(tool.name for tool in episode.tools)
    return (f"the chat template of {cfg.model.path} shows no tools: each episode describes {names} in its system "
            f"message, in the {episode.tool_format} format (tool_parsers.describe_tools)")


def prompt_overflow(cfg: Config, env: Any, sample: dict) -> Optional[str]:
    """Why `sample`'s prompt leaves no room under agent.max_total_tokens, or None if it fits. A rendering of
    more bytes than the budget's tokens can hold (at the most bytes a token stands for) is too long without
    tokenizing it (10 MiB take a minute); any other is tokenized by Episode.start, as in the run."""
    from nanoverl_async.agents.agent_loop import Episode, call_hook, with_system_text  # numpy: long prompts only

    tokenizer, most_bytes = prompt_tokenizer(cfg.model.path, cfg.model.cache_dir)
    try:
        messages = asyncio.run(call_hook(cfg.agent, env, "reset", sample))
    except UserCodeError as error:
        raise ConfigError(f"config key 'agent.env': {error}") from None
    episode = Episode(None, tokenizer, cfg.agent, 1.0, env)
    # as Episode.start renders it: with the tools in the system message where the template drops them
    rendered = len(tokenizer.apply_chat_template(with_system_text(messages, episode.tools_described),
                                                 tools=episode.schemas, tokenize=False,
                                                 add_generation_prompt=True).encode())
    if rendered >= cfg.agent.max_total_tokens * most_bytes:
        return (f"the prompt has at least {-(-rendered // most_bytes)} tokens ({rendered} bytes), no room under "
                f"agent.max_total_tokens={cfg.agent.max_total_tokens}")
    try:
        episode.start(messages)
    except ValueError as error:
        return str(error)
    return None


@functools.cache
def prompt_tokenizer(path: str, cache_dir: str) -> tuple[Any, int]:
    """model.path's tokenizer (a built-in is built: launch would build it next) and the most bytes one of its
    tokens stands for: 4 (UTF-8's longest character) per character of its longest token, a bound for any
    vocabulary (a byte-level token's characters stand for one byte each)."""
    from nanoverl_async.models.load import load_tokenizer, resolve_model_path  # torch: only for a long prompt

    try:
        tokenizer = load_tokenizer(resolve_model_path(path, cache_dir))
    except (ValueError, OSError) as error:
        raise ConfigError(f"config key 'model.path': {str(error).strip().splitlines()[0]}") from None
    return tokenizer, 4 * max(map(len, tokenizer.get_vocab()))
