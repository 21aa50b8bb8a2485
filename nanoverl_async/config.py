"""One typed config tree for a run: dataclasses, loaded from YAML plus dotted overrides.

    cfg = load_config("configs/agent_grpo.yaml", ["staleness.max=4", "learner.world_size=2"])

OmegaConf checks keys and types against the dataclasses (an unknown key or a wrong type is an
error); `validation.validate` then checks values that types cannot express (ranges, divisibility, choices).
Every failure is raised as `ConfigError`, whose message names the offending key in one line, so
the CLI can print it and exit non-zero before anything starts.

The YAML of the file and of each override is read strictly (config_file.py: no aliases, duplicate keys or
runaway nesting). A string set through an interpolation (`${oc.env:WANDB_API_KEY}`) is an `Interpolated`: the
run uses its value, and what a run writes (`to_yaml`, `to_dict`) holds the text as written, never the value.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nanoverl_async.config_file import (ConfigLoader, Interpolated, describe, keep_interpolated, read_yaml,
                                        yaml_problem)
from nanoverl_async.validation import ConfigError, validate  # noqa: F401 (ConfigError: re-exported)

log = logging.getLogger(__name__)


@dataclass
class RunConfig:
    output_dir: str = "outputs/agent_grpo"  # metrics.jsonl and final/ (Hugging Face format) go here
    total_steps: int = 60  # training steps (one batch each); version v = steps completed
    seed: int = 0  # seeds prompts, sampling and init
    step_timeout_s: float = 300.0  # the longest the loop waits for one batch before failing loudly
    wandb: bool = False  # also log metrics to Weights & Biases (offline unless WANDB_MODE says otherwise)
    progress: bool = True  # live console progress line
    eval_every: int = 0  # every N steps: near-greedy episodes on data.val_files, logged as eval/*; 0 = off
    save_every: int = 0  # every N steps: the whole async state to output_dir/checkpoints/step_N; 0 = off
    keep_checkpoints: int = 2  # the newest checkpoints kept after each save; 0 = all
    # "" = a fresh run; auto = the newest complete checkpoint under output_dir/checkpoints (fresh if none);
    # or the path of one step_N folder. metrics.jsonl is appended to from the checkpoint's step.
    resume: str = ""
    overwrite: bool = False  # a fresh run may clear a non-empty output_dir (else it refuses: no run is lost)
    # episodes per step written to output_dir/samples.jsonl: messages (tool calls, results, errors), reward, versions
    log_samples: int = 0
    print_sample_every: int = 0  # every N steps, one of those samples on the console too; 0 = never
    # two runs with the same seed log the same metrics: the engine batches requests in waves whose make-up
    # does not depend on timing (docs/design.md "Reproducible runs"); needs staleness.max=0, one replica
    deterministic: bool = False
    # output_dir/trace.json (Chrome trace events, open in ui.perfetto.dev): episodes per generator, the
    # buffer's leases and gate, learner prepare/update/publish, weight loads (nanoverl_async/observe/trace.py)
    trace: bool = False
    # output_dir/record/: every batch the learner trained on, in order (msgpack), for `nanoverl-async replay`
    record: bool = False


@dataclass
class WarmStartConfig:  # supervised steps on a scripted solver's demonstrations before RL (controller/warm_start.py)
    # fn(sample, messages) -> the next assistant turn: a final answer (str) or a tool call {"name": ...,
    # "arguments": {...}} (or a list of them), written in agent.env's tool format; path/file.py:fn or
    # pkg.module:fn; "" = off
    solver: str = ""
    demos: int = 256  # demonstrations: real agent-loop episodes on prompts RL does not draw
    epochs: int = 2  # passes over the demonstrations that earned a reward > 0
    batch_size: int = 8  # demonstrations per optimizer step
    lr: float = 5.0e-5
    eval_episodes: int = 32  # held-out episodes sampled before and after: tool-call rate and reward, printed


@dataclass
class ModelConfig:
    # a Hugging Face directory, a builtin: name (agents/user_code.BUILTINS["model.path"]: built locally, no
    # download) or a builder fn(cache_dir) -> directory (file.py:fn)
    path: str = "builtin:tiny"
    dtype: str = "float32"  # float32 | bfloat16
    cache_dir: str = ""  # where builtin models are built; "" = $NANOVERL_CACHE or ~/.cache/nanoverl_async
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)  # off unless warm_start.solver is set


@dataclass
class DataConfig:
    # prompts: builtin:multiply | builtin:long-tail | builtin:code | pkg.mod:fn | path/file.py:fn;
    # fn(seed, index) -> sample
    task: str = "builtin:multiply"
    prompts_per_step: int = 16  # B: prompt groups per training step
    samples_per_prompt: int = 8  # G: episodes per prompt (a GRPO group)
    train_files: list[str] = field(default_factory=list)  # verl-format parquet/jsonl; when set, data.task is unused
    val_files: list[str] = field(default_factory=list)  # verl-format parquet/jsonl for evaluation (run.eval_every)
    # a row whose prompt leaves no room under agent.max_total_tokens: false = the run is refused, naming it;
    # true = it is left out (added to skip_rows), and the start says how many were
    skip_long_prompts: bool = False
    skip_rows: list[str] = field(default_factory=list)  # rows of the files above left out: "<file> row <i>"

    @property
    def episodes_per_step(self) -> int:
        """B x G: the episodes of one training step's batch (the buffer hands out whole groups only)."""
        return self.prompts_per_step * self.samples_per_prompt


