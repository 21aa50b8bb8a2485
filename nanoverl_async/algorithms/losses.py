"""Policy losses, the value loss, aggregation, and `policy_loss`: correction + loss + KL + entropy, aggregated.

Per token: p = current logprob (differentiable), base = the anchor a correction chose (p_old or mu, detached),
A = advantage ([N] per sequence or [N, T] per token), mask = 1 on tokens in the loss. Each loss returns
(token_loss [N, T], exactly 0 off the mask; per-token metrics [N, T], detached); log-ratios are zeroed off
the mask before exp, so padding garbage can never make inf/NaN, and clamped to +-LOG_RATIO_CLAMP on it.

Data-parallel invariant: `aggregate` divides by an explicit GLOBAL `normaliser` (see `loss_normaliser`:
sum its value over ranks), never by a local count, so the losses, gradients and "sum" metrics of the
ranks add up to what one rank computes on the whole batch. Metric keys ending in `_max` reduce with max.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nanoverl_async.algorithms.corrections import off_policy_correction
from nanoverl_async.algorithms.kl import LOG_RATIO_CLAMP, entropy_bonus, kl_per_token

POLICY_LOSSES = ("ppo", "gspo", "cispo")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _per_token(advantages: Tensor) -> Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def _log_ratio(logprobs: Tensor, base_logprobs: Tensor, mask: Tensor) -> Tensor:
    """p - base on the mask, clamped to +-LOG_RATIO_CLAMP, 0 off it (padding garbage never reaches exp)."""
    return torch.where(mask, (logprobs - base_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)


def ppo_clip_loss(logprobs: Tensor, base_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                  clip_high: float, clip_ratio_c: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip (Schulman et al. 2017, arXiv:1707.06347) with clip-higher (Yu et al. 2025, "DAPO") and dual
    clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games", arXiv:1912.09729), per token:

        r = exp(p - base),   loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
        dual clip (c = clip_ratio_c > 1, only where A < 0):   loss = min(loss, -c A)

    clip_fraction: tokens where the clipped branch is active; dual_clip_fraction: where -c A bounds the loss.
    """
    mask = mask.bool()
    adv = _per_token(advantages)
    ratio = torch.exp(_log_ratio(logprobs, base_logprobs, mask))
    unclipped, clipped = ratio * adv, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    dual = torch.zeros_like(mask)
    if clip_ratio_c > 0:
        dual = (adv < 0) & (loss > -clip_ratio_c * adv)
        loss = torch.where(dual, -clip_ratio_c * adv, loss)
    metrics = {"clip_fraction": (clipped < unclipped).float(), "dual_clip_fraction": dual.float()}
    return torch.where(mask, loss, 0.0), metrics


