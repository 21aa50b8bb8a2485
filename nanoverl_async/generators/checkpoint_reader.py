"""The checkpoint under the builtin engine's forward (llama_forward.py): model.path as a folder or a Hugging Face Hub
id, its config, and the tensors the forward reads, from safetensors or PyTorch pickles (tensors only, no code), one
file or shards, registered on the model under their transformers names.

    directory, config = open_checkpoint(model_path)   # a Hub id is downloaded: its safetensors, else its pickles
    read_parameters(model, directory, model_path, config, device, dtype)   # model.model.layers.0.mlp.up_proj.weight

Why apart from the forward: where the tensors come from (files, formats, names) changes with checkpoints, how they
compute does not; the names stay transformers', so a learner's state dict loads into them in place.
Run alone: nothing to run; tests/test_engine.py loads every layout (safetensors shards, .bin, .bin shards, a Hub id
with pickles only) and a folder with none.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig


def open_checkpoint(model_path: str) -> tuple[Path, PretrainedConfig]:
    """model.path -> (the folder holding the checkpoint, its config). A path that is no folder is a Hub id: its
    safetensors, else its PyTorch pickles, are downloaded."""
    directory = Path(model_path).expanduser()
    if not directory.is_dir():
        directory = Path(snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors"]))
        if not any(directory.glob("*.safetensors")):
            directory = Path(snapshot_download(model_path, allow_patterns=["*.json", "*.bin"]))
    return directory, AutoConfig.from_pretrained(directory)


def llama_modules(config: PretrainedConfig) -> list[str]:
    """The modules whose tensors the Llama family's forward reads (qwen3 adds q and k norms)."""
    layer = ("input_layernorm", "post_attention_layernorm", *(f"self_attn.{p}_proj" for p in "qkvo"),
             *(f"mlp.{p}_proj" for p in ("gate", "up", "down")), *(("self_attn.q_norm", "self_attn.k_norm")
                                                                   if config.model_type == "qwen3" else ()))
    return ["model.embed_tokens", "model.norm", "lm_head",
            *(f"model.layers.{i}.{part}" for i in range(config.num_hidden_layers) for part in layer)]


def read_parameters(model: torch.nn.Module, directory: Path, model_path: str, config: PretrainedConfig,
                    device: torch.device, dtype: torch.dtype) -> None:
    """Register on `model`, under their dotted names, the checkpoint's tensors of `llama_modules` in `dtype` on
    `device` (a checkpoint's other tensors, none in these families, stay out); a tied LM head is the embedding's
    own tensor, as in transformers. A module without its weight: ValueError naming model.path."""
    modules = llama_modules(config)
    wanted = {f"{module}.{kind}" for module in modules for kind in ("weight", "bias")}
    params = {}
    for file in checkpoint_files(directory, model_path):
        tensors = load_file(file) if file.suffix == ".safetensors" else torch.load(file, "cpu", weights_only=True)
        params.update({name: torch.nn.Parameter(tensor.to(device, dtype), requires_grad=False)
                       for name, tensor in tensors.items() if name in wanted})
    if config.tie_word_embeddings:  # the head is the embedding, whatever the file holds
        params["lm_head.weight"] = params.get("model.embed_tokens.weight")
    missing = [module for module in modules if params.get(f"{module}.weight") is None]
    if missing:
        raise ValueError(f"model.path={model_path!r}: the checkpoint in {directory} has no {missing[:3]}")
    for name, parameter in params.items():  # each under its dotted name: model.layers.0.mlp.up_proj.weight
        *path, leaf = name.split(".")
        module = model
        for part in path:
            module = module._modules.setdefault(part, torch.nn.Module())
        module.register_parameter(leaf, parameter)


def checkpoint_files(directory: Path, model_path: str) -> list[Path]:
    """The files holding a checkpoint's tensors, as transformers saves them: safetensors, else PyTorch's pickles
    (read with weights_only: tensors only, no code), one file or shards named by an index."""
    for single in ("model.safetensors", "pytorch_model.bin"):
        index = directory / f"{single}.index.json"  # a sharded checkpoint's file per tensor
        if index.is_file():
            return [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        if (directory / single).is_file():
            return [directory / single]
    raise ValueError(f"model.path={model_path!r}: {directory} holds no model.safetensors or pytorch_model.bin "
                     "(nor a sharded index of either)")