@dataclass
class AgentConfig:
    max_turns: int = 3  # assistant turns per episode
    max_new_tokens: int = 16  # sampled tokens per turn
    max_total_tokens: int = 96  # prompt + every turn; the episode ends when it is reached
    tool_timeout_s: float = 5.0  # a tool call running longer becomes an error observation
    hook_timeout_s: float = 60.0  # one reset(), step() or reward function call; longer fails the run, naming it
    rollout_timeout_s: float = 240.0  # one rollout(episode, sample): the whole episode; longer fails the run
    max_tool_calls: int = 8  # tool calls per episode; one more ends it ("max_tool_calls", reward 0)
    # how the `python` tool (sandbox.py) isolates model-written code: bwrap (bubblewrap; refused where it is
    # missing) | unsafe_no_isolation (only rlimits and a wall clock: the code can read, write and connect as this user)
    sandbox: str = "bwrap"
    # the environment: builtin:multiply | builtin:slow-tool | builtin:long-tail | builtin:code | builtin:chat |
    # pkg.module:Name | path/file.py:Name; "" = builtin:chat when data.train_files is set, else builtin:multiply
    env: str = ""
    # keyword arguments of agent.env's class, given to every instance, e.g. {median_s: 0.5} for builtin:slow-tool
    env_args: dict[str, Any] = field(default_factory=dict)


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
    # launcher prefix; [] = python -m sglang.launch_server (tests: the fake)
    server_command: list[str] = field(default_factory=list)


@dataclass
class GeneratorConfig:
    replicas: int = 1  # generator workers side by side
    engine: str = "builtin"  # builtin: the project's own (CPU/GPU) | sglang (GPU); "transformers": builtin's old name
    sglang: SGLangConfig = field(default_factory=SGLangConfig)  # used when engine is sglang
    temperature: float = 1.0  # sampling temperature; the learner's logprobs use the same
    max_groups_in_flight: int = 16  # prompt groups one generator runs at once (each is G episodes)
    torch_threads: int = 1  # intra-op threads of the generator process
    device: str = "cpu"
    # GPUs Ray reserves for each builtin-engine replica on cuda; a fraction shares one GPU (e.g. 0.5
    # beside learner.gpus_per_rank=0.5 on a one-GPU machine). SGLang replicas take servers x tp_size.
    gpus_per_replica: float = 1.0
    # The paged KV cache of a builtin-engine replica (generators/kv_blocks.py): a fraction in (0, 1] of the
    # device memory free once the model is loaded (cuda: GPU memory; cpu: RAM available; 1 = all of it), or a size
    # with its unit: 4GiB, 512MiB, 0.5GiB; a number above 1 is read as GiB (the key's first form); 0 = auto (0.5
    # on cuda, 2GiB on cpu). validation.kv_cache_budget reads it. While it is full, requests wait and the latest
    # rows are preempted. (int in the type: OmegaConf casts an int to a float key, not to a union.)
    kv_cache_memory: float | int | str = 0.0
    kv_block_size: int = 16  # positions per KV block: the unit of allocation and of shared prefixes


