"""algorithms.py and learners/batch.py against naive per-token Python references (fast, CPU)."""

import math

import numpy as np
import pytest
import torch

from nanoverl_async.algorithms import grpo_advantages, kl_estimates, policy_loss, token_entropy, token_logprobs
from nanoverl_async.learners.batch import collate, micro_batches, sequence_logprobs, shard
from nanoverl_async.trajectory import Trajectory

torch.set_num_threads(1)


# ---------------------------------------------------------------- advantages

def naive_grpo(rewards, group_size, eps=1e-6):
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1)) if len(group) > 1 else 0.0
        out += [(r - mean) / (std + eps) for r in group]
    return out


@pytest.mark.parametrize("rewards, group_size", [
    ([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.2, 0.9], 4),
    ([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], 3),  # all-equal groups -> 0
    ([0.3, 0.7, 1.0], 1),  # single-sample groups -> 0
    ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 8),
])
def test_grpo_advantages_match_naive(rewards, group_size):
    got = grpo_advantages(torch.tensor(rewards), group_size)
    assert torch.allclose(got, torch.tensor(naive_grpo(rewards, group_size)), atol=1e-5)
    assert torch.isfinite(got).all()


def test_grpo_tied_and_single_groups_are_zero():
    assert torch.equal(grpo_advantages(torch.ones(6), 3), torch.zeros(6))
    assert torch.equal(grpo_advantages(torch.tensor([0.2, 5.0]), 1), torch.zeros(2))


# ---------------------------------------------------------------- policy loss

def naive_loss(p, p_old, mu, adv, mask, correction, lo, hi, cap, normaliser):
    """Token by token, straight from the formulas of DESIGN.md "Losses"."""
    total, clipped = 0.0, 0
    n, t = len(p), len(p[0])
    for i in range(n):
        for j in range(t):
            if not mask[i][j]:
                continue
            a = adv[i]
            if correction == "decoupled":
                r = math.exp(p[i][j] - p_old[i][j])
                w = min(math.exp(p_old[i][j] - mu[i][j]), cap)
            else:
                r, w = math.exp(p[i][j] - mu[i][j]), 1.0
            r_clip = min(max(r, 1 - lo), 1 + hi)
            total += -w * min(r * a, r_clip * a)
            clipped += r_clip * a < r * a
    return total / normaliser, clipped / normaliser


def random_inputs(n, t, mask_kind, seed):
    g = torch.Generator().manual_seed(seed)
    p = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    p_old = p + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)  # some ratios leave the clip range
    mu = p_old + 0.8 * torch.randn(n, t, generator=g, dtype=torch.float64)  # some IS weights exceed the cap
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=g) < 0.6).double()
    if mask_kind == "full":
        mask = torch.ones(n, t, dtype=torch.float64)
    elif mask_kind == "row_masked":
        mask[0] = 0.0  # a fully masked row (e.g. a prompt-only sequence or a shard's padding)
    # off-mask values as a padded batch carries them: garbage current logprobs, zeros elsewhere
    p_old, mu = p_old * mask, mu * mask
    return p, p_old, mu, adv, mask


@pytest.mark.parametrize("n, t", [(1, 1), (2, 5), (4, 7)])
@pytest.mark.parametrize("mask_kind", ["full", "random", "row_masked"])
@pytest.mark.parametrize("correction", ["decoupled", "none"])
def test_policy_loss_matches_naive(n, t, mask_kind, correction):
    p, p_old, mu, adv, mask = random_inputs(n, t, mask_kind, seed=n * 100 + t)
    normaliser = max(float(mask.sum()), 1.0)
    loss, metrics = policy_loss(p, p_old, mu, adv, mask, correction, 0.2, 0.28, 2.0, normaliser)
    want, want_clip = naive_loss(p.tolist(), p_old.tolist(), mu.tolist(), adv.tolist(), mask.tolist(),
                                 correction, 0.2, 0.28, 2.0, normaliser)
    assert loss.item() == pytest.approx(want, abs=1e-9)
    assert metrics["clip_fraction"].item() == pytest.approx(want_clip, abs=1e-9)
    on = mask.bool()
    raw = torch.exp(p_old - mu)[on]
    assert metrics["is_weight_max"].item() == pytest.approx(raw.max().item() if on.any() else 0.0)
    assert metrics["is_truncated_fraction"].item() == pytest.approx((raw > 2.0).sum().item() / normaliser)
    assert metrics["is_weight_mean"].item() == pytest.approx(raw.clamp(max=2.0).sum().item() / normaliser)
    x = (p_old - mu)[on]
    assert metrics["behaviour_kl"].item() == pytest.approx((torch.exp(x) - 1 - x).sum().item() / normaliser)
    assert metrics["behaviour_kl_k1"].item() == pytest.approx(-x.sum().item() / normaliser)


