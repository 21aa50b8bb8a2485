"""The learner's batch: trajectories -> right-padded tensors, sharding, and the one logprob alignment.

Invariants of a `TrainBatch` (checked by `collate`):
  - every per-token tensor is [N, L] and TOKEN-INDEXED: column j describes token j of each sequence,
    exactly as in `Trajectory` (no shifted copies to keep in sync);
  - loss_mask is 1 exactly on tokens the policy sampled: never on prompt or tool tokens, never on
    padding, never on token 0 (no logits predict it);
  - rows are group-contiguous (the G samples of a prompt are adjacent), which the group advantages need.
"Logits at position i predict token i+1" is applied by `sequence_logprobs` (and, the same way, by the
learner's entropy and critic values). `collate` leaves the advantages to `with_advantages`, which shapes
rewards and computes them once, on the whole batch; `token_budget_bounds`, `split_to` and `trimmed` cut a
rank's rows into micro-batches, which `packing.pack` lays out for the model.

Run alone: `python -m pytest tests/test_algorithms.py tests/test_fsdp_schedule.py tests/test_packing.py -q`.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from nanoverl_async.algorithms import ADVANTAGES, kl_reward_penalty, overlong_penalty, token_logprobs
from nanoverl_async.config import AlgorithmConfig, KLConfig
from nanoverl_async.models.load import on_device
from nanoverl_async.wire.trajectory import Trajectory

PAD_TOKEN_ID = 0  # any valid id: padded positions are masked out of attention and of the loss


@dataclass
class TrainBatch:
    input_ids: Tensor  # int64 [N, L], right-padded with PAD_TOKEN_ID
    attention_mask: Tensor  # int64 [N, L], 1 on real tokens
    loss_mask: Tensor  # float32 [N, L], 1 only on sampled tokens
    behaviour_logprobs: Tensor  # float32 [N, L], log mu of sampled tokens (generator), 0 elsewhere
    versions: Tensor  # int64 [N, L], weight version that sampled each token, -1 elsewhere
    rewards: Tensor  # float32 [N]
    advantages: Optional[Tensor] = None  # float32 [N] (per sequence) or [N, L] (token-level); with_advantages
    proximal_logprobs: Optional[Tensor] = None  # float32 [N, L], log p_old (learner before this step), 0 off-mask
    reference_logprobs: Optional[Tensor] = None  # float32 [N, L], log pi_ref (frozen reference), 0 off-mask; KL only
    values: Optional[Tensor] = None  # float32 [N, L], the critic's V before this step, token-indexed (gae only)
    returns: Optional[Tensor] = None  # float32 [N, L], the critic's targets A + V (gae only)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]


def group_size_of(trajectories: Sequence[Trajectory]) -> int:
    """The common group size of group-contiguous trajectories (asserts contiguity and equal sizes)."""
    runs = [(group_id, len(list(run))) for group_id, run in itertools.groupby(t.group_id for t in trajectories)]
    ids = [group_id for group_id, _ in runs]
    assert len(set(ids)) == len(ids), f"trajectories are not group-contiguous (group ids in order: {ids})"
    sizes = {size for _, size in runs}
    assert len(sizes) == 1, f"groups have different sizes {sorted(sizes)}; GRPO needs equal groups"
    return sizes.pop()


def collate(trajectories: Sequence[Trajectory]) -> TrainBatch:
    """Group-contiguous trajectories -> a right-padded TrainBatch, without advantages (`with_advantages`). Off
    the loss mask a trajectory's behaviour logprobs are already 0 and its versions -1 (trajectory.validate)."""
    assert trajectories, "collate needs at least one trajectory"
    group_size_of(trajectories)  # asserts contiguity and equal group sizes
    for t in trajectories:
        assert t.loss_mask[0] == 0, f"trajectory {t.id}: token 0 has no logits to predict it and cannot be trained on"
    length = max(len(t.token_ids) for t in trajectories)

    def padded(field: str, fill: int, dtype: type) -> Tensor:
        """[N, length]: each trajectory's `field`, then `fill`."""
        out = np.full((len(trajectories), length), fill, dtype=dtype)
        for row, t in enumerate(trajectories):
            out[row, :len(t.token_ids)] = getattr(t, field)
        return torch.from_numpy(out)

    sizes = torch.tensor([len(t.token_ids) for t in trajectories])
    return TrainBatch(input_ids=padded("token_ids", PAD_TOKEN_ID, np.int64),
                      attention_mask=(torch.arange(length) < sizes[:, None]).long(),
                      loss_mask=padded("loss_mask", 0, np.float32),
                      behaviour_logprobs=padded("behaviour_logprobs", 0, np.float32),
                      versions=padded("versions", -1, np.int64),
                      rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32))


