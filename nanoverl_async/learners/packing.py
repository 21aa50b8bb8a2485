"""Sequence packing: a micro-batch's right-padded sequences laid out for the model as packed rows.

    packing = pack(mb.input_ids, mb.attention_mask, prompts=prompt_lengths(mb.loss_mask),
                   attention_cost=attention_cost_per_position(model), wanted=mb.loss_mask)
    logprobs, entropy = packing.logprobs_and_entropy(model, temperature, entropy_grad=False, chunk_tokens=0)

Several sequences share a row, kept apart by restarting position ids (verl's remove-padding, TRL's
padding-free training), and the samples of a group share their prompt under an explicit mask (`Packing`).
Outputs come back token-indexed [n, l], as `batch.sequence_logprobs` gives them on the padded layout, so
nothing after the forward knows the layout. `keeps_packed_sequences_apart` checks that a model honours it
(the learner pads one sequence per row otherwise). With `chunk_tokens` the LM head and its log-softmax run
over at most that many tokens at a time, each chunk recomputed in backward (`chunked_head`), so that the
[tokens, vocabulary] float32 logits, a step's largest tensor, never exist at once.

Run alone: `python -m pytest tests/test_packing.py -q`.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from nanoverl_async.algorithms import token_logprobs, token_logprobs_and_entropy
from nanoverl_async.learners.batch import PAD_TOKEN_ID
from nanoverl_async.models.load import on_device


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
    position predicts every member's first sampled token. Only the tokens read (`pack`'s `wanted`: the
    learner's are the sampled ones) have a predictor, and a causal LM's head runs at those positions alone. A
    sequence is laid out up to its last read token, exclusive: no later position predicts a read token, and
    no earlier one attends to them."""

    input_ids: Tensor  # int64 [r, c]
    position_ids: Optional[Tensor]  # int64 [r, c]; None when each row is one sequence from position 0
    attention_mask: Optional[Tensor]  # bool [r, 1, c, c], True where a token may attend; only if prompts are shared
    outputs: Tensor  # int64 [h]: the flat positions in [r * c] whose outputs are read, ascending
    predictor: Tensor  # int64 [k]: for each token read, the one of `outputs` that predicts it
    target: Tensor  # int64 [k]: that token's id
    destination: Tensor  # int64 [k]: its flat position in [n * l]
    shape: tuple[int, int]  # [n, l], the micro-batch's

    def forward(self, model: torch.nn.Module, head: Optional[Callable[[Tensor, torch.nn.Module], Tensor]] = None
                ) -> Tensor:
        """The model's outputs (logits, or a critic's scores) at `outputs` [h, ...]. A causal LM's head gets only
        those positions' hidden states (a hook on it: the logits and their log-softmax are a step's largest
        tensors, and prompt, tool and padding positions would be discarded); `head`, if given, replaces the
        head's own computation: head(hidden states predicting each read token [k, H], the head module) is
        returned in place of the logits, computed inside the model's forward, where FSDP2 holds the head's
        weights unsharded and its output enters FSDP2's backward. Position ids only where rows hold several
        sequences: from them transformers derives the blocks of its mask, and checks on the host whether
        there are any (a wait for the GPU); the explicit mask only where prompts are shared (transformers
        takes a 4-D mask as it is); rows of one sequence need the plain causal mask."""
        lm_head = model.get_output_embeddings()  # None for a critic: its scores are read after the forward
        kept = []  # the hidden states `head` gets
        # Threads may forward one model at once (learner.micro_batch_threads): each hook serves its own thread's.
        thread = threading.get_ident()

        def read(_, args) -> Optional[tuple[Tensor]]:
            if threading.get_ident() != thread:
                return None
            hidden = args[0].flatten(0, 1)
            if head is None:
                return (hidden[self.outputs],)
            kept.append(hidden[self.outputs[self.predictor]])
            return (hidden[:0],)  # the head's own matmul runs on no position

        def replace(module, _, out) -> Tensor:
            return head(kept.pop(), module) if threading.get_ident() == thread else out

        hooks = [] if lm_head is None else [lm_head.register_forward_pre_hook(read)] + (
            [] if head is None else [lm_head.register_forward_hook(replace)])
        try:
            out = model(input_ids=self.input_ids, position_ids=self.position_ids,
                        attention_mask=self.attention_mask, use_cache=False).logits
        finally:
            for hook in hooks:
                hook.remove()
        return out if lm_head is not None else out.flatten(0, 1)[self.outputs]

    def logprobs(self, model: torch.nn.Module, temperature: float, chunk_tokens: int = 0) -> Tensor:
        """Token-indexed logprobs [n, l] (as `sequence_logprobs`) from one forward of the causal LM `model`, the
        head over at most `chunk_tokens` tokens at a time (0: all at once; `chunked_head`)."""
        return self._read(model, lambda logits, targets, rows=None: (
            token_logprobs(logits, targets, temperature, rows),), chunk_tokens)[0]

    def logprobs_and_entropy(self, model: torch.nn.Module, temperature: float, entropy_grad: bool,
                             chunk_tokens: int = 0) -> tuple[Tensor, Tensor]:
        """`logprobs` and, token-indexed the same way, the entropy of the distribution that sampled each token,
        from one pass over each logit (algorithms.token_logprobs_and_entropy)."""
        return self._read(model, lambda logits, targets, rows=None: token_logprobs_and_entropy(
            logits, targets, temperature, entropy_grad, rows), chunk_tokens)

    def _read(self, model: torch.nn.Module, reduce, chunk_tokens: int) -> tuple[Tensor, ...]:
        """reduce(logits, targets[, rows]) -> per-token values, token-indexed [n, l] each: from the logits at the
        read positions at once, or, with more read tokens than `chunk_tokens` > 0, from `chunked_head`."""
        if chunk_tokens and len(self.target) > chunk_tokens:
            # the model would transform what replaces its logits (Gemma 2's soft cap: tanh(logits / c) * c)
            assert not getattr(model.config, "final_logit_softcapping", None), \
                "learner.logits_chunk_tokens: this model caps its logits after the head; set it to 0"
            out = self.forward(model, lambda hidden, head: chunked_head(hidden, head, self.target, reduce,
                                                                         chunk_tokens))
            return tuple(self.scatter(values) for values in out.unbind(-1))
        return tuple(self.scatter(values) for values in reduce(self.forward(model), self.target, self.predictor))

    def predicted(self, per_position: Tensor) -> Tensor:
        """`forward`'s output [h, ...] (a critic's values) -> token-indexed [n, l, ...]: token j gets the
        output at the position that predicts it, the state in which it was sampled."""
        return self.scatter(per_position[self.predictor])

    def values(self, critic: torch.nn.Module) -> Tensor:
        """A critic's token-indexed V [n, l]: its scalar head at the position that predicts token j (that of token
        j - 1: the state in which token j is sampled, the same shift as the logprobs); 0 at j = 0."""
        return self.predicted(self.forward(critic)[..., 0].float())

    def scatter(self, values: Tensor) -> Tensor:
        """Values of tokens j >= 1 [k, ...] -> [n, l, ...], 0 on token 0 and on padding. Integer indices only: a
        boolean mask would make the host wait for the GPU."""
        out = values.new_zeros((self.shape[0] * self.shape[1], *values.shape[1:]))
        out[self.destination] = values
        return out.view(*self.shape, *values.shape[1:])

    def to(self, device: torch.device) -> "Packing":
        return Packing(*(on_device(getattr(self, f.name), device) for f in dataclasses.fields(self)[:-1]), self.shape)