@pytest.mark.parametrize("correction", ["decoupled", "none"])
def test_gradient_flows_only_through_current_logprobs(correction):
    p, p_old, mu, adv, mask = random_inputs(3, 6, "random", seed=7)
    p, p_old, mu = (x.clone().requires_grad_(True) for x in (p, p_old, mu))
    loss, _ = policy_loss(p, p_old, mu, adv, mask, correction, 0.2, 0.28, 2.0, float(mask.sum()))
    loss.backward()
    assert p_old.grad is None and mu.grad is None  # the IS weight and the ratio anchors are detached
    assert (p.grad[mask == 0] == 0).all() and p.grad.abs().sum() > 0


def test_decoupled_gradient_is_weighted_by_the_detached_is_weight():
    # one token, r = 1 inside the clip range: d loss / d p = -w * A with w = min(exp(p_old - mu), C)
    p = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    p_old, mu, adv = torch.tensor([[-1.0]]).double(), torch.tensor([[-1.5]]).double(), torch.tensor([2.0]).double()
    for cap, w in [(10.0, math.exp(0.5)), (1.2, 1.2)]:
        p.grad = None
        loss, _ = policy_loss(p, p_old, mu, adv, torch.ones(1, 1), "decoupled", 0.2, 0.28, cap, 1.0)
        loss.backward()
        assert p.grad.item() == pytest.approx(-w * 2.0)


def test_ranks_sum_to_the_whole_batch():
    p, p_old, mu, adv, mask = random_inputs(4, 6, "random", seed=3)
    total = float(mask.sum())
    whole, whole_metrics = policy_loss(p, p_old, mu, adv, mask, "decoupled", 0.2, 0.28, 2.0, total)
    halves = [policy_loss(p[s], p_old[s], mu[s], adv[s], mask[s], "decoupled", 0.2, 0.28, 2.0, total)
              for s in (slice(0, 2), slice(2, 4))]
    assert (halves[0][0] + halves[1][0]).item() == pytest.approx(whole.item())
    for key in ("clip_fraction", "is_weight_mean", "behaviour_kl"):
        assert (halves[0][1][key] + halves[1][1][key]).item() == pytest.approx(whole_metrics[key].item())


def test_padding_garbage_never_leaks():
    p, p_old, mu, adv, mask = random_inputs(2, 5, "row_masked", seed=11)
    p = p.clone()
    p[mask == 0] = 80.0  # exp(80 - 0) would overflow any product it entered
    loss, metrics = policy_loss(p, p_old, mu, adv, mask, "none", 0.2, 0.28, 2.0, float(mask.sum()))
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())


def test_token_logprobs_and_entropy():
    logits = torch.randn(2, 3, 11)
    targets = torch.randint(0, 11, (2, 3))
    for temperature in (1.0, 0.7):
        want = torch.log_softmax(logits / temperature, -1).gather(-1, targets[..., None])[..., 0]
        assert torch.allclose(token_logprobs(logits, targets, temperature), want, atol=1e-6)
        probs = torch.softmax(logits / temperature, -1)
        assert torch.allclose(token_entropy(logits, temperature), -(probs * probs.log()).sum(-1), atol=1e-5)


