"""LearnerRank with FSDP2 on CPU (gloo, torch.multiprocessing, no Ray): 2 ranks == 1 rank == plain torch.

One tiny random Qwen2 (hidden 64, 2 layers, vocab 100, tied embeddings) is built in a tmp dir. Each run
does: proximal logprobs -> update (decoupled, proximal from compute) -> update (proximal
omitted) -> publish_weights -> save_pretrained, and rank 0 writes what it saw to a file. The learning
rate is small because Adam turns fp32 summation-order noise on near-zero gradients into steps of ~lr.
"""

import copy
import dataclasses
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from nanoverl_async.algorithms import LossInputs, policy_loss
from nanoverl_async.config import AlgorithmConfig, KLConfig, LearnerConfig, ModelConfig
from nanoverl_async.learners.batch import collate, sequence_logprobs, with_advantages
from nanoverl_async.learners.checkpoint import full_state_dict
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.learners.packing import pack, prompt_lengths
from nanoverl_async.learners.setup import LearnerSetup
from nanoverl_async.models.tiny import build_tokenizer
from synthetic import episodes
from nanoverl_async.wire.weights import WeightSubscriber
from weight_waits import wait_newest

torch.set_num_threads(1)
TEMPERATURE = 0.8
LEARNER = LearnerConfig(lr=1e-3, weight_decay=0.01, betas=[0.9, 0.99], grad_clip=0.5, torch_threads=1)
ALGO = AlgorithmConfig(is_cap=1.5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("tiny_qwen2"))


def write_model_dir(path) -> str:
    """A tiny random Qwen2 with the builtin byte-level tokenizer (save_pretrained copies it), saved in `path`."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def make_batch():
    """4 episodes in 2 groups, each sharing its prompt: prompt, sampled tokens, a tool result (mask 0), more
    sampled tokens. In one micro-batch the second group's prompt is packed once (packing.pack)."""
    batch = collate(episodes([(3, [4, 2], 1.0), (3, [5], 0.0), (4, [2], 0.0), (4, [1], 1.0)], seed=0,
                             shared_prompts=True))
    return with_advantages(batch, 2, ALGO, KLConfig(), max_total_tokens=16)


def setup(model_dir, algo=ALGO, learner=LEARNER, world_size=1, **fields):
    """The LearnerSetup of these tests: the tiny model in `model_dir`, `learner` on `world_size` ranks,
    TEMPERATURE, and any other LearnerSetup `fields`."""
    return LearnerSetup(ModelConfig(path=model_dir), dataclasses.replace(learner, world_size=world_size), algo,
                        temperature=TEMPERATURE, **fields)


def train_and_report(rank, world_size, port, model_dir, out_dir, micro_batch_tokens):
    cfg = dataclasses.replace(LEARNER, micro_batch_tokens=micro_batch_tokens)
    learner = LearnerRank(setup(model_dir, learner=cfg, world_size=world_size), rank, "127.0.0.1", port)
    batch = make_batch()
    parts = [None] * world_size
    dist.all_gather_object(parts, learner.compute(batch, "proximal_logprobs"))  # what LearnerPool.prepare does
    batch.proximal_logprobs = torch.from_numpy(np.concatenate(parts))
    first = learner.update(batch, 0)
    batch.proximal_logprobs = None
    second = learner.update(batch, 1)
    subscriber = WeightSubscriber(learner.weights_endpoint()) if rank == 0 else None
    learner.publish_weights(version=2)
    learner.save_pretrained(f"{out_dir}/final")
    if rank == 0:
        version, published = wait_newest(subscriber, current_version=0, timeout_s=30)
        subscriber.close()
        torch.save({"logprobs": torch.from_numpy(np.concatenate(parts)), "first": first, "second": second,
                    "version": version, "published": published, "shares_prompts": learner.shares_prompts},
                   f"{out_dir}/result.pt")
    learner.shutdown()


