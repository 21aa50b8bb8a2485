"""algorithms/ (advantages, KL, the default policy loss) and learners/batch.py against naive per-token Python
references (fast, CPU). Corrections, the policy-loss family, gradients, data-parallel sums and aggregation:
tests/test_losses.py (whose random_inputs these tests share)."""

import math

import pytest
import torch

from nanoverl_async.algorithms import (ADVANTAGES, CORRECTIONS, LossInputs, drgrpo_advantages, entropy_bonus,
                                      gae_advantages, grpo_advantages, kl_estimates, kl_per_token, kl_reward_penalty,
                                      outcome_token_rewards, overlong_penalty, policy_loss,
                                      reinforce_pp_advantages, rloo_advantages, token_entropy, token_logprobs,
                                      token_logprobs_and_entropy)
from nanoverl_async.config import AlgorithmConfig, ClipConfig, KLConfig
from nanoverl_async.learners.batch import collate, sequence_logprobs, shard, with_advantages
from synthetic import episodes as synthetic_episodes
from test_losses import random_inputs

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


REWARD_CASES = [
    ([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.2, 0.9], 4),
    ([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], 3),  # all-equal groups -> 0
    ([0.3, 0.7, 1.0], 1),  # single-sample groups -> 0
    ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 8),
    ([2.0, -1.0], 2),
]


@pytest.mark.parametrize("rewards, group_size", REWARD_CASES)
def test_grpo_advantages_match_naive(rewards, group_size):
    got = grpo_advantages(torch.tensor(rewards), group_size)
    assert torch.allclose(got, torch.tensor(naive_grpo(rewards, group_size)), atol=1e-5)
    assert torch.isfinite(got).all()


def test_grpo_tied_and_single_groups_are_zero():
    assert torch.equal(grpo_advantages(torch.ones(6), 3), torch.zeros(6))
    assert torch.equal(grpo_advantages(torch.tensor([0.2, 5.0]), 1), torch.zeros(2))


def naive_group_baseline(rewards, group_size, kind):
    """drgrpo: r - group mean; rloo: r - mean of the OTHER samples (0 without any)."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        for i, r in enumerate(group):
            if kind == "drgrpo":
                out.append(r - sum(group) / len(group))
            else:
                others = group[:i] + group[i + 1:]
                out.append(r - sum(others) / len(others) if others else 0.0)
    return out


@pytest.mark.parametrize("rewards, group_size", REWARD_CASES)
@pytest.mark.parametrize("kind", ["drgrpo", "rloo"])
def test_group_baselines_match_naive(rewards, group_size, kind):
    fn = drgrpo_advantages if kind == "drgrpo" else rloo_advantages
    got = fn(torch.tensor(rewards), group_size)
    assert got.shape == (len(rewards),)
    assert torch.allclose(got, torch.tensor(naive_group_baseline(rewards, group_size, kind)), atol=1e-6)
    if group_size == 1 or len(set(rewards)) == 1:
        assert torch.equal(got, torch.zeros(len(rewards)))


def token_mask(n, t, kind, seed):
    """[N, T] float masks: full | random | row_masked (row 0 empty) | agentic (prompt, turns, tool gaps, padding)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "full":
        return torch.ones(n, t, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=g) < 0.6).double()
    if kind == "row_masked":
        mask[0] = 0.0
    elif kind == "agentic":
        mask = torch.zeros(n, t, dtype=torch.float64)
        for i in range(n):
            length = t - i % 3  # right padding
            mask[i, 2:length] = 1.0  # prompt: tokens 0-1
            mask[i, 2 + (i + 2) % 4: 4 + (i + 2) % 4] = 0.0  # a tool result in between
    mask[:, 0] = 0.0  # token 0 is never sampled
    return mask


def sampled_positions(mask, i):
    return [j for j in range(len(mask[i])) if mask[i][j]]


