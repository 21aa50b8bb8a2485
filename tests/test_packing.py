"""Sequence packing in the learner (learners/packing.py): several sequences per row, kept apart by restarting
position ids, and the samples of a group sharing their prompt under an explicit mask, give the same
logprobs, entropies, values and gradients as the padded layout, also on seeded random batches; a model
whose attention would mix them is detected (the learner then pads one sequence per row).

Run alone: `python -m pytest tests/test_packing.py -q` (~5 s).
"""

import random

import pytest
import torch
from test_fsdp import model_dir  # noqa: F401 (a fixture)
from transformers import AutoConfig, AutoModelForCausalLM

from nanoverl_async.algorithms import token_entropy
from nanoverl_async.learners.batch import PAD_TOKEN_ID, collate, sequence_logprobs
from nanoverl_async.learners.packing import (attends_to_whole_context, attention_cost_per_position,
                                             keeps_packed_sequences_apart, pack, prompt_lengths)
from synthetic import episodes

# lengths 11, 8, 10, 5, 23, 7: the 23-token row sets the padded width, the others share rows
SHAPES = [(3, [4, 2], 1.0), (3, [5], 0.0), (4, [6], 1.0), (2, [3], 0.0), (5, [6, 5, 3], 1.0), (3, [4], 0.0)]
# groups of 4: two with 6-token prompts (lengths 8-14), one with a 4-token prompt whose 30-token sequence sets
# the row length
GROUPS = [(6, turns, 1.0) for turns in ([2], [3, 2], [4], [2, 4])] + [(6, turns, 0.0) for turns in (
    [3], [2], [2], [2])] + [(4, turns, 1.0) for turns in ([12, 12], [3], [2], [5])]


def grouped_batch():
    return collate(episodes(GROUPS, seed=1, group_size=4, shared_prompts=True))


def padded_and_packed(model, batch, prompts=None, attention_cost=0.0, wanted=None, chunk_tokens=0):
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    packing = pack(batch.input_ids, batch.attention_mask, prompts=prompts, attention_cost=attention_cost,
                   wanted=wanted)
    return sequence_logprobs(logits, batch.input_ids, 0.8), packing.logprobs(model, 0.8, chunk_tokens), packing


def scored(batch):
    """Where a token-indexed quantity is defined: real tokens after token 0 (no logits predict token 0)."""
    where = batch.attention_mask.bool().clone()
    where[:, 0] = False
    return where


def assert_same_logprobs_and_gradients(model, batch, prompts=None, attention_cost=0.0, wanted=None, chunk_tokens=0):
    """wanted=None: every token's logprob; else those tokens' alone (the head runs only where it predicts
    them), the others 0; chunk_tokens > 0: the head over that many at a time, each chunk recomputed in
    backward. The loss (a weighted sum over the sampled tokens read) and its gradient are the same."""
    padded, packed, packing = padded_and_packed(model, batch, prompts, attention_cost, wanted, chunk_tokens)
    read = scored(batch) if wanted is None else scored(batch) & wanted
    assert torch.allclose(packed[read], padded[read], atol=1e-5)
    assert packed[~read].abs().sum() == 0
    assert len(packing.outputs) <= int(read.sum()) and len(packing.predictor) == int(read.sum())
    read_weights = batch.loss_mask if wanted is None else batch.loss_mask * wanted
    weights = read_weights * torch.linspace(-1, 1, batch.size)[:, None]
    grads = []
    for logprobs in padded_and_packed(model, batch, prompts, attention_cost, wanted, chunk_tokens)[:2]:
        model.zero_grad()
        (logprobs * weights).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5)


