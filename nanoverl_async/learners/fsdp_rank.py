"""One data-parallel learner rank: a Hugging Face causal LM sharded with FSDP2, AdamW, the policy loss;
optionally a frozen reference (KL) and a critic (advantage=gae) sharded the same way in the same ranks.

Every rank receives the WHOLE TrainBatch. `update` runs learner.ppo_epochs x learner.minibatches optimizer
steps: minibatch k is the k-th contiguous block of the batch's rows, of which each rank trains its own
contiguous shard, in micro-batches of at most learner.micro_batch_tokens padded tokens. Invariants:
  - every loss and metric is a sum over this rank's micro-batch divided by a GLOBAL normaliser (counts
    of the whole minibatch, all-reduced over ranks), and FSDP2 averages gradients over ranks, so each
    rank backpropagates world_size * loss: the accumulated gradient is then exactly that of one pass
    over the whole minibatch, however the rows are split (tests/test_fsdp.py, test_fsdp_schedule.py);
  - ranks run the same number of micro-batches (the largest any rank needs), since each forward and
    backward all-gathers parameters collectively;
  - logprobs use the generator's sampling temperature (softmax(logits / T), as the generator sampled);
  - the models stay in eval mode (no dropout), so the logprobs of the update's forward equal the
    proximal logprobs of `compute_logprobs` on the same weights;
  - `version` counts BATCHES trained (one per training step t, however many optimizer steps it took):
    the weights published after step t are version t + 1 (DESIGN.md "Versions");
  - every collective (`update`, `compute_logprobs`, `compute_values`, `publish_weights`,
    `save_pretrained`, `save_checkpoint`, `load_checkpoint`, `connect_sglang`) must be called on all
    ranks, in the same order.
Weights out: by default rank 0 publishes each version's full state dict over ZeroMQ (weights.py). After
`connect_sglang` (generator.sglang.weight_transport=nccl) rank 0 loads each version straight into the
SGLang servers (learners/sglang_nccl.py) and publishes only a version notice (an empty state dict).
Device: "cpu" uses gloo; "cuda" uses nccl, one GPU per rank (`local_rank`, default rank % GPUs visible).

Run alone (no Ray): `python -m pytest tests/test_fsdp.py tests/test_fsdp_schedule.py -q` spawns 1 and 2
ranks with gloo.
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
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from nanoverl_async.algorithms import (aggregate, kl_estimates, kl_per_token, loss_normaliser, policy_loss,
                                      reduce_token_metrics, token_entropy, value_loss)
from nanoverl_async.config import AlgorithmConfig, CriticConfig, KLConfig, LearnerConfig, SGLangConfig
from nanoverl_async.learners.batch import (TrainBatch, epoch_order, sequence_logprobs, shard, split_to, take_rows,
                                           to_device, token_budget_bounds, trimmed)
from nanoverl_async.learners.checkpoint import load_training_state, save_training_state
from nanoverl_async.models import DTYPES, load_tokenizer
from nanoverl_async.weights import WeightPublisher

PROCESS_GROUP_TIMEOUT_S = 600  # a collective that waits longer than this fails loudly instead of hanging


class LearnerRank:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str,
                 cfg: LearnerConfig, algo: AlgorithmConfig, temperature: float, seed: int, *,
                 kl: Optional[KLConfig] = None, reference_path: str = "", critic: Optional[CriticConfig] = None,
                 max_tokens: int = 0,
                 dtype: str = "float32", wire_host: str = "127.0.0.1", initial_version: int = 0,
                 local_rank: Optional[int] = None):
        torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(seed + rank)
        self.rank, self.world_size, self.cfg, self.algo, self.seed = rank, world_size, cfg, algo, seed
        self.kl = kl or KLConfig()
        self.max_tokens = max_tokens  # seq-mean-token-sum-norm's constant (agent.max_total_tokens)
        self.model_path, self.temperature = model_path, temperature
        self.dtype = DTYPES[dtype]  # compute and published-weights dtype; master weights stay fp32
        self.version = initial_version  # optimizer steps done: the weights this rank holds are this version
        self.device = _device(cfg.device, rank, local_rank)
        cuda = self.device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size, device_id=self.device if cuda else None,
                                timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
        self.mesh = init_device_mesh(self.device.type, (world_size,))
        self.model = self._sharded_model(model_path)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)
        self.reference = None  # the frozen reference policy, only when KL is on
        if self.kl.loss_coef > 0 or self.kl.reward_coef > 0:
            self.reference = self._sharded_model(reference_path or model_path).requires_grad_(False)
        self.critic = None  # the value model of advantage=gae: LM backbone + scalar head, its own optimizer
        if algo.advantage == "gae":
            self.critic_cfg = critic or CriticConfig()
            torch.manual_seed(seed)  # the fresh head: the same initial values on every rank and world size
            self.critic = self._sharded_model(self.critic_cfg.path or model_path, AutoModelForTokenClassification,
                                              num_labels=1)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=self.critic_cfg.lr,
                                                      betas=tuple(cfg.betas), weight_decay=self.critic_cfg.weight_decay)
        self.publisher = WeightPublisher(wire_host) if rank == 0 else None
        self.nccl_transport = False  # set by connect_sglang on every rank (publish_weights gathers differently)
        self.sender = None  # rank 0's SGLangWeightSender once connected

    def _sharded_model(self, path: str, model_class=AutoModelForCausalLM, **kwargs) -> torch.nn.Module:
        """A causal LM (or, for the critic, its backbone with a token-level head) with fp32 master weights,
        sharded per decoder layer and at the root; bfloat16 only for compute when asked (FSDP2 mixed
        precision), gradients reduced in fp32."""
        model = model_class.from_pretrained(path, dtype=torch.float32, **kwargs).to(self.device)
        model.config.use_cache = False
        model.eval()  # no dropout: see the module docstring
        mp_policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        layer_classes = set(getattr(model, "_no_split_modules", None) or [])
        assert layer_classes, f"{type(model).__name__} names no decoder-layer class (_no_split_modules)"
        for module in list(model.modules()):
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=self.mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=self.mesh, mp_policy=mp_policy)
        return model

    @property
    def steps_per_batch(self) -> int:
        return self.cfg.ppo_epochs * self.cfg.minibatches

    def _micro_bounds(self, local: TrainBatch) -> list[tuple[int, int]]:
        """Row ranges of this rank's rows within learner.micro_batch_tokens padded tokens each, split
        to the largest count of any rank (collective: ranks must run the same number of passes)."""
        bounds = token_budget_bounds(local.attention_mask.sum(dim=1).tolist(), self.cfg.micro_batch_tokens)
        count = torch.tensor([len(bounds)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return split_to(bounds, int(count.item()))

    def compute_logprobs(self, batch: TrainBatch, which: str = "policy") -> np.ndarray:
        """float32 [rows of this rank's shard, L], token-indexed (see batch.sequence_logprobs), 0 off the
        loss mask: under `which` = "policy", the proximal logprobs p_old of the weights this rank holds now
        (version `self.version`); under "reference", those of the frozen reference model."""
        model = {"policy": self.model, "reference": self.reference}[which]
        assert model is not None, "no reference model: KL is off (kl.loss_coef = kl.reward_coef = 0)"
        return self._per_token(batch, lambda mb: sequence_logprobs(
            model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits,
            mb.input_ids, self.temperature))

    def compute_values(self, batch: TrainBatch) -> np.ndarray:
        """The critic's values V before this step, [rows of this rank's shard, L], token-indexed, 0 off the
        loss mask (advantage=gae only)."""
        assert self.critic is not None, "no critic: algorithm.advantage is not gae"
        return self._per_token(batch, self._values)

    @torch.no_grad()
    def _per_token(self, batch: TrainBatch, forward) -> np.ndarray:
        """forward(micro-batch) -> [n, l] token-indexed values, over this rank's shard, padded back to L."""
        local = shard(batch, self.rank, self.world_size)
        out = torch.zeros(local.input_ids.shape, dtype=torch.float32)
        for start, stop in self._micro_bounds(local):
            mb = to_device(trimmed(local, start, stop), self.device)
            values = forward(mb)
            out[start:stop, :values.shape[1]] = torch.where(mb.loss_mask.bool(), values, 0.0).cpu()
        return out.numpy()

    def _values(self, mb: TrainBatch) -> torch.Tensor:
        """Token-indexed V [n, l]: the head's output at position j - 1, the state in which token j is
        sampled (the same shift as sequence_logprobs); 0 at j = 0."""
        scores = self.critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        scores = scores[..., 0].float()
        return torch.cat([scores.new_zeros(scores.shape[0], 1), scores[:, :-1]], dim=1)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """ppo_epochs x minibatches optimizer steps on the batch, then version += 1: ONE new version per
        batch, however many optimizer steps (DESIGN.md "Versions"). Minibatch k is the k-th contiguous
        block of rows of the batch in this epoch's order (`epoch_order`: shuffled when there are several
        minibatches), of which each rank trains its own shard. Without
        proximal_logprobs the update's own detached logprobs stand in for p_old, which is exact only
        with one optimizer step per batch (LearnerPool.prepare computes them otherwise). Metrics are
        reduced over ranks, then averaged over optimizer steps (`*_max` keys: max)."""
        assert batch.proximal_logprobs is not None or self.steps_per_batch == 1, \
            "several optimizer steps per batch need the proximal logprobs (LearnerPool.prepare)"
        history = []
        for epoch in range(self.cfg.ppo_epochs):
            ordered = batch if self.cfg.minibatches == 1 else \
                take_rows(batch, epoch_order(batch.size, self.seed, self.version, epoch))
            for k in range(self.cfg.minibatches):
                minibatch = shard(ordered, k, self.cfg.minibatches)
                history.append(self._optimizer_step(shard(minibatch, self.rank, self.world_size)))
        self.version += 1
        out = {key: max(h[key] for h in history) if key.endswith("_max") else
               sum(h[key] for h in history) / len(history) for key in history[0]}
        out.update(tokens=int(sum(h["tokens"] for h in history) / self.cfg.ppo_epochs), version=self.version,
                   optimizer_steps=len(history))
        return out

    def _normalisers(self, local: TrainBatch) -> dict[str, float]:
        """Global (all-rank) counts of this minibatch: the denominators of every loss and metric, so
        micro-batches and ranks add up to one pass over the whole minibatch: sampled tokens (metrics,
        token-mean), same-version tokens (mismatch_kl), and the aggregation's own normaliser."""
        sampled = local.loss_mask.bool()
        same_version = sampled & (local.versions == self.version)  # train/inference mismatch, not staleness
        aggregation = loss_normaliser(local.loss_mask, self.algo.loss_agg, self.max_tokens)
        counts = torch.stack([sampled.sum().double(), same_version.sum().double(), aggregation]).to(self.device)
        dist.all_reduce(counts)
        tokens, same_version_tokens, aggregation = counts.clamp(min=1.0).tolist()
        return {"tokens": tokens, "same_version_tokens": same_version_tokens, "aggregation": aggregation}

    def _optimizer_step(self, local: TrainBatch) -> dict[str, float]:
        """Accumulate gradients over this rank's micro-batches (each loss already divided by the global
        normalisers), clip, step."""
        normalisers, bounds = self._normalisers(local), self._micro_bounds(local)
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor] = {}  # over micro-batches: sums, or maxima for `*_max` keys
        for start, stop in bounds:
            loss, metrics = self._loss(to_device(trimmed(local, start, stop), self.device), normalisers)
            (loss * self.world_size).backward()  # FSDP2 averages gradients over ranks: undo the 1/world_size
            _accumulate(totals, metrics)
        grad_norm = _clip_grad_norm(self.model, self.cfg.grad_clip)
        self.optimizer.step()
        out = _reduce(totals)
        out.update(grad_norm=grad_norm, tokens=int(normalisers["tokens"]))
        if self.critic is not None:
            out.update(self._critic_step(local, bounds, normalisers["tokens"]))
        return out

    def _critic_step(self, local: TrainBatch, bounds: list[tuple[int, int]], tokens: float) -> dict[str, float]:
        """One critic optimizer step on the same micro-batches: the clipped value loss (algorithms.value_loss)
        against the GAE returns, token-mean over the global sampled-token count."""
        self.critic_optimizer.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor] = {}
        for start, stop in bounds:
            mb = to_device(trimmed(local, start, stop), self.device)
            token_loss, metrics = value_loss(self._values(mb), mb.values, mb.returns, mb.loss_mask,
                                             self.critic_cfg.value_clip)
            loss = aggregate(token_loss, mb.loss_mask, "token-mean", tokens)
            (loss * self.world_size).backward()
            _accumulate(totals, {"value_loss": loss.detach(), **reduce_token_metrics(metrics, mb.loss_mask, tokens)})
        grad_norm = _clip_grad_norm(self.critic, self.critic_cfg.grad_clip)
        self.critic_optimizer.step()
        return {**_reduce(totals), "value_grad_norm": grad_norm}

    def _loss(self, mb: TrainBatch, normalisers: dict[str, float]) -> tuple[torch.Tensor, dict]:
        """The loss of one micro-batch (algorithms.policy_loss: correction, policy loss, KL, entropy) and
        its metrics, every sum divided by the GLOBAL normalisers."""
        logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        logprobs = sequence_logprobs(logits, mb.input_ids, self.temperature)
        proximal = mb.proximal_logprobs if mb.proximal_logprobs is not None else logprobs.detach()
        mask = mb.loss_mask.bool()
        with torch.set_grad_enabled(self.algo.entropy_coef > 0):  # the [N, L, V] softmax only in the graph if used
            # logits[:, i] is the distribution that sampled token i + 1; token 0 is never in the mask
            entropy = torch.cat([logits.new_zeros(logits.shape[0], 1, dtype=torch.float32),
                                 token_entropy(logits[:, :-1], self.temperature)], dim=1)
        algo, tokens = self.algo, normalisers["tokens"]
        loss, metrics = policy_loss(
            logprobs, proximal, mb.behaviour_logprobs, mb.advantages, mb.loss_mask, algo.correction,
            algo.clip.low, algo.clip.high, algo.is_cap, tokens, loss=algo.loss, clip_ratio_c=algo.clip.ratio_c,
            is_low=algo.is_low, is_level=algo.is_level, aggregation=algo.loss_agg,
            agg_normaliser=normalisers["aggregation"], ref_logprobs=mb.reference_logprobs,
            kl_coef=self.kl.loss_coef, kl_estimator=self.kl.estimator, entropy=entropy,
            entropy_coef=algo.entropy_coef)
        with torch.no_grad():
            metrics["entropy"] = torch.where(mask, entropy, 0.0).sum() / tokens
            if mb.reference_logprobs is not None:  # KL(pi || ref), whether or not it is in the loss
                metrics["kl"] = kl_per_token(logprobs, mb.reference_logprobs, mask, self.kl.estimator).sum() / tokens
            # train/inference mismatch alone: tokens sampled by the very weights the learner holds
            same_version = mask & (mb.versions == self.version)
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

    def publish_weights(self, version: int) -> None:
        """Collective: gather the full state dict to rank 0 in the run's dtype (what the generators compute
        in; a no-op for float32). Disk transport: to rank 0's CPU, published without blocking. NCCL transport:
        on rank 0's device (no CPU round trip), loaded into every server before this returns (they are
        paused only meanwhile), then a version notice tells the generators which version their servers hold."""
        if self.nccl_transport:
            state_dict = self._gathered_on_device()
            if self.sender is not None:
                self.sender.send(state_dict.items(), version)
                del state_dict
                self.publisher.publish(version, {})
            return
        state_dict = self.full_state_dict()
        if self.publisher is not None:
            self.publisher.publish(version, {name: tensor.to(self.dtype) if tensor.is_floating_point() else tensor
                                             for name, tensor in state_dict.items()})

    @torch.no_grad()
    def _gathered_on_device(self) -> dict[str, torch.Tensor]:
        """Collective: the full state dict on rank 0's device in the run's dtype ({} on other ranks),
        gathered one tensor at a time, so the other ranks hold at most one unsharded tensor at once."""
        out = {}
        for name, tensor in self.model.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if self.rank == 0:
                out[name] = full.to(self.dtype) if full.is_floating_point() else full
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the full (unsharded) fp32 state dict on rank 0's CPU; {} on other ranks."""
        return _full_state_dict(self.model)

    def weights_endpoint(self) -> str:
        return self.publisher.endpoint if self.publisher is not None else ""

    def save_pretrained(self, path: str) -> None:
        """Collective: rank 0 writes a Hugging Face directory (config, weights, tokenizer) at `path`, and
        the critic's (advantage=gae; AutoModelForTokenClassification, one label) at `path/critic`."""
        _save_hf(self.model, AutoModelForCausalLM, self.model_path, path, self.rank)
        if self.critic is not None:
            _save_hf(self.critic, AutoModelForTokenClassification, self.critic_cfg.path or self.model_path,
                     f"{path}/critic", self.rank, num_labels=1)

    def save_checkpoint(self, path: str) -> None:
        """Collective: this rank's shards of models and optimizers, DCP, under `path` (learners/checkpoint.py)."""
        save_training_state(self, path)

    def load_checkpoint(self, path: str, version: int) -> None:
        """Collective: restore what `save_checkpoint` wrote; the weights are then version `version`."""
        load_training_state(self, path)
        self.version = version

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.publisher is not None:
            self.publisher.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: `module`'s full (unsharded) state dict on rank 0's CPU; {} on other ranks."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _save_hf(module: torch.nn.Module, model_class, source: str, path: str, rank: int, **kwargs) -> None:
    """Collective: gather `module`'s full state dict and have rank 0 save it as `model_class` built from
    `source` (its config and tokenizer files are copied too)."""
    state_dict = _full_state_dict(module)
    if rank == 0:
        model = model_class.from_pretrained(source, dtype=torch.float32, **kwargs)
        model.load_state_dict(state_dict)
        model.save_pretrained(path)
        if _has_tokenizer(source):
            load_tokenizer(source).save_pretrained(path)
    dist.barrier()


def _device(kind: str, rank: int, local_rank: Optional[int]) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    assert kind == "cuda" and torch.cuda.is_available(), f"learner device '{kind}' is not available here"
    index = local_rank if local_rank is not None else rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _accumulate(totals: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor]) -> None:
    """Add a micro-batch's metrics to the running totals (max for `*_max` keys)."""
    for key, value in metrics.items():
        if key not in totals:
            totals[key] = value
        else:
            totals[key] = torch.maximum(totals[key], value) if key.endswith("_max") else totals[key] + value


def _clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (0 = no clipping); returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


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