def naive_token_rewards(rewards, mask, kl):
    out = [[0.0] * len(mask[0]) for _ in mask]
    for i in range(len(mask)):
        positions = sampled_positions(mask, i)
        for j in positions:
            out[i][j] = -(kl[i][j] if kl is not None else 0.0)
        if positions:
            out[i][positions[-1]] += rewards[i]
    return out


def naive_whiten(values, mask, eps=1e-8):
    on = [(i, j) for i in range(len(mask)) for j in range(len(mask[0])) if mask[i][j]]
    mean = sum(values[i][j] for i, j in on) / max(len(on), 1)
    var = sum((values[i][j] - mean) ** 2 for i, j in on) / max(len(on) - 1, 1)
    out = [[0.0] * len(mask[0]) for _ in mask]
    for i, j in on:
        out[i][j] = (values[i][j] - mean) / math.sqrt(var + eps)
    return out


def naive_reinforce_pp(rewards, mask, gamma, kl):
    token_rewards = naive_token_rewards(rewards, mask, kl)
    returns = [[0.0] * len(mask[0]) for _ in mask]
    for i in range(len(mask)):
        running = 0.0
        for j in reversed(sampled_positions(mask, i)):  # tool/prompt tokens take no discount step
            running = token_rewards[i][j] + gamma * running
            returns[i][j] = running
    return naive_whiten(returns, mask)


def naive_gae(token_rewards, values, mask, gamma, lam):
    advantages = [[0.0] * len(mask[0]) for _ in mask]
    returns = [[0.0] * len(mask[0]) for _ in mask]
    for i in range(len(mask)):
        positions = sampled_positions(mask, i)
        next_value, next_advantage = 0.0, 0.0
        for j in reversed(positions):
            delta = token_rewards[i][j] + gamma * next_value - values[i][j]
            advantages[i][j] = delta + gamma * lam * next_advantage
            returns[i][j] = advantages[i][j] + values[i][j]
            next_value, next_advantage = values[i][j], advantages[i][j]
    return advantages, returns


SHAPES_AND_MASKS = [(n, t, kind) for n, t in [(1, 2), (3, 6), (5, 9)]
                    for kind in ["full", "random", "row_masked", "agentic"]
                    if not (n == 1 and kind == "row_masked")]


@pytest.mark.parametrize("n, t, mask_kind", SHAPES_AND_MASKS)
@pytest.mark.parametrize("with_kl", [False, True])
def test_outcome_token_rewards_match_naive(n, t, mask_kind, with_kl):
    mask = token_mask(n, t, mask_kind, seed=n + t)
    rewards = torch.randn(n, dtype=torch.float64)
    kl = torch.rand(n, t, dtype=torch.float64) if with_kl else None
    got = outcome_token_rewards(rewards, mask, kl)
    want = naive_token_rewards(rewards.tolist(), mask.tolist(), kl.tolist() if with_kl else None)
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("n, t, mask_kind", SHAPES_AND_MASKS)
@pytest.mark.parametrize("gamma, with_kl", [(1.0, False), (0.9, True), (0.0, True)])
def test_reinforce_pp_matches_naive(n, t, mask_kind, gamma, with_kl):
    mask = token_mask(n, t, mask_kind, seed=3 * n + t)
    rewards = torch.randn(n, dtype=torch.float64)
    kl = 0.1 * torch.rand(n, t, dtype=torch.float64) if with_kl else None
    got = reinforce_pp_advantages(rewards, mask, gamma, kl)
    want = naive_reinforce_pp(rewards.tolist(), mask.tolist(), gamma, kl.tolist() if with_kl else None)
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)
    assert torch.isfinite(got).all() and (got[mask == 0] == 0).all()


def test_reinforce_pp_all_equal_rewards_give_zero():
    mask = token_mask(4, 6, "agentic", seed=1)
    got = reinforce_pp_advantages(torch.ones(4), mask, gamma=1.0)  # every return is 1: nothing to prefer
    assert torch.equal(got, torch.zeros(4, 6))