def gspo_loss(logprobs: Tensor, base_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
              clip_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071): a sequence-level
    ratio, the geometric mean of the token ratios, clipped per sequence:

        s_i = exp(1/|y_i| sum_t (p_t - base_t))       (over the row's masked tokens)
        GSPO-token form, per token:  s_{i,t} = sg(s_i) * exp(p_t - sg(p_t))   (value s_i, grad s_i grad p_t)
        loss_{i,t} = -min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1 - eps_low, 1 + eps_high) A_{i,t})

    With A_{i,t} = A_i and `seq-mean-token-mean` aggregation, value and gradient equal the paper's sequence
    objective (its eq. 5-7); the paper's clip ranges are tiny (eps_low 3e-4, eps_high 4e-4).
    clip_fraction: the tokens of sequences whose ratio is clipped.
    """
    mask = mask.bool()
    adv = _per_token(advantages)
    log_ratio = _log_ratio(logprobs, base_logprobs, mask)
    seq_log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    token_logprobs = torch.where(mask, logprobs, 0.0)
    ratio = torch.exp(seq_log_ratio.detach() + token_logprobs - token_logprobs.detach())
    unclipped, clipped = ratio * adv, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    return torch.where(mask, loss, 0.0), {"clip_fraction": (clipped < unclipped).float()}


def cispo_loss(logprobs: Tensor, base_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
               clip_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585, eq. 4): REINFORCE with a clipped, stop-gradient
    IS weight, so no token's gradient is ever dropped (only its weight bounded):

        r = exp(p - base),   loss = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * exp(p - sg(p))

    exp(p - sg(p)) = 1 in value and has gradient grad p, so d loss = -clip(r) A grad p exactly as the
    paper's sg(clip(r)) A log p, while the loss VALUE reads -clip(r) A (comparable across losses).
    The paper sets no lower clip (eps_low large). clip_fraction: tokens whose weight is clipped.
    """
    mask = mask.bool()
    adv = _per_token(advantages)
    ratio = torch.exp(_log_ratio(logprobs, base_logprobs, mask).detach())
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_logprobs = torch.where(mask, logprobs, 0.0)
    loss = -weight * adv * torch.exp(token_logprobs - token_logprobs.detach())
    return torch.where(mask, loss, 0.0), {"clip_fraction": (weight != ratio).float()}


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               cliprange_value: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (PPO as in OpenAI baselines ppo2 and verl), per token:

        v_clip = v_old + clip(v - v_old, -eps_v, eps_v),   loss = 1/2 * max((v - R)^2, (v_clip - R)^2)

    cliprange_value = 0 turns the clipping off (loss = 1/2 (v - R)^2). values (differentiable), old_values,
    returns, mask [N, T] -> (token_loss [N, T], 0 off the mask; metrics: vf_clip_fraction per token).
    """
    mask = mask.bool()
    old_values, returns = old_values.detach(), returns.detach()
    unclipped = (values - returns) ** 2
    if cliprange_value > 0:
        clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
        clipped = (clipped_values - returns) ** 2
        loss, clip_active = 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped
    else:
        loss, clip_active = 0.5 * unclipped, torch.zeros_like(mask)
    return torch.where(mask, loss, 0.0), {"vf_clip_fraction": clip_active.float()}


def loss_normaliser(loss_mask: Tensor, mode: str, max_tokens: int = 0) -> Tensor:
    """This rank's share of the normaliser of `aggregate`; SUM it over data-parallel ranks (all-reduce):
        token-mean:               sampled tokens
        seq-mean-token-mean:      sequences with at least one sampled token
        seq-mean-token-sum-norm:  those sequences * max_tokens (Dr. GRPO's constant, e.g. the generation budget)
    loss_mask [N, T] -> float64 scalar."""
    assert mode in AGGREGATIONS, f"unknown aggregation '{mode}' (expected one of {AGGREGATIONS})"
    mask = loss_mask.bool()
    if mode == "token-mean":
        return mask.sum().double()
    assert mode == "seq-mean-token-mean" or max_tokens > 0, "seq-mean-token-sum-norm needs max_tokens > 0"
    sequences = mask.any(dim=1).sum().double()
    return sequences if mode == "seq-mean-token-mean" else sequences * max_tokens


def aggregate(token_loss: Tensor, loss_mask: Tensor, mode: str, normaliser: float | Tensor) -> Tensor:
    """Per-token loss [N, T] -> scalar, with `normaliser` the GLOBAL value of `loss_normaliser`:
        token-mean:               sum_{i,t} m l / normaliser                          (DAPO; long answers weigh more)
        seq-mean-token-mean:      sum_i (sum_t m l / sum_t m) / normaliser            (GRPO paper; GSPO)
        seq-mean-token-sum-norm:  sum_{i,t} m l / normaliser   (normaliser = sequences * max_tokens: Dr. GRPO)
    Rows without a masked token contribute 0."""
    assert mode in AGGREGATIONS, f"unknown aggregation '{mode}' (expected one of {AGGREGATIONS})"
    mask = loss_mask.bool()
    masked = torch.where(mask, token_loss, 0.0)
    if mode == "seq-mean-token-mean":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / normaliser
    return masked.sum() / normaliser


def reduce_token_metrics(metrics: dict[str, Tensor], loss_mask: Tensor, normaliser: float | Tensor,
                         dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Per-token metrics [N, T] -> detached scalars over the loss mask: masked sum / normaliser (a token
    mean that adds up over ranks), or masked max for keys ending in `_max` (0 when nothing is masked)."""
    mask = loss_mask.bool()
    out = {}
    for key, values in metrics.items():
        values = torch.where(mask, values.detach().to(dtype), 0.0)
        if key.endswith("_max"):
            out[key] = values.amax() if values.numel() else values.new_zeros(())
        else:
            out[key] = values.sum() / normaliser
    return out


def policy_loss(logprobs: Tensor, proximal_logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor,
                loss_mask: Tensor, correction: str, clip_low: float, clip_high: float, is_cap: float,
                normaliser: float | Tensor, *, loss: str = "ppo", clip_ratio_c: float = 0.0, is_low: float = 0.0,
                is_level: str = "token", aggregation: str = "token-mean",
                agg_normaliser: float | Tensor | None = None, ref_logprobs: Tensor | None = None,
                kl_coef: float = 0.0, kl_estimator: str = "k3", entropy: Tensor | None = None,
                entropy_coef: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """The learner's loss: an off-policy correction (corrections.py), a policy loss, optional KL and entropy
    terms, aggregated once. Per sampled token, with c = off_policy_correction(correction, p_old, mu, ...):

        l_t = c.weight_t * [c.keep_t] * policy_loss_t(p, c.base, A)
              + kl_coef * k(p, ref)_t - entropy_coef * H_t
        loss = aggregate(l, loss_mask, aggregation, agg_normaliser)

    logprobs (current, differentiable), proximal_logprobs, behaviour_logprobs, loss_mask [N, T]; advantages
    [N] or [N, T]; ref_logprobs, entropy [N, T] token-indexed (or None). `normaliser` is the GLOBAL sampled-
    token count: the metrics' divisor, and the loss's for token-mean; `agg_normaliser` is the global
    `loss_normaliser(..., aggregation)` (required for the seq-* modes). Metrics (detached scalars, adding up
    over ranks, `*_max` by max): the correction's (behaviour_kl, behaviour_kl_k1, is_weight_mean/_max,
    is_truncated_fraction or is_masked_fraction), the loss's (clip_fraction, ...), pg_loss, kl_loss.
    """
    assert loss in POLICY_LOSSES, f"unknown policy loss '{loss}' (expected one of {POLICY_LOSSES})"
    assert agg_normaliser is not None or aggregation == "token-mean", \
        f"aggregation '{aggregation}' needs agg_normaliser (the global loss_normaliser)"
    agg_normaliser = normaliser if agg_normaliser is None else agg_normaliser
    c = off_policy_correction(correction, proximal_logprobs, behaviour_logprobs, loss_mask, cap=is_cap,
                              low=is_low, level=is_level)
    if loss == "ppo":
        pg, loss_metrics = ppo_clip_loss(logprobs, c.base_logprobs, advantages, c.keep, clip_low, clip_high,
                                         clip_ratio_c)
    else:
        pg, loss_metrics = (gspo_loss if loss == "gspo" else cispo_loss)(
            logprobs, c.base_logprobs, advantages, c.keep, clip_low, clip_high)
    pg = torch.where(c.keep, c.weight.to(pg.dtype) * pg, 0.0)
    total = pg
    metrics = dict(c.metrics)
    metrics.update({key: torch.where(c.keep, value, 0.0) for key, value in loss_metrics.items()})
    if ref_logprobs is not None and kl_coef > 0:
        kl = kl_per_token(logprobs, ref_logprobs.detach(), loss_mask, kl_estimator)
        total = total + kl_coef * kl
        metrics["kl_loss"] = kl
    if entropy is not None and entropy_coef > 0:
        total = total + entropy_bonus(entropy, loss_mask, entropy_coef)
    out = reduce_token_metrics(metrics, loss_mask, normaliser, logprobs.dtype)
    out["pg_loss"] = aggregate(pg, loss_mask, aggregation, agg_normaliser).detach()
    return aggregate(total, loss_mask, aggregation, agg_normaliser), out
