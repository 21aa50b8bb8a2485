"""One typed config tree for a run: dataclasses, loaded from YAML plus dotted overrides.

    cfg = load_config("configs/agent_grpo.yaml", ["staleness.max=4", "learner.world_size=2"])

OmegaConf checks keys and types against the dataclasses (an unknown key or a wrong type is an
error); `validate` then checks values that types cannot express (ranges, divisibility, choices).
Every failure is raised as `ConfigError`, whose message names the offending key in one line, so
the CLI can print it and exit non-zero before anything starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A config problem, with the offending key named in the message."""


@dataclass
class RunConfig:
    output_dir: str = "outputs/agent_grpo"  # metrics.jsonl and final/ (Hugging Face format) go here
    total_steps: int = 60  # optimizer steps; version v = steps completed
    seed: int = 0  # seeds prompts, sampling and init
    step_timeout_s: float = 300.0  # the longest the loop waits for one batch before failing loudly
    wandb: bool = False  # also log metrics to Weights & Biases (offline unless WANDB_MODE says otherwise)
    progress: bool = True  # live console progress line


@dataclass
class ModelConfig:
    path: str = "builtin:tiny"  # a Hugging Face directory, or builtin:tiny (created locally, no download)
    dtype: str = "float32"  # float32 | bfloat16
    cache_dir: str = ""  # where builtin models are built; "" = $NANOVERL_CACHE or ~/.cache/nanoverl_async


@dataclass
class DataConfig:
    task: str = "builtin:multiply"  # the prompt source and environment
    prompts_per_step: int = 16  # B: prompt groups per optimizer step
    samples_per_prompt: int = 8  # G: episodes per prompt (a GRPO group)


@dataclass
class AgentConfig:
    max_turns: int = 3  # assistant turns per episode
    max_new_tokens: int = 16  # sampled tokens per turn
    max_total_tokens: int = 96  # prompt + every turn; the episode ends when it is reached
    tool_timeout_s: float = 5.0  # a tool call running longer becomes an error observation


@dataclass
class StalenessConfig:
    max: int = 2  # eta: step t trains on a trajectory of version u only if t - u <= eta (0 = on-policy)


@dataclass
class GeneratorConfig:
    replicas: int = 1  # generator workers side by side
    engine: str = "transformers"  # transformers (CPU/GPU) | sglang (GPU)
    temperature: float = 1.0  # sampling temperature; the learner's logprobs use the same
    max_groups_in_flight: int = 16  # prompt groups one generator runs at once (each is G episodes)
    torch_threads: int = 1  # intra-op threads of the generator process
    device: str = "cpu"


@dataclass
class LearnerConfig:
    world_size: int = 1  # FSDP2 ranks
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0  # max global grad norm
    torch_threads: int = 1  # intra-op threads of each learner rank
    device: str = "cpu"  # cpu (gloo) | cuda (nccl)


@dataclass
class ClipConfig:
    low: float = 0.2  # eps_low of the PPO clip
    high: float = 0.28  # eps_high (clip-higher, DAPO)


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"  # grpo: (r - group mean) / (group std + eps)
    correction: str = "decoupled"  # decoupled (AReaL proximal + truncated IS) | none (naive, r vs behaviour)
    clip: ClipConfig = field(default_factory=ClipConfig)
    is_cap: float = 5.0  # C: truncation of the importance weight exp(p_old - mu)
    loss_agg: str = "token-mean"


@dataclass
class WeightSyncConfig:
    mode: str = "interrupt"  # interrupt: apply between decode steps | drain: finish in-flight episodes first
    timeout_s: float = 120.0  # a generator that sees no newer version for this long while it waits fails loudly


@dataclass
class BufferConfig:
    lease_timeout_s: float = 300.0  # a leased group not complete by then is expired and its prompt re-issued


@dataclass
class RayConfig:
    address: str = ""  # "" = local ray.init(); "auto" or host:port = join a cluster
    num_cpus: int = 0  # 0 = let Ray count; roles ask for 0 CPUs so small machines never deadlock