def test_kl_estimates_are_zero_on_identical_policies():
    logp = -torch.rand(3, 4)
    kl = kl_estimates(logp, logp, torch.ones(3, 4), 12.0)
    assert kl["k1"].item() == 0.0 and kl["k3"].item() == 0.0


# ---------------------------------------------------------------- batch

def make_trajectory(group_id, sample_index, pieces, reward):
    """pieces: list of (kind, n_tokens), kind in prompt | sampled | tool."""
    ids, mask, logp, versions = [], [], [], []
    for kind, count in pieces:
        for _ in range(count):
            ids.append(len(ids) + 3 + 10 * sample_index)
            sampled = kind == "sampled"
            mask.append(int(sampled))
            logp.append(-0.1 * (len(ids) % 7) - 0.05 if sampled else 0.0)
            versions.append(group_id if sampled else -1)
    return Trajectory(id=f"{group_id}-{sample_index}", group_id=group_id, prompt_index=group_id,
                      sample_index=sample_index, token_ids=np.array(ids, np.int32),
                      loss_mask=np.array(mask, np.uint8), behaviour_logprobs=np.array(logp, np.float32),
                      versions=np.array(versions, np.int32), reward=reward)


def episodes():
    return [
        make_trajectory(7, 0, [("prompt", 4), ("sampled", 3), ("tool", 2), ("sampled", 2)], 1.0),
        make_trajectory(7, 1, [("prompt", 4), ("sampled", 2)], 0.0),
        make_trajectory(9, 0, [("prompt", 3), ("sampled", 5), ("tool", 3), ("sampled", 1)], 0.0),
        make_trajectory(9, 1, [("prompt", 3), ("sampled", 1)], 0.0),
    ]


def test_batch_loss_mask_covers_only_sampled_tokens():
    trajectories = episodes()
    batch = collate(trajectories)
    assert batch.input_ids.shape == (4, 12) and batch.input_ids.dtype == torch.int64
    for row, t in enumerate(trajectories):
        size = len(t.token_ids)
        assert batch.input_ids[row, :size].tolist() == t.token_ids.tolist()
        assert batch.attention_mask[row].tolist() == [1] * size + [0] * (12 - size)
        assert batch.loss_mask[row, :size].tolist() == t.loss_mask.tolist()  # prompt and tool tokens: 0
        assert batch.loss_mask[row, size:].sum() == 0  # padding: 0
        sampled = batch.loss_mask[row].bool()
        assert (batch.versions[row][sampled] >= 0).all() and (batch.versions[row][~sampled] == -1).all()
        assert (batch.behaviour_logprobs[row][~sampled] == 0).all()
    assert batch.advantages.tolist() == pytest.approx(grpo_advantages(torch.tensor([1.0, 0, 0, 0]), 2).tolist())
    assert batch.advantages[2:].abs().sum() == 0  # tied group


def test_collate_rejects_interleaved_groups():
    trajectories = episodes()
    with pytest.raises(AssertionError, match="group-contiguous"):
        collate([trajectories[0], trajectories[2], trajectories[1], trajectories[3]])


def test_shard_and_micro_batches_partition_the_rows():
    batch = collate(episodes())
    parts = [shard(batch, rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat([part.input_ids for part in parts]), batch.input_ids)
    assert [mb.size for mb in micro_batches(batch, 3)] == [3, 1]
    with pytest.raises(AssertionError):
        shard(batch, 0, 3)


def test_sequence_logprobs_alignment():
    # logits at position i predict token i + 1: position i puts all its mass on token id i + 6
    input_ids = torch.tensor([[2, 6, 7, 1]])
    logits = torch.full((1, 4, 10), -30.0)
    for i in range(4):
        logits[0, i, i + 6] = 30.0
    out = sequence_logprobs(logits, input_ids, 1.0)
    assert out[0, 0] == 0.0  # token 0 is never predicted
    assert out[0, 1].item() == pytest.approx(0.0, abs=1e-6) and out[0, 2].item() == pytest.approx(0.0, abs=1e-6)
    assert out[0, 3].item() < -50  # token 3 is id 1, but position 2 predicted id 8
