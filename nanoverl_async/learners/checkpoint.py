"""What a learner rank writes to disk: its training state, torch.distributed.checkpoint (DCP), sharded,
every rank writing and reading only its own shards; and the full model as a Hugging Face directory.

    save_training_state(rank, "out/checkpoints/.step_4.tmp/learner")   # collective, on every rank
    load_training_state(rank, "out/checkpoints/step_4/learner")        # collective, on every rank
    save_hf(rank.model, AutoModelForCausalLM, model_path, "out/final", rank.rank)   # collective

What is saved: the policy and its AdamW state, and, with algorithm.advantage=gae, the critic and its
optimizer. The frozen reference model is not: it is rebuilt from reference.path (or model.path).
`get_state_dict` / `set_state_dict` turn FSDP2's DTensor shards into DCP's format and back, so a checkpoint
written by N ranks loads into M ranks too (DCP reshards). Multi-node runs need `run.output_dir` on a
filesystem every rank sees. Fresh optimizers have no state yet; `get_state_dict` initialises it (a step
with lr 0) so DCP has tensors to load into.

Run alone: `python -m pytest tests/test_checkpoint.py -q -k learner` (1 and 2 ranks on gloo).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import FSDPModule

from nanoverl_async.models.load import load_tokenizer


def _modules(learner) -> dict:
    """name -> (model, optimizer) of everything a rank trains."""
    pairs = {"policy": (learner.model, learner.optimizer), "critic": (learner.critic, learner.critic_optimizer)}
    return {name: pair for name, pair in pairs.items() if pair[0] is not None}


def _state(learner) -> dict:
    """name -> {"model": ..., "optimizer": ...}: the state dicts DCP saves and loads in place."""
    return {name: dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))
            for name, (model, optimizer) in _modules(learner).items()}


def save_training_state(learner, path: str) -> None:
    """Collective: every rank writes its shards of models and optimizers under `path`."""
    dcp.save(_state(learner), checkpoint_id=path)


def load_training_state(learner, path: str) -> None:
    """Collective: every rank reads its shards from `path` into its models and optimizers, in place."""
    state = _state(learner)
    dcp.load(state, checkpoint_id=path)
    for name, (model, optimizer) in _modules(learner).items():
        set_state_dict(model, optimizer, model_state_dict=state[name]["model"],
                       optim_state_dict=state[name]["optimizer"])
        drop_compute_copy(model)


def drop_compute_copy(model: torch.nn.Module) -> None:
    """One FSDP2 rank keeps the unsharded compute copy of its weights after a forward (it does not reshard);
    once the weights change other than by an optimizer step (a loaded checkpoint; the first step after the
    packing probe's forward), that copy is stale: reshard. A plain model computes on its weights themselves."""
    if isinstance(model, FSDPModule):
        model.reshard()


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: `module`'s full (unsharded) state dict on rank 0's CPU; {} on other ranks."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_hf(module: torch.nn.Module, model_class, source: str, path: str, rank: int, **kwargs) -> None:
    """Collective: gather `module`'s full state dict and have rank 0 save it as `model_class` built from
    `source` (its config and tokenizer files are copied too)."""
    state_dict = full_state_dict(module)
    if rank == 0:
        model = model_class.from_pretrained(source, dtype=torch.float32, **kwargs)
        model.load_state_dict(state_dict)
        model.save_pretrained(path)
        if any(os.path.exists(os.path.join(source, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
            load_tokenizer(source).save_pretrained(path)
    dist.barrier()
