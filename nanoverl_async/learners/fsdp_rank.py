"""One data-parallel learner rank: a Hugging Face causal LM sharded with FSDP2, AdamW, the policy loss.

Every rank receives the WHOLE TrainBatch and trains on its own contiguous shard of rows. Invariants:
  - the loss is a sum over this rank's tokens divided by the sampled-token count of ALL ranks
    (all-reduced), and FSDP2 averages gradients over ranks, so each rank backpropagates
    world_size * loss: the gradient is then exactly that of one rank on the whole batch
    (tests/test_fsdp.py checks the loss and the updated weights against world_size 1);
  - logprobs use the generator's sampling temperature (softmax(logits / T), as the generator sampled);
  - the model stays in eval mode (no dropout), so the logprobs of the update's forward equal the
    proximal logprobs of `compute_logprobs` on the same weights;
  - every collective (`update`, `compute_logprobs`, `publish_weights`, `save_pretrained`) must be called
    on all ranks, in the same order; `version` counts optimizer steps (DESIGN.md "Versions").
Device: "cpu" uses gloo; "cuda" uses nccl, one GPU per rank (`local_rank`, default rank % GPUs visible).

Run alone (no Ray): `python -m pytest tests/test_fsdp.py -q` spawns 1 and 2 ranks with gloo.
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoverl_async.algorithms import kl_estimates, policy_loss, token_entropy
from nanoverl_async.config import AlgorithmConfig, LearnerConfig
from nanoverl_async.learners.batch import TrainBatch, micro_batches, sequence_logprobs, shard, to_device
from nanoverl_async.weights import WeightPublisher

PROCESS_GROUP_TIMEOUT_S = 600  # a collective that waits longer than this fails loudly instead of hanging
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class LearnerRank:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str,
                 cfg: LearnerConfig, algo: AlgorithmConfig, temperature: float, seed: int, *,
                 dtype: str = "float32", wire_host: str = "127.0.0.1", micro_batch_size: int = 0,
                 initial_version: int = 0, local_rank: Optional[int] = None):
        torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(seed + rank)
        self.rank, self.world_size, self.cfg, self.algo = rank, world_size, cfg, algo
        self.model_path, self.temperature, self.micro_batch_size = model_path, temperature, micro_batch_size
        self.dtype = DTYPES[dtype]  # compute and published-weights dtype; master weights stay fp32
        self.version = initial_version  # optimizer steps done: the weights this rank holds are this version
        self.device = _device(cfg.device, rank, local_rank)
        cuda = self.device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size, device_id=self.device if cuda else None,
                                timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
        mesh = init_device_mesh(self.device.type, (world_size,))
        # fp32 master weights; bfloat16 only for compute (FSDP2 mixed precision), gradients reduced in fp32
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        model.config.use_cache = False
        model.eval()  # no dropout: see the module docstring
        mp_policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        layer_classes = set(getattr(model, "_no_split_modules", None) or [])
        assert layer_classes, f"{type(model).__name__} names no decoder-layer class (_no_split_modules)"
        for module in list(model.modules()):
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)
        self.publisher = WeightPublisher(wire_host) if rank == 0 else None

    def _logits(self, mb: TrainBatch) -> torch.Tensor:
        return self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> np.ndarray:
        """float32 [rows of this rank's shard, L], token-indexed (see batch.sequence_logprobs), 0 off the
        loss mask: the proximal logprobs p_old of the weights this rank holds now (version `self.version`)."""
        parts = []
        for mb in micro_batches(shard(batch, self.rank, self.world_size), self.micro_batch_size):
            mb = to_device(mb, self.device)
            logprobs = sequence_logprobs(self._logits(mb), mb.input_ids, self.temperature)
            parts.append(torch.where(mb.loss_mask.bool(), logprobs, 0.0).cpu())
        return torch.cat(parts).numpy()

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on the whole batch (this rank's shard); metrics reduced over ranks.
        Without proximal_logprobs the current logprobs (detached) stand in for p_old: with one step per
        batch they are the same numbers, so the extra forward of compute_logprobs can be skipped."""
        local = shard(batch, self.rank, self.world_size)
        sampled = local.loss_mask.bool()
        same_version = sampled & (local.versions == self.version)  # train/inference mismatch, not staleness
        counts = torch.stack([sampled.sum(), same_version.sum()]).double().to(self.device)
        dist.all_reduce(counts)
        normaliser, same_normaliser = counts.clamp(min=1.0).tolist()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor] = {}  # over micro-batches: sums, or maxima for `*_max` keys
        for mb in micro_batches(local, self.micro_batch_size):
            loss, metrics = self._loss(to_device(mb, self.device), normaliser, same_normaliser)
            (loss * self.world_size).backward()  # FSDP2 averages gradients over ranks: undo the 1/world_size
            for key, value in metrics.items():
                if key not in totals:
                    totals[key] = value
                else:
                    totals[key] = torch.maximum(totals[key], value) if key.endswith("_max") else totals[key] + value
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        self.optimizer.step()
        self.version += 1
        out = _reduce(totals)
        out.update(grad_norm=float(grad_norm), tokens=int(counts[0].item()), version=self.version)
        return out

    def _loss(self, mb: TrainBatch, normaliser: float, same_normaliser: float) -> tuple[torch.Tensor, dict]:
        logits = self._logits(mb)
        logprobs = sequence_logprobs(logits, mb.input_ids, self.temperature)
        proximal = mb.proximal_logprobs if mb.proximal_logprobs is not None else logprobs.detach()
        loss, metrics = policy_loss(logprobs, proximal, mb.behaviour_logprobs, mb.advantages, mb.loss_mask,
                                    self.algo.correction, self.algo.clip.low, self.algo.clip.high,
                                    self.algo.is_cap, normaliser)
        with torch.no_grad():
            # logits[:, i] is the distribution that sampled token i + 1
            entropy = token_entropy(logits[:, :-1], self.temperature)
            metrics["entropy"] = torch.where(mb.loss_mask[:, 1:].bool(), entropy, 0.0).sum() / normaliser
            # train/inference mismatch alone: tokens sampled by the very weights the learner holds
            same_version = mb.loss_mask.bool() & (mb.versions == self.version)
            metrics["mismatch_kl"] = kl_estimates(proximal, mb.behaviour_logprobs, same_version, same_normaliser)["k3"]
            metrics["same_version_fraction"] = same_version.sum() / normaliser
        metrics["loss"] = loss.detach()
        return loss, metrics

    def publish_weights(self, version: int) -> None:
        """Collective: gather the full state dict to rank 0's CPU; rank 0 publishes it (non-blocking) in
        the run's dtype (what the generators compute in; a no-op for float32)."""
        state_dict = self.full_state_dict()
        if self.publisher is not None:
            self.publisher.publish(version, {name: tensor.to(self.dtype) if tensor.is_floating_point() else tensor
                                             for name, tensor in state_dict.items()})

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the full (unsharded) fp32 state dict on rank 0's CPU; {} on other ranks."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def weights_endpoint(self) -> str:
        return self.publisher.endpoint if self.publisher is not None else ""

    def save_pretrained(self, path: str) -> None:
        """Collective: rank 0 writes a Hugging Face directory (config, weights, tokenizer) at `path`."""
        state_dict = self.full_state_dict()
        if self.rank == 0:
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
            model.load_state_dict(state_dict)
            model.save_pretrained(path)
            if _has_tokenizer(self.model_path):
                AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)
        dist.barrier()

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _device(kind: str, rank: int, local_rank: Optional[int]) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    assert kind == "cuda" and torch.cuda.is_available(), f"learner device '{kind}' is not available here"
    index = local_rank if local_rank is not None else rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _reduce(totals: dict[str, torch.Tensor]) -> dict[str, float]:
    """All-reduce scalar metrics over ranks: `*_max` keys with max, the others (already divided by the
    global token count) with sum. Two collectives, whatever the number of metrics."""
    out = {}
    for is_max, op in ((False, dist.ReduceOp.SUM), (True, dist.ReduceOp.MAX)):
        names = sorted(key for key in totals if key.endswith("_max") == is_max)
        if names:
            values = torch.stack([totals[key].detach().double() for key in names])
            dist.all_reduce(values, op=op)
            out.update(zip(names, values.tolist()))
    return out


def _has_tokenizer(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json"))