def pack(input_ids: Tensor, attention_mask: Tensor, several_per_row: bool = True,
         prompts: Optional[Tensor] = None, attention_cost: float = 0.0, wanted: Optional[Tensor] = None) -> Packing:
    """Pack sequences first-fit decreasing into rows as long as the longest one, so that a row's attention
    never costs more than in the padded layout; or, given `attention_cost` (`attention_cost_per_position`),
    into rows twice as long where the estimated cost says that is cheaper: fewer rows, in which more of a
    group share their prompt, against more attention per token. `prompts` ([n], e.g. `prompt_lengths`):
    sequences whose first prompts[i] tokens are the same share them, as many in a row as fit.
    several_per_row=False keeps one sequence per row (the padded layout itself, for a model whose attention
    mixes packed sequences). `wanted` ([n, l], nonzero where read, e.g. the loss mask): the tokens whose
    outputs are read, every token j >= 1 if None; the others come back 0. Host tensors in, a Packing on the
    host out (`Packing.to` copies it to a device without blocking)."""
    # the tokens read (real, wanted, j >= 1: nothing predicts token 0), each predicted where token j - 1 lies
    read = attention_mask.bool() & (True if wanted is None else wanted.bool())
    read[:, 0] = False
    # a sequence is laid out up to its last read token, exclusive: the positions from there on predict nothing
    # read, and no earlier position attends to them (a causal model)
    lengths = torch.where(read, torch.arange(read.shape[1]), 0).amax(dim=1).clamp(min=1).tolist()
    longest = max(lengths, default=1)  # every length is >= 1 already
    groups = _prompt_groups(input_ids, lengths, prompts if several_per_row else None)
    layouts = [_rows(groups, lengths, capacity, several_per_row)
               for capacity in ([longest, 2 * longest] if several_per_row and attention_cost > 0 else [longest])]
    capacity, units, rows = min(layouts, key=lambda layout: len(layout[2]) * layout[0] * (
        1 + layout[0] * attention_cost))
    place, unit, branch, filled = _placed(units, rows, lengths, capacity, input_ids.shape[1])
    size = (len(rows), capacity)
    packed_ids = _laid_out(input_ids, place, torch.full(size, PAD_TOKEN_ID, dtype=input_ids.dtype))
    # position ids restart at each sequence (a shared prompt's continue after it) and at each row's tail,
    # which is a block of its own, discarded
    tails = torch.arange(capacity) - torch.tensor(filled, dtype=torch.long)[:, None]
    positions = _laid_out(torch.arange(input_ids.shape[1]), place, tails)
    blocks = _laid_out(unit, place, torch.full(size, -1))  # the unit of each position (-1: the tail)
    branches = _laid_out(branch, place, torch.zeros(size, dtype=torch.long))
    outputs, predictor = torch.unique(place[:, :-1][read[:, 1:]], return_inverse=True)
    target, destination = input_ids[read], read.flatten().nonzero().squeeze(1)
    several = len(rows) < len(lengths)  # else each row is one sequence from position 0: no ids needed
    mask = _shared_prompt_mask(blocks, branches) if any(shared for shared, _ in units) else None
    return Packing(input_ids=packed_ids, position_ids=positions if several else None, attention_mask=mask,
                   outputs=outputs, predictor=predictor, target=target, destination=destination,
                   shape=tuple(attention_mask.shape))