@dataclass
class LoRAConfig:  # low-rank adapters on a frozen base (models/lora.py): A and B train, a version is them alone
    rank: int = 0  # r of every adapter; 0 = off (the whole model trains)
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input while training; > 0 costs a separate proximal forward
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # PEFT's; all-linear: all but the head
    save_merged: bool = False  # final/ is PEFT's adapter folder; with this, also final/merged: the whole model

    @property
    def drops(self) -> bool:
        """Whether the update's forward draws dropout: adapters on and dropout > 0."""
        return self.rank > 0 and self.dropout > 0


@dataclass
class LearnerConfig:
    world_size: int = 1  # FSDP2 ranks
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0  # max global grad norm
    torch_threads: int = 1  # intra-op threads of each learner rank
    # micro-batches trained at once, each on a thread of its own, where the learner is one float32 CPU rank (else
    # one at a time): unlike intra-op threads they never wait for each other mid-op when the generator holds a
    # core (learners/threaded_passes.py)
    micro_batch_threads: int = 1
    device: str = "cpu"  # cpu (gloo) | cuda (nccl)
    # GPUs Ray reserves per rank on cuda; <1 shares a GPU with generators (NCCL: one rank per GPU)
    gpus_per_rank: float = 1.0
    ppo_epochs: int = 1  # passes over each batch; optimizer steps per batch = ppo_epochs x minibatches
    minibatches: int = 1  # optimizer steps per pass (must divide the batch into equal per-rank shards)
    micro_batch_tokens: int = 0  # forward/backward chunks of at most this many padded tokens (0 = no bound)
    activation_checkpointing: bool = False  # keep only each decoder layer's input for backward, recompute the rest
    logits_chunk_tokens: int = 0  # LM head + log-softmax over at most this many sampled tokens at once (0 = all)
    # torch.compile each decoder layer (dynamic shapes): a step 14-23% shorter on the CPU, the first one 10-15 s
    # longer (docs/benchmarks.md "The learner compiled, CPU"); pays in runs of hundreds of steps; needs g++ on a CPU
    compile: bool = False
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class ClipConfig:
    low: float = 0.2  # eps_low of the PPO clip
    high: float = 0.28  # eps_high (clip-higher, DAPO)
    ratio_c: float = 0.0  # dual clip: bound -A * c on negative advantages (Ye et al. 2020); 0 = off, else > 1


@dataclass
class OverlongConfig:
    # DAPO's soft overlong punishment over the last `buffer` tokens before agent.max_total_tokens; 0 = off
    buffer: int = 0
    penalty: float = 1.0  # the reward penalty at the very end of that buffer (linear ramp from 0)


@dataclass
class AlgorithmConfig:
    # The names below are keys of the algorithm modules' tables (algorithms/*.py: ADVANTAGES, POLICY_LOSSES,
    # CORRECTIONS, AGGREGATIONS, KL_ESTIMATORS); each function's docstring has its formula and paper.
    advantage: str = "grpo"  # the advantage estimator (gae trains a critic: critic.*)
    loss: str = "ppo"  # the policy loss
    correction: str = "decoupled"  # the off-policy correction (decoupled: AReaL's proximal policy)
    clip: ClipConfig = field(default_factory=ClipConfig)
    is_cap: float = 5.0  # C: truncation (tis, decoupled) or upper bound (mis) of the IS weight exp(p_old - mu)
    is_low: float = 0.0  # mis only: tokens/sequences whose IS weight is below this are masked out
    is_level: str = "token"  # token | sequence: where tis/mis compute the IS weight
    loss_agg: str = "token-mean"  # how token losses are averaged into one number
    entropy_coef: float = 0.0  # entropy bonus: loss -= entropy_coef * entropy
    gamma: float = 1.0  # discount (gae, reinforce++)
    lam: float = 1.0  # GAE lambda
    group_filter: bool = False  # DAPO dynamic sampling: drop groups whose rewards all tie, pull until B informative
    overlong: OverlongConfig = field(default_factory=OverlongConfig)


@dataclass
class KLConfig:
    loss_coef: float = 0.0  # KL(pi || ref) as a loss term (needs a reference); 0 = off
    reward_coef: float = 0.0  # KL as a per-token reward penalty (reinforce++, gae); 0 = off
    estimator: str = "k3"  # a KL estimator of algorithms/kl.py (Schulman 2020, http://joschu.net/blog/kl-approx.html)


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
    bucket_mb: int = 512  # MiB a bucket of a version (wire/weights.py): the learner keeps ~1 version, a generator 1


