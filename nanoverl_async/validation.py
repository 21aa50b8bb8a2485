"""Value checks on a loaded `Config` that types cannot express: choices, ranges, divisibility, and the
combinations that cannot work together. `load_config` runs `validate`; each failure is a ConfigError
naming the offending key. Kept apart from config.py so the tree of keys reads on its own.

Pure: it looks at values only. Files, checkpoints and user code are checked at launch (preflight.py).
It imports no other module of the package, so config.py can import it: the algorithm keys' choices are read
from the source of algorithms/ (`algorithm_names`), since importing those modules imports torch, ~3 s of CPU
before the CLI may start Ray, and in a process that merely reads a Config (the buffer's).
"""

from __future__ import annotations

import ast
import dataclasses
import math
from functools import cache
from pathlib import Path
from typing import Any

# `Config` in the annotations below is config.py's, not imported: config.py imports this module.


class ConfigError(ValueError):
    """A config problem, with the offending key named in the message."""


MIN_LEASE_TIMEOUT_S = 1.0


def _numbers(node: Any, prefix: str = ""):
    """(dotted key, value) of every number in the config tree (a list's floats too)."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _numbers(value, f"{prefix}{f.name}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{f.name}", value
        elif isinstance(value, list):
            yield from ((f"{prefix}{f.name}", v) for v in value if isinstance(v, float))


def get_key(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@cache
def algorithm_names() -> dict[str, tuple[str, ...]]:
    """Table of algorithms/ ("ADVANTAGES", ...) -> its names, as its modules give them: the string keys of a
    dict, or the strings of a tuple, assigned to an upper-case name. tests/test_imports.py checks they equal
    the imported tables."""
    names: dict[str, tuple[str, ...]] = {}
    for path in sorted((Path(__file__).parent / "algorithms").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id.isupper() and isinstance(node.value, (ast.Dict, ast.Tuple))):
                items = node.value.keys if isinstance(node.value, ast.Dict) else node.value.elts
                if items and all(isinstance(item, ast.Constant) and isinstance(item.value, str) for item in items):
                    names[node.targets[0].id] = tuple(item.value for item in items)
    return names


def choices() -> dict[str, Any]:
    """Every key with a fixed set of values -> those values; the algorithm keys read the algorithm modules'
    own tables (their source), so a new estimator is valid at once."""
    algorithms = algorithm_names()
    return {
        "model.dtype": ("float32", "bfloat16"),
        "generator.engine": ("transformers", "sglang"),
        "generator.device": ("cpu", "cuda"),
        "learner.device": ("cpu", "cuda"),
        "algorithm.advantage": algorithms["ADVANTAGES"],
        "algorithm.loss": algorithms["POLICY_LOSSES"],
        "algorithm.correction": algorithms["CORRECTIONS"],
        "algorithm.is_level": algorithms["IS_LEVELS"],
        "algorithm.loss_agg": algorithms["AGGREGATIONS"],
        "kl.estimator": algorithms["KL_ESTIMATORS"],
        "weight_sync.mode": ("interrupt", "drain"),
        "generator.sglang.weight_transport": ("disk", "nccl"),
        "generator.sglang.pause_mode": ("abort", "retract"),
        "agent.sandbox": ("bwrap", "unsafe_no_isolation"),
    }


def validate(cfg: Config) -> None:
    """Value checks that types cannot express; raises ConfigError naming the key."""
    _check_numbers(cfg)
    for key, allowed in choices().items():
        value = get_key(cfg, key)
        if value not in allowed:
            raise ConfigError(f"config key '{key}': '{value}' is not one of {', '.join(allowed)}")
    if cfg.algorithm.clip.low >= 1:
        raise ConfigError(f"config key 'algorithm.clip.low': must be < 1, got {cfg.algorithm.clip.low}")
    if len(cfg.learner.betas) != 2 or not all(0 <= b < 1 for b in cfg.learner.betas):
        raise ConfigError(f"config key 'learner.betas': must be two numbers in [0, 1), got {cfg.learner.betas}")
    for key in (f.name for f in dataclasses.fields(cfg.ray) if f.name.endswith("_resource")):
        if getattr(cfg.ray, key) and not cfg.ray.address:
            raise ConfigError(f"config key 'ray.{key}': places roles on a cluster's nodes, so it needs ray.address "
                              "(a local run has one node)")
    replica_gpus = cfg.generator.gpus_per_replica
    if not (0 < replica_gpus <= 1 or (replica_gpus > 1 and replica_gpus % 1 == 0)):
        raise ConfigError(f"config key 'generator.gpus_per_replica': must be in (0, 1] or a whole number, got {replica_gpus}")
    if cfg.agent.max_new_tokens >= cfg.agent.max_total_tokens:
        raise ConfigError("config key 'agent.max_new_tokens': must be smaller than agent.max_total_tokens")
    if not cfg.model.path:
        raise ConfigError("config key 'model.path': must not be empty")
    if cfg.generator.engine == "sglang" and cfg.generator.sglang.weight_transport == "nccl" \
            and cfg.weight_sync.mode != "interrupt":  # rank 0 loads weights into the servers whenever it publishes
        raise ConfigError(f"config key 'weight_sync.mode': '{cfg.weight_sync.mode}' cannot be honoured with "
                          "generator.sglang.weight_transport=nccl (learner rank 0 loads each version into the "
                          "servers when it publishes, mid-episode); use weight_sync.mode=interrupt or "
                          "generator.sglang.weight_transport=disk")
    _check_run(cfg)
    validate_algorithm(cfg)


def _check_run(cfg: Config) -> None:
    if cfg.run.overwrite and cfg.run.resume:
        raise ConfigError("config key 'run.overwrite': clears run.output_dir for a fresh run, so it cannot be "
                          f"combined with run.resume={cfg.run.resume!r}")
    if cfg.run.print_sample_every and not cfg.run.log_samples:
        raise ConfigError("config key 'run.print_sample_every': prints one of the logged samples, so it needs "
                          "run.log_samples >= 1")
    if cfg.run.eval_every and not cfg.data.val_files:
        raise ConfigError("config key 'run.eval_every': needs data.val_files (the evaluation prompts)")
    # Asynchronous batches depend on how fast each role runs, and so does which replica samples a group.
    for key, needed in {"staleness.max": 0, "generator.replicas": 1, "generator.engine": "transformers"}.items():
        if cfg.run.deterministic and get_key(cfg, key) != needed:
            raise ConfigError(f"config key 'run.deterministic': needs {key}={needed} (got {get_key(cfg, key)}); "
                              f"for an asynchronous run, run.record=true and `nanoverl-async replay` reproduce the "
                              f"learner")


POSITIVE = ("run.total_steps", "data.prompts_per_step", "data.samples_per_prompt", "agent.max_turns",
            "agent.max_new_tokens", "agent.max_total_tokens", "agent.tool_timeout_s", "agent.max_tool_calls",
            "generator.replicas", "generator.max_groups_in_flight", "generator.torch_threads",
            "generator.kv_block_size", "learner.world_size", "learner.torch_threads", "learner.ppo_epochs",
            "learner.minibatches", "learner.lr", "critic.lr", "run.step_timeout_s", "weight_sync.timeout_s",
            "learner.gpus_per_rank", "generator.temperature", "algorithm.is_cap", "generator.sglang.servers",
            "generator.sglang.tp_size", "generator.sglang.mem_fraction_static", "generator.sglang.launch_timeout_s",
            "generator.sglang.request_timeout_s", "generator.sglang.control_timeout_s")
# Upper bounds: numpy seeds are 32-bit; a discount and GAE's lambda weigh at most 1; a rank takes a share of
# one GPU or one whole GPU (Ray's fractional GPUs).
AT_MOST = {"run.seed": 2**32 - 1, "algorithm.gamma": 1, "algorithm.lam": 1, "learner.gpus_per_rank": 1}


def _check_numbers(cfg: Config) -> None:
    """Every number finite and >= 0 (none of the config's means anything below 0), the POSITIVE ones > 0, none
    above its AT_MOST, and the lease timeout's own bound."""
    for key, value in _numbers(cfg):
        if isinstance(value, float) and not math.isfinite(value):  # an inf lr used to pass, then kill the generator
            raise ConfigError(f"config key '{key}': must be a finite number, got {value}")
        if value < 0:
            raise ConfigError(f"config key '{key}': must be >= 0, got {value}")
    for key in POSITIVE:
        if not get_key(cfg, key) > 0:
            raise ConfigError(f"config key '{key}': must be > 0, got {get_key(cfg, key)}")
    for key, most in AT_MOST.items():
        if get_key(cfg, key) > most:
            raise ConfigError(f"config key '{key}': must be at most {most}, got {get_key(cfg, key)}")
    if cfg.buffer.lease_timeout_s < MIN_LEASE_TIMEOUT_S:
        raise ConfigError(f"config key 'buffer.lease_timeout_s': must be >= {MIN_LEASE_TIMEOUT_S} s (a lease must "
                          f"outlive an episode, or every group expires), got {cfg.buffer.lease_timeout_s}")


def validate_algorithm(cfg: Config) -> None:
    """Algorithm, KL and update-schedule values, and the combinations that cannot work together."""
    algo, kl, learner = cfg.algorithm, cfg.kl, cfg.learner
    samples = cfg.data.prompts_per_step * cfg.data.samples_per_prompt  # data.prompts_per_step x samples_per_prompt
    if samples % (learner.minibatches * learner.world_size):
        key = "learner.world_size" if samples % learner.world_size else "learner.minibatches"
        raise ConfigError(f"config key '{key}': {learner.minibatches} minibatches x {learner.world_size} ranks do "
                          f"not divide the {samples} samples per step evenly")
    if algo.clip.ratio_c != 0 and algo.clip.ratio_c <= 1:
        raise ConfigError(f"config key 'algorithm.clip.ratio_c': must be 0 (off) or > 1, got {algo.clip.ratio_c}")
    if algo.is_low >= algo.is_cap:
        raise ConfigError(f"config key 'algorithm.is_low': must be below algorithm.is_cap ({algo.is_cap})")
    if algo.correction not in ("tis", "mis") and (algo.is_level != "token" or algo.is_low != 0):
        raise ConfigError("config key 'algorithm.is_level': is_level and is_low apply to correction tis or mis "
                          f"only, not '{algo.correction}'")
    if algo.loss == "gspo" and algo.correction in ("tis", "mis") and algo.is_level == "token":
        raise ConfigError(f"config key 'algorithm.is_level': loss gspo takes one ratio per sequence, so its "
                          f"{algo.correction} correction must be sequence-level too (algorithm.is_level=sequence)")
    if algo.advantage != "gae" and cfg.critic != type(cfg.critic)():
        raise ConfigError(f"config key 'critic': set, but only algorithm.advantage=gae trains a critic "
                          f"(advantage is '{algo.advantage}')")
    if kl.reward_coef > 0 and algo.advantage not in ("reinforce++", "gae"):
        raise ConfigError(f"config key 'kl.reward_coef': a per-token KL reward needs a token-level advantage "
                          f"(reinforce++ or gae), not '{algo.advantage}'; use kl.loss_coef instead")
    if cfg.reference.path and kl.loss_coef == 0 and kl.reward_coef == 0:
        raise ConfigError("config key 'reference.path': set, but KL is off (kl.loss_coef = kl.reward_coef = 0), "
                          "so the reference would never be used")
    if algo.group_filter and cfg.data.samples_per_prompt < 2:
        raise ConfigError("config key 'algorithm.group_filter': needs data.samples_per_prompt >= 2 "
                          "(a single-sample group always ties and would be dropped)")
    if algo.overlong.buffer >= cfg.agent.max_total_tokens:
        raise ConfigError(f"config key 'algorithm.overlong.buffer': must be below agent.max_total_tokens "
                          f"({cfg.agent.max_total_tokens})")