class Placement(NamedTuple):
    """Where `_rows`' layout puts each token of [n, width] sequences."""
    place: Tensor  # [n, width]: its flat position in [r * capacity], -1 past the sequence's end (a shared
    #                prompt's tokens at the one copy of the prompt)
    unit: Tensor  # [n, 1]
    branch: Tensor  # [n, width]: 0 on a shared prompt and in a unit of one sequence, else the sequence's number
    #                 in its unit from 1
    filled: list[int]  # how many positions of each row are filled


def _placed(units: list[tuple[int, list[int]]], rows: list[list[int]], lengths: list[int], capacity: int,
            width: int) -> Placement:
    """Where `_rows`' layout puts each token of the [n, width] sequences (`Placement`). Integers per sequence,
    then whole-tensor arithmetic: tensor slices per sequence cost `pack` several times the host time, in every
    step (docs/benchmarks.md "Costs behind choices in the code")."""
    prompt_at = [0] * len(lengths)
    own_at = [0] * len(lengths)
    shared_of = [0] * len(lengths)
    unit_of = [0] * len(lengths)
    branch_of = [0] * len(lengths)
    filled = []
    for r, members_of_row in enumerate(rows):
        offset = r * capacity
        for unit in members_of_row:
            shared, members = units[unit]
            prompt, offset = offset, offset + shared
            for branch, sequence in enumerate(members, start=1):
                prompt_at[sequence] = prompt
                own_at[sequence] = offset
                shared_of[sequence] = shared
                unit_of[sequence], branch_of[sequence] = unit, branch if shared else 0
                offset += lengths[sequence] - shared
        filled.append(offset - r * capacity)

    def as_column(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long)[:, None]

    prompt_at = as_column(prompt_at)
    own_at = as_column(own_at)
    shared = as_column(shared_of)
    unit = as_column(unit_of)
    branch = as_column(branch_of)
    length = as_column(lengths)
    column = torch.arange(width)
    in_prompt = column < shared
    place = torch.where(in_prompt, prompt_at + column, own_at + column - shared)
    return Placement(torch.where(column < length, place, -1), unit, torch.where(in_prompt, 0, branch), filled)