@pytest.mark.parametrize("n, t, mask_kind", SHAPES_AND_MASKS)
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.95), (1.0, 0.0), (0.0, 0.5)])
def test_gae_matches_naive(n, t, mask_kind, gamma, lam):
    mask = token_mask(n, t, mask_kind, seed=5 * n + t)
    rewards = torch.randn(n, dtype=torch.float64)
    kl = torch.randn(n, t, dtype=torch.float64)  # a per-token KL penalty makes the token rewards dense
    values = torch.randn(n, t, dtype=torch.float64)  # garbage off the mask: must be ignored
    raw, returns = gae_advantages(rewards, mask, values, gamma, lam, kl_penalty=kl, whiten=False)
    token_rewards = naive_token_rewards(rewards.tolist(), mask.tolist(), kl.tolist())
    want_adv, want_ret = naive_gae(token_rewards, values.tolist(), mask.tolist(), gamma, lam)
    assert torch.allclose(raw.double(), torch.tensor(want_adv, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(returns.double(), torch.tensor(want_ret, dtype=torch.float64), atol=1e-5)
    whitened, returns2 = gae_advantages(rewards, mask, values, gamma, lam, kl_penalty=kl)
    assert torch.allclose(whitened.double(), torch.tensor(naive_whiten(want_adv, mask.tolist()), dtype=torch.float64),
                          atol=1e-6)
    assert torch.equal(returns, returns2)  # returns are never whitened


def test_gae_with_lambda_one_is_return_minus_value():
    # gamma = lam = 1: A_t = (sum of the row's rewards from t on) - V_t, across a tool gap; token rewards
    # [0, 0.5, 0, 0, 0, 1.0, 0]: the outcome 1.0 on the last sampled token, a negative penalty on token 1
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0]], dtype=torch.float64)
    penalty = torch.tensor([[0, -0.5, 0, 9, 9, 0, 9]], dtype=torch.float64)  # 9s off the mask are ignored
    values = torch.tensor([[7, 0.2, 0.4, 7, 7, 0.8, 7]], dtype=torch.float64)
    advantages, returns = gae_advantages(torch.tensor([1.0]), mask, values, 1.0, 1.0, penalty, whiten=False)
    assert advantages[0].tolist() == pytest.approx([0, 1.5 - 0.2, 1.0 - 0.4, 0, 0, 1.0 - 0.8, 0])
    assert returns[0].tolist() == pytest.approx([0, 1.5, 1.0, 0, 0, 1.0, 0])


@pytest.mark.parametrize("name", list(ADVANTAGES))
def test_every_estimator_takes_the_common_inputs(name):
    """with_advantages calls ADVANTAGES[name](**inputs): every estimator picks what it needs from them."""
    mask = token_mask(4, 6, "agentic", seed=2)
    out = ADVANTAGES[name](rewards=torch.tensor([1.0, 0.0, 0.5, 0.5]), group_size=2, loss_mask=mask,
                           values=torch.zeros(4, 6), gamma=1.0, lam=1.0, kl_penalty=None)
    advantages = out[0] if isinstance(out, tuple) else out
    assert advantages.shape[0] == 4 and torch.isfinite(advantages).all() and advantages.abs().sum() > 0


def naive_overlong(length, max_length, buffer, penalty):
    if buffer == 0 or length <= max_length - buffer:
        return 0.0
    if length <= max_length:
        return ((max_length - buffer) - length) / buffer * penalty
    return -penalty


@pytest.mark.parametrize("max_length, buffer, penalty", [(20, 4, 1.0), (20, 0, 1.0), (10, 10, 0.5)])
def test_overlong_penalty_matches_naive(max_length, buffer, penalty):
    lengths = list(range(0, 26))
    got = overlong_penalty(torch.tensor(lengths), max_length, buffer, penalty)
    want = [naive_overlong(length, max_length, buffer, penalty) for length in lengths]
    assert got.tolist() == pytest.approx(want)


# ---------------------------------------------------------------- KL and entropy

