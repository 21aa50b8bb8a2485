"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685): a linear
layer's weight W0 [out, in] stays frozen and a low-rank update trains beside it,

    y = x W0^T + s x A^T B^T,   A [r, in], B [out, r], s = alpha / r,   B = 0 at the start

so version 0 is the base model itself. learner.lora (config.py) turns it on; PEFT's LoRA layers do the math in
the learner, and its file format is the one everything else speaks:
  - the learner (learners/fsdp_rank.py) injects PEFT's layers into its model in place (`add_adapters`: the model
    keeps its class, names and decoder layers for FSDP2), trains A and B only, in float32 over a base held in the
    run's dtype, and publishes a version as the adapters alone, under PEFT's names (`adapter_key`):
    `base_model.model.<module>.lora_A.weight` [r, in] and `base_model.model.<module>.lora_B.weight` [out, r];
  - a generator's own engine keeps W0 of every adapted layer (`MergedAdapters`) and writes W0 + s B A into
    the model it decodes with: decoding runs the plain model, as fast as without LoRA, and every version is
    merged into the same W0, so no version leaves rounding behind for the next;
  - final/ is PEFT's adapter folder (`save_adapter`), which `peft.PeftModel.from_pretrained(base, "final")`
    loads, and, with learner.lora.save_merged, the merged model beside it (`merged_state`).
Why LoRA for asynchronous RL: a version is megabytes instead of the whole model, and the optimizer holds
moments of the adapters only ("LoRA Without Regret", Thinking Machines 2025: rank 16-64 adapters on every
linear layer match full fine-tuning in policy-gradient RL, at about 10x full fine-tuning's learning rate).

Run alone: `python -m pytest tests/test_lora.py -q`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from nanoverl_async.config import LoRAConfig

PEFT_PREFIX = "base_model.model."  # how PEFT's files name a module of the model they adapt
ADAPTER = "default"  # PEFT's name of the one adapter a learner trains
FACTORS = ("lora_A", "lora_B")
ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's name (beside its adapter_config.json)


def scaling(cfg: LoRAConfig) -> float:
    """s = alpha / r (PEFT's default; rank-stabilised LoRA would use alpha / sqrt(r))."""
    return cfg.alpha / cfg.rank


def peft_config(cfg: LoRAConfig, targets: object = None, base_path: str = ""):
    """PEFT's LoraConfig of learner.lora: its target modules, or `targets` (the names actually adapted, as saved)."""
    from peft import LoraConfig  # the learner's import only: generators never build PEFT layers

    modules = targets or ("all-linear" if list(cfg.target_modules) == ["all-linear"] else list(cfg.target_modules))
    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=modules,
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_path or None)