@dataclass
class WireConfig:
    host: str = "127.0.0.1"  # ZeroMQ binds here; change only on a trusted cluster network


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    wire: WireConfig = field(default_factory=WireConfig)


CHOICES = {
    "data.task": ("builtin:multiply",),
    "model.dtype": ("float32", "bfloat16"),
    "generator.engine": ("transformers", "sglang"),
    "generator.device": ("cpu", "cuda"),
    "learner.device": ("cpu", "cuda"),
    "algorithm.advantage": ("grpo",),
    "algorithm.correction": ("decoupled", "none"),
    "algorithm.loss_agg": ("token-mean",),
    "weight_sync.mode": ("interrupt", "drain"),
}


def load_config(path: Optional[str], overrides: list[str] = ()) -> Config:
    """YAML file (or None for the defaults) + `key=value` overrides -> a validated `Config`."""
    merged = OmegaConf.structured(Config)
    try:
        if path is not None:
            merged = OmegaConf.merge(merged, _read_yaml(path))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override '{item}' is not of the form key=value")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
    except OmegaConfBaseException as error:
        raise ConfigError(_describe(error)) from None
    cfg: Config = OmegaConf.to_object(merged)
    validate(cfg)
    return cfg


def _read_yaml(path: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        loaded = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:  # the parser's message carries line and column
        where = getattr(error, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"config file '{path}' is not valid YAML{at}: {getattr(error, 'problem', error)}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections, not a {type(loaded).__name__}")
    return OmegaConf.create(loaded)


def _describe(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", None) or "?"
    message = str(error).strip().splitlines()[0]
    if "not in struct" in message or "Key '" in message and "not" in message:
        return f"unknown config key '{key}'"
    return f"config key '{key}': {message}"


def validate(cfg: Config) -> None:
    """Value checks that types cannot express; raises ConfigError naming the key."""
    for key, allowed in CHOICES.items():
        value = get_key(cfg, key)
        if value not in allowed:
            raise ConfigError(f"config key '{key}': '{value}' is not one of {', '.join(allowed)}")
    positive = ["run.total_steps", "data.prompts_per_step", "data.samples_per_prompt", "agent.max_turns",
                "agent.max_new_tokens", "agent.max_total_tokens", "agent.tool_timeout_s", "generator.replicas",
                "generator.max_groups_in_flight", "generator.torch_threads", "learner.world_size",
                "learner.torch_threads", "run.step_timeout_s", "weight_sync.timeout_s",
                "buffer.lease_timeout_s", "generator.temperature", "learner.lr", "algorithm.is_cap"]
    for key in positive:
        if not get_key(cfg, key) > 0:
            raise ConfigError(f"config key '{key}': must be > 0, got {get_key(cfg, key)}")
    non_negative = ["staleness.max", "run.seed", "learner.weight_decay", "learner.grad_clip",
                    "algorithm.clip.low", "algorithm.clip.high", "ray.num_cpus"]
    for key in non_negative:
        if get_key(cfg, key) < 0:
            raise ConfigError(f"config key '{key}': must be >= 0, got {get_key(cfg, key)}")
    if cfg.algorithm.clip.low >= 1:
        raise ConfigError(f"config key 'algorithm.clip.low': must be < 1, got {cfg.algorithm.clip.low}")
    if len(cfg.learner.betas) != 2 or not all(0 <= b < 1 for b in cfg.learner.betas):
        raise ConfigError(f"config key 'learner.betas': must be two numbers in [0, 1), got {cfg.learner.betas}")
    samples = cfg.data.prompts_per_step * cfg.data.samples_per_prompt
    if samples % cfg.learner.world_size:
        raise ConfigError(f"config key 'learner.world_size': {cfg.learner.world_size} does not divide the "
                          f"{samples} samples per step (data.prompts_per_step x data.samples_per_prompt)")
    if cfg.agent.max_new_tokens >= cfg.agent.max_total_tokens:
        raise ConfigError("config key 'agent.max_new_tokens': must be smaller than agent.max_total_tokens")
    if not cfg.model.path:
        raise ConfigError("config key 'model.path': must not be empty")


def get_key(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