def naive_kl(p, ref, mask, kind):
    out = [[0.0] * len(p[0]) for _ in p]
    for i in range(len(p)):
        for j in range(len(p[0])):
            if mask[i][j]:
                x = ref[i][j] - p[i][j]
                out[i][j] = {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[kind]
    return out


@pytest.mark.parametrize("n, t, mask_kind", SHAPES_AND_MASKS)
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_per_token_matches_naive_with_gradient(n, t, mask_kind, kind):
    mask = token_mask(n, t, mask_kind, seed=n * t)
    p = (-torch.rand(n, t, dtype=torch.float64) * 3).requires_grad_(True)
    ref = (p.detach() + torch.randn(n, t, dtype=torch.float64)).masked_fill(mask == 0, 50.0)  # garbage off-mask
    got = kl_per_token(p, ref, mask, kind)
    assert torch.allclose(got, torch.tensor(naive_kl(p.tolist(), ref.tolist(), mask.tolist(), kind),
                                            dtype=torch.float64), atol=1e-9)
    got.sum().backward()
    x = ref - p.detach()
    want_grad = {"k1": torch.ones_like(x), "k2": -x, "k3": 1 - torch.exp(x)}[kind] * mask  # d k / d p
    assert torch.allclose(p.grad, want_grad, atol=1e-9)
    if kind != "k1":
        assert (got >= 0).all()


def test_kl_reward_penalty_is_detached_and_scaled():
    p = (-torch.rand(2, 4)).requires_grad_(True)
    ref, mask = -torch.rand(2, 4), torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1.0]])
    penalty = kl_reward_penalty(p, ref, mask, "k1", 0.5)
    assert not penalty.requires_grad
    assert torch.allclose(penalty, 0.5 * (p.detach() - ref) * mask)


def test_entropy_bonus():
    entropy = torch.rand(2, 3, requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 0, 0.0]])
    term = entropy_bonus(entropy, mask, 0.01)
    assert torch.allclose(term, -0.01 * entropy.detach() * mask)
    term.sum().backward()
    assert torch.allclose(entropy.grad, -0.01 * mask)


# ---------------------------------------------------------------- policy loss

def naive_loss(p, p_old, mu, adv, mask, correction, lo, hi, cap, normaliser):
    """Token by token, straight from the formulas of docs/design.md "Losses and off-policy corrections"."""
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


def loss_of(p, p_old, mu, adv, mask, correction, normaliser, cap=2.0):
    """policy_loss as these tests use it: ppo, clip 0.2 / 0.28, IS cap `cap`, token-mean, no KL."""
    algo = AlgorithmConfig(correction=correction, clip=ClipConfig(0.2, 0.28), is_cap=cap)
    return policy_loss(LossInputs(p, p_old, mu, adv, mask), algo, KLConfig(), normaliser)


@pytest.mark.parametrize("n, t", [(1, 1), (2, 5), (4, 7)])
@pytest.mark.parametrize("mask_kind", ["full", "random", "row_masked"])
@pytest.mark.parametrize("correction", ["decoupled", "none"])
def test_policy_loss_matches_naive(n, t, mask_kind, correction):
    p, p_old, mu, adv, mask = random_inputs(n, t, mask_kind, seed=n * 100 + t)
    normaliser = max(float(mask.sum()), 1.0)
    loss, metrics = loss_of(p, p_old, mu, adv, mask, correction, normaliser)
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


def test_is_weights_at_the_cap_and_the_floor():
    """mis keeps low <= w <= cap (both ends inclusive) and drops the rest; tis truncates w > cap to cap and
    counts only those as truncated. w = exp(p_old - mu) is exactly 1 where p_old == mu, so each bound is
    met exactly by a weight of 1, and missed by exp(+-1e-3)."""
    mu = torch.full((1, 3), -1.0)
    mask = torch.ones(1, 3)
    p_old = mu + torch.tensor([[0.0, 1e-3, -1e-3]])  # w = 1, just above 1, just below 1
    at_cap = CORRECTIONS["mis"](p_old, mu, mask, cap=1.0, low=0.5)
    assert at_cap.keep.tolist() == [[True, False, True]] and at_cap.weight[0, 0] == 1.0
    at_floor = CORRECTIONS["mis"](p_old, mu, mask, cap=2.0, low=1.0)
    assert at_floor.keep.tolist() == [[True, True, False]] and at_floor.weight[0, 2] == 0.0
    assert at_floor.metrics["is_masked_fraction"].tolist() == [[0.0, 0.0, 1.0]]
    tis = CORRECTIONS["tis"](p_old, mu, mask, cap=1.0)
    assert tis.weight[0, :2].tolist() == [1.0, 1.0] and tis.weight[0, 2] < 1.0
    assert tis.metrics["is_truncated_fraction"].tolist() == [[0.0, 1.0, 0.0]]


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

