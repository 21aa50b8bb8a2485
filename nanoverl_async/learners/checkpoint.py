"""What a learner rank writes to disk: its training state, torch.distributed.checkpoint (DCP), sharded,
every rank writing and reading only its own shards; and the final model as a Hugging Face directory (with
LoRA, PEFT's adapter folder).

    save_training_state(rank, "out/checkpoints/.step_4.tmp/learner")   # collective, on every rank
    load_training_state(rank, "out/checkpoints/step_4/learner")        # collective, on every rank
    save_final(rank, "out/final")                                      # collective

What is saved: the policy (with LoRA, its adapters: the base is model.path) and its AdamW state, and, with
algorithm.advantage=gae, the critic and its optimizer. Tensors only: an optimizer's param_groups (lr, betas,
...) come from the config, so a resumed run takes a changed learner.lr. The frozen reference model is not
saved: it is rebuilt from reference.path (or model.path).
`get_state_dict` / `set_state_dict` turn FSDP2's DTensor shards into DCP's format and back, so a checkpoint
written by N ranks loads into M ranks too (DCP reshards). Multi-node runs need `run.output_dir` on a
filesystem every rank sees. Fresh optimizers have no state yet; `get_state_dict` initialises it (a step
with lr 0) so DCP has tensors to load into.

A checkpoint is data, never code. DCP's own reader unpickles `.metadata` (its index of the shards) with
`pickle.load` and any non-tensor value with `torch.load(weights_only=False)`: a crafted file would run its
code. `TensorReader` unpickles the index with `IndexUnpickler`, which resolves DCP's metadata classes and
nothing else, and refuses an index naming files outside the folder; `TensorsOnly` refuses any non-tensor
value (a checkpoint written here holds none); DCP reads the tensors themselves with weights_only. A refused
file ends the load in one line naming it (ConfigError on every rank, before or after DCP's collectives).

Run alone: `python -m pytest tests/test_checkpoint.py -q -k learner` (1 and 2 ranks on gloo).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path, PosixPath

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, Metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (_MEM_FORMAT_ENCODING, BytesStorageMetadata, ChunkStorageMetadata,
                                                   MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from nanoverl_async.config import ConfigError, LoRAConfig
from nanoverl_async.models import lora
from nanoverl_async.models.load import load_tokenizer, refusal

# The globals DCP pickles into .metadata: its own classes, torch.Size, dtypes, layouts and the path it was written
# to (StorageMeta.checkpoint_id). BytesStorageMetadata indexes the param_groups of checkpoints written before they
# were left out; TensorsOnly never reads those.
INDEX_GLOBALS = {(kind.__module__, kind.__qualname__) for kind in (
    Metadata, StorageMeta, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
    MetadataIndex, _MEM_FORMAT_ENCODING, _StorageInfo, PosixPath, torch.Size, torch.serialization._get_layout)}
INDEX_GLOBALS |= {("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


def _modules(learner) -> dict:
    """name -> (model, optimizer) of everything a rank trains."""
    pairs = {"policy": (learner.model, learner.optimizer), "critic": (learner.critic, learner.critic_optimizer)}
    return {name: pair for name, pair in pairs.items() if pair[0] is not None}


# A frozen parameter is not part of a checkpoint: a LoRA run's base is model.path itself. Loading is then not
# strict about the model's other keys; DCP's load still fails on any trained tensor the checkpoint lacks.
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
LOAD_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


def _state_dicts(learner) -> dict:
    """name -> (model state dict, optimizer state dict), as `set_state_dict` takes them back; no frozen tensor,
    not even a second name of one (a tied LM head, which `ignore_frozen_params` keeps)."""
    out = {}
    for name, (model, optimizer) in _modules(learner).items():
        model_state, optimizer_state = get_state_dict(model, optimizer, options=TRAINED_ONLY)
        frozen = {key for key, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        out[name] = ({key: value for key, value in model_state.items() if key not in frozen}, optimizer_state)
    return out


def _tensors(state_dicts: dict) -> dict:
    """name -> {"model": ..., "optimizer": {"state": ...}}: the tensors DCP saves and loads in place."""
    return {name: {"model": model, "optimizer": {"state": optimizer["state"]}}
            for name, (model, optimizer) in state_dicts.items()}


def save_training_state(learner, path: str) -> None:
    """Collective: every rank writes its shards of models and optimizers under `path`."""
    dcp.save(_tensors(_state_dicts(learner)), checkpoint_id=path)


def load_training_state(learner, path: str) -> None:
    """Collective: every rank reads its shards from `path` into its models and optimizers, in place; a file
    that is not a checkpoint's: ConfigError naming it, on every rank."""
    state_dicts = _state_dicts(learner)
    reader = TensorReader(path)
    reader.read_metadata()  # a refused index fails here in one line, not in DCP's report of every rank's traceback
    try:
        dcp.load(_tensors(state_dicts), storage_reader=reader, planner=TensorsOnly(reader.index))
    except CheckpointException as error:  # a BaseException, holding each failed rank's error
        failure = error.failures[min(error.failures)][0]
        raise failure if isinstance(failure, ConfigError) else refused(path, refusal(failure)) from None
    for name, (model, optimizer) in _modules(learner).items():
        model_state, optimizer_state = state_dicts[name]
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                       options=LOAD_TRAINED)
        drop_compute_copy(model)