def worker(rank, ports, model_dir, out_dir):
    """2 ranks accumulating over micro-batches of one sequence (a 1-token budget), then (saving a process
    start, ~7 s of imports) rank 0 alone as a 1-rank group, whole batch at once."""
    train_and_report(rank, 2, ports[0], model_dir, f"{out_dir}/two", micro_batch_tokens=1)
    if rank == 0:
        train_and_report(0, 1, ports[1], model_dir, f"{out_dir}/one", micro_batch_tokens=0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_reference(model_dir, batch):
    """The same two steps with a plain (unsharded) model, AdamW and clip_grad_norm_."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNER.lr, betas=tuple(LEARNER.betas),
                                  weight_decay=LEARNER.weight_decay)
    losses, initial_logprobs = [], None
    for _ in range(2):
        optimizer.zero_grad()
        loss, logprobs = plain_gradients(model, batch)
        initial_logprobs = logprobs if initial_logprobs is None else initial_logprobs
        optimizer.step()
        losses.append(loss)
    return initial_logprobs, losses, model.state_dict()


def plain_gradients(model, batch) -> tuple[float, torch.Tensor]:
    """One plain step up to the optimizer: a forward over the whole batch, the loss backward, gradients
    clipped. Returns the loss and the logprobs before the step (token-indexed, [N, L])."""
    logprobs = sequence_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                                 batch.input_ids, TEMPERATURE)
    proximal = logprobs.detach()  # one optimizer step per batch: p_old is the pre-step policy
    inputs = LossInputs(logprobs, proximal, batch.behaviour_logprobs, batch.advantages, batch.loss_mask)
    loss, _ = policy_loss(inputs, ALGO, KLConfig(), batch.loss_mask.sum())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), LEARNER.grad_clip)
    return loss.item(), proximal


def test_two_ranks_match_one_rank_and_plain_torch(model_dir, tmp_path):
    mp.spawn(worker, args=((free_port(), free_port()), model_dir, str(tmp_path)), nprocs=2, join=True)
    one, two = torch.load(tmp_path / "one" / "result.pt"), torch.load(tmp_path / "two" / "result.pt")
    batch = make_batch()
    initial_logprobs, losses, weights = plain_reference(model_dir, batch)
    mask = batch.loss_mask.bool()
    # one rank trains the whole batch in one micro-batch, the second group's prompt packed once
    assert one["shares_prompts"] and pack(batch.input_ids, batch.attention_mask,
                                          prompts=prompt_lengths(batch.loss_mask)).attention_mask is not None

    # proximal logprobs: learner (1 and 2 ranks) == a plain forward of the initial weights, 0 off the mask
    plain_initial = torch.where(mask, initial_logprobs, 0.0)
    for run in (one, two):
        assert torch.allclose(run["logprobs"], plain_initial, atol=1e-5)
        assert run["logprobs"][~mask].abs().sum() == 0

    # the loss and the updated weights agree, step by step
    for key in ("loss", "grad_norm", "clip_fraction", "is_weight_mean", "is_weight_max", "entropy",
                "behaviour_kl", "mismatch_kl", "same_version_fraction"):
        assert two["first"][key] == pytest.approx(one["first"][key], abs=1e-5), key
        assert two["second"][key] == pytest.approx(one["second"][key], abs=1e-5), key
    assert [one["first"]["loss"], one["second"]["loss"]] == pytest.approx(losses, abs=1e-5)
    assert one["first"]["tokens"] == two["first"]["tokens"] == int(batch.loss_mask.sum())
    assert two["first"]["is_truncated_fraction"] > 0 and two["first"]["behaviour_kl"] > 0  # the IS path ran
    # every token has version 0: at step 0 all are same-version (mismatch only), at step 1 none are
    assert two["first"]["same_version_fraction"] == 1.0
    assert two["first"]["mismatch_kl"] == pytest.approx(two["first"]["behaviour_kl"])
    assert two["second"]["same_version_fraction"] == 0.0 and two["second"]["mismatch_kl"] == 0.0
    assert one["second"]["version"] == two["second"]["version"] == 2
    assert two["version"] == 2
    for name, tensor in weights.items():
        assert torch.allclose(one["published"][name], tensor, atol=1e-5), name
        assert torch.allclose(two["published"][name], tensor, atol=1e-5), name

    # save_pretrained wrote a directory that transformers loads, with the trained weights and tokenizer
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "final", dtype=torch.float32)
    for name, tensor in saved.state_dict().items():
        assert torch.allclose(tensor, weights[name], atol=1e-5), name
    assert AutoTokenizer.from_pretrained(tmp_path / "two" / "final").get_vocab() == build_tokenizer().get_vocab()


@pytest.mark.parametrize("micro_batch_tokens", [0, 1])  # one micro-batch, a group's prompt shared; one per sequence
def test_one_optimizer_step_takes_p_old_from_its_own_forward_bit_for_bit(model_dir, micro_batch_tokens):
    """ppo_epochs = minibatches = 1 (the default job): `prepare` runs no proximal forward and the update takes
    p_old from its own forward, detached. Against the separate forward (`compute`) on the same weights: the
    same loss, metrics, gradients and updated weights, bit for bit."""
    cfg = dataclasses.replace(LEARNER, micro_batch_tokens=micro_batch_tokens)
    learner = LearnerRank(setup(model_dir, learner=cfg), 0, "127.0.0.1", free_port())
    assert learner.setup.forwards == []
    initial = {name: tensor.clone() for name, tensor in learner.model.state_dict().items()}
    fresh_optimizer = copy.deepcopy(learner.optimizer.state_dict())
    runs = []
    try:
        for separate_forward in (True, False):
            learner.model.load_state_dict(initial)
            learner.optimizer.load_state_dict(fresh_optimizer)
            batch = make_batch()
            if separate_forward:  # what LearnerPool.prepare computes when it is in setup.forwards
                batch.proximal_logprobs = torch.from_numpy(learner.compute(batch, "proximal_logprobs"))
            metrics = {key: value for key, value in learner.update(batch, 0).items() if not key.startswith("memory/")}
            runs.append((metrics, {name: param.grad.clone() for name, param in learner.model.named_parameters()},
                         {name: tensor.clone() for name, tensor in learner.model.state_dict().items()}))
    finally:
        learner.shutdown()
    (separate, separate_grads, separate_weights), (own, own_grads, own_weights) = runs
    assert separate == own and own["is_truncated_fraction"] > 0  # every metric, the IS truncation included
    assert separate_grads.keys() == own_grads.keys() and separate_weights.keys() == own_weights.keys()
    assert all(torch.equal(separate_grads[name], own_grads[name]) for name in own_grads)
    assert all(torch.equal(separate_weights[name], own_weights[name]) for name in own_weights)
    assert not torch.equal(own_weights["model.norm.weight"], initial["model.norm.weight"])  # the step ran


@pytest.mark.parametrize("ppo_epochs, minibatches", [(2, 1), (1, 2)])
def test_several_optimizer_steps_a_batch_need_the_separate_proximal_forward(model_dir, ppo_epochs, minibatches):
    cfg = dataclasses.replace(LEARNER, ppo_epochs=ppo_epochs, minibatches=minibatches)
    assert setup(model_dir, learner=cfg).forwards == ["proximal_logprobs"]
    both = setup(model_dir, AlgorithmConfig(advantage="gae"), cfg, kl=KLConfig(reward_coef=0.1))
    assert both.forwards == ["proximal_logprobs", "reference_logprobs", "values"]
    learner = LearnerRank(setup(model_dir, learner=cfg), 0, "127.0.0.1", free_port())
    try:
        with pytest.raises(AssertionError, match="several optimizer steps per batch need the proximal logprobs"):
            learner.update(make_batch(), 0)
    finally:
        learner.shutdown()


def published_versions_equal_held(learner: LearnerRank, versions: int = 4) -> list:
    """Update, then publish, `versions` times, in buckets of 64 KiB (several): each version received is exactly
    the weights the learner held then (a float32 run: no cast). Returns the bucket set rank 0 wrote each time."""
    subscriber = WeightSubscriber(learner.weights_endpoint())
    writable, written = learner.publisher.writable_buckets, []

    def recorded_writable(*args):
        written.append(writable(*args))
        return written[-1]

    learner.publisher.writable_buckets, learner.bucket_bytes = recorded_writable, 64 * 1024
    try:
        for version in range(1, versions + 1):
            learner.update(make_batch(), version - 1)
            held = full_state_dict(learner.model)
            learner.publish_weights(version)
            received, published = wait_newest(subscriber, current_version=version - 1, timeout_s=30)
            assert received == version and published.keys() == held.keys()
            for name, tensor in held.items():
                assert torch.equal(published[name], tensor.cpu()), (version, name)
    finally:
        subscriber.close()
    return written


def test_each_published_version_is_the_weights_held_written_into_one_set_of_buckets(model_dir):
    learner = LearnerRank(setup(model_dir), 0, "127.0.0.1", free_port())
    try:
        written = published_versions_equal_held(learner)
    finally:
        learner.shutdown()
    assert len(written[0].payloads) > 1 and all(buckets is written[0] for buckets in written)  # one set, reused


def test_one_bfloat16_rank_accumulates_fsdp2_micro_batches_like_a_float32_pass(model_dir):
    bfloat16_rank_matches_a_float32_pass(model_dir, "cpu")


def bfloat16_rank_matches_a_float32_pass(model_dir, device: str) -> None:
    """model.dtype=bfloat16 on one rank is the FSDP2 path a lone GPU learner runs (mixed precision; gradients
    kept unsharded across micro-batches until the last, `LearnerRank._train`): over one micro-batch per sequence,
    its first step's gradient (AdamW's first moment / (1 - beta1)) and loss equal a float32 pass over the
    whole batch on the CPU up to bfloat16 rounding (0.7% on the CPU; a dropped micro-batch: 79%). The
    published weights are the held ones in bfloat16."""
    cfg = dataclasses.replace(LEARNER, micro_batch_tokens=1, device=device, micro_batch_threads=2)
    bf16 = dataclasses.replace(setup(model_dir, learner=cfg), model=ModelConfig(path=model_dir, dtype="bfloat16"))
    learner = LearnerRank(bf16, 0, "127.0.0.1", free_port())
    subscriber = WeightSubscriber(learner.weights_endpoint())
    try:
        assert isinstance(learner.model, FSDPModule) and learner.passes is None  # one pass at a time, whatever the 2
        batch = make_batch()
        metrics = learner.update(batch, 0)
        state = learner.optimizer.state
        first_moments = {name: state[param]["exp_avg"].full_tensor().cpu() / (1 - LEARNER.betas[0])
                         for name, param in learner.model.named_parameters()}
        learner.publish_weights(version=1)
        held = full_state_dict(learner.model)
        _, published = wait_newest(subscriber, current_version=0, timeout_s=30)
    finally:
        subscriber.close()
        learner.shutdown()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loss, _ = plain_gradients(model, batch)
    gradients = {name: param.grad for name, param in model.named_parameters()}
    assert metrics["loss"] == pytest.approx(loss, rel=2e-2)
    learned = torch.cat([first_moments[name].flatten() for name in gradients])
    expected = torch.cat([gradient.flatten() for gradient in gradients.values()])
    assert (learned - expected).norm() / expected.norm() < 0.05
    for name, tensor in held.items():
        assert published[name].dtype == torch.bfloat16
        assert torch.equal(published[name], tensor.cpu().to(torch.bfloat16)), name


def test_the_lm_head_runs_only_where_a_sampled_token_is_predicted(model_dir):
    """The head and its [tokens, vocab] logits cost what the sampled tokens need, never every position (a head
    at every position was 1.75-2.23x slower with a 151,936-token vocabulary, and no result changed)."""
    learner = LearnerRank(setup(model_dir), 0, "127.0.0.1", free_port())
    rows = []
    hook = learner.model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows.append(out.shape[:-1].numel()))
    batch = make_batch()
    try:
        learner.update(batch, 0)
    finally:
        hook.remove()
        learner.shutdown()
    sampled = int(batch.loss_mask.sum())  # 14 of the batch's 30 tokens
    assert sampled < int(batch.attention_mask.sum()) - len(batch.attention_mask)  # every position would be more
    # at most one row a sampled token (fewer: the samples of a group predict their first token from one shared
    # prompt position, packed once)
    assert LEARNER.ppo_epochs <= sum(rows) <= LEARNER.ppo_epochs * sampled
