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
    eval_every: int = 0  # every N steps: near-greedy episodes on data.val_files, logged as eval/*; 0 = off


@dataclass
class ModelConfig:
    path: str = "builtin:tiny"  # a Hugging Face directory, or builtin:tiny (created locally, no download)
    dtype: str = "float32"  # float32 | bfloat16
    cache_dir: str = ""  # where builtin models are built; "" = $NANOVERL_CACHE or ~/.cache/nanoverl_async


@dataclass
class DataConfig:
    task: str = "builtin:multiply"  # prompts: builtin:multiply | pkg.mod:fn | path/file.py:fn; fn(seed, index) -> sample
    prompts_per_step: int = 16  # B: prompt groups per optimizer step
    samples_per_prompt: int = 8  # G: episodes per prompt (a GRPO group)
    train_files: list[str] = field(default_factory=list)  # verl-format parquet/jsonl; when set, data.task is unused
    val_files: list[str] = field(default_factory=list)  # verl-format parquet/jsonl for evaluation (run.eval_every)


@dataclass
class AgentConfig:
    max_turns: int = 3  # assistant turns per episode
    max_new_tokens: int = 16  # sampled tokens per turn
    max_total_tokens: int = 96  # prompt + every turn; the episode ends when it is reached
    tool_timeout_s: float = 5.0  # a tool call running longer becomes an error observation
    max_tool_calls: int = 8  # tool calls per episode; one more ends it ("max_tool_calls", reward 0)
    # the environment: builtin:multiply | builtin:chat | pkg.module:Name | path/file.py:Name;
    # "" = builtin:chat when data.train_files is set, else builtin:multiply
    env: str = ""


@dataclass
class StalenessConfig:
    max: int = 2  # eta: step t trains on a trajectory of version u only if t - u <= eta (0 = on-policy)


@dataclass
class SGLangConfig:
    """generator.engine=sglang: SGLang servers driven over HTTP (generators/sglang_engine.py)."""

    servers: int = 1  # servers per generator worker; requests go to the least busy, an episode stays on one
    port_base: int = 30000  # server i of generator g listens on port_base + g * servers + i
    host: str = "127.0.0.1"
    tp_size: int = 1  # GPUs per server (tensor parallel)
    mem_fraction_static: float = 0.7  # GPU memory share for weights and KV cache
    server_args: list[str] = field(default_factory=list)  # extra launch_server flags, e.g. ["--dtype", "bfloat16"]
    weight_transport: str = "disk"  # disk: update_weights_from_disk | nccl: update_weights_from_distributed
    weights_dir: str = ""  # where disk updates are written (on the generator's node); "" = a temp directory
    pause_mode: str = "abort"  # abort: resume aborted requests from their partial tokens | retract
    launch_timeout_s: float = 600.0  # a server not healthy by then fails the generator
    request_timeout_s: float = 600.0  # one /generate call
    control_timeout_s: float = 300.0  # pause, continue, weight updates, health
    server_command: list[str] = field(default_factory=list)  # launcher prefix; [] = python -m sglang.launch_server (tests: the fake)


@dataclass
class GeneratorConfig:
    replicas: int = 1  # generator workers side by side
    engine: str = "transformers"  # transformers (CPU/GPU) | sglang (GPU)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)  # used when engine is sglang
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
    ppo_epochs: int = 1  # passes over each batch; optimizer steps per batch = ppo_epochs x minibatches
    minibatches: int = 1  # optimizer steps per pass (must divide the batch into equal per-rank shards)
    micro_batch_tokens: int = 0  # forward/backward chunks of at most this many padded tokens (0 = no bound)


@dataclass
class ClipConfig:
    low: float = 0.2  # eps_low of the PPO clip
    high: float = 0.28  # eps_high (clip-higher, DAPO)
    ratio_c: float = 0.0  # dual clip: bound -A * c on negative advantages (Ye et al. 2020); 0 = off, else > 1


@dataclass
class OverlongConfig:
    buffer: int = 0  # DAPO soft overlong punishment over the last `buffer` tokens before agent.max_total_tokens; 0 = off
    penalty: float = 1.0  # the reward penalty at the very end of that buffer (linear ramp from 0)


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"  # grpo (group mean/std) | drgrpo (group mean) | rloo | reinforce++ | gae (critic)
    loss: str = "ppo"  # ppo (clip, clip-higher, dual clip) | gspo (sequence ratio) | cispo (clipped IS x logprob)
    correction: str = "decoupled"  # none (r vs behaviour) | decoupled (AReaL) | tis (truncated IS) | mis (masked IS)
    clip: ClipConfig = field(default_factory=ClipConfig)
    is_cap: float = 5.0  # C: truncation (tis, decoupled) or upper bound (mis) of the IS weight exp(p_old - mu)
    is_low: float = 0.0  # mis only: tokens/sequences whose IS weight is below this are masked out
    is_level: str = "token"  # token | sequence: where tis/mis compute the IS weight
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm (Dr. GRPO)
    entropy_coef: float = 0.0  # entropy bonus: loss -= entropy_coef * entropy
    gamma: float = 1.0  # discount (gae, reinforce++)
    lam: float = 1.0  # GAE lambda
    group_filter: bool = False  # DAPO dynamic sampling: drop groups whose rewards all tie, pull until B informative
    overlong: OverlongConfig = field(default_factory=OverlongConfig)


@dataclass
class KLConfig:
    loss_coef: float = 0.0  # KL(pi || ref) as a loss term (needs a reference); 0 = off
    reward_coef: float = 0.0  # KL as a per-token reward penalty (reinforce++, gae); 0 = off
    estimator: str = "k3"  # k1 | k2 | k3 (Schulman 2020, http://joschu.net/blog/kl-approx.html)