def _laid_out(values: Tensor, place: Tensor, fill: Tensor) -> Tensor:
    """`fill` [r, c] with the value in `values` ([n, l], or broadcast to it) of each token written where
    `_placed` puts it (a shared prompt's positions by each sequence that shares it: the same values)."""
    real = place >= 0
    out = fill.flatten().clone()
    out[place[real]] = values.expand_as(place)[real]
    return out.view(fill.shape)


def chunked_head(hidden: Tensor, head: torch.nn.Module, targets: Tensor, reduce, chunk_tokens: int) -> Tensor:
    """reduce(head(hidden[i]), targets[i]) -> [k, values] (e.g. logprob and entropy), over chunks of
    `chunk_tokens` rows of hidden [k, H]: at most one chunk's [chunk, V] logits exist at a time. With autograd
    on, each chunk runs under torch.utils.checkpoint, so that backward recomputes its logits instead of
    keeping them (the head's matmul once more per token); the gradients are those of the whole head at once."""
    assert isinstance(head, torch.nn.Linear), \
        f"learner.logits_chunk_tokens needs a linear LM head, not {type(head).__name__}"

    def one_chunk(rows: Tensor, chunk_targets: Tensor) -> Tensor:
        return torch.stack(reduce(F.linear(rows, head.weight, head.bias), chunk_targets), dim=-1)

    parts = []
    for start in range(0, len(targets), chunk_tokens):
        rows, chunk_targets = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        parts.append(checkpoint(one_chunk, rows, chunk_targets, use_reentrant=False) if torch.is_grad_enabled()
                     else one_chunk(rows, chunk_targets))
    return torch.cat(parts)


def attention_cost_per_position(model: torch.nn.Module) -> float:
    """A token's attention FLOPs per position of its row (4 x hidden per layer: the scores and the weighted
    values over every position, masked or not), relative to its other FLOPs (2 per weight of the layers and
    the LM head): what one more position of row length costs each token, for `pack`."""
    config = model.config
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    weights = sum(p.numel() for p in model.parameters()) - embedding.numel()
    weights += embedding.numel() if head is None or head.weight is embedding else 0  # a tied head: once more
    return 4 * config.hidden_size * config.num_hidden_layers / (2 * weights)


