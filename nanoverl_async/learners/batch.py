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
rank's rows into micro-batches, and `pack` lays a micro-batch out for the model, several sequences to a
row (`keeps_packed_sequences_apart` checks that a model honours it).

Run alone: `python -m pytest tests/test_algorithms.py tests/test_fsdp_schedule.py tests/test_packing.py -q`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from nanoverl_async.algorithms import (ADVANTAGES, kl_reward_penalty, overlong_penalty, token_logprobs,
                                      token_logprobs_and_entropy)
from nanoverl_async.config import AlgorithmConfig, KLConfig
from nanoverl_async.trajectory import Trajectory

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
    runs: list[list] = []
    for t in trajectories:
        if runs and runs[-1][0] == t.group_id:
            runs[-1][1] += 1
        else:
            runs.append([t.group_id, 1])
    ids = [group_id for group_id, _ in runs]
    assert len(set(ids)) == len(ids), f"trajectories are not group-contiguous (group ids in order: {ids})"
    sizes = {size for _, size in runs}
    assert len(sizes) == 1, f"groups have different sizes {sorted(sizes)}; GRPO needs equal groups"
    return sizes.pop()


def collate(trajectories: Sequence[Trajectory]) -> TrainBatch:
    """Group-contiguous trajectories -> a right-padded TrainBatch, without advantages (`with_advantages`)."""
    assert trajectories, "collate needs at least one trajectory"
    group_size_of(trajectories)  # asserts contiguity and equal group sizes
    n, length = len(trajectories), max(len(t.token_ids) for t in trajectories)
    input_ids = np.full((n, length), PAD_TOKEN_ID, dtype=np.int64)
    attention_mask = np.zeros((n, length), dtype=np.int64)
    loss_mask = np.zeros((n, length), dtype=np.float32)
    behaviour = np.zeros((n, length), dtype=np.float32)
    versions = np.full((n, length), -1, dtype=np.int64)
    for row, t in enumerate(trajectories):
        size = len(t.token_ids)
        assert t.loss_mask[0] == 0, f"trajectory {t.id}: token 0 has no logits to predict it and cannot be trained on"
        input_ids[row, :size] = t.token_ids
        attention_mask[row, :size] = 1
        loss_mask[row, :size] = t.loss_mask
        behaviour[row, :size] = np.where(t.loss_mask == 1, t.behaviour_logprobs, 0.0)
        versions[row, :size] = np.where(t.loss_mask == 1, t.versions, -1)
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    return TrainBatch(input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(attention_mask),
                      loss_mask=torch.from_numpy(loss_mask), behaviour_logprobs=torch.from_numpy(behaviour),
                      versions=torch.from_numpy(versions), rewards=rewards)


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


def slice_rows(batch: TrainBatch, start: int, stop: int) -> TrainBatch:
    """Rows [start, stop) of every tensor (views, no copy)."""
    return TrainBatch(**{f.name: None if getattr(batch, f.name) is None else getattr(batch, f.name)[start:stop]
                         for f in dataclasses.fields(TrainBatch)})


def take_rows(batch: TrainBatch, rows: Tensor) -> TrainBatch:
    """The rows `rows` (an index tensor) of every tensor, in that order (copies)."""
    return TrainBatch(**{f.name: None if getattr(batch, f.name) is None else getattr(batch, f.name)[rows]
                         for f in dataclasses.fields(TrainBatch)})


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
    return slice_rows(batch, rank * per_rank, (rank + 1) * per_rank)