def episodes():
    """2 groups of 2: prompt, sampled turns with a tool result (mask 0) between them; the second group ties."""
    return synthetic_episodes([(4, [3, 2], 1.0), (4, [2], 0.0), (3, [5, 1], 0.0), (3, [1], 0.0)], seed=0)


def test_batch_loss_mask_covers_only_sampled_tokens():
    trajectories = episodes()
    batch = collate(trajectories)
    assert batch.input_ids.shape == (4, 11) and batch.input_ids.dtype == torch.int64
    for row, t in enumerate(trajectories):
        size = len(t.token_ids)
        assert batch.input_ids[row, :size].tolist() == t.token_ids.tolist()
        assert batch.attention_mask[row].tolist() == [1] * size + [0] * (11 - size)
        assert batch.loss_mask[row, :size].tolist() == t.loss_mask.tolist()  # prompt and tool tokens: 0
        assert batch.loss_mask[row, size:].sum() == 0  # padding: 0
        sampled = batch.loss_mask[row].bool()
        assert (batch.versions[row][sampled] >= 0).all() and (batch.versions[row][~sampled] == -1).all()
        assert (batch.behaviour_logprobs[row][~sampled] == 0).all()
    assert batch.advantages is None  # computed once, by with_advantages
    advantages = with_advantages(batch, 2, AlgorithmConfig(), KLConfig(), max_total_tokens=16).advantages
    assert advantages.tolist() == pytest.approx(grpo_advantages(torch.tensor([1.0, 0, 0, 0]), 2).tolist())
    assert advantages[2:].abs().sum() == 0  # tied group


def test_collate_rejects_interleaved_groups():
    trajectories = episodes()
    with pytest.raises(AssertionError, match="group-contiguous"):
        collate([trajectories[0], trajectories[2], trajectories[1], trajectories[3]])


def test_shard_partitions_the_rows():
    batch = collate(episodes())
    parts = [shard(batch, rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat([part.input_ids for part in parts]), batch.input_ids)
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


def test_logprobs_and_entropy_in_one_pass_equal_the_two_functions():
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 5, 11, requires_grad=True), torch.randint(11, (3, 5))
    for temperature in (1.0, 0.7):
        logprobs, entropy = token_logprobs_and_entropy(logits, targets, temperature, entropy_grad=False)
        assert torch.allclose(logprobs, token_logprobs(logits, targets, temperature), atol=1e-6)
        assert torch.allclose(entropy, token_entropy(logits, temperature), atol=1e-6)
        assert logprobs.requires_grad and not entropy.requires_grad  # a metric unless the loss uses it
        assert token_logprobs_and_entropy(logits, targets, temperature, entropy_grad=True)[1].requires_grad
    # with rows: logits [P, V], row rows[i] predicts targets[i], and a row may predict several tokens
    flat, rows, picked = logits.detach().flatten(0, 1), torch.tensor([0, 0, 3, 7, 7, 14]), torch.randint(11, (6,))
    want = torch.log_softmax(flat / 0.7, -1)[rows, picked]
    assert torch.allclose(token_logprobs(flat, picked, 0.7, rows), want, atol=1e-6)
    logprobs, entropy = token_logprobs_and_entropy(flat, picked, 0.7, False, rows)
    assert torch.allclose(logprobs, want, atol=1e-6) and torch.allclose(entropy, token_entropy(flat, 0.7)[rows])
