"""Value checks on a loaded `Config` that types cannot express: choices, ranges, divisibility, and the
combinations that cannot work together. `load_config` runs `validate`; each failure is a ConfigError
naming the offending key. Kept apart from config.py so the tree of keys reads on its own.

Pure: it looks at values only. Files, checkpoints and user code are checked at launch (preflight.py).
It imports no other module of the package, so config.py can import it: the algorithm keys' choices are read
from the source of algorithms/ (`algorithm_names`), since importing those modules imports torch, seconds of CPU
(docs/benchmarks.md "Start-up") before the CLI may start Ray, and in a process that merely reads a Config (the
buffer's).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from functools import cache
from pathlib import Path
from typing import Any, Iterator

# `Config` in the annotations below is config.py's, not imported: config.py imports this module.


class ConfigError(ValueError):
    """A config problem, with the offending key named in the message."""


MIN_LEASE_TIMEOUT_S = 1.0
KV_KEY = "generator.kv_cache_memory"
MEMORY_UNITS = {"GiB": 2**30, "MiB": 2**20}  # binary only: "GB" could mean either, so it is refused
SIZE = re.compile(r"\s*(\d+\.?\d*|\.\d+)\s*(GiB|MiB)\s*")


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
        "generator.engine": ("builtin", "sglang"),
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


def kv_cache_budget(value: float | int | str) -> tuple[float, int]:
    """generator.kv_cache_memory -> (fraction of the device memory free once the model is loaded, bytes), one of
    them 0: a number in (0, 1] is a fraction (1: all of it, as vLLM's gpu_memory_utilization or SGLang's
    mem_fraction_static), a size with a unit ("4GiB", "512MiB", "0.5GiB") is bytes, and a number above 1 is GiB
    (the key's first form, still read: 1 is the whole fraction, so a size of 1 GiB or less needs its unit);
    0 is (0, 0): the engine's default. Anything else: ConfigError naming the key."""
    size = SIZE.fullmatch(value) if isinstance(value, str) else None
    if size:
        size_bytes = float(size[1]) * MEMORY_UNITS[size[2]]
        if size_bytes == 0:
            raise ConfigError(f"config key '{KV_KEY}': a size must be more than 0 bytes, got {value!r} (0 without "
                              f"a unit is the engine's default)")
        return 0.0, int(size_bytes)
    try:
        number = float(value)  # a number, or one quoted in the YAML
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise ConfigError(f"config key '{KV_KEY}': must be a fraction in (0, 1] of the free device memory, a size "
                          f"in GiB or MiB (4GiB, 512MiB) or 0 (the engine's default), got {value!r}")
    return (number, 0) if number <= 1 else (0.0, int(number * MEMORY_UNITS["GiB"]))


def validate(cfg: Config) -> None:
    """Value checks that types cannot express; raises ConfigError naming the key."""
    _check_numbers(cfg)
    kv_cache_budget(cfg.generator.kv_cache_memory)
    for key, allowed in choices().items():
        value = get_key(cfg, key)
        if value not in allowed:
            raise ConfigError(f"config key '{key}': '{value}' is not one of {', '.join(allowed)}")
    for key, wrong, why in _rules(cfg):
        if wrong:
            raise ConfigError(f"config key '{key}': {why}")


def _rules(cfg: Config) -> Iterator[tuple[str, bool, str]]:
    """(key, whether its value is wrong, why) of every check beyond one number or choice: one key's bounds and
    the combinations that cannot work together, in order; lazily, so a check may rely on those before it."""
    algo = cfg.algorithm
    learner = cfg.learner
    run = cfg.run
    agent = cfg.agent
    yield "algorithm.clip.low", algo.clip.low >= 1, f"must be < 1, got {algo.clip.low}"
    yield "learner.betas", len(learner.betas) != 2 or not all(0 <= b < 1 for b in learner.betas), \
        f"must be two numbers in [0, 1), got {learner.betas}"
    for key in (f.name for f in dataclasses.fields(cfg.ray) if f.name.endswith("_resource")):
        yield f"ray.{key}", getattr(cfg.ray, key) != "" and not cfg.ray.address, \
            "places roles on a cluster's nodes, so it needs ray.address (a local run has one node)"
    gpus = cfg.generator.gpus_per_replica
    yield "generator.gpus_per_replica", not (0 < gpus <= 1 or (gpus > 1 and gpus % 1 == 0)), \
        f"must be in (0, 1] or a whole number, got {gpus}"
    yield "agent.max_new_tokens", agent.max_new_tokens >= agent.max_total_tokens, \
        "must be smaller than agent.max_total_tokens"
    yield from _hook_timeout_rules(cfg)
    yield "model.path", not cfg.model.path, "must not be empty"
    nccl = cfg.generator.engine == "sglang" and cfg.generator.sglang.weight_transport == "nccl"
    yield "weight_sync.mode", nccl and cfg.weight_sync.mode != "interrupt", \
        (f"'{cfg.weight_sync.mode}' cannot be honoured with generator.sglang.weight_transport=nccl (learner rank 0 "
         "loads each version into the servers when it publishes, mid-episode); use weight_sync.mode=interrupt or "
         "generator.sglang.weight_transport=disk")
    yield from _lora_rules(learner.lora, nccl)
    yield "run.overwrite", run.overwrite and run.resume != "", \
        f"clears run.output_dir for a fresh run, so it cannot be combined with run.resume={run.resume!r}"
    yield "run.print_sample_every", run.print_sample_every > 0 and run.log_samples == 0, \
        "prints one of the logged samples, so it needs run.log_samples >= 1"
    yield "run.eval_every", run.eval_every > 0 and not cfg.data.val_files, \
        "needs data.val_files (the evaluation prompts)"
    # Asynchronous batches depend on how fast each role runs, and so does which replica samples a group.
    for key, needed in {"staleness.max": 0, "generator.replicas": 1, "generator.engine": "builtin"}.items():
        yield "run.deterministic", run.deterministic and get_key(cfg, key) != needed, \
            (f"needs {key}={needed} (got {get_key(cfg, key)}); for an asynchronous run, run.record=true and "
             f"`nanoverl-async replay` reproduce the learner")
    yield from _algorithm_rules(cfg)


def _algorithm_rules(cfg: Config) -> Iterator[tuple[str, bool, str]]:
    """`_rules` of the algorithm, KL and the update schedule."""
    algo = cfg.algorithm
    kl = cfg.kl
    learner = cfg.learner
    samples = cfg.data.episodes_per_step
    yield "learner.world_size" if samples % learner.world_size else "learner.minibatches", \
        samples % (learner.minibatches * learner.world_size) != 0, \
        (f"{learner.minibatches} minibatches x {learner.world_size} ranks do not divide the {samples} samples per "
         f"step evenly")
    yield "algorithm.clip.ratio_c", algo.clip.ratio_c != 0 and algo.clip.ratio_c <= 1, \
        f"must be 0 (off) or > 1, got {algo.clip.ratio_c}"
    yield "algorithm.is_low", algo.is_low >= algo.is_cap, f"must be below algorithm.is_cap ({algo.is_cap})"
    weighted = algo.correction in ("tis", "mis")  # the corrections with an IS level and a lower bound
    yield "algorithm.is_level", not weighted and (algo.is_level != "token" or algo.is_low != 0), \
        f"is_level and is_low apply to correction tis or mis only, not '{algo.correction}'"
    yield "algorithm.is_level", algo.loss == "gspo" and weighted and algo.is_level == "token", \
        (f"loss gspo takes one ratio per sequence, so its {algo.correction} correction must be sequence-level too "
         f"(algorithm.is_level=sequence)")
    yield "critic", algo.advantage != "gae" and cfg.critic != type(cfg.critic)(), \
        f"set, but only algorithm.advantage=gae trains a critic (advantage is '{algo.advantage}')"
    yield "kl.reward_coef", kl.reward_coef > 0 and algo.advantage not in ("reinforce++", "gae"), \
        (f"a per-token KL reward needs a token-level advantage (reinforce++ or gae), not '{algo.advantage}'; use "
         f"kl.loss_coef instead")
    yield "reference.path", cfg.reference.path != "" and kl.loss_coef == 0 and kl.reward_coef == 0, \
        "set, but KL is off (kl.loss_coef = kl.reward_coef = 0), so the reference would never be used"
    yield "algorithm.group_filter", algo.group_filter and cfg.data.samples_per_prompt < 2, \
        "needs data.samples_per_prompt >= 2 (a single-sample group always ties and would be dropped)"
    yield "algorithm.overlong.buffer", algo.overlong.buffer >= cfg.agent.max_total_tokens, \
        f"must be below agent.max_total_tokens ({cfg.agent.max_total_tokens})"


def _hook_timeout_rules(cfg: Config) -> Iterator[tuple[str, bool, str]]:
    """A hook that hangs is named by its own timeout only if that comes before the buffer gives up on the batch;
    a group's lease must outlive its episodes."""
    for key in ("agent.hook_timeout_s", "agent.rollout_timeout_s"):
        yield key, get_key(cfg, key) >= cfg.run.step_timeout_s, \
            f"must be below run.step_timeout_s ({cfg.run.step_timeout_s:g}), or a hung hook fails the step unnamed"
    yield "agent.rollout_timeout_s", cfg.agent.rollout_timeout_s >= cfg.buffer.lease_timeout_s, \
        (f"must be below buffer.lease_timeout_s ({cfg.buffer.lease_timeout_s:g}): a group's lease must outlive its "
         f"episodes, or it expires and its prompt is issued again while they run")


def _lora_rules(lora, nccl: bool) -> Iterator[tuple[str, bool, str]]:
    """learner.lora's: its own bounds, and the weight transport its versions need."""
    yield "learner.lora.dropout", lora.dropout >= 1, f"must be < 1, got {lora.dropout}"
    yield "learner.lora.alpha", lora.rank > 0 and lora.alpha <= 0, "must be > 0 with learner.lora.rank"
    yield "learner.lora.target_modules", lora.rank > 0 and not lora.target_modules, \
        "must name at least one module (or all-linear) with learner.lora.rank"
    yield "learner.lora.rank", lora.rank > 0 and nccl, \
        ("LoRA versions are adapter folders SGLang loads (/load_lora_adapter): use generator.sglang.weight_transport="
         "disk")


POSITIVE = ("run.total_steps", "data.prompts_per_step", "data.samples_per_prompt", "agent.max_turns",
            "agent.max_new_tokens", "agent.max_total_tokens", "agent.tool_timeout_s", "agent.max_tool_calls",
            "agent.hook_timeout_s", "agent.rollout_timeout_s", "learner.micro_batch_threads",
            "generator.replicas", "generator.max_groups_in_flight", "generator.torch_threads",
            "generator.kv_block_size", "learner.world_size", "learner.torch_threads", "learner.ppo_epochs",
            "learner.minibatches", "learner.lr", "critic.lr", "run.step_timeout_s", "weight_sync.timeout_s",
            "weight_sync.bucket_mb", "model.warm_start.demos", "model.warm_start.epochs",
            "model.warm_start.batch_size", "model.warm_start.lr", "model.warm_start.eval_episodes",
            "learner.gpus_per_rank", "generator.temperature", "algorithm.is_cap", "generator.sglang.servers",
            "generator.sglang.tp_size", "generator.sglang.mem_fraction_static", "generator.sglang.launch_timeout_s",
            "generator.sglang.request_timeout_s", "generator.sglang.control_timeout_s")
# Upper bounds: numpy seeds are 32-bit; a discount and GAE's lambda weigh at most 1; a rank takes a share of
# one GPU or one whole GPU (Ray's fractional GPUs); a TCP port.
AT_MOST = {"run.seed": 2**32 - 1, "algorithm.gamma": 1, "algorithm.lam": 1, "learner.gpus_per_rank": 1,
           "generator.sglang.port_base": 65535}
# Any other whole number (a count of steps, tokens, ranks, ...) fits a C int, as the libraries it reaches
# (torch, numpy, the OS) take it; a wait (a key ending in _s) fits poll()'s C int of milliseconds.
MAX_INT, MAX_WAIT_S = 2**31 - 1, (2**31 - 1) / 1000


def _check_numbers(cfg: Config) -> None:
    """Every number finite and >= 0 (none of the config's means anything below 0), the POSITIVE ones > 0, none
    above its AT_MOST (else MAX_INT, MAX_WAIT_S), and the lease timeout's own bound."""
    for key, value in _numbers(cfg):
        if isinstance(value, float) and not math.isfinite(value):  # an inf lr used to pass, then kill the generator
            raise ConfigError(f"config key '{key}': must be a finite number, got {value}")
        if value < 0:
            raise ConfigError(f"config key '{key}': must be >= 0, got {value}")
        most = AT_MOST.get(key, MAX_WAIT_S if key.endswith("_s") else MAX_INT if isinstance(value, int) else None)
        if most is not None and value > most:
            raise ConfigError(f"config key '{key}': must be at most {most}, got {value}")
    for key in POSITIVE:
        if not get_key(cfg, key) > 0:
            raise ConfigError(f"config key '{key}': must be > 0, got {get_key(cfg, key)}")
    if cfg.buffer.lease_timeout_s < MIN_LEASE_TIMEOUT_S:
        raise ConfigError(f"config key 'buffer.lease_timeout_s': must be >= {MIN_LEASE_TIMEOUT_S} s (a lease must "
                          f"outlive an episode, or every group expires), got {cfg.buffer.lease_timeout_s}")

