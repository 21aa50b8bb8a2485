"""The learner's update schedule on FSDP2 (CPU, gloo, no Ray): several optimizer steps per batch, unequal
micro-batches under a token budget, a frozen reference with a KL loss, per-token advantages.

2 ranks with learner.micro_batch_tokens=20 (rank 0's rows of 11 + 11 tokens need two micro-batches,
rank 1's of 8 + 10 fit in one, which it splits in two to match rank 0's passes) and 1 rank with no budget must both equal a plain-torch loop doing
ppo_epochs=2 x minibatches=2 optimizer steps on whole minibatches, with the proximal and reference
logprobs computed once before the first step, and the version must advance by ONE per batch.

Run alone: `python -m pytest tests/test_fsdp_schedule.py -q` (~30 s).
"""

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from test_fsdp import LEARNER, TEMPERATURE, free_port, model_dir, setup  # noqa: F401 (model_dir is a fixture)
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from nanoverl_async.algorithms import LossInputs, loss_normaliser, policy_loss, token_entropy
from nanoverl_async.config import AlgorithmConfig, CriticConfig, KLConfig, ModelConfig
from nanoverl_async.learners.batch import (TrainBatch, collate, epoch_order, explained_variance, sequence_logprobs,
                                           with_advantages)
from nanoverl_async.learners.checkpoint import full_state_dict
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.models.load import DTYPES
from synthetic import episodes

torch.set_num_threads(1)
SCHEDULE = dataclasses.replace(LEARNER, ppo_epochs=2, minibatches=2, lr=5e-3)
ALGO = AlgorithmConfig(advantage="reinforce++", correction="tis", is_cap=1.5, loss_agg="seq-mean-token-mean",
                       entropy_coef=0.01)
KL = KLConfig(loss_coef=0.1, estimator="k2")


def make_batch(algo=ALGO):
    """8 episodes in 4 groups of 2 (lengths 11, 11, 8, 10, twice), with `algo`'s advantages (None: none yet)."""
    shapes = [(3, [4, 2], 1.0), (4, [2, 3], 0.0), (3, [5], 0.0), (4, [6], 1.0)] * 2  # lengths 11, 11, 8, 10
    trajectories = episodes(shapes, seed=1)
    batch = collate(trajectories)
    return batch if algo is None else with_advantages(batch, 2, algo, KL, max_total_tokens=16)


def gathered(learner, batch, which, world_size):
    parts = [None] * world_size
    dist.all_gather_object(parts, learner.compute(batch, which))  # what LearnerPool.prepare does
    return torch.from_numpy(np.concatenate(parts))


def train(rank, world_size, port, model_dir, out_dir, micro_batch_tokens):
    cfg = dataclasses.replace(SCHEDULE, micro_batch_tokens=micro_batch_tokens)
    learner = LearnerRank(setup(model_dir, ALGO, cfg, world_size, kl=KL), rank, "127.0.0.1", port)
    batch = make_batch()
    batch.proximal_logprobs = gathered(learner, batch, "proximal_logprobs", world_size)
    batch.reference_logprobs = gathered(learner, batch, "reference_logprobs", world_size)
    metrics = learner.update(batch, 0)
    state = full_state_dict(learner.model)
    if rank == 0:
        torch.save({"metrics": metrics, "weights": state}, f"{out_dir}/{world_size}.pt")
    learner.shutdown()


def two_then_one(rank, fns, ports, model_dir, out_dirs):
    for fn, (two, one), out_dir in zip(fns, ports, out_dirs):
        fn(rank, 2, two, model_dir, out_dir, micro_batch_tokens=20)
        if rank == 0:
            fn(0, 1, one, model_dir, out_dir, micro_batch_tokens=0)


@pytest.fixture(scope="module")
def saves(model_dir, tmp_path_factory):
    """Each fn(rank, world_size, port, model_dir, out_dir, micro_batch_tokens) below on 2 ranks with a budget
    of 20 tokens, then on 1 rank with none, rank 0 saving `<world_size>.pt`: {fn name: (the 1-rank save, the
    2-rank save, out_dir)}. Both fns in one spawn: each spawned process spends seconds importing torch."""
    fns = (train, train_critic)
    out_dirs = [tmp_path_factory.mktemp(fn.__name__) for fn in fns]
    ports = [(free_port(), free_port()) for _ in fns]
    mp.spawn(two_then_one, args=(fns, ports, model_dir, [str(d) for d in out_dirs]), nprocs=2, join=True)
    return {fn.__name__: (torch.load(d / "1.pt"), torch.load(d / "2.pt"), d) for fn, d in zip(fns, out_dirs)}


