"""Before anything starts: check what the config points at, and pin it down for the roles in one `Plan`.

    cfg = prepare(load_config("configs/agent_grpo.yaml", overrides))   # launch and `validate` both do this
    plan = launch_plan(cfg, started)                                    # launch: the config, model, checkpoint

`validation.py` checks values and touches nothing; this module checks the world the config names:
data files exist and every row has a chat `prompt` that leaves room under agent.max_total_tokens
(`check_prompt_lengths`), the environment, the prompt function and the reward function load (user code
runs here, once, in the launching process), the model paths name models whose positions hold
agent.max_total_tokens (`check_model`), `run.resume` names a checkpoint, `wire.host` can be bound, and the
learner's predicted peak fits in the memory of its devices (fit_check.py; launch checks a builder's model
once it has made it), and learner.compile on the CPU finds the C++ compiler it builds kernels with.
Each failure is one ConfigError naming the key. The returned config has `agent.env`'s default filled in,
every user path absolute, so roles in other processes (and a later resume) load exactly the same code, the
rows left out in data.skip_rows, and `wire.host` placed (wire_auth.placed_host: "auto" is loopback on one
machine, each role's own node address on a cluster).

The plan (`launch_plan`, `replay_plan`) is where the facts a run starts from are resolved, each once: the
prepared config, the model RL starts from (model.path resolved: `model_files`, then model.warm_start) and, for a
launch, the checkpoint it resumes with its meta.json and the step it continues after (`inspect_output`). The
launcher, the roles and `replay` read them from the plan and resolve nothing again.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import shutil
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
from nanoverl_async.controller.fit_check import check_learner_fits, predicted_memory
from nanoverl_async.validation import get_key
from nanoverl_async.wire.auth import placed_host


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a launch or a replay runs, resolved once before anything is placed (the module docstring)."""
    cfg: Config  # prepare's (a replay: the run's own config.yaml, which launch wrote prepared)
    model_path: str  # model.path resolved to a directory, after model.warm_start: what every role loads
    output: Optional[checkpoint.OutputDir] = None  # a launch's run.output_dir, with what it resumes; None: replay's
    predicted: dict = dataclasses.field(default_factory=dict)  # a launch's learner peak, by its memory/* key (GB)

    @property
    def resume_from(self) -> Optional[Path]:
        """The checkpoint the run resumes; None: it starts from model_path's weights."""
        return self.output.resume_from if self.output else None

    @property
    def start(self) -> int:
        """The steps done before this run's first: the resumed checkpoint's step (= its weights' version), else 0."""
        return self.output.meta["step"] if self.resume_from else 0


def launch_plan(cfg: Config, started: float) -> Plan:
    """`launch`'s plan, a console line for each phase (startup.phase, seconds since `started`): `cfg` prepared,
    what the launch does with run.output_dir (`inspect_output`: a folder it may not use is refused before the
    model is built), then the model RL starts from, checked against agent.max_total_tokens. Writes nothing."""
    from nanoverl_async.controller import warm_start  # torch and Ray: a launch's, never `validate`'s
    from nanoverl_async.controller.startup import phase
    from nanoverl_async.models.load import check_positions

    cfg = prepare(cfg)  # files, user code and run.resume checked; user paths made absolute
    output = inspect_output(cfg)
    phase(started, f"model {cfg.model.path}" + (" (built on first use, then cached)" if ":" in cfg.model.path else ""))
    model_path, tokenizer = model_files(cfg.model.path, cfg.model.cache_dir)
    model_path = warm_start.start_model(cfg, model_path)  # model.warm_start: RL starts from the warm-started model
    if measured := warm_start.report(model_path):
        phase(started, measured)
    if notice := tools_notice(cfg, tokenizer):
        phase(started, notice)
    check_positions(model_path, cfg.agent.max_total_tokens)  # the buffer drops longer trajectories
    predicted = predicted_memory(cfg, model_path, started)  # a builder's model too, before Ray and the roles
    return Plan(cfg, model_path, output, predicted)


def replay_plan(cfg: Config) -> Plan:
    """`replay`'s plan for a run's config.yaml: the model that run started from (its warm start found in the
    cache), and no checkpoint: a replay trains every recorded step from the first."""
    from nanoverl_async.controller.warm_start import start_model  # torch

    return Plan(cfg, start_model(cfg, model_files(cfg.model.path, cfg.model.cache_dir)[0]))


def inspect_output(cfg: Config) -> checkpoint.OutputDir:
    """What launching `cfg` does with run.output_dir (checkpoint.inspect_output_dir: every refusal, and what a fresh
    run clears), after resolving run.resume: the checkpoint to resume (None: a fresh run) and its meta.json, read
    here once. Changes nothing, imports no torch: the CLI calls it before Ray starts."""
    resume_from = checkpoint.find_checkpoint(cfg.run)
    meta = checkpoint.read_meta(resume_from) if resume_from else None
    return checkpoint.inspect_output_dir(cfg, resume_from, meta)


def resume_line(cfg: Config, output: checkpoint.OutputDir) -> str:
    """The console's line for a resumed run: the checkpoint, the steps left, and any other settings it resumes
    with (say a new learning rate: allowed, but never silent)."""
    resume_from, meta = output.resume_from, output.meta
    changed = checkpoint.changed_keys(meta["config"], checkpoint.trained_config(cfg))
    left = (f"steps {meta['step'] + 1}-{cfg.run.total_steps}" if meta["step"] < cfg.run.total_steps
            else "no step left, final/ to write")
    return (f"resuming from {resume_from.name} ({resume_from}): {left}"
            + (f" with changed config keys: {', '.join(changed)}" if changed else ""))


def model_files(path: str, cache_dir: str) -> tuple[str, Any]:
    """model.path (`path`) resolved to a Hugging Face directory (a built-in's or a builder's made on first use,
    then cached: models/load.resolve_model_path) and its tokenizer, checked to keep whitespace. A missing model
    or such a tokenizer fails here in one ConfigError line, not in each role."""
    from nanoverl_async.models.load import load_tokenizer, resolve_model_path  # torch: once a model is needed

    try:
        directory = resolve_model_path(path, cache_dir)
        return directory, load_tokenizer(directory)
    except (ValueError, OSError) as error:  # transformers raises OSError for a model it cannot find
        raise ConfigError(f"config key 'model.path': {str(error).strip().splitlines()[0]}") from None


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
    if cfg.learner.compile and cfg.learner.device == "cpu" and not shutil.which(os.environ.get("CXX") or "g++"):
        raise ConfigError("config key 'learner.compile': torch.compile builds its CPU kernels with a C++ compiler, "
                          "and none is here ($CXX, else g++); install g++, or set learner.compile=false")
    check_model(cfg)
    cfg = check_prompt_lengths(cfg, loaded["agent.env"], rows)
    check_task_prompts(cfg, loaded["agent.env"])
    checkpoint.find_checkpoint(cfg.run)  # a check (for `validate` too): a run.resume path that is no checkpoint
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
    tokenizer = model_files(path, cache_dir)[1]  # torch: only for a long prompt
    return tokenizer, 4 * max(map(len, tokenizer.get_vocab()))
