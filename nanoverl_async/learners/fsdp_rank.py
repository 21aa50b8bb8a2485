"""One data-parallel learner rank: a Hugging Face causal LM sharded with FSDP2 (`_sharded_model`), AdamW, the
policy loss; optionally a frozen reference (KL) and a critic (advantage=gae) sharded the same way.

Every rank receives the WHOLE TrainBatch. `update` runs learner.ppo_epochs x learner.minibatches optimizer steps:
minibatch k is the k-th contiguous block of the batch's rows, of which each rank trains its own contiguous shard,
in micro-batches of at most learner.micro_batch_tokens padded tokens (learner.micro_batch_threads at once, on
threads: threaded_passes.py), each packed several sequences to a row, a group sharing its prompt (packing.pack).
Invariants:
  - every loss and metric is a sum over this rank's micro-batch divided by a GLOBAL normaliser (counts
    of the whole minibatch, all-reduced over ranks), and FSDP2 averages gradients over ranks, so each
    rank backpropagates world_size * loss: the accumulated gradient is then exactly that of one pass
    over the whole minibatch, however the rows are split (tests/test_fsdp.py, test_fsdp_schedule.py);
  - ranks run the same number of micro-batches (the largest any rank needs), since each forward and backward
    all-gathers parameters collectively;
  - logprobs use the generator's sampling temperature (softmax(logits / T), as the generator sampled);
  - the models stay in eval mode (no dropout), so the logprobs of the update's forward equal the proximal
    logprobs of `compute` on the same weights;
  - the rank counts no versions: the controller's loop owns them and passes each `update` the version of the
    weights it trains (step N: N - 1; docs/design.md "Versions and staleness");
  - every collective (`update`, `compute`, `publish_weights`, `save_pretrained`, `save_checkpoint`,
    `load_checkpoint`, `connect_sglang`) must be called on all ranks, in the same order.
Weights out: by default rank 0 publishes each version's full state dict over ZeroMQ, in buckets (weights.py).
After `connect_sglang` (generator.sglang.weight_transport=nccl) rank 0 loads each version straight into the SGLang
servers (learners/sglang_nccl.py) and publishes only a version notice (an empty state dict).
Device: "cpu" uses gloo; "cuda" uses nccl, one GPU per rank (rank % GPUs visible). Memory (docs/design.md
"Learner memory"): learner.activation_checkpointing, learner.logits_chunk_tokens; peaks logged as memory/*.

Run alone (no Ray, 1 and 2 gloo ranks): `python -m pytest tests/test_fsdp.py tests/test_fsdp_schedule.py -q`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from functools import partial
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from nanoverl_async.algorithms import (LossInputs, aggregate, kl_estimates, kl_per_token, loss_normaliser,
                                      merge_metrics, policy_loss, reduce_token_metrics, value_loss)
from nanoverl_async.config import SGLangConfig
from nanoverl_async.learners.batch import (TrainBatch, epoch_order, shard, split_to, take_rows, to_device,
                                           token_budget_bounds, trimmed)
from nanoverl_async.learners.checkpoint import drop_compute_copy, load_training_state, save_final, save_training_state
from nanoverl_async.learners.memory import peak_memory
from nanoverl_async.learners.packing import (Packing, attends_to_whole_context, attention_cost_per_position,
                                             keeps_packed_sequences_apart, pack, prompt_lengths)
from nanoverl_async.learners.setup import PROCESS_GROUP_TIMEOUT_S, LearnerSetup
from nanoverl_async.learners.threaded_passes import ThreadedPasses
from nanoverl_async.models import lora
from nanoverl_async.models.host_allocator import tune_host_allocator
from nanoverl_async.models.load import DTYPES
from nanoverl_async.wire.buckets import BucketSet
from nanoverl_async.wire.weights import WeightPublisher

log = logging.getLogger(__name__)


class LearnerRank:
    def __init__(self, setup: LearnerSetup, rank: int, master_addr: str, master_port: int):
        cfg, world_size = setup.learner, setup.learner.world_size
        torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(setup.seed + rank)
        self.setup = setup
        self.rank = rank
        self.world_size = world_size
        self.cfg = cfg
        self.algo = setup.algorithm
        self.dtype = DTYPES[setup.model.dtype]  # compute and published-weights dtype; master weights stay fp32
        cuda = cfg.device == "cuda"  # else cpu (validation allows no other); one GPU per rank, rank % GPUs visible
        assert not cuda or torch.cuda.is_available(), "learner.device=cuda, but no GPU is visible here"
        self.device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        # one rank meets no one: a store in memory, not a probed port, which another process may take meanwhile
        meeting = {"store": dist.HashStore()} if world_size == 1 else {
            "init_method": f"tcp://{master_addr}:{master_port}"}
        dist.init_process_group("nccl" if cuda else "gloo", **meeting, rank=rank, world_size=world_size,
                                device_id=self.device if cuda else None,
                                timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
        self.mesh = init_device_mesh(self.device.type, (world_size,))
        self.lora = cfg.lora if cfg.lora.rank > 0 else None  # learner.lora: adapters train, the base is frozen
        self.model = self._sharded_model(setup.model.path, adapters=self.lora)
        tune_host_allocator(self.device, sum(parameter.numel() for parameter in self.model.parameters()))
        # every optimizer (policy, critic): AdamW with learner.betas, fused: one kernel per step instead of a
        # DTensor dispatch per parameter and op (docs/benchmarks.md "Costs behind choices in the code")
        adamw = partial(torch.optim.AdamW, betas=tuple(cfg.betas), fused=True)
        trained = [parameter for parameter in self.model.parameters() if parameter.requires_grad]
        self.optimizer = adamw(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.reference = None  # the frozen reference policy, only when KL is on; with LoRA, the base model itself
        if (setup.kl.loss_coef > 0 or setup.kl.reward_coef > 0) and not (self.lora and not setup.reference.path):
            self.reference = self._sharded_model(setup.reference.path or setup.model.path).requires_grad_(False)
        self.critic = self.critic_optimizer = None
        if self.algo.advantage == "gae":  # the value model: LM backbone + scalar head, its own optimizer
            critic = setup.critic
            torch.manual_seed(setup.seed)  # the fresh head: the same initial values on every rank and world size
            self.critic = self._sharded_model(critic.path or setup.model.path, AutoModelForTokenClassification,
                                              num_labels=1)
            self.critic_optimizer = adamw(self.critic.parameters(), lr=critic.lr, weight_decay=critic.weight_decay)
        # after the optimizers, so that the probe's forward cannot leave stale compute copies behind them
        models = {name: model for name, model in {"policy": self.model, "reference": self.reference,
                                                   "critic": self.critic}.items() if model is not None}
        with torch.compiler.set_stance("force_eager"):  # learner.compile: no graphs for the probe's shapes
            mixing = [name for name, model in models.items() if not keeps_packed_sequences_apart(model, self.device)]
        for model in models.values():
            drop_compute_copy(model)
        self.packs = not mixing  # else every forward pads one sequence per row
        self.shares_prompts = self.packs and all(attends_to_whole_context(model.config) for model in models.values())
        self.attention_cost = attention_cost_per_position(self.model)  # how long pack makes rows
        if mixing:
            log.warning("the %s model mixes packed sequences in attention: the learner pads one sequence per "
                        "row (slower)", " and ".join(mixing))
        self.publisher = WeightPublisher(setup.wire_host, setup.curve) if rank == 0 else None
        self.bucket_bytes = setup.bucket_mb * 2**20  # weight_sync.bucket_mb: the size of one bucket of a version
        self.nccl_transport = False  # set by connect_sglang on every rank (publish_weights gathers differently)
        self.sender = None  # rank 0's SGLangWeightSender once connected
        self.passes = ThreadedPasses.where_usable(cfg, self.model)  # learner.micro_batch_threads
        peak_memory(self.device)  # the first step's memory/* peaks leave the start-up out

    def _sharded_model(self, path: str, model_class=AutoModelForCausalLM, adapters=None, **kwargs) -> torch.nn.Module:
        """A causal LM (or, for the critic, its backbone with a token-level head) with fp32 master weights, sharded per
        decoder layer and at the root; bfloat16 only for compute when asked (FSDP2 mixed precision), gradients reduced
        in fp32. On one rank the shard is the whole model: freeing the compute copy after each forward would save no
        memory and cost a second cast of every weight in backward. One rank in fp32 has nothing to shard, reduce or
        cast: the plain model (FSDP2's hooks and DTensors would slow its update: docs/benchmarks.md "Costs behind
        choices in the code"). Each decoder layer, in place (parameter names unchanged, FSDP2 composes):
        learner.activation_checkpointing keeps only its input for backward and recomputes the rest (torch's composable,
        non-reentrant checkpoint); learner.compile compiles it with dynamic shapes (packed rows change shape every step:
        one graph serves them all). `adapters` (learner.lora): a frozen base in the compute dtype, LoRA's A and B the
        fp32 master weights, A's random start the same on every rank."""
        dtype = self.dtype if adapters else torch.float32
        model = model_class.from_pretrained(path, dtype=dtype, **kwargs).to(self.device)
        if adapters:
            torch.manual_seed(self.setup.seed)
            lora.add_adapters(model, adapters)
        model.config.use_cache = False
        model.eval()  # no dropout: see the module docstring
        layer_classes = set(getattr(model, "_no_split_modules", None) or [])
        assert layer_classes, f"{type(model).__name__} names no decoder-layer class (_no_split_modules)"
        layers = [module for module in model.modules() if type(module).__name__ in layer_classes]
        for layer in layers if self.cfg.activation_checkpointing else []:
            checkpoint_activations(layer)
        for layer in layers if self.cfg.compile else []:
            layer.compile(dynamic=True)
        if self.world_size == 1 and self.dtype == torch.float32:
            return model
        mp_policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        for module in [*layers, model]:
            fully_shard(module, mesh=self.mesh, mp_policy=mp_policy, reshard_after_forward=self.world_size > 1)
        return model

    def _micro_bounds(self, local: TrainBatch) -> list[tuple[int, int]]:
        """Row ranges of this rank's rows within learner.micro_batch_tokens padded tokens each, split
        to the largest count of any rank (collective: ranks must run the same number of passes)."""
        bounds = token_budget_bounds(local.attention_mask.sum(dim=1).tolist(), self.cfg.micro_batch_tokens)
        count = torch.tensor([len(bounds)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return split_to(bounds, int(count.item()))

    def _micro_batch(self, local: TrainBatch, start: int, stop: int) -> tuple[TrainBatch, Packing]:
        """Rows [start, stop) of this rank's shard and their packing into rows (packing.pack), on the device:
        laid out on the host, then copied without blocking, so no step of a micro-batch waits for the GPU."""
        mb = trimmed(local, start, stop)
        prompts = prompt_lengths(mb.loss_mask) if self.shares_prompts else None
        packing = pack(mb.input_ids, mb.attention_mask, self.packs, prompts, self.attention_cost, mb.loss_mask)
        return to_device(mb, self.device), packing.to(self.device)

    @torch.no_grad()
    def compute(self, batch: TrainBatch, field: str) -> np.ndarray:
        """The TrainBatch field `field` of this rank's shard, from a forward before the update: float32 [rows, L],
        token-indexed (batch.sequence_logprobs), 0 off the loss mask. "proximal_logprobs": p_old, of the weights
        this rank holds now; "reference_logprobs": the frozen reference's (KL only; with LoRA and no reference.path,
        the base: the policy, its adapters off); "values": the critic's V before this step (advantage=gae only)."""
        base = field == "reference_logprobs" and self.reference is None and self.lora is not None  # the base model
        model = {"proximal_logprobs": self.model, "reference_logprobs": self.model if base else self.reference,
                 "values": self.critic}[field]
        assert model is not None, f"no model computes {field} in this run (the reference needs KL, the critic gae)"
        local = shard(batch, self.rank, self.world_size)
        out = torch.zeros(local.input_ids.shape, dtype=torch.float32)
        with lora.adapters_off(self.model) if base else contextlib.nullcontext():
            for start, stop in self._micro_bounds(local):
                mb, packing = self._micro_batch(local, start, stop)
                values = packing.values(self.critic) if field == "values" else \
                    packing.logprobs(model, self.setup.temperature, self.cfg.logits_chunk_tokens)
                out[start:stop, :values.shape[1]] = torch.where(mb.loss_mask.bool(), values, 0.0).cpu()
        return out.numpy()

    def update(self, batch: TrainBatch, version: int) -> dict[str, float]:
        """ppo_epochs x minibatches optimizer steps on the batch, from the weights of `version` to those of
        version + 1: ONE new version per batch, however many optimizer steps
        (docs/design.md "The bound in batches"). Minibatch k is the k-th contiguous block of rows of the batch
        in this epoch's order (`epoch_order`, seeded by `version`: shuffled when there are several
        minibatches), of which each rank trains its own shard. Without proximal_logprobs the update's own
        detached logprobs stand in for p_old, which is exact only with one optimizer step per batch
        (LearnerPool.prepare computes them otherwise). Metrics are reduced over ranks, then averaged over
        optimizer steps (`*_max` keys: max); `memory/*`: the largest peak of any rank since the previous
        update returned (docs/metrics.md)."""
        assert batch.advantages is not None, "the batch has no advantages (batch.with_advantages)"
        assert batch.proximal_logprobs is not None or "proximal_logprobs" not in self.setup.forwards, \
            "several optimizer steps per batch need the proximal logprobs (LearnerPool.prepare)"
        history = []
        for epoch in range(self.cfg.ppo_epochs):
            ordered = batch if self.cfg.minibatches == 1 else \
                take_rows(batch, epoch_order(batch.size, self.setup.seed, version, epoch))
            for k in range(self.cfg.minibatches):
                minibatch = shard(ordered, k, self.cfg.minibatches)
                history.append(self._optimizer_step(shard(minibatch, self.rank, self.world_size), version))
        steps = {key: torch.tensor([h[key] for h in history], dtype=torch.float64) for key in history[0]}
        out = {key: float(value) for key, value in merge_metrics(steps, len(history)).items()}  # the mean or max
        out.update(tokens=int(sum(h["tokens"] for h in history) / self.cfg.ppo_epochs), version=version + 1,
                   optimizer_steps=len(history))
        return {**out, **peak_memory(self.device, over_ranks=True)}

    def _normalisers(self, local: TrainBatch, version: int) -> dict[str, float]:
        """Global (all-rank) counts of this minibatch: the denominators of every loss and metric, so
        micro-batches and ranks add up to one pass over the whole minibatch: sampled tokens (metrics,
        token-mean), tokens of `version`, the weights trained (mismatch_kl), and the aggregation's own normaliser."""
        sampled = local.loss_mask.bool()
        same_version = sampled & (local.versions == version)  # train/inference mismatch, not staleness
        aggregation = loss_normaliser(local.loss_mask, self.algo.loss_agg, self.setup.max_total_tokens)
        counts = torch.stack([sampled.sum().double(), same_version.sum().double(), aggregation]).to(self.device)
        dist.all_reduce(counts)
        return dict(zip(("tokens", "same_version_tokens", "aggregation"), counts.clamp(min=1.0).tolist()))

    def _optimizer_step(self, local: TrainBatch, version: int) -> dict[str, float]:
        """One optimizer step of the policy (on the weights of `version`) on this rank's rows and, with gae, one of
        the critic on the same micro-batches."""
        normalisers, bounds = self._normalisers(local, version), self._micro_bounds(local)
        with lora.adapter_dropout(self.model) if self.lora else contextlib.nullcontext():
            out, grad_norm = self._train(self.model, self.optimizer, self.cfg.grad_clip, local, bounds, normalisers,
                                         partial(self._loss, version=version))
        out.update(grad_norm=grad_norm, tokens=int(normalisers["tokens"]))
        if self.critic is not None:
            critic, critic_norm = self._train(self.critic, self.critic_optimizer, self.setup.critic.grad_clip, local,
                                              bounds, normalisers, self._value_loss)
            out.update(critic, value_grad_norm=critic_norm)
        return out

    def _train(self, model: torch.nn.Module, optimizer, grad_clip: float, local: TrainBatch,
               bounds: list[tuple[int, int]], normalisers: dict[str, float], loss_of) -> tuple[dict[str, float], float]:
        """Accumulate the gradients of loss_of(micro-batch, packing, normalisers) -> (loss, metrics), each loss already
        divided by the global normalisers, over this rank's micro-batches; clip (grad_clip 0: not at all), step: (the
        metrics reduced, the global gradient norm before clipping). One rank accumulates gradients unsharded (in fp32)
        and keeps the compute copy of the weights until the last micro-batch, instead of a reduce (a copy) and a cast
        per micro-batch and layer; several ranks reduce-scatter each one, so that no rank holds all gradients."""
        optimizer.zero_grad(set_to_none=True)

        def one_pass(start: int, stop: int) -> tuple[torch.Tensor, dict]:
            return loss_of(*self._micro_batch(local, start, stop), normalisers)
        if self.passes is not None:  # learner.micro_batch_threads, where usable: one rank, a plain model
            parts = self.passes.accumulate(one_pass, bounds, [p for p in model.parameters() if p.requires_grad])
        else:
            parts = []  # each micro-batch's metrics
            for index, (start, stop) in enumerate(bounds):
                if isinstance(model, FSDPModule) and self.world_size == 1:
                    model.set_requires_gradient_sync(index == len(bounds) - 1)
                    model.set_reshard_after_backward(index == len(bounds) - 1)
                loss, metrics = one_pass(start, stop)
                (loss * self.world_size).backward()  # FSDP2 averages gradients over ranks: undo the 1/world_size
                parts.append(metrics)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
        optimizer.step()
        return _reduce(parts), float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def _value_loss(self, mb: TrainBatch, packing: Packing, normalisers: dict[str, float]) -> tuple[torch.Tensor, dict]:
        """The critic's loss of one micro-batch: the clipped value loss (algorithms.value_loss) against the GAE
        returns, token-mean over the global sampled-token count."""
        tokens = normalisers["tokens"]
        token_loss, metrics = value_loss(packing.values(self.critic), mb.values, mb.returns, mb.loss_mask,
                                         self.setup.critic.value_clip)
        loss = aggregate(token_loss, mb.loss_mask, "token-mean", tokens)
        return loss, {"value_loss": loss.detach(), **reduce_token_metrics(metrics, mb.loss_mask, tokens)}

    def _loss(self, mb: TrainBatch, packing: Packing, normalisers: dict[str, float],
              version: int) -> tuple[torch.Tensor, dict]:
        """The loss of one micro-batch (algorithms.policy_loss: correction, policy loss, KL, entropy) and
        its metrics, every sum divided by the GLOBAL normalisers; mismatch_kl over the tokens of `version`."""
        kl = self.setup.kl
        tokens = normalisers["tokens"]
        # the [N, L, V] softmax of the entropy is in the autograd graph only if the loss uses it
        logprobs, entropy = packing.logprobs_and_entropy(self.model, self.setup.temperature,
                                                         self.algo.entropy_coef > 0, self.cfg.logits_chunk_tokens)
        proximal = mb.proximal_logprobs if mb.proximal_logprobs is not None else logprobs.detach()
        mask = mb.loss_mask.bool()
        inputs = LossInputs(logprobs=logprobs, proximal_logprobs=proximal, behaviour_logprobs=mb.behaviour_logprobs,
                            advantages=mb.advantages, loss_mask=mb.loss_mask, ref_logprobs=mb.reference_logprobs,
                            entropy=entropy)
        loss, metrics = policy_loss(inputs, self.algo, kl, tokens, normalisers["aggregation"])
        with torch.no_grad():
            metrics["entropy"] = torch.where(mask, entropy, 0.0).sum() / tokens
            if mb.reference_logprobs is not None:  # KL(pi || ref), whether or not it is in the loss
                metrics["kl"] = kl_per_token(logprobs, mb.reference_logprobs, mask, kl.estimator).sum() / tokens
            # train/inference mismatch alone: tokens sampled by the very weights the learner holds
            same_version = mask & (mb.versions == version)
            metrics["mismatch_kl"] = kl_estimates(proximal, mb.behaviour_logprobs, same_version,
                                                  normalisers["same_version_tokens"])["k3"]
            metrics["same_version_fraction"] = same_version.sum() / tokens
        metrics["loss"] = loss.detach()
        return loss, metrics

    def connect_sglang(self, endpoints: list[dict], cfg: SGLangConfig, master_addr: str, master_port: int) -> None:
        """Switch to weight_transport=nccl on every rank; rank 0 also joins one process group with every
        SGLang server in `endpoints` (it is rank 0 of that group, at master_addr:master_port on its node)."""
        from nanoverl_async.learners.sglang_nccl import SGLangWeightSender, server_handles

        self.nccl_transport = True
        if self.rank == 0:
            self.sender = SGLangWeightSender(server_handles(endpoints, cfg), master_addr, master_port,
                                             pause_mode=cfg.pause_mode, timeout_s=cfg.control_timeout_s)
            self.sender.init_group(self.device)

    @torch.no_grad()
    def publish_weights(self, version: int) -> None:
        """Collective: gather the full state dict to rank 0 in the run's dtype (what the generators compute in), one
        tensor at a time, each cast before it crosses. NCCL transport: on rank 0's device, loaded into every server
        (paused only meanwhile) before this returns, then a version notice names the version they hold. ZeroMQ
        transport: rank 0 copies each tensor into its slot in the publisher's one set of buckets (weight_sync.bucket_mb
        each; wire/buckets.py: a bucket's stamp changes before its bytes do), then publishes it without blocking while
        the optimizer steps: in shared memory on CPU, on the GPU itself when every generator shares it (CUDA IPC), else
        pinned; from a GPU the copies do not block, and the host waits once for all."""
        state = self._published_state()
        if self.nccl_transport:
            gathered = list(self._full_tensors(state))  # collective: every rank gathers, rank 0 keeps them
            if self.sender is not None:
                self.sender.send(gathered, version)
                self.publisher.publish(version, BucketSet.of({}, version, self.bucket_bytes))
            return
        cuda, buckets = self.device.type == "cuda", None
        if self.rank == 0:
            layout = {name: (self.dtype if tensor.is_floating_point() else tensor.dtype, tuple(tensor.shape))
                      for name, tensor in state.items()}
            buckets = self.publisher.writable_buckets(layout, self.device, self.bucket_bytes)
            buckets.begin(version)
        for name, full in self._full_tensors(state):
            buckets.write(name, full, non_blocking=cuda)
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()
        if self.publisher is not None:
            self.publisher.publish(version, buckets)

    def _published_state(self) -> dict:
        """What a version holds: the policy's state dict; with LoRA, its adapters alone, under PEFT's names."""
        state = self.model.state_dict()
        if self.lora is None:
            return state
        return {key: state[name] for name in state if (key := lora.adapter_key(name)) is not None}

    def _full_tensors(self, state: dict) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective, one tensor gathered at a time: on rank 0, (name, the full tensor in the run's dtype on
        this rank's device); nothing on the others."""
        for name, tensor in state.items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if self.rank == 0:
                yield name, full.to(self.dtype) if full.is_floating_point() else full

    def weights_endpoint(self) -> str:
        return self.publisher.endpoint if self.publisher is not None else ""

    def save_pretrained(self, path: str) -> None:
        """Collective: rank 0 writes the final model at `path` in the run's dtype: a Hugging Face directory, the
        critic's in `path/critic`; with LoRA, PEFT's adapter folder (learners/checkpoint.py `save_final`)."""
        save_final(self, path)

    def save_checkpoint(self, path: str) -> None:
        """Collective: this rank's shards of models and optimizers, DCP, under `path` (learners/checkpoint.py)."""
        save_training_state(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Collective: restore what `save_checkpoint` wrote."""
        load_training_state(self, path)

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.publisher is not None:
            self.publisher.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _reduce(parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """This rank's micro-batch metrics -> those of every rank's (merge_metrics: `*_max` keys by max, the others, already
    divided by global counts, by sum): this rank's in their own dtype, then all in float64, in one collective."""
    names = sorted(parts[0])
    local = merge_metrics({key: torch.stack([part[key].detach() for part in parts]) for key in names})
    values = torch.stack([local[key].double() for key in names])
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, values)
    merged = merge_metrics(dict(zip(names, torch.stack(gathered, 1))))
    return dict(zip(merged, torch.stack(list(merged.values())).tolist()))

