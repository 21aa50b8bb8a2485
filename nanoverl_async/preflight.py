"""Before anything starts: check what the config points at, and pin it down for the roles.

    cfg = prepare(load_config("configs/agent_grpo.yaml", overrides))   # launch and `validate` both do this

`validation.py` checks values and touches nothing; this module checks the world the config names:
data files exist and every row has a chat `prompt`, the environment, the prompt function and the
reward function load (user code runs here, once, in the launching process), `run.resume` names a
checkpoint, and `wire.host` can be bound. Each failure is one ConfigError naming the key. The returned
config has `agent.env`'s default filled in and every user path absolute, so roles in other processes (and
a later resume) load exactly the same code, and `wire.host` placed (wire_auth.placed_host: "auto" is
loopback on one machine, each role's own node address on a cluster).
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

from nanoverl_async import checkpoint
from nanoverl_async.config import Config, ConfigError
from nanoverl_async.data import load_samples, prompt_source
from nanoverl_async.env import env_factory
from nanoverl_async.rewards import load_reward
from nanoverl_async.user_code import absolute_spec
from nanoverl_async.wire_auth import placed_host

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


def prepare(cfg: Config) -> Config:
    """`cfg` with user paths made absolute, after checking every file and piece of user code it names."""
    for key in ("data.train_files", "data.val_files"):
        files = getattr(cfg.data, key.split(".")[1])
        for path in files:
            if not str(path).endswith(DATA_SUFFIXES):
                raise ConfigError(f"config key '{key}': '{path}' is not a .parquet or .jsonl file")
            if not Path(path).is_file():
                raise ConfigError(f"config key '{key}': file '{path}' does not exist")
        try:  # every row, now: a bad one deep in the file would otherwise kill the buffer mid-run
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
    for key, load in (("reward.path", lambda: load_reward(cfg.reward.path, cfg.reward.name)),
                      ("agent.env", lambda: env_factory(cfg.agent.env)),
                      ("data.task", lambda: prompt_source(cfg.data, cfg.run.seed))):
        try:
            load()
        except (ValueError, ImportError, SyntaxError) as error:
            raise ConfigError(f"config key '{key}': {error}") from None
    checkpoint.find_checkpoint(cfg.run)  # a run.resume path that is not a checkpoint fails here
    if cfg.wire.host != "auto":  # one address for every role (auto: each binds on its own node, wire_auth.py)
        try:
            with socket.socket(socket.AF_INET6 if ":" in cfg.wire.host else socket.AF_INET) as probe:
                probe.bind((cfg.wire.host, 0))
        except (OSError, UnicodeError) as error:
            raise ConfigError(f"config key 'wire.host': cannot bind {cfg.wire.host!r} on this machine "
                              f"({error})") from None
    return dataclasses.replace(cfg, wire=dataclasses.replace(cfg.wire, host=placed_host(cfg.wire.host,
                                                                                      bool(cfg.ray.address))))