def _rows(groups: dict[tuple, list[int]], lengths: list[int], capacity: int,
          several_per_row: bool) -> tuple[int, list[tuple[int, list[int]]], list[list[int]]]:
    """(capacity, units, unit numbers per row): `_units` placed first-fit decreasing in rows of `capacity`."""
    units = _units(groups, lengths, capacity)
    sizes = [shared + sum(lengths[s] - shared for s in members) for shared, members in units]
    rows, room = [], []  # the units in each row, and its free positions
    for unit in sorted(range(len(units)), key=lambda u: -sizes[u]):
        row = next((r for r, free in enumerate(room) if several_per_row and free >= sizes[unit]), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(unit)
        room[row] -= sizes[unit]
    return capacity, units, rows


def _prompt_groups(input_ids: Tensor, lengths: list[int], prompts: Optional[Tensor]) -> dict[tuple, list[int]]:
    """(shared, *prompt tokens) -> the sequences that begin with that prompt; (0, s) -> sequence s alone
    (no prompt to share). Whatever the row length, so `pack` groups once for every layout it weighs."""
    groups: dict[tuple, list[int]] = {}
    ids, prompts = input_ids.tolist(), [0] * len(lengths) if prompts is None else prompts.tolist()  # host lists
    for sequence, length in enumerate(lengths):
        shared = min(prompts[sequence], length)  # all of it: a sequence read only where its prompt ends
        key = (shared, *ids[sequence][:shared]) if shared > 0 else (0, sequence)
        groups.setdefault(key, []).append(sequence)
    return groups


def _units(groups: dict[tuple, list[int]], lengths: list[int], capacity: int) -> list[tuple[int, list[int]]]:
    """What `pack` places: (shared, sequences), the first `shared` tokens common to those sequences and laid
    out once, then each one's rest; (0, [s]) is sequence s alone. The sequences of a `_prompt_groups` group
    are bundled first-fit decreasing, as many as fit in `capacity` tokens."""
    units = []
    for key, members in groups.items():
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
    collective (forwards on every rank); one rank then holds a compute copy (checkpoint.drop_compute_copy)."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def outputs(sequences: list[Tensor], prompts: Optional[Tensor] = None) -> Tensor:
        """The model's outputs (logits, or a critic's values) that predict each token, [n, l, V]."""
        ids = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)
        attention = (torch.arange(ids.shape[1]) < torch.tensor([[len(s)] for s in sequences])).long()
        packing = pack(ids, attention, prompts=prompts).to(device)
        return packing.predicted(packing.forward(model).float())

    def bumped(tokens: Tensor) -> Tensor:
        return (tokens + 1) % vocab

    # Rows Z | X Y, kept apart by position ids; rows L | A B C, with A and B sharing a 4-token prompt.
    def random_tokens(size: int) -> Tensor:
        return torch.randint(vocab, (size,), generator=generator)

    x = random_tokens(4)  # drawn in this order from one seeded generator
    y = random_tokens(3)
    z = random_tokens(7)
    prompt = random_tokens(4)
    a = random_tokens(3)
    b = random_tokens(3)
    c = random_tokens(2)
    longest = random_tokens(12)
    shared = torch.tensor([4, 4, 0, 0])
    plain = outputs([x, y, z])
    grouped = outputs([torch.cat([prompt, a]), torch.cat([prompt, b]), c, longest], shared)
    others_unchanged = [torch.allclose(plain[1:], outputs([bumped(x), y, z])[1:], rtol=1e-4, atol=1e-6),
                        torch.allclose(grouped[1:], outputs([torch.cat([prompt, bumped(a)]), torch.cat([prompt, b]),
                                                              c, longest], shared)[1:], rtol=1e-4, atol=1e-6)]
    # B's tokens 5 and 6 are predicted at B's own positions, whose outputs must depend on the prompt
    sees_prompt = outputs([torch.cat([bumped(prompt), a]), torch.cat([bumped(prompt), b]), c, longest], shared)
    return all(others_unchanged) and not torch.allclose(grouped[1, 5:7], sees_prompt[1, 5:7], rtol=1e-4, atol=1e-6)
