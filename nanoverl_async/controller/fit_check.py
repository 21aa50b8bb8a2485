"""The learner's fit check: the peak one learner rank is predicted to reach in an update (learners/memory.py:
its state, the compute copy, activations, logits, the runtime) against the memory it runs in, before Ray starts.

    check_learner_fits(cfg)               # preflight.prepare: model.path a directory or Hub id (and `validate`)
    check_learner_fits(cfg, model_path)   # launch, on the directory a builder or builtin:NAME made
    learner_prediction(cfg, model_path)   # the Prediction, None where the model cannot be counted here

Each returns the Prediction (launch logs it, and the run's summary puts it beside the measured peak) or raises
one ConfigError line. Models are counted from their configs alone (meta device: no weights, no memory).
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path
from typing import Optional

from nanoverl_async.config import Config, ConfigError


def check_learner_fits(cfg: Config, model_path: str = ""):
    """learner_prediction(cfg, model_path), after one ConfigError line if it exceeds the memory its ranks run
    in: on cuda, each GPU's (the smallest nvidia-smi lists here); on cpu, this machine's, which every local
    rank shares. Not refused where that memory is not knowable here: on a Ray cluster (ray.address: the
    ranks' machines are not this one), or without nvidia-smi."""
    work = learner_workload(cfg, model_path)
    if work is None:
        return None
    from nanoverl_async.learners.memory import learner_fit_error, predict_peak  # torch: imported for counting

    memory = learner_memory(cfg)
    error = memory and learner_fit_error(lambda ranks: predict_peak(work, ranks), cfg.learner.world_size, *memory,
                                         ranks_share_it=cfg.learner.device == "cpu",
                                         remedies=remedies(cfg, work.tokens))
    if error:
        raise ConfigError(f"config key 'model.path': {error}")
    return predict_peak(work, cfg.learner.world_size)


def learner_prediction(cfg: Config, model_path: str = ""):
    """The predicted peak of one rank's update (learners/memory.Prediction), or None (`learner_workload`)."""
    from nanoverl_async.learners.memory import predict_peak

    work = learner_workload(cfg, model_path)
    return None if work is None else predict_peak(work, cfg.learner.world_size)


def micro_batch_tokens(cfg: Config) -> int:
    """The most tokens one micro-batch of a rank holds: learner.micro_batch_tokens (padded tokens; a sequence
    longer than it is a micro-batch of its own), or, at 0, the rank's whole share of a minibatch, every
    sequence agent.max_total_tokens long."""
    rows = math.ceil(cfg.data.episodes_per_step / cfg.learner.minibatches / cfg.learner.world_size)
    whole = rows * cfg.agent.max_total_tokens
    budget = cfg.learner.micro_batch_tokens
    return min(whole, max(budget, cfg.agent.max_total_tokens)) if budget else whole


def remedies(cfg: Config, tokens: int) -> tuple[str, ...]:
    """The settings that would lower the prediction, of those not already at their lowest."""
    learner = cfg.learner
    return tuple(remedy for remedy, applies in (
        (f"a smaller learner.micro_batch_tokens (a micro-batch holds {tokens:,} tokens)",
         tokens > cfg.agent.max_total_tokens),
        ("learner.activation_checkpointing=true", not learner.activation_checkpointing),
        ("learner.logits_chunk_tokens=1024", not learner.logits_chunk_tokens or learner.logits_chunk_tokens > 1024),
        ("learner.lora.rank=16", not learner.lora.rank),
        ("learner.device=cuda", learner.device == "cpu")) if applies)


def learner_workload(cfg: Config, model_path: str = ""):
    """What one rank trains (learners/memory.Workload), with model_path (resolved) standing for model.path
    wherever the config names it; None if a path is not a directory or Hub id, or a config cannot be read
    (launch says why)."""
    counted = learner_parameters(cfg, model_path)
    policy = counted and _meta_model(model_path or cfg.model.path)
    if policy is None:
        return None
    from nanoverl_async.learners.memory import Architecture, Workload
    from nanoverl_async.models.load import DTYPES
    from nanoverl_async.models.lora import adapter_parameters

    layer_classes = set(getattr(policy, "_no_split_modules", None) or [])
    in_layers = sum(p.numel() for module in policy.modules() if type(module).__name__ in layer_classes
                    for p in module.parameters())
    parameters = sum(p.numel() for p in policy.parameters())
    adapters = adapter_parameters(policy, cfg.learner.lora) if cfg.learner.lora.rank else 0
    tokens = micro_batch_tokens(cfg)
    return Workload(*counted, Architecture.of(policy.config), parameters + adapters,
                    parameters - in_layers, DTYPES[cfg.model.dtype].itemsize, tokens,
                    min(tokens, 2 * cfg.agent.max_total_tokens), tokens,  # packing.pack: rows of 2 sequences at most
                    cfg.learner.activation_checkpointing, cfg.learner.logits_chunk_tokens, cfg.learner.device)


def learner_parameters(cfg: Config, model_path: str = "") -> Optional[tuple[int, int]]:
    """(trained parameters, frozen bytes): the policy and, for gae, the critic trained; the KL reference frozen
    in float32; with learner.lora, the policy's adapters trained and its base frozen in model.dtype (and no
    reference of its own without reference.path: the base is it). model_path (resolved) stands for model.path.
    None if a path is not a directory or Hub id, or its config cannot be read (launch says why)."""
    adapters = cfg.learner.lora if cfg.learner.lora.rank else None
    policy = model_path or cfg.model.path
    paths = [(policy, False, True)]  # (path, is the critic, trained)
    if (cfg.kl.loss_coef > 0 or cfg.kl.reward_coef > 0) and not (adapters and not cfg.reference.path):
        paths.append((cfg.reference.path or policy, False, False))
    if cfg.algorithm.advantage == "gae":
        paths.append((cfg.critic.path or policy, True, True))
    if any(":" in path and not Path(path).expanduser().is_dir() for path, _, _ in paths):
        return None  # builtin:NAME or file.py:fn: nothing to count, and no torch to import for it
    from nanoverl_async.learners.memory import REFERENCE_BYTES
    from nanoverl_async.models.load import DTYPES
    from nanoverl_async.models.lora import adapter_parameters

    trained_count, frozen_bytes = 0, 0
    for path, critic, trained in paths:
        model = _meta_model(path, critic)
        if model is None:
            return None
        count = sum(p.numel() for p in model.parameters())
        if trained and adapters and not critic:
            trained_count += adapter_parameters(model, adapters)
            frozen_bytes += count * DTYPES[cfg.model.dtype].itemsize
        elif trained:
            trained_count += count
        else:
            frozen_bytes += count * REFERENCE_BYTES
    return trained_count, frozen_bytes


def _meta_model(path: str, critic: bool = False):
    """The model at `path` (for the critic, its token-classification form with one label) on the meta device:
    shapes only, no memory, no initialisation; None if its config cannot be read."""
    import torch  # here, not at the top: the CLI checks a config before starting Ray, in a fraction of a second
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    try:
        config = AutoConfig.from_pretrained(path, **({"num_labels": 1} if critic else {}))
        with torch.device("meta"):
            return (AutoModelForTokenClassification if critic else AutoModelForCausalLM).from_config(config)
    except (OSError, ValueError):
        return None


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


def predicted_memory(cfg: Config, model_path: str, started: float) -> dict[str, float]:
    """The learner's fit check on the resolved model (whatever form model.path took), in one ConfigError line if
    it cannot fit; else the prediction is logged once (startup.phase, seconds since `started`) and returned as GB
    by the memory/* key it predicts (on a GPU the device peak, which leaves the runtime out), for the summary."""
    from nanoverl_async.controller.startup import phase
    from nanoverl_async.learners.memory import GB

    prediction = check_learner_fits(cfg, model_path)
    if prediction is None:
        return {}
    phase(started, f"learner memory: an update's peak predicted at {prediction.total / GB:.1f} GB a rank "
                   f"({prediction.parts()} GB; learners/memory.py)")
    if cfg.learner.device == "cuda":
        return {"memory/learner_peak_device_gb": (prediction.total - prediction.runtime) / GB}
    return {"memory/learner_peak_host_gb": prediction.total / GB}