def with_advantages(batch: TrainBatch, group_size: int, algo: AlgorithmConfig, kl: KLConfig,
                    max_total_tokens: int) -> TrainBatch:
    """The batch with DAPO overlong-shaped rewards (a sequence of L tokens loses up to
    algorithm.overlong.penalty as L enters the last algorithm.overlong.buffer tokens before
    agent.max_total_tokens, where the episode is cut) and the advantages of `algo.advantage`, computed on
    the WHOLE batch (group and batch statistics are global). The per-token KL reward penalty (kl.reward_coef,
    reinforce++ and gae only) compares the proximal logprobs (or, when the update takes one step and none
    were computed, the behaviour logprobs: the same policy up to mismatch) with the reference's."""
    lengths = batch.attention_mask.sum(dim=1)
    rewards = batch.rewards + overlong_penalty(lengths, max_total_tokens, algo.overlong.buffer,
                                               algo.overlong.penalty)
    penalty = None
    if kl.reward_coef > 0:
        policy = batch.proximal_logprobs if batch.proximal_logprobs is not None else batch.behaviour_logprobs
        penalty = kl_reward_penalty(policy, batch.reference_logprobs, batch.loss_mask, kl.estimator, kl.reward_coef)
    out = ADVANTAGES[algo.advantage](rewards=rewards, group_size=group_size, loss_mask=batch.loss_mask,
                                     values=batch.values, gamma=algo.gamma, lam=algo.lam, kl_penalty=penalty)
    advantages, returns = out if isinstance(out, tuple) else (out, None)  # gae: the critic's targets too
    return dataclasses.replace(batch, rewards=rewards, advantages=advantages, returns=returns)


def explained_variance(batch: TrainBatch) -> float:
    """1 - Var(returns - values) / Var(returns) over sampled tokens (1: the critic explains the returns;
    <= 0: no better than a constant). Needs a gae batch (values and returns)."""
    mask = batch.loss_mask.bool()
    returns, values = batch.returns[mask].double(), batch.values[mask].double()
    if returns.numel() < 2 or returns.var() == 0:
        return 0.0
    return float(1 - (returns - values).var() / returns.var())


def _each(batch: TrainBatch, fn) -> TrainBatch:
    """fn(tensor) for every tensor of the batch (None stays None)."""
    return TrainBatch(**{f.name: None if getattr(batch, f.name) is None else fn(getattr(batch, f.name))
                         for f in dataclasses.fields(TrainBatch)})


def take_rows(batch: TrainBatch, rows: Tensor | slice) -> TrainBatch:
    """The rows `rows` (an index tensor: copies, in that order; a slice: views) of every tensor."""
    return _each(batch, lambda tensor: tensor[rows])


def epoch_order(size: int, seed: int, version: int, epoch: int) -> Tensor:
    """The row order of one pass over a batch split into minibatches: a fresh permutation per (seed,
    version, epoch), the same on every rank and world size, so that each minibatch mixes prompts' groups
    and each epoch draws different minibatches (PPO's minibatch SGD, Schulman et al. 2017, Algorithm 1)."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + version) * 1_009 + epoch)
    return torch.randperm(size, generator=generator)


def shard(batch: TrainBatch, rank: int, world_size: int) -> TrainBatch:
    """This rank's contiguous block of rows. Equal shards are required: FSDP ranks must run the same
    number of forward/backward passes, since each one all-gathers parameters collectively."""
    assert 0 <= rank < world_size and batch.size % world_size == 0, \
        f"{batch.size} sequences do not split evenly over {world_size} ranks (rank {rank})"
    per_rank = batch.size // world_size
    return take_rows(batch, slice(rank * per_rank, (rank + 1) * per_rank))


def token_budget_bounds(lengths: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive row ranges [start, stop) whose padded size, rows x longest row, stays within `budget`
    tokens (a row longer than the budget alone gets its own range); budget 0 = one range of all rows."""
    bounds = []
    start = 0
    longest = 0
    for row, length in enumerate(lengths):
        longest_with = max(longest, int(length))
        if budget > 0 and row > start and (row - start + 1) * longest_with > budget:
            bounds.append((start, row))
            start, longest_with = row, int(length)
        longest = longest_with
    if len(lengths):
        bounds.append((start, len(lengths)))
    return bounds


def split_to(bounds: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """Split the range with the most rows in two until there are `count` ranges. Data-parallel ranks
    must run the same number of forward/backward passes (each all-gathers parameters collectively), so
    every rank splits to the largest count of any rank (count <= rows, which ranks share)."""
    bounds = list(bounds)
    while len(bounds) < count:
        widest = max(range(len(bounds)), key=lambda i: bounds[i][1] - bounds[i][0])
        start, stop = bounds[widest]
        assert stop - start > 1, f"cannot split {len(bounds)} single-row ranges into {count}"
        middle = (start + stop) // 2
        bounds[widest:widest + 1] = [(start, middle), (middle, stop)]
    return bounds


def trimmed(batch: TrainBatch, start: int, stop: int) -> TrainBatch:
    """Rows [start, stop), with the columns after their longest row cut off (right padding only:
    the logits of the remaining tokens do not change)."""
    rows = take_rows(batch, slice(start, stop))
    length = max(1, int(rows.attention_mask.sum(dim=1).max())) if rows.size else 1
    return _each(rows, lambda tensor: tensor[:, :length] if tensor.dim() == 2 else tensor)


def to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    return _each(batch, lambda tensor: on_device(tensor, device))


def sequence_logprobs(logits: Tensor, input_ids: Tensor, temperature: float) -> Tensor:
    """Token-indexed logprobs [N, L] from causal-LM logits [N, L, V]: the logits at position i predict
    token i + 1, so out[:, j] = log p(input_ids[:, j] | input_ids[:, :j]) for j >= 1 and out[:, 0] = 0
    (token 0 is never predicted and is never in the loss mask). Differentiable w.r.t. logits."""
    predicted = token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
    return torch.cat([predicted.new_zeros(predicted.shape[0], 1), predicted], dim=1)
