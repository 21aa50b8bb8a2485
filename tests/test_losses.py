"""algorithms/ corrections, policy losses, value loss and aggregation against naive per-token references.

The reference `naive_policy_loss` walks the batch token by token with Python control flow, straight from
the docstring formulas, building torch scalars so autograd gives the reference gradient too. Also: nothing the
learner runs on the device per micro-batch reads a value back or sizes a tensor by its values (HostWaits),
which on a GPU would make the host wait once per micro-batch. Fast, CPU.
"""

import math

import pytest
import torch

from nanoverl_async.algorithms import (AGGREGATIONS, CORRECTIONS, LossInputs, aggregate, cispo_loss, gspo_loss,
                                      kl_estimates, kl_per_token, loss_normaliser, merge_metrics, policy_loss,
                                      ppo_clip_loss, reduce_token_metrics, token_logprobs_and_entropy, value_loss)
from host_waits import HostWaits
from nanoverl_async.config import AlgorithmConfig, ClipConfig, KLConfig

torch.set_num_threads(1)

CAP, LOW, CLIP_LOW, CLIP_HIGH = 2.0, 0.5, 0.2, 0.28
DROP = 80.0  # off-mask current logprobs: exp(80) would overflow any product it entered


def random_inputs(n, t, mask_kind, seed, spread=0.3, token_advantages=False):
    g = torch.Generator().manual_seed(seed)
    p = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    p_old = p + spread * torch.randn(n, t, generator=g, dtype=torch.float64)  # some ratios leave the clip range
    mu = p_old + 0.8 * torch.randn(n, t, generator=g, dtype=torch.float64)  # some IS weights leave [LOW, CAP]
    shape = (n, t) if token_advantages else (n,)
    adv = torch.randn(*shape, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=g) < 0.6).double()
    if mask_kind == "full":
        mask = torch.ones(n, t, dtype=torch.float64)
    elif mask_kind == "row_masked":
        mask[0] = 0.0
    elif mask_kind == "empty":
        mask = torch.zeros(n, t, dtype=torch.float64)
    p = torch.where(mask.bool(), p, DROP)  # garbage current logprobs off the mask, zeros in the anchors
    return p, p_old * mask, mu * mask, adv, mask


def naive_correction(p_old, mu, mask, i, correction, level):
    """{j: (base, w, keep)} for the sampled tokens of row i."""
    sampled = [j for j in range(len(mask[i])) if mask[i][j]]
    seq_x = sum(p_old[i][j] - mu[i][j] for j in sampled)
    out = {}
    for j in sampled:
        raw = math.exp(p_old[i][j] - mu[i][j] if level == "token" else seq_x)
        if correction == "none":
            out[j] = (mu[i][j], 1.0, True)
        elif correction in ("decoupled", "tis"):
            out[j] = (p_old[i][j], min(raw, CAP), True)
        else:
            keep = LOW <= raw <= CAP
            out[j] = (p_old[i][j], raw if keep else 0.0, keep)
    return out