def token_budget_bounds(lengths: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive row ranges [start, stop) whose padded size, rows x longest row, stays within `budget`
    tokens (a row longer than the budget alone gets its own range); budget 0 = one range of all rows."""
    bounds, start, longest = [], 0, 0
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
    rows = slice_rows(batch, start, stop)
    length = max(1, int(rows.attention_mask.sum(dim=1).max())) if rows.size else 1
    return TrainBatch(**{f.name: _cut(getattr(rows, f.name), length) for f in dataclasses.fields(TrainBatch)})


def _cut(tensor: Optional[Tensor], length: int) -> Optional[Tensor]:
    return tensor[:, :length] if tensor is not None and tensor.dim() == 2 else tensor


def to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    return TrainBatch(**{f.name: moved(getattr(batch, f.name), device) for f in dataclasses.fields(TrainBatch)})


def moved(tensor: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    """`tensor` on `device`; host to GPU from pinned memory without blocking, since a copy from pageable
    memory waits for all the GPU work queued so far (the host could not run ahead of the GPU)."""
    if tensor is None:
        return None
    if torch.device(device).type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def sequence_logprobs(logits: Tensor, input_ids: Tensor, temperature: float) -> Tensor:
    """Token-indexed logprobs [N, L] from causal-LM logits [N, L, V]: the logits at position i predict
    token i + 1, so out[:, j] = log p(input_ids[:, j] | input_ids[:, :j]) for j >= 1 and out[:, 0] = 0
    (token 0 is never predicted and is never in the loss mask). Differentiable w.r.t. logits."""
    predicted = token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
    return torch.cat([predicted.new_zeros(predicted.shape[0], 1), predicted], dim=1)


def prompt_lengths(loss_mask: Tensor) -> Tensor:
    """[N]: the tokens before each sequence's first sampled one (its prompt; 0 for a row with none)."""
    return loss_mask.bool().int().argmax(dim=1)


def attends_to_whole_context(config) -> bool:
    """Whether every layer of a transformers model attends to the whole context (no sliding window): the
    mask of a shared prompt (`pack`) replaces the model's own, so only such models may share prompts."""
    return not getattr(config, "sliding_window", None) and all(
        kind == "full_attention" for kind in getattr(config, "layer_types", None) or [])


@dataclass(frozen=True)
class Packing:
    """A micro-batch's right-padded sequences [n, l] laid out for the model as packed rows [r, c], several
    sequences per row, each with its own position ids (verl's remove-padding, TRL's padding-free
    training): padding then costs only each row's unfilled tail, not every row's gap to the longest one.
    Sequences with the same prompt (a GRPO group's samples) may share it: the prompt once, then each
    one's continuation, which attends to the prompt and to itself only (Prefix Grouper, Liu et al. 2025,
    arXiv:2506.05433), so a group's prompt is computed once per row instead of once per sample. That needs
    an explicit attention mask; without shared prompts, where position ids restart transformers' causal
    mask starts a new block, so no sequence attends to another.

    A token-indexed quantity of token j (its logprob, the entropy it was sampled from, the critic's value)
    comes from the position that predicts it, that of token j - 1 (`predictor`); a shared prompt's last
    position predicts every member's first sampled token."""

    input_ids: Tensor  # int64 [r, c]
    position_ids: Optional[Tensor]  # int64 [r, c]; None when each row is one sequence from position 0
    attention_mask: Optional[Tensor]  # bool [r, 1, c, c], True where a token may attend; only if prompts are shared
    predictor: Tensor  # int64 [k]: flat position in [r * c] of the logits that predict each token j >= 1
    target: Tensor  # int64 [k]: that token's id
    destination: Tensor  # int64 [k]: its flat position in [n * l]
    shape: tuple[int, int]  # [n, l], the micro-batch's

    def forward(self, model: torch.nn.Module) -> Tensor:
        """The model's output (logits, or a critic's scores) on the packed rows [r, c, ...]. Position ids only
        where rows are shared: from them transformers derives the blocks of its mask, and checks on the host
        whether there are any (a wait for the GPU), while rows of one sequence need the plain causal mask."""
        return model(input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=self.attention_mask,
                     use_cache=False).logits

    def logprobs(self, logits: Tensor, temperature: float) -> Tensor:
        """Token-indexed logprobs [n, l] (as `sequence_logprobs`) from the packed logits [r, c, V]."""
        return self.scatter(token_logprobs(logits.flatten(0, 1), self.target, temperature, self.predictor))

    def logprobs_and_entropy(self, logits: Tensor, temperature: float, entropy_grad: bool) -> tuple[Tensor, Tensor]:
        """`logprobs` and, token-indexed the same way, the entropy of the distribution that sampled each token,
        from one pass over the logits (algorithms.token_logprobs_and_entropy)."""
        return tuple(self.scatter(values) for values in token_logprobs_and_entropy(
            logits.flatten(0, 1), self.target, temperature, entropy_grad, self.predictor))

    def predicted(self, per_position: Tensor) -> Tensor:
        """A per-position output [r, c, ...] (a critic's values) -> token-indexed [n, l, ...]: token j gets the
        output at the position that predicts it, the state in which it was sampled."""
        return self.scatter(per_position.flatten(0, 1)[self.predictor])

    def scatter(self, values: Tensor) -> Tensor:
        """Values of tokens j >= 1 [k, ...] -> [n, l, ...], 0 on token 0 and on padding. Integer indices only: a
        boolean mask would make the host wait for the GPU."""
        out = values.new_zeros((self.shape[0] * self.shape[1], *values.shape[1:]))
        out[self.destination] = values
        return out.view(*self.shape, *values.shape[1:])

    def to(self, device: torch.device) -> "Packing":
        return Packing(*(moved(getattr(self, f.name), device) for f in dataclasses.fields(self)[:-1]), self.shape)


def pack(input_ids: Tensor, attention_mask: Tensor, several_per_row: bool = True,
         prompts: Optional[Tensor] = None, attention_cost: float = 0.0) -> Packing:
    """Pack sequences first-fit decreasing into rows as long as the longest one, so that a row's attention
    never costs more than in the padded layout; or, given `attention_cost` (`attention_cost_per_position`),
    into rows twice as long where the estimated cost says that is cheaper: fewer rows, in which more of a
    group share their prompt, against more attention per token. `prompts` ([n], e.g. `prompt_lengths`):
    sequences whose first prompts[i] tokens are the same share them, as many in a row as fit.
    several_per_row=False keeps one sequence per row (the padded layout itself, for a model whose attention
    mixes packed sequences)."""
    lengths = attention_mask.sum(dim=1).tolist()
    longest = max(1, max(lengths, default=1))
    layouts = [_rows(input_ids, lengths, prompts if several_per_row else None, capacity, several_per_row)
               for capacity in ([longest, 2 * longest] if several_per_row and attention_cost > 0 else [longest])]
    capacity, units, rows = min(layouts, key=lambda layout: len(layout[2]) * layout[0] * (
        1 + layout[0] * attention_cost))
    packed_ids = torch.full((len(rows), capacity), PAD_TOKEN_ID, dtype=input_ids.dtype)
    positions = torch.zeros((len(rows), capacity), dtype=torch.long)
    blocks = torch.full((len(rows), capacity), -1, dtype=torch.long)  # the unit of each position (-1: the tail)
    branches = torch.zeros((len(rows), capacity), dtype=torch.long)  # 0: a whole sequence or a shared prompt
    places: list[Tensor] = [torch.zeros(0, dtype=torch.long)] * len(lengths)  # flat position of each token
    for r, members_of_row in enumerate(rows):
        offset = 0
        for unit in members_of_row:
            shared, members = units[unit]
            prompt = torch.arange(r * capacity + offset, r * capacity + offset + shared)
            packed_ids[r, offset:offset + shared] = input_ids[members[0], :shared]
            positions[r, offset:offset + shared] = torch.arange(shared)
            blocks[r, offset:offset + shared] = unit
            offset += shared
            for branch, sequence in enumerate(members, start=1):
                end = offset + lengths[sequence] - shared
                packed_ids[r, offset:end] = input_ids[sequence, shared:lengths[sequence]]
                positions[r, offset:end] = torch.arange(shared, lengths[sequence])
                blocks[r, offset:end], branches[r, offset:end] = unit, branch if shared else 0
                places[sequence] = torch.cat([prompt, torch.arange(r * capacity + offset, r * capacity + end)])
                offset = end
        positions[r, offset:] = torch.arange(capacity - offset)  # the tail: a block of its own, discarded
    width = input_ids.shape[1]
    predictor = torch.cat([place[:-1] for place in places] or [torch.zeros(0, dtype=torch.long)])
    target = torch.cat([input_ids[s, 1:size] for s, size in enumerate(lengths)] or [torch.zeros(0, dtype=torch.long)])
    destination = torch.cat([torch.arange(s * width + 1, s * width + size) for s, size in enumerate(lengths)]
                            or [torch.zeros(0, dtype=torch.long)])
    several = len(rows) < len(lengths)  # else each row is one sequence from position 0: no ids needed
    mask = _shared_prompt_mask(blocks, branches) if any(shared for shared, _ in units) else None
    device = input_ids.device
    return Packing(packed_ids.to(device), positions.to(device) if several else None,
                   None if mask is None else mask.to(device), predictor.to(device), target.to(device),
                   destination.to(device), tuple(attention_mask.shape))


def attention_cost_per_position(model: torch.nn.Module) -> float:
    """A token's attention FLOPs per position of its row (4 x hidden per layer: the scores and the weighted
    values over every position, masked or not), relative to its other FLOPs (2 per weight of the layers and
    the LM head): what one more position of row length costs each token, for `pack`."""
    config, embedding, head = model.config, model.get_input_embeddings().weight, model.get_output_embeddings()
    weights = sum(p.numel() for p in model.parameters()) - embedding.numel()
    weights += embedding.numel() if head is None or head.weight is embedding else 0  # a tied head: once more
    return 4 * config.hidden_size * config.num_hidden_layers / (2 * weights)


def _rows(input_ids: Tensor, lengths: list[int], prompts: Optional[Tensor], capacity: int,
          several_per_row: bool) -> tuple[int, list[tuple[int, list[int]]], list[list[int]]]:
    """(capacity, units, unit numbers per row): `_units` placed first-fit decreasing in rows of `capacity`."""
    units = _units(input_ids, lengths, prompts, capacity)
    sizes = [shared + sum(lengths[s] - shared for s in members) for shared, members in units]
    rows: list[list[int]] = []
    room: list[int] = []
    for unit in sorted(range(len(units)), key=lambda u: -sizes[u]):
        row = next((r for r, free in enumerate(room) if several_per_row and free >= sizes[unit]), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(unit)
        room[row] -= sizes[unit]
    return capacity, units, rows


def _units(input_ids: Tensor, lengths: list[int], prompts: Optional[Tensor],
           capacity: int) -> list[tuple[int, list[int]]]:
    """What `pack` places: (shared, sequences), the first `shared` tokens common to those sequences and laid
    out once, then each one's rest; (0, [s]) is sequence s alone. Sequences with the same prompt are
    bundled first-fit decreasing, as many as fit in `capacity` tokens."""
    by_prompt: dict[tuple, list[int]] = {}
    for sequence, length in enumerate(lengths):
        shared = min(int(prompts[sequence]), length - 1) if prompts is not None else 0  # >= 1 token of its own
        key = (shared, *input_ids[sequence, :shared].tolist()) if shared > 0 else (0, sequence)
        by_prompt.setdefault(key, []).append(sequence)
    units = []
    for key, members in by_prompt.items():
        shared, bundles = key[0], []  # [size, sequences]
        for sequence in sorted(members, key=lambda s: -lengths[s]):
            rest = lengths[sequence] - shared
            bundle = next((b for b in bundles if b[0] + rest <= capacity), None)
            if bundle is None:
                bundles.append([shared + rest, [sequence]])
            else:
                bundle[0] += rest
                bundle[1].append(sequence)
        units += [(shared if len(sequences) > 1 else 0, sequences) for _, sequences in bundles]
    return units


def _shared_prompt_mask(blocks: Tensor, branches: Tensor) -> Tensor:
    """[r, 1, c, c] bool: a token attends to earlier tokens of its own unit that are its shared prompt
    (branch 0) or its own branch; the tail (block -1) attends to itself, so no row is all False."""
    columns = torch.arange(blocks.shape[1])
    causal = columns[None, :] <= columns[:, None]
    same_block = blocks[:, :, None] == blocks[:, None, :]
    visible = (branches[:, None, :] == 0) | (branches[:, None, :] == branches[:, :, None])
    return (causal & same_block & visible)[:, None]


@torch.no_grad()
def keeps_packed_sequences_apart(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether `model` honours `pack`: a sequence's outputs do not change when the tokens of others in its
    row do (position ids, and a shared prompt's mask), and a sequence sees the prompt it shares. With FSDP2,
    collective (forwards on every rank); it leaves the model resharded."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def outputs(sequences: list[Tensor], prompts: Optional[Tensor] = None) -> Tensor:
        """The model's outputs (logits, or a critic's values) that predict each token, [n, l, V]."""
        width = max(len(s) for s in sequences)
        ids = torch.stack([torch.cat([s, s.new_zeros(width - len(s))]) for s in sequences])
        attention = (torch.arange(width) < torch.tensor([[len(s)] for s in sequences])).long()
        packing = pack(ids, attention, prompts=prompts).to(device)
        return packing.predicted(packing.forward(model).float())

    def draw(size: int) -> Tensor:
        return torch.randint(vocab, (size,), generator=generator)

    def bumped(tokens: Tensor) -> Tensor:
        return (tokens + 1) % vocab

    # Rows Z | X Y, kept apart by position ids; rows L | A B C, with A and B sharing a 4-token prompt.
    x, y, z, prompt, a, b, c, longest = draw(4), draw(3), draw(7), draw(4), draw(3), draw(3), draw(2), draw(12)
    shared = torch.tensor([4, 4, 0, 0])
    plain = outputs([x, y, z])
    grouped = outputs([torch.cat([prompt, a]), torch.cat([prompt, b]), c, longest], shared)
    others_unchanged = [torch.allclose(plain[1:], outputs([bumped(x), y, z])[1:], rtol=1e-4, atol=1e-6),
                        torch.allclose(grouped[1:], outputs([torch.cat([prompt, bumped(a)]), torch.cat([prompt, b]),
                                                              c, longest], shared)[1:], rtol=1e-4, atol=1e-6)]
    # B's tokens 5 and 6 are predicted at B's own positions, whose outputs must depend on the prompt
    sees_prompt = outputs([torch.cat([bumped(prompt), a]), torch.cat([bumped(prompt), b]), c, longest], shared)
    model.reshard()
    return all(others_unchanged) and not torch.allclose(grouped[1, 5:7], sees_prompt[1, 5:7], rtol=1e-4, atol=1e-6)