def refused(where, reason: str) -> ConfigError:
    return ConfigError(f"config key 'run.resume': {where} is not a valid checkpoint ({reason}); resume from "
                       f"another checkpoint (run.resume=<its step_N folder>)")


class TensorReader(FileSystemReader):
    """DCP's reader of a checkpoint folder, its index unpickled as data (module docstring)."""

    @property
    def index(self) -> Path:
        return Path(self.path) / ".metadata"

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then never falls back to a rank's own __N.metadata
        try:
            with open(self.index, "rb") as file:
                metadata = IndexUnpickler(file).load()
            if not isinstance(metadata, Metadata):
                raise TypeError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
            outside = [s.relative_path for s in metadata.storage_data.values()
                       if Path(str(s.relative_path)).name != s.relative_path or s.relative_path in ("", "..")]
            if outside:
                raise ValueError(f"it names {outside[0]!r}, not a file of its folder")
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
        except Exception as error:
            raise refused(self.index, refusal(error)) from None
        return metadata


class IndexUnpickler(pickle.Unpickler):
    """pickle resolving INDEX_GLOBALS only, the Python documentation's "restricting globals": whatever else a
    crafted index would call (os.system, ...) is refused before anything runs. (torch's weights-only unpickler
    reads pickle protocol 2 at most; DCP writes protocol 4.)"""

    def find_class(self, module: str, name: str):
        if (module, name) not in INDEX_GLOBALS:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is none of DCP's index classes")
        return super().find_class(module, name)


class TensorsOnly(DefaultLoadPlanner):
    """DCP's load planner, refusing what the index declares a pickled object where this run loads a tensor (DCP
    would torch.load it with weights_only=False)."""

    def __init__(self, index: Path):
        super().__init__()
        self.index = index

    def load_bytes(self, read_item, value) -> None:
        raise refused(self.index, f"it stores {read_item.dest_index.fqn} as a pickled object, not a tensor")


def drop_compute_copy(model: torch.nn.Module) -> None:
    """One FSDP2 rank keeps the unsharded compute copy of its weights after a forward (it does not reshard);
    once the weights change other than by an optimizer step (a loaded checkpoint; the first step after the
    packing probe's forward), that copy is stale: reshard, every FSDP2 module (`reshard` is not recursive, and each
    decoder layer holds its own copy). A plain model computes on its weights themselves."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: `module`'s full (unsharded) state dict on rank 0's CPU; {} on other ranks."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_hf(module: torch.nn.Module, model_class, source: str, path: str, rank: int, dtype: torch.dtype,
            merge: float = 0.0, **kwargs) -> None:
    """Collective: gather `module`'s full state dict and have rank 0 save it as `model_class` built from
    `source` in `dtype` (its config and tokenizer files are copied too). `dtype` is the run's model.dtype, not
    the fp32 master weights': a bfloat16 run's final/ is bfloat16, half the bytes, as save_pretrained users
    expect; load_state_dict casts each weight into the model built in it. `merge`: the module has LoRA layers,
    merged with this scaling (models/lora.py) into the base model's weights."""
    state_dict = full_state_dict(module)
    if rank == 0:
        state_dict = lora.merged_state(state_dict, merge) if merge else state_dict
        model = model_class.from_pretrained(source, dtype=dtype, **kwargs)
        model.load_state_dict(state_dict)
        model.save_pretrained(path)
        _copy_tokenizer(source, path)
    dist.barrier()


def save_final(learner, path: str) -> None:
    """Collective: `LearnerRank.save_pretrained`: the policy (with LoRA, its adapter folder, and the merged model in
    `path/merged` with learner.lora.save_merged) and the critic (`path/critic`), in the run's dtype."""
    model_path = learner.setup.model.path
    dtype = learner.dtype
    rank = learner.rank
    if learner.lora is not None:
        adapters = dict(learner._full_tensors(learner._published_state()))
        save_adapter(adapters, learner.lora, model_path, path, rank)
        if learner.lora.save_merged:
            save_hf(learner.model, AutoModelForCausalLM, model_path, f"{path}/merged", rank, dtype,
                    merge=lora.scaling(learner.lora))
    else:
        save_hf(learner.model, AutoModelForCausalLM, model_path, path, rank, dtype)
    if learner.critic is not None:
        save_hf(learner.critic, AutoModelForTokenClassification, learner.setup.critic.path or model_path,
                f"{path}/critic", rank, dtype, num_labels=1)


def save_adapter(adapters: dict[str, torch.Tensor], cfg: LoRAConfig, source: str, path: str, rank: int) -> None:
    """Collective: rank 0 writes PEFT's adapter folder of `adapters` (gathered to it) for the base model at
    `source`, with that model's tokenizer, as peft's own `save_pretrained` leaves it."""
    if rank == 0:
        lora.save_adapter(adapters, cfg, source, path)
        _copy_tokenizer(source, path)
    dist.barrier()


def _copy_tokenizer(source: str, path: str) -> None:
    if any(os.path.exists(os.path.join(source, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        load_tokenizer(source).save_pretrained(path)