@dataclass
class ReferenceConfig:
    path: str = ""  # the frozen reference model for KL; "" = the policy's initial weights (model.path)


@dataclass
class CriticConfig:
    """The value model of algorithm.advantage=gae: a causal-LM backbone with a scalar head, trained in the
    learner ranks by the same FSDP2 machinery with its own optimizer."""

    path: str = ""  # backbone weights; "" = the policy's initial weights (model.path); the head starts fresh
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm of the critic
    value_clip: float = 0.2  # eps_v of the clipped value loss (0 = unclipped)


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
class RewardConfig:
    path: str = ""  # a .py file or module with a verl-style compute_score; "" = the math-verify scorer (nanoverl_async/rewards.py)
    name: str = "compute_score"  # the function's name in reward.path


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
    kl: KLConfig = field(default_factory=KLConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "generator.engine": ("transformers", "sglang"),
    "generator.device": ("cpu", "cuda"),
    "learner.device": ("cpu", "cuda"),
    "algorithm.advantage": ("grpo", "drgrpo", "rloo", "reinforce++", "gae"),
    "algorithm.loss": ("ppo", "gspo", "cispo"),
    "algorithm.correction": ("decoupled", "none", "tis", "mis"),
    "algorithm.is_level": ("token", "sequence"),
    "algorithm.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "kl.estimator": ("k1", "k2", "k3"),
    "weight_sync.mode": ("interrupt", "drain"),
    "generator.sglang.weight_transport": ("disk", "nccl"),
    "generator.sglang.pause_mode": ("abort", "retract"),
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
                "agent.max_new_tokens", "agent.max_total_tokens", "agent.tool_timeout_s", "agent.max_tool_calls", "generator.replicas",
                "generator.max_groups_in_flight", "generator.torch_threads", "learner.world_size",
                "learner.torch_threads", "run.step_timeout_s", "weight_sync.timeout_s",
                "buffer.lease_timeout_s", "generator.temperature", "learner.lr", "algorithm.is_cap",
                "generator.sglang.servers", "generator.sglang.tp_size", "generator.sglang.mem_fraction_static",
                "generator.sglang.launch_timeout_s", "generator.sglang.request_timeout_s",
                "generator.sglang.control_timeout_s"]
    for key in positive:
        if not get_key(cfg, key) > 0:
            raise ConfigError(f"config key '{key}': must be > 0, got {get_key(cfg, key)}")
    non_negative = ["staleness.max", "run.seed", "run.eval_every", "learner.weight_decay", "learner.grad_clip",
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
    validate_algorithm(cfg)
    validate_agent_data(cfg)


def validate_agent_data(cfg: Config) -> None:
    """Dataset files exist with a known suffix; agent.env and reward.path name loadable objects."""
    if cfg.run.eval_every and not cfg.data.val_files:
        raise ConfigError("config key 'run.eval_every': needs data.val_files (the evaluation prompts)")
    for key in ("data.train_files", "data.val_files"):
        for path in get_key(cfg, key):
            if not str(path).endswith((".parquet", ".jsonl", ".json")):
                raise ConfigError(f"config key '{key}': '{path}' is not a .parquet or .jsonl file")
            if not Path(path).is_file():
                raise ConfigError(f"config key '{key}': file '{path}' does not exist")
    from nanoverl_async.env import env_factory, resolved_env  # imported here: no user code until now
    from nanoverl_async.rewards import load_reward

    from nanoverl_async.buffer.service import resolve_prompt_fn

    for key, load in (("agent.env", lambda: env_factory(resolved_env(cfg.agent.env, cfg.data.train_files))),
                      ("data.task", lambda: cfg.data.train_files or resolve_prompt_fn(cfg.data.task, cfg.run.seed)),
                      ("reward.path", lambda: load_reward(cfg.reward.path, cfg.reward.name))):
        try:
            load()
        except (ValueError, ImportError, SyntaxError) as error:
            raise ConfigError(f"config key '{key}': {error}") from None


INF = float("inf")


def validate_algorithm(cfg: Config) -> None:
    """Algorithm, KL and update-schedule values, and the combinations that cannot work together."""
    algo, kl, learner = cfg.algorithm, cfg.kl, cfg.learner
    ranges = {"learner.ppo_epochs": (1, INF), "learner.minibatches": (1, INF), "algorithm.gamma": (0, 1),
              "algorithm.lam": (0, 1), "critic.lr": (1e-12, INF)}
    ranges.update({key: (0, INF) for key in (
        "learner.micro_batch_tokens", "algorithm.entropy_coef", "algorithm.is_low", "kl.loss_coef", "kl.reward_coef",
        "algorithm.overlong.buffer", "algorithm.overlong.penalty", "critic.weight_decay", "critic.grad_clip",
        "critic.value_clip")})
    for key, (low, high) in ranges.items():
        if not low <= get_key(cfg, key) <= high:
            raise ConfigError(f"config key '{key}': must be in [{low}, {high}], got {get_key(cfg, key)}")
    samples = cfg.data.prompts_per_step * cfg.data.samples_per_prompt
    if samples % (learner.minibatches * learner.world_size):
        raise ConfigError(f"config key 'learner.minibatches': {learner.minibatches} minibatches x "
                          f"{learner.world_size} ranks do not divide the {samples} samples per step evenly")
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
    if algo.advantage != "gae" and cfg.critic != CriticConfig():
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


def get_key(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
