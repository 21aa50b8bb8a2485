"""Sequence packing in the learner (batch.pack): several sequences per row, kept apart by restarting
position ids, give the same logprobs and gradients as the padded layout, and a model whose attention
would mix them is detected (the learner then pads one sequence per row).

Run alone: `python -m pytest tests/test_packing.py -q` (~5 s).
"""

import torch
from test_fsdp import model_dir  # noqa: F401 (a fixture)
from transformers import AutoModelForCausalLM

from nanoverl_async.learners.batch import collate, keeps_packed_sequences_apart, pack, sequence_logprobs
from synthetic import episodes

# lengths 11, 8, 10, 5, 23, 7: the 23-token row sets the padded width, the others share rows
SHAPES = [(3, [4, 2], 1.0), (3, [5], 0.0), (4, [6], 1.0), (2, [3], 0.0), (5, [6, 5, 3], 1.0), (3, [4], 0.0)]


def padded_and_packed(model, batch):
    padded = sequence_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                               batch.input_ids, 0.8)
    packing = pack(batch.input_ids, batch.attention_mask)
    return padded, packing.unpack(sequence_logprobs(packing.forward(model), packing.input_ids, 0.8)), packing


def test_packing_fills_rows_and_matches_the_padded_layout(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = collate(episodes(SHAPES, seed=0))
    padded, packed, packing = padded_and_packed(model, batch)
    assert packing.input_ids.shape == (3, 23)  # 23 | 11 + 10 | 8 + 7 + 5: 69 slots for 64 tokens, not 6 x 23
    scored = batch.attention_mask.bool().clone()
    scored[:, 0] = False  # token 0 has no logits to predict it
    assert torch.allclose(packed[scored], padded[scored], atol=1e-5)
    assert packed[~scored].abs().sum() == 0

    # the gradients of a loss on the logprobs agree too
    weights = batch.loss_mask * torch.linspace(-1, 1, batch.size)[:, None]
    grads = []
    for logprobs in padded_and_packed(model, batch)[:2]:
        model.zero_grad()
        (logprobs * weights).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5)


def test_one_sequence_per_row_is_the_padded_layout():
    batch = collate(episodes(SHAPES, seed=0))
    packing = pack(batch.input_ids, batch.attention_mask, several_per_row=False)
    assert packing.input_ids.shape == batch.input_ids.shape
    order = batch.attention_mask.sum(dim=1).argsort(descending=True, stable=True)
    assert torch.equal(packing.input_ids, batch.input_ids[order])
    assert packing.position_ids is None  # rows of one sequence from position 0: the plain causal mask


class DropsPositions(torch.nn.Module):
    """A model whose attention ignores restarting position ids (so packed sequences see each other)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, input_ids, position_ids=None, **kwargs):
        return self.inner(input_ids=input_ids, **kwargs)

    def reshard(self):  # what FSDP2 modules offer; nothing to do here
        pass


def test_a_model_that_mixes_packed_sequences_is_detected(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.reshard = lambda: None
    assert keeps_packed_sequences_apart(model, torch.device("cpu"))
    assert not keeps_packed_sequences_apart(DropsPositions(model), torch.device("cpu"))