def test_packing_fills_rows_and_matches_the_padded_layout(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = collate(episodes(SHAPES, seed=0))
    packing = padded_and_packed(model, batch)[2]
    # each sequence up to its last token, whose own position predicts nothing: 22 | 10 + 9 | 7 + 6 + 4, 66 slots
    # for 58 positions, not 6 x 23
    assert packing.input_ids.shape == (3, 22)
    assert packing.attention_mask is None  # restarting position ids keep the sequences apart
    assert_same_logprobs_and_gradients(model, batch)


def test_a_sequence_is_laid_out_up_to_its_last_read_token(model_dir):
    """Read token j is predicted at position j - 1: a sequence's positions from its last read token on predict
    nothing read, and no earlier one attends to them, so they are not laid out; a sequence with none read keeps
    one position. The same logprobs and gradients as the padded layout."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = collate(episodes(SHAPES, seed=0))
    wanted = batch.loss_mask.bool().clone()
    assert wanted[4, 17] and wanted[4, 22]
    wanted[4, 18:] = False  # the 23-token sequence's last read token is now token 17: positions 0..16 laid out
    wanted[1] = False  # nothing read
    packing = pack(batch.input_ids, batch.attention_mask, wanted=wanted)
    assert packing.input_ids.shape[1] == 17  # the longest laid out, not 18 (token 17's own) nor 23
    assert_same_logprobs_and_gradients(model, batch, wanted=wanted)


def test_a_shared_prompt_is_computed_once_per_row_and_changes_nothing(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = grouped_batch()
    prompts = prompt_lengths(batch.loss_mask)
    assert prompts.tolist() == [6] * 8 + [4] * 4
    alone, shared = pack(batch.input_ids, batch.attention_mask), pack(batch.input_ids, batch.attention_mask,
                                                                     prompts=prompts)
    # 130 tokens, each sequence laid out up to its last one (118 positions); each group's prompt once per row:
    # 6 + 7 + 6 + 3 + 1 | 6 + 2 + 1 + 1 + 1 and 4 + 4 + 2 + 1 | the 30-token sequence's 29 alone: 74 positions in
    # 3 rows of 29, against 5 rows without sharing
    assert int(batch.attention_mask.sum()) == 130 and alone.input_ids.shape == (5, 29)
    assert shared.input_ids.shape == (3, 29) and shared.attention_mask.shape == (3, 1, 29, 29)
    assert_same_logprobs_and_gradients(model, batch, prompts)
    assert_same_logprobs_and_gradients(model, batch, prompts, wanted=batch.loss_mask.bool())

    # the entropy and a per-position value (a critic's) are read at the same predicting positions
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    packed_logits = shared.forward(model)
    _, entropy = shared.logprobs_and_entropy(model, 0.8, entropy_grad=False)
    want = torch.cat([torch.zeros(batch.size, 1), token_entropy(logits[:, :-1], 0.8)], dim=1)
    assert torch.allclose(entropy[scored(batch)], want[scored(batch)], atol=1e-5)
    values = shared.predicted(packed_logits[..., 0])
    want = torch.cat([torch.zeros(batch.size, 1), logits[:, :-1, 0]], dim=1)
    assert torch.allclose(values[scored(batch)], want[scored(batch)], atol=1e-5)


def test_rows_grow_to_twice_the_longest_sequence_where_that_is_estimated_cheaper(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # 4 x hidden x layers of attention per row position, against 2 FLOPs per weight (the tied head's included)
    assert attention_cost_per_position(model) == pytest.approx(
        4 * 64 * 2 / (2 * sum(p.numel() for p in model.parameters())))
    batch = collate(episodes([(4, [16], 1.0)] + [(4, [8], 0.0)] * 7, seed=2))  # 20 tokens, then seven of 12
    ids, mask = batch.input_ids, batch.attention_mask  # laid out: 19 positions, then 11 (the last predicts none)
    assert pack(ids, mask).input_ids.shape == (8, 19)  # 11 + 11 > 19: one sequence per row
    assert pack(ids, mask, attention_cost=0.1).input_ids.shape == (8, 19)  # attention too dear to double rows
    cost = attention_cost_per_position(model)
    assert pack(ids, mask, attention_cost=cost).input_ids.shape == (3, 38)  # 19 + 11 | 3 x 11 | 3 x 11
    assert_same_logprobs_and_gradients(model, batch, attention_cost=cost)


def test_only_identical_prompts_are_shared():
    batch = grouped_batch()
    batch.input_ids[1, 5] = (batch.input_ids[1, 5] + 1) % 100  # sample 1's prompt now differs in its last token
    packing = pack(batch.input_ids, batch.attention_mask, prompts=prompt_lengths(batch.loss_mask))
    # sample 1's own first token is predicted inside its own block, not at the shared prompt's last position
    first_of = {int(d) // batch.input_ids.shape[1]: int(p) for d, p in
                zip(packing.destination.flip(0), packing.predictor.flip(0)) if int(d) % batch.input_ids.shape[1] == 6}
    assert first_of[0] == first_of[2] == first_of[3] and first_of[1] != first_of[0]


def test_one_sequence_per_row_is_the_padded_layout():
    batch = collate(episodes(SHAPES, seed=0))
    packing = pack(batch.input_ids, batch.attention_mask, several_per_row=False,
                   prompts=prompt_lengths(batch.loss_mask))
    lengths = batch.attention_mask.sum(dim=1)
    order = lengths.argsort(descending=True, stable=True)
    # each sequence up to its last token, exclusive (that position predicts nothing)
    laid_out = torch.where(torch.arange(batch.input_ids.shape[1]) < lengths[order, None] - 1,
                           batch.input_ids[order], PAD_TOKEN_ID)
    assert torch.equal(packing.input_ids, laid_out[:, :-1])
    assert packing.position_ids is None and packing.attention_mask is None  # the plain causal mask


class Drops(torch.nn.Module):
    """A model whose attention ignores one of the inputs that keep packed sequences apart."""

    def __init__(self, model, ignored: str):
        super().__init__()
        self.inner, self.config, self.ignored = model, model.config, ignored

    def forward(self, **kwargs):
        return self.inner(**{key: value for key, value in kwargs.items() if key != self.ignored})

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()


@pytest.mark.parametrize("ignored", ["position_ids", "attention_mask"])
def test_a_model_that_mixes_packed_sequences_is_detected(model_dir, ignored):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert keeps_packed_sequences_apart(model, torch.device("cpu"))
    assert not keeps_packed_sequences_apart(Drops(model, ignored), torch.device("cpu"))


def test_only_models_attending_to_the_whole_context_share_prompts(model_dir):
    config = AutoConfig.from_pretrained(model_dir)
    assert attends_to_whole_context(config)
    config.sliding_window = 4
    assert not attends_to_whole_context(config)
    config.sliding_window, config.layer_types = None, ["full_attention", "sliding_attention"]
    assert not attends_to_whole_context(config)


@pytest.mark.parametrize("seed", range(8))
def test_random_batches_pack_like_the_padded_layout(model_dir, seed):
    """Shapes drawn from `seed`: groups of 1-8 samples sharing prompts of 1-9 tokens, 1-3 turns of 1-12
    tokens, rows as long as the longest sequence or twice that (attention_cost), the head over all tokens at
    once or in chunks of 1-7: the same logprobs and gradients as the padded layout."""
    rng = random.Random(seed)
    group_size = rng.choice([1, 2, 3, 4, 8])
    shapes = [(prompt, [rng.randint(1, 12) for _ in range(rng.randint(1, 3))], float(rng.random() < 0.5))
              for prompt in (rng.choice([1, 2, 5, 9]) for _ in range(rng.randint(1, 6))) for _ in range(group_size)]
    batch = collate(episodes(shapes, seed=seed, group_size=group_size, shared_prompts=True))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cost, sampled_only = rng.choice([0.0, 1e-3, 1e-2]), rng.random() < 0.5  # the learner's: the sampled tokens
    assert_same_logprobs_and_gradients(model, batch, prompt_lengths(batch.loss_mask), attention_cost=cost,
                                       wanted=batch.loss_mask.bool() if sampled_only else None,
                                       chunk_tokens=rng.choice([0, 1, 3, 7]))