def naive_policy_loss(p, p_old, mu, adv, mask, correction, level, loss, agg, clip_ratio_c=0.0, max_tokens=0,
                      ref=None, kl_coef=0.0, entropy=None, entropy_coef=0.0):
    """(value, surrogate): scalars whose value is the loss and whose gradient is the loss's gradient."""
    n, t = mask.shape
    m, po, be = mask.tolist(), p_old.tolist(), mu.tolist()
    total_v, total_g, tokens, sequences = 0.0, 0.0, 0, 0
    for i in range(n):
        corr = naive_correction(po, be, m, i, correction, level)
        kept = [j for j in corr if corr[j][2]]
        if kept:  # GSPO: geometric mean of the kept tokens' ratios (differentiable w.r.t. p)
            s = torch.exp(sum(p[i, j] - corr[j][0] for j in kept) / len(kept))
        row_v, row_g = 0.0, 0.0
        for j, (base, w, keep) in corr.items():
            a = adv[i] if adv.dim() == 1 else adv[i, j]
            v = g = 0.0
            if keep and loss == "ppo":
                r = torch.exp(p[i, j] - base)
                v = -min(r * a, torch.clamp(r, 1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
                if clip_ratio_c > 0 and a < 0:
                    v = min(v, -clip_ratio_c * a)
                g = v
            elif keep and loss == "gspo":
                v = g = -min(s * a, torch.clamp(s, 1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
            elif keep and loss == "cispo":
                weight = torch.clamp(torch.exp(p[i, j] - base), 1 - CLIP_LOW, 1 + CLIP_HIGH).detach()
                v, g = -weight * a, -weight * a * p[i, j]  # the paper: sg(clip(r)) * A * log p
            row_v, row_g = row_v + w * v, row_g + w * g
            if ref is not None:
                x = ref[i, j] - p[i, j]
                row_v, row_g = row_v + kl_coef * (torch.exp(x) - 1 - x), row_g + kl_coef * (torch.exp(x) - 1 - x)
            if entropy is not None:
                row_v, row_g = row_v - entropy_coef * entropy[i, j], row_g - entropy_coef * entropy[i, j]
        tokens += len(corr)
        sequences += bool(corr)
        if agg == "seq-mean-token-mean" and corr:
            row_v, row_g = row_v / len(corr), row_g / len(corr)
        total_v, total_g = total_v + row_v, total_g + row_g
    normaliser = {"token-mean": tokens, "seq-mean-token-mean": sequences,
                  "seq-mean-token-sum-norm": sequences * max_tokens}[agg]
    normaliser = max(normaliser, 1)
    return torch.as_tensor(total_v / normaliser), torch.as_tensor(total_g / normaliser)


def algorithm(correction, level, loss, agg, clip_ratio_c=0.0, entropy_coef=0.0):
    return AlgorithmConfig(loss=loss, correction=correction, clip=ClipConfig(CLIP_LOW, CLIP_HIGH, clip_ratio_c),
                           is_cap=CAP, is_low=LOW if correction == "mis" else 0.0, is_level=level, loss_agg=agg,
                           entropy_coef=entropy_coef)


def run_policy_loss(p, p_old, mu, adv, mask, correction, level, loss, agg, max_tokens=0, clip_ratio_c=0.0,
                    ref=None, kl_coef=0.0, entropy=None, entropy_coef=0.0):
    tokens = max(float(mask.sum()), 1.0)
    agg_normaliser = max(float(loss_normaliser(mask, agg, max_tokens)), 1.0)
    return policy_loss(LossInputs(p, p_old, mu, adv, mask, ref, entropy),
                       algorithm(correction, level, loss, agg, clip_ratio_c, entropy_coef),
                       KLConfig(loss_coef=kl_coef, estimator="k3"), tokens, agg_normaliser)


CORRECTION_LEVELS = [("none", "token"), ("decoupled", "token"), ("tis", "token"), ("tis", "sequence"),
                     ("mis", "token"), ("mis", "sequence")]


def sequence_constant_weights(correction, level):
    return correction == "none" or level == "sequence"


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("correction, level", CORRECTION_LEVELS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("n, t, mask_kind", [(1, 1, "full"), (3, 5, "random"), (4, 6, "row_masked")])
def test_policy_loss_family_matches_naive(loss, correction, level, agg, n, t, mask_kind):
    p, p_old, mu, adv, mask = random_inputs(n, t, mask_kind, seed=7 * n + t, token_advantages=(loss == "ppo"))
    p = p.requires_grad_(True)
    got, metrics = run_policy_loss(p, p_old, mu, adv, mask, correction, level, loss, agg, max_tokens=t)
    want, surrogate = naive_policy_loss(p, p_old, mu, adv, mask, correction, level, loss, agg, max_tokens=t)
    assert got.item() == pytest.approx(want.item(), abs=1e-9)
    assert metrics["pg_loss"].item() == pytest.approx(want.item(), abs=1e-9)
    got.backward()
    grad = p.grad.clone()
    assert (grad[mask == 0] == 0).all()
    # GSPO weights each token's gradient by its own IS weight (the GSPO-token form); the sequence-level
    # reference only agrees when the weight is constant along a sequence
    if loss != "gspo" or sequence_constant_weights(correction, level):
        p.grad = None
        if surrogate.requires_grad:
            surrogate.backward()
            assert torch.allclose(grad, p.grad, atol=1e-9)
        else:
            assert (grad == 0).all()


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_kl_and_entropy_terms_match_naive(loss, agg):
    p, p_old, mu, adv, mask = random_inputs(3, 6, "random", seed=21)
    p = p.requires_grad_(True)
    ref = torch.where(mask.bool(), p.detach() + 0.5 * torch.randn(3, 6, dtype=torch.float64), 0.0)
    entropy = torch.rand(3, 6, dtype=torch.float64)
    extra = dict(ref=ref, kl_coef=0.1, entropy=entropy, entropy_coef=0.01)
    got, metrics = run_policy_loss(p, p_old, mu, adv, mask, "decoupled", "token", loss, agg, max_tokens=6, **extra)
    want, surrogate = naive_policy_loss(p, p_old, mu, adv, mask, "decoupled", "token", loss, agg, max_tokens=6,
                                        **extra)
    assert got.item() == pytest.approx(want.item(), abs=1e-9)
    x = (ref - p.detach())[mask.bool()]
    assert metrics["kl_loss"].item() == pytest.approx((torch.exp(x) - 1 - x).sum().item() / mask.sum().item())
    if loss != "gspo":
        got.backward()
        grad, p.grad = p.grad.clone(), None
        surrogate.backward()
        assert torch.allclose(grad, p.grad, atol=1e-9)


@pytest.mark.parametrize("correction, level", CORRECTION_LEVELS)
@pytest.mark.parametrize("mask_kind", ["full", "random", "row_masked", "empty"])
def test_corrections_match_naive(correction, level, mask_kind):
    _, p_old, mu, _, mask = random_inputs(4, 7, mask_kind, seed=5)
    c = CORRECTIONS[correction](p_old, mu, mask, cap=CAP, low=LOW if correction == "mis" else 0.0, level=level)
    m, po, be = mask.tolist(), p_old.tolist(), mu.tolist()
    weights, dropped, truncated, raw_max = [], 0, 0, 0.0
    for i in range(4):
        seq_x = sum(po[i][j] - be[i][j] for j in range(7) if m[i][j])
        for j, (base, w, keep) in naive_correction(po, be, m, i, correction, level).items():
            assert c.base_logprobs[i, j].item() == pytest.approx(base)
            assert c.weight[i, j].item() == pytest.approx(w) and bool(c.keep[i, j]) == keep
            raw = math.exp(po[i][j] - be[i][j] if level == "token" else seq_x)
            weights.append(min(raw, CAP) if correction == "none" else w)
            dropped += not keep
            truncated += raw > CAP
            raw_max = max(raw_max, raw)
    assert not c.keep[mask == 0].any() and not c.weight.requires_grad
    normaliser = max(len(weights), 1)
    metrics = reduce_token_metrics(c.metrics, mask, normaliser, torch.float64)
    assert metrics["is_weight_mean"].item() == pytest.approx(sum(weights) / normaliser)
    assert metrics["is_weight_max"].item() == pytest.approx(raw_max)
    key, count = ("is_masked_fraction", dropped) if correction == "mis" else ("is_truncated_fraction", truncated)
    assert metrics[key].item() == pytest.approx(count / normaliser)
    x = (p_old - mu)[mask.bool()]
    assert metrics["behaviour_kl"].item() == pytest.approx((torch.exp(x) - 1 - x).sum().item() / normaliser)


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("correction, level", CORRECTION_LEVELS)
def test_only_current_logprobs_carry_gradient(loss, correction, level):
    p, p_old, mu, adv, mask = random_inputs(3, 6, "random", seed=9)
    p, p_old, mu = (x.clone().requires_grad_(True) for x in (p, p_old, mu))
    got, _ = run_policy_loss(p, p_old, mu, adv, mask, correction, level, loss, "token-mean")
    got.backward()
    assert p_old.grad is None and mu.grad is None  # anchors and IS weights are detached
    assert (p.grad[mask == 0] == 0).all() and p.grad.abs().sum() > 0


def test_cispo_gradient_is_the_clipped_weight_even_where_clipped():
    # d loss / d p_t = -clip(r_t) * A (no gradient through the weight); PPO would give 0 on clipped tokens
    p = torch.tensor([[0.0, 1.0, -1.0, 0.1]], dtype=torch.float64, requires_grad=True)
    base, adv, mask = torch.zeros(1, 4, dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 4)
    token_loss, metrics = cispo_loss(p, base, adv, mask, CLIP_LOW, CLIP_HIGH)
    token_loss.sum().backward()
    weights = torch.exp(p.detach()).clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
    assert torch.allclose(p.grad, -weights * 2.0)
    assert torch.allclose(token_loss.detach(), -weights * 2.0)
    assert metrics["clip_fraction"].tolist() == [[0.0, 1.0, 1.0, 0.0]]


def test_dual_clip_bounds_negative_advantages():
    # r = 5, A = -1: PPO loss = -min(-5, -1.28) = 5; dual clip with c = 3 bounds it at 3, with no gradient
    p = torch.tensor([[math.log(5.0), math.log(5.0)]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    base, mask = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2)
    loss, metrics = ppo_clip_loss(p, base, adv, mask, CLIP_LOW, CLIP_HIGH, clip_ratio_c=3.0)
    assert loss[0].tolist() == pytest.approx([3.0, -(1 + CLIP_HIGH)])
    assert metrics["dual_clip_fraction"].tolist() == [[1.0, 0.0]]
    loss.sum().backward()
    assert p.grad.tolist() == [[0.0, 0.0]]
    plain, _ = ppo_clip_loss(p.detach(), base, adv, mask, CLIP_LOW, CLIP_HIGH)
    assert plain[0, 0].item() == pytest.approx(5.0)


def test_gspo_sequence_ratio_is_the_geometric_mean():
    p = torch.tensor([[0.0, 0.3, -0.1, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    loss, _ = gspo_loss(p, torch.zeros(1, 4, dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64),
                        mask, 1.0, 1.0)  # no clipping within (0, 2)
    s = math.exp((0.3 - 0.1) / 2)
    assert loss[0].tolist() == pytest.approx([0.0, -s, -s, 0.0])


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("correction, level", CORRECTION_LEVELS)
def test_extreme_ratios_stay_finite(loss, correction, level):
    p, p_old, mu, adv, mask = random_inputs(4, 6, "random", seed=13, spread=60.0)  # ratios up to e^+-150
    mu = mu + 100.0 * torch.sign(torch.randn(4, 6, dtype=torch.float64)) * mask
    p, p_old, mu, adv = p.float().requires_grad_(True), p_old.float(), mu.float(), adv.float()
    got, metrics = run_policy_loss(p, p_old, mu, adv, mask.float(), correction, level, loss, "token-mean",
                                   clip_ratio_c=3.0 if loss == "ppo" else 0.0)
    got.backward()
    assert torch.isfinite(got) and torch.isfinite(p.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("correction", ["none", "decoupled", "mis"])
def test_fully_masked_batch_is_zero(loss, correction):
    p, p_old, mu, adv, mask = random_inputs(2, 4, "empty", seed=1)
    p = p.requires_grad_(True)
    got, metrics = run_policy_loss(p, p_old, mu, adv, mask, correction, "token", loss, "seq-mean-token-mean")
    got.backward()
    assert got.item() == 0.0 and (p.grad == 0).all()
    assert all(v.item() == 0.0 for v in metrics.values())


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("correction, level", [("decoupled", "token"), ("mis", "sequence")])
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_ranks_sum_to_the_whole_batch(loss, correction, level, agg):
    p, p_old, mu, adv, mask = random_inputs(4, 6, "row_masked", seed=3)
    tokens, agg_total = float(mask.sum()), float(loss_normaliser(mask, agg, 6))
    parts = [loss_normaliser(mask[s], agg, 6) for s in (slice(0, 2), slice(2, 4))]
    assert float(parts[0] + parts[1]) == agg_total  # what the learner all-reduces

    def run(rows):
        return policy_loss(LossInputs(p[rows], p_old[rows], mu[rows], adv[rows], mask[rows]),
                           algorithm(correction, level, loss, agg), KLConfig(), tokens, agg_total)
    whole, whole_metrics = run(slice(0, 4))
    halves = [run(rows) for rows in (slice(0, 2), slice(2, 4))]
    assert (halves[0][0] + halves[1][0]).item() == pytest.approx(whole.item())
    for key, value in whole_metrics.items():
        combine = max if key.endswith("_max") else (lambda a, b: a + b)
        assert combine(halves[0][1][key], halves[1][1][key]).item() == pytest.approx(value.item())


def test_aggregations_by_hand():
    token_loss = torch.tensor([[9.0, 1.0, 3.0, 9.0], [9.0, 2.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0.0]])
    assert loss_normaliser(mask, "token-mean").item() == 3
    assert loss_normaliser(mask, "seq-mean-token-mean").item() == 2  # the empty row is no sequence
    assert loss_normaliser(mask, "seq-mean-token-sum-norm", max_tokens=10).item() == 20
    assert aggregate(token_loss, mask, "token-mean", 3).item() == pytest.approx(6 / 3)
    assert aggregate(token_loss, mask, "seq-mean-token-mean", 2).item() == pytest.approx((4 / 2 + 2 / 1) / 2)
    assert aggregate(token_loss, mask, "seq-mean-token-sum-norm", 20).item() == pytest.approx(6 / 20)


def naive_value_loss(v, old, ret, mask, eps):
    total = 0.0
    for i in range(v.shape[0]):
        for j in range(v.shape[1]):
            if mask[i, j]:
                loss = (v[i, j] - ret[i, j]) ** 2
                if eps > 0:
                    clipped = old[i, j] + torch.clamp(v[i, j] - old[i, j], -eps, eps)
                    loss = max(loss, (clipped - ret[i, j]) ** 2)
                total = total + 0.5 * loss
    return total


@pytest.mark.parametrize("n, t, mask_kind", [(1, 1, "full"), (3, 5, "random"), (4, 6, "row_masked")])
@pytest.mark.parametrize("cliprange_value", [0.0, 0.2, 5.0])
def test_value_loss_matches_naive_with_gradient(n, t, mask_kind, cliprange_value):
    _, _, _, _, mask = random_inputs(n, t, mask_kind, seed=n + t)
    g = torch.Generator().manual_seed(t)
    old = torch.randn(n, t, generator=g, dtype=torch.float64)
    values = (old + 0.5 * torch.randn(n, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    returns = torch.randn(n, t, generator=g, dtype=torch.float64)
    token_loss, metrics = value_loss(values, old, returns, mask, cliprange_value)
    got = aggregate(token_loss, mask, "token-mean", max(float(mask.sum()), 1.0))
    want = naive_value_loss(values, old, returns, mask, cliprange_value) / max(float(mask.sum()), 1.0)
    assert got.item() == pytest.approx(float(want.detach() if torch.is_tensor(want) else want), abs=1e-9)
    if torch.is_tensor(want) and want.requires_grad:
        got.backward()
        grad, values.grad = values.grad.clone(), None
        want.backward()
        assert torch.allclose(grad, values.grad, atol=1e-9)
    if cliprange_value == 0:
        assert (metrics["vf_clip_fraction"] == 0).all()


def test_host_waits_sees_value_reads_and_masked_indexing():
    x = torch.randn(3, 4)
    with HostWaits() as waits:
        float(x.sum()), x[x > 0], (x > 0).nonzero(), bool((x > 0).any())
        x + 1, torch.where(x > 0, x, 0.0).sum()
    assert waits.ops == ["_local_scalar_dense", "index", "nonzero", "_local_scalar_dense"]
    with torch.inference_mode(), HostWaits() as waits:  # as the engine runs
        int(torch.arange(3).max())
    assert waits.ops == ["item"]


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("correction, level", CORRECTION_LEVELS)
def test_a_micro_batchs_loss_metrics_and_gradient_never_make_the_host_wait(loss, correction, level):
    """Everything the learner runs on the device per micro-batch (LearnerRank._loss and backward; the critic's
    value loss): logprobs and entropy from logits, every aggregation with dual clip, KL and entropy terms, the
    metrics, their per-micro-batch merge. On a GPU each wait would stall the host once per micro-batch, so
    the GPU would idle while the host prepares the next kernels. The normalisers come from the host batch."""
    p, p_old, mu, adv, mask = random_inputs(3, 5, "random", seed=5, token_advantages=(loss == "ppo"))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    targets, ref = torch.randint(11, (3, 5), generator=g), p_old - 0.1
    values = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = float(mask.sum())
    normalisers = {agg: float(loss_normaliser(mask, agg, 5)) for agg in AGGREGATIONS}
    with HostWaits() as waits:
        for agg in AGGREGATIONS:
            logprobs, entropy = token_logprobs_and_entropy(logits, targets, 0.7, entropy_grad=True)
            logprobs = torch.where(mask.bool(), logprobs, p)  # garbage off the mask, as the padding gives
            total, metrics = policy_loss(LossInputs(logprobs, p_old, mu, adv, mask, ref, entropy),
                                         algorithm(correction, level, loss, agg, 3.0, 0.01),
                                         KLConfig(loss_coef=0.1, estimator="k3"), tokens, normalisers[agg])
            metrics.update(kl=kl_per_token(logprobs, ref, mask.bool(), "k3").sum() / tokens,
                           mismatch_kl=kl_estimates(p_old, mu, mask.bool(), tokens)["k3"])
            token_loss, value_metrics = value_loss(values, values.detach() + 0.1, values.detach() - 0.2, mask, 0.2)
            total = total + aggregate(token_loss, mask, "token-mean", tokens)
            metrics.update(reduce_token_metrics(value_metrics, mask, tokens))
            total.backward()
            merge_metrics({key: torch.stack([value.detach()] * 2) for key, value in metrics.items()})
    assert logits.grad is not None and values.grad is not None
    assert waits.ops == []