@dataclass
class BufferConfig:
    lease_timeout_s: float = 300.0  # a leased group not complete by then is expired and its prompt re-issued


@dataclass
class RayConfig:
    address: str = ""  # "" = local ray.init(); "auto" or host:port = join a cluster
    num_cpus: int = 0  # 0 = let Ray count; roles ask for 0 CPUs so small machines never deadlock
    # Placement on a cluster: a role runs only on nodes offering its custom resource (`ray start
    # --resources='{"NAME": 1}'`); "" = any node. Checked at launch against the cluster's resources.
    learner_resource: str = ""
    generator_resource: str = ""
    buffer_resource: str = ""

    def resources(self, role: str) -> dict[str, float]:
        """Ray's `resources=` for one actor of `role` (learner, generator, buffer): a sliver of the role's
        resource, so that any number of its actors fit on a node offering it."""
        name = getattr(self, f"{role}_resource")
        return {name: 0.001} if name else {}


@dataclass
class RewardConfig:
    # a .py file or module with a verl-style compute_score; "" = the math-verify scorer
    # (nanoverl_async/agents/rewards.py)
    path: str = ""
    name: str = "compute_score"  # the function's name in reward.path


@dataclass
class WireConfig:
    # Where the buffer and the weight publisher bind ZeroMQ: "auto" = 127.0.0.1 on one machine and, on a
    # cluster (ray.address), the address of the node each one is placed on; or one address for all.
    # Every socket, loopback included, uses CURVE with keys made for each run (wire/auth.py).
    host: str = "auto"


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


def load_config(path: Optional[str], overrides: list[str] = ()) -> Config:
    """YAML file (or None for the defaults) + `key=value` overrides -> a validated `Config`."""
    merged = OmegaConf.structured(Config)
    try:
        if path is not None:
            merged = OmegaConf.merge(merged, _paths_as_lists(read_yaml(path)))
    except OmegaConfBaseException as error:
        raise ConfigError(describe(error, Config())) from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        key, text = item.split("=", 1)
        try:
            update = OmegaConf.create()
            OmegaConf.update(update, key, yaml.load(text, ConfigLoader))  # as OmegaConf.from_dotlist, bounded
            merged = OmegaConf.merge(merged, _paths_as_lists(update))
        except yaml.YAMLError as error:
            raise ConfigError(f"config key '{key}': the value {yaml_problem(error)}") from None
        except OmegaConfBaseException as error:
            raise ConfigError(describe(error, Config(), key)) from None
    try:  # interpolations resolve here: an unset ${oc.env:NAME}, a cycle, a value of the wrong type
        cfg: Config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(describe(error, Config())) from None
    keep_interpolated(cfg, OmegaConf.to_container(merged, resolve=False))
    _read_old_names(cfg)
    validate(cfg)
    return cfg


def _read_old_names(cfg: Config) -> None:
    """generator.engine's first name for the builtin engine, `transformers` (it never ran transformers' model
    classes), still reads, with a one-line warning."""
    if cfg.generator.engine == "transformers":
        log.warning("config key 'generator.engine': 'transformers' is deprecated, write 'builtin' (the same engine)")
        cfg.generator.engine = "builtin"


def _paths_as_lists(update: Any) -> Any:
    """A single string for a list-of-paths key (`data.train_files=train.parquet`, as every verl command
    line writes it) becomes a one-item list."""
    for section in dataclasses.fields(Config):
        for key in dataclasses.fields(globals()[section.type]):  # annotations are strings (__future__)
            dotted = f"{section.name}.{key.name}"
            if key.type == "list[str]" and isinstance(OmegaConf.select(update, dotted), str):
                OmegaConf.update(update, dotted, [OmegaConf.select(update, dotted)])
    return update


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(to_dict(cfg))


def to_dict(cfg: Config, resolved: tuple[str, ...] = ()) -> dict:
    """The config as plain values, an Interpolated string as its text (an environment variable's value is
    never written), except the dotted keys in `resolved`, kept as their values."""
    def written(value: Any, key: str) -> Any:
        if isinstance(value, dict):
            return {name: written(v, f"{key}{name}.") for name, v in value.items()}
        if isinstance(value, list):
            return [written(v, key) for v in value]
        if isinstance(value, Interpolated):
            return str(value) if key[:-1] in resolved else value.text
        return value
    return written(dataclasses.asdict(cfg), "")