def add_adapters(model: torch.nn.Module, cfg: LoRAConfig) -> None:
    """Inject LoRA layers into `model` in place, every other parameter frozen; A and B in float32 whatever the
    base's dtype (they are the master weights; FSDP2 casts them for compute). PEFT initialises A at random
    (Kaiming-uniform) from torch's generator: seed it the same on every rank."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(adapter_key(name) is not None)
        if parameter.requires_grad:
            parameter.data = parameter.data.float()


def adapter_parameters(model: torch.nn.Module, cfg: LoRAConfig) -> int:
    """How many parameters A and B add to `model` (a model on the meta device will do): r x (in + out) for each
    linear layer PEFT adapts, chosen as PEFT chooses: all-linear, every one but the output layer; else each whose
    name is a listed one or ends in "." and a listed one. Counted without importing PEFT (seconds at start-up)."""
    targets, output = list(cfg.target_modules), model.get_output_embeddings()
    return sum(cfg.rank * (module.in_features + module.out_features) for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and (
                   module is not output if targets == ["all-linear"] else
                   any(name == target or name.endswith(f".{target}") for target in targets)))


def adapter_key(name: str) -> str | None:
    """A learner parameter's name -> its key in PEFT's adapter files; None for a base-model tensor.
    `model.layers.0.mlp.up_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.mlp.up_proj.lora_A.weight`."""
    for factor in FACTORS:
        marker = f".{factor}.{ADAPTER}."
        if marker in name:
            return PEFT_PREFIX + name.replace(marker, f".{factor}.")
    return None


@contextlib.contextmanager
def adapter_dropout(model: torch.nn.Module) -> Iterator[None]:
    """learner.lora.dropout within: the adapters' dropout layers alone in train mode (the model stays in eval)."""
    layers = [module for name, module in model.named_modules() if name.endswith(f"lora_dropout.{ADAPTER}")]
    for layer in layers:
        layer.train()
    try:
        yield
    finally:
        for layer in layers:
            layer.eval()


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model within: every LoRA layer computes W0 x alone (the KL reference, without a copy of it)."""
    from peft.tuners.lora import LoraLayer

    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapted_layers(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A version's adapter tensors (PEFT's keys) -> {the adapted weight's name in the base model: (A, B)};
    ValueError for a key that is not an adapter factor's or a layer without both factors."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapters.items():
        module, _, factor = key.removeprefix(PEFT_PREFIX).removesuffix(".weight").rpartition(".")
        if not key.startswith(PEFT_PREFIX) or not key.endswith(".weight") or factor not in FACTORS:
            raise ValueError(f"{key!r} is not a LoRA factor (base_model.model.<module>.lora_A|lora_B.weight)")
        factors.setdefault(f"{module}.weight", {})[factor] = tensor
    halves = [name for name, pair in factors.items() if len(pair) != 2]
    if halves:
        raise ValueError(f"LoRA layers without both lora_A and lora_B: {halves[:5]}")
    return {name: (pair["lora_A"], pair["lora_B"]) for name, pair in factors.items()}


def gathered(parts: dict[str, torch.Tensor], bucket_state: dict[str, torch.Tensor], bucket: tuple[int, int]
             ) -> dict[str, torch.Tensor] | None:
    """A version's adapters gathered over its buckets (index, count) into `parts`, emptied at bucket 0: the whole
    set at the last bucket, else None (a layer's A and B may lie in two buckets). Each tensor is copied
    (megabytes): a bucket's tensors view the subscriber's buffer, which its next bucket reuses."""
    if bucket[0] == 0:
        parts.clear()
    parts.update({key: tensor.clone() for key, tensor in bucket_state.items()})
    return parts if bucket[0] == bucket[1] - 1 else None


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    """W0 + s B A, in float32, rounded once to W0's dtype (PEFT's merge adds the delta in W0's dtype)."""
    return (base.float() + s * (b.float() @ a.float())).to(base.dtype)


class MergedAdapters:
    """A decoding model's weights with each version's adapters merged in, in place: `merge` keeps a copy of W0 of
    every layer it adapts (once, the first time) and writes W0 + s B A over the parameter the forward reads."""

    def __init__(self, parameters: dict[str, torch.Tensor], s: float):
        self.parameters, self.s = parameters, s
        self.base: dict[str, torch.Tensor] = {}  # W0 of each adapted layer, as loaded

    def merge(self, adapters: dict[str, torch.Tensor]) -> None:
        """Merge one version's adapters (checked first: KeyError, the model untouched, if they do not fit it).
        A layer adapted before and not in this version gets W0 back."""
        layers = adapted_layers(adapters)
        unknown = [name for name in layers if name not in self.parameters]
        shapes = [name for name, (a, b) in layers.items() if name in self.parameters
                  and (a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(self.parameters[name].shape))]
        if unknown or shapes:
            raise KeyError(f"LoRA adapters do not fit the model: no weight {unknown[:5]}, wrong shape {shapes[:5]}")
        for name in self.base.keys() - layers.keys():
            self.parameters[name].data.copy_(self.base[name])
        for name, (a, b) in layers.items():
            weight = self.parameters[name]
            base = self.base.setdefault(name, weight.detach().clone())
            weight.data.copy_(merged_weight(base, a.to(base.device), b.to(base.device), self.s))


def merged_state(state: dict[str, torch.Tensor], s: float) -> dict[str, torch.Tensor]:
    """A LoRA model's full state dict (PEFT's layer names: `<module>.base_layer.weight`, `<module>.lora_A.default.
    weight`, ...) -> the base model's, each adapted weight merged (W0 + s B A): what `save_pretrained` writes."""
    adapters = {adapter_key(name): tensor for name, tensor in state.items() if adapter_key(name) is not None}
    plain = {name.replace(".base_layer.", "."): tensor for name, tensor in state.items() if adapter_key(name) is None}
    for name, (a, b) in adapted_layers(adapters).items():
        plain[name] = merged_weight(plain[name], a, b, s)
    return plain


def save_adapter(adapters: dict[str, torch.Tensor], cfg: LoRAConfig, base_path: str, path: str) -> None:
    """PEFT's adapter folder at `path`: adapter_config.json (the layers adapted named as PEFT resolves them, the
    base model's path) and adapter_model.safetensors (the factors, as published)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    targets = sorted({name.removesuffix(".weight").rpartition(".")[2] for name in adapted_layers(adapters)})
    peft_config(cfg, targets, base_path).save_pretrained(str(folder))  # adapter_config.json
    save_file({key: tensor.contiguous() for key, tensor in adapters.items()}, str(folder / ADAPTER_FILE),
              metadata={"format": "pt"})