def plain_reference(model_dir, batch):
    """ppo_epochs x minibatches steps of plain torch on whole minibatches; p_old and ref from the start."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=SCHEDULE.lr, betas=tuple(SCHEDULE.betas),
                                  weight_decay=SCHEDULE.weight_decay)
    with torch.no_grad():
        initial = sequence_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                                    batch.input_ids, TEMPERATURE)
    initial = torch.where(batch.loss_mask.bool(), initial, 0.0)
    losses = []
    for epoch in range(SCHEDULE.ppo_epochs):
        order = epoch_order(batch.size, seed=0, version=0, epoch=epoch)  # the learner's shuffle, rows by hand
        for k in range(SCHEDULE.minibatches):
            rows = order[k * batch.size // SCHEDULE.minibatches:(k + 1) * batch.size // SCHEDULE.minibatches]
            mb = TrainBatch(**{f: None if getattr(batch, f) is None else getattr(batch, f)[rows]
                               for f in ("input_ids", "attention_mask", "loss_mask", "behaviour_logprobs",
                                         "versions", "rewards", "advantages")})
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            logprobs = sequence_logprobs(logits, mb.input_ids, TEMPERATURE)
            entropy = torch.cat([torch.zeros(mb.size, 1), token_entropy(logits[:, :-1], TEMPERATURE)], dim=1)
            inputs = LossInputs(logprobs, initial[rows], mb.behaviour_logprobs, mb.advantages, mb.loss_mask,
                                ref_logprobs=initial[rows], entropy=entropy)
            loss, _ = policy_loss(inputs, ALGO, KL, mb.loss_mask.sum(), loss_normaliser(mb.loss_mask, ALGO.loss_agg))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), SCHEDULE.grad_clip)
            optimizer.step()
            losses.append(loss.item())
    return losses, model.state_dict()


def test_epochs_minibatches_and_unequal_micro_batches_match_plain_torch(model_dir, saves):
    one, two, _ = saves["train"]
    batch = make_batch()
    assert batch.advantages.shape == batch.loss_mask.shape  # per-token advantages went through trimming
    losses, weights = plain_reference(model_dir, batch)
    for run in (one, two):
        assert run["metrics"]["version"] == 1 and run["metrics"]["optimizer_steps"] == 4  # one version per batch
        assert run["metrics"]["loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)
        assert run["metrics"]["kl"] > 0  # the policy moved away from the reference within the batch
        for name, tensor in weights.items():
            # A key bias has no gradient in exact arithmetic (adding q.b to every key of a query leaves its
            # softmax unchanged): Adam scales its rounding noise, which differs with any summation order, to
            # steps of up to lr. Only the weights that the loss really moves are compared.
            if not name.endswith("k_proj.bias"):
                assert torch.allclose(run["weights"][name], tensor, atol=1e-5), name
    assert abs(weights["model.norm.weight"] - 1).max() > 1e-3  # the steps did move the weights


def test_each_epoch_draws_its_own_minibatches():
    orders = [epoch_order(64, seed=0, version=3, epoch=e) for e in range(3)]
    assert all(sorted(order.tolist()) == list(range(64)) for order in orders)  # permutations of the rows
    assert len({tuple(order.tolist()) for order in orders}) == 3  # a different order each epoch
    assert torch.equal(orders[0], epoch_order(64, seed=0, version=3, epoch=0))  # the same on every rank
    assert not torch.equal(orders[0], epoch_order(64, seed=0, version=4, epoch=0))  # and each batch


GAE = AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0)
CRITIC = CriticConfig(lr=1e-2, value_clip=0.2)


def train_critic(rank, world_size, port, model_dir, out_dir, micro_batch_tokens):
    """Two batches (values recomputed in between, as LearnerPool.prepare does): policy + critic steps."""
    cfg = dataclasses.replace(LEARNER, micro_batch_tokens=micro_batch_tokens)
    learner = LearnerRank(setup(model_dir, GAE, cfg, world_size, critic=CRITIC), rank, "127.0.0.1", port)
    runs = []
    for version in range(2):
        batch = make_batch(algo=None)
        parts = [None] * world_size
        dist.all_gather_object(parts, learner.compute(batch, "values"))
        batch.values = torch.from_numpy(np.concatenate(parts))
        batch = with_advantages(batch, 2, GAE, KLConfig(), max_total_tokens=16)
        runs.append({**learner.update(batch, version), "explained_variance": explained_variance(batch)})
    critic = get_model_state_dict(learner.critic, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    policy = full_state_dict(learner.model)  # collectives: every rank calls them
    learner.save_pretrained(f"{out_dir}/final{world_size}")
    if rank == 0:
        torch.save({"runs": runs, "critic": critic, "policy": policy}, f"{out_dir}/{world_size}.pt")
    learner.shutdown()


def test_critic_learns_the_returns_and_two_ranks_match_one(saves):
    one, two, out_dir = saves["train_critic"]
    for key in ("value_loss", "vf_clip_fraction", "loss", "grad_norm", "value_grad_norm"):
        for step in range(2):
            assert two["runs"][step][key] == pytest.approx(one["runs"][step][key], abs=1e-5), key
    for name, tensor in one["critic"].items():  # lr 1e-2: Adam turns fp32 summation-order noise into ~1e-5 steps
        assert torch.allclose(two["critic"][name], tensor, atol=1e-4), name
    for name, tensor in one["policy"].items():
        assert torch.allclose(two["policy"][name], tensor, atol=1e-5), name
    # gamma = lam = 1: the returns are the outcome rewards whatever V is, so the critic's loss must fall
    first, second = one["runs"]
    assert second["value_loss"] < first["value_loss"]
    assert second["explained_variance"] > first["explained_variance"]
    assert first["version"] == 1 and second["version"] == 2
    # final/ holds the policy and, in final/critic, the critic, each loadable by transformers as trained
    saved = AutoModelForTokenClassification.from_pretrained(out_dir / "final2" / "critic", dtype=torch.float32)
    for name, tensor in saved.state_dict().items():
        assert torch.allclose(tensor, two["critic"][name]), name
    saved = AutoModelForCausalLM.from_pretrained(out_dir / "final2", dtype=torch.float32)
    assert all(torch.allclose(tensor, two["policy"][name]) for name, tensor in saved.state_dict().items())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_final_is_saved_in_the_runs_dtype_policy_and_critic(model_dir, tmp_path, dtype):
    """save_pretrained writes final/ and final/critic in model.dtype, not the fp32 master weights' (a bfloat16
    final/ in float32 was twice the size): every tensor of their safetensors in that dtype, equal to the
    trained master weights cast to it."""
    run = dataclasses.replace(setup(model_dir, GAE, LEARNER, critic=CRITIC), model=ModelConfig(model_dir, dtype))
    learner = LearnerRank(run, 0, "127.0.0.1", free_port())
    try:
        batch = make_batch(algo=None)
        batch.values = torch.from_numpy(learner.compute(batch, "values"))
        learner.update(with_advantages(batch, 2, GAE, KLConfig(), max_total_tokens=16), 0)
        masters = {"": full_state_dict(learner.model), "critic": full_state_dict(learner.critic)}
        learner.save_pretrained(str(tmp_path))
    finally:
        learner.shutdown()
    for folder, master in masters.items():
        assert all(tensor.dtype == torch.float32 for tensor in master.values())
        saved = load_file(tmp_path / folder / "model.safetensors")
        assert set(saved) == set(master) - {"lm_head.weight"}  # tied to the embedding: saved once
        for name, tensor in saved.items():
            assert tensor.dtype == DTYPES[dtype], (folder, name)
            assert torch.equal(tensor, master[name].to(DTYPES[dtype])), (folder, name)
    assert not torch.equal(masters[""]["model.norm.weight"], torch.ones(64))  # the step moved the weights
