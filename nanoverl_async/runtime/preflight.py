"""Before anything starts: check what the config points at, and pin it down for the roles.

    cfg = prepare(load_config("configs/agent_grpo.yaml", overrides))   # launch and `validate` both do this

`validation.py` checks values and touches nothing; this module checks the world the config names:
data files exist and every row has a chat `prompt`, the environment, the prompt function and the
reward function load (user code runs here, once, in the launching process), `run.resume` names a
checkpoint, `wire.host` can be bound, and the learner's weights, gradients and optimizer states fit in the
memory of its devices (`check_learner_fits`). Each failure is one ConfigError naming the key. The returned
config has `agent.env`'s default filled in and every user path absolute, so roles in other processes (and
a later resume) load exactly the same code, and `wire.host` placed (wire_auth.placed_host: "auto" is
loopback on one machine, each role's own node address on a cluster).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
from pathlib import Path
from typing import Optional

from nanoverl_async import checkpoint

from nanoverl_async.agents import sandbox
from nanoverl_async.config import Config, ConfigError
from nanoverl_async.agents.data import load_samples, prompt_source
from nanoverl_async.agents.env import env_factory
from nanoverl_async.agents.rewards import load_reward
from nanoverl_async.agents.user_code import absolute_spec
from nanoverl_async.wire.auth import placed_host


def prepare(cfg: Config) -> Config:
    """`cfg` with user paths made absolute, after checking every file and piece of user code it names."""
    for key in ("data.train_files", "data.val_files"):
        files = getattr(cfg.data, key.split(".")[1])
        try:  # every file and row, now: a bad one deep in a file would otherwise kill the buffer mid-run
            if files:
                load_samples(files)
        except ValueError as error:
            raise ConfigError(f"config key '{key}': {error}") from None
    default_env = "builtin:chat" if cfg.data.train_files else "builtin:multiply"  # a dataset: score its answers
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=absolute_spec(cfg.model.path)),  # a builder file.py:fn
        agent=dataclasses.replace(cfg.agent, env=absolute_spec(cfg.agent.env or default_env)),
        reward=dataclasses.replace(cfg.reward, path=absolute_spec(cfg.reward.path)),
        data=dataclasses.replace(cfg.data, task=absolute_spec(cfg.data.task),
                                 train_files=[str(Path(p).resolve()) for p in cfg.data.train_files],
                                 val_files=[str(Path(p).resolve()) for p in cfg.data.val_files]))
    loaded = {}
    for key, load in (("reward.path", lambda: load_reward(cfg.reward.path, cfg.reward.name)),
                      ("agent.env", lambda: env_factory(cfg.agent.env, env_args=cfg.agent.env_args)),
                      ("data.task", lambda: prompt_source(cfg.data, cfg.run.seed))):
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
    checkpoint.find_checkpoint(cfg.run)  # a run.resume path that is not a checkpoint fails here
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


def check_learner_fits(cfg: Config) -> None:
    """One ConfigError line if the learner's persistent state (learners/memory.py: 16 bytes a trained
    parameter, 4 a frozen one, over learner.world_size ranks) exceeds the memory its ranks run in: on cuda,
    each GPU's (the smallest nvidia-smi lists here); on cpu, this machine's, which every local rank shares.
    Skipped where that is not knowable here: on a Ray cluster (ray.address: the ranks' machines are not this
    one), without nvidia-smi, and for a model.path given as builtin:NAME (small) or a builder file.py:fn
    (its directory is made later); a directory or Hub id is counted from its config alone (meta device)."""
    counted = learner_parameters(cfg)
    memory = learner_memory(cfg) if counted else None
    if memory:
        from nanoverl_async.learners.memory import learner_fit_error  # torch: only for a model counted here

        error = learner_fit_error(*counted, cfg.learner.world_size, *memory, ranks_share_it=cfg.learner.device == "cpu")
        if error:
            raise ConfigError(f"config key 'model.path': {error}")


def learner_parameters(cfg: Config) -> Optional[tuple[int, int]]:
    """(trained, frozen) parameter counts: the policy and, for gae, the critic trained; the KL reference
    frozen. None if a path is not a directory or Hub id, or its config cannot be read (launch says why)."""
    paths = [(cfg.model.path, False, True)]  # (path, is the critic, trained)
    if cfg.kl.loss_coef > 0 or cfg.kl.reward_coef > 0:
        paths.append((cfg.reference.path or cfg.model.path, False, False))
    if cfg.algorithm.advantage == "gae":
        paths.append((cfg.critic.path or cfg.model.path, True, True))
    if any(":" in path and not Path(path).expanduser().is_dir() for path, _, _ in paths):
        return None  # builtin:NAME or file.py:fn: nothing to count, and no torch to import for it
    import torch  # here, not at the top: the CLI checks a config before starting Ray, in a fraction of a second
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    counts = [0, 0]  # trained, frozen
    for path, critic, trained in paths:
        model_class = AutoModelForTokenClassification if critic else AutoModelForCausalLM
        try:
            config = AutoConfig.from_pretrained(path, **({"num_labels": 1} if critic else {}))
            with torch.device("meta"):  # shapes only: no memory, no initialisation
                counts[not trained] += sum(p.numel() for p in model_class.from_config(config).parameters())
        except (OSError, ValueError):
            return None
    return counts[0], counts[1]


def learner_memory(cfg: Config) -> Optional[tuple[int, str]]:
    """(bytes, what they are) of the memory one learner rank runs in, where this machine can tell."""
    if cfg.ray.address:
        return None
    if cfg.learner.device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory (CPU ranks share it)"
    try:  # not torch.cuda: that would hold a CUDA context in the controller for the whole run
        listed = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,name", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    mib, name = min((int(row.split(",")[0]), row.split(",", 1)[1].strip()) for row in listed.strip().splitlines())
    return mib * 2**20, f"GPU memory ({name})"
