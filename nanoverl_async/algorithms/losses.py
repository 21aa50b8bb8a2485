"""Policy losses, the value loss, aggregation, and `policy_loss`: correction + loss + KL + entropy, aggregated.

Per token: p = current logprob (differentiable), base = the anchor a correction chose (p_old or mu, detached),
A = advantage ([N] per sequence or [N, T] per token), mask = 1 on tokens in the loss. Each loss returns
(token_loss [N, T], exactly 0 off the mask; per-token metrics [N, T], detached); log-ratios are zeroed off
the mask before exp, so padding garbage can never make inf/NaN, and clamped to +-LOG_RATIO_CLAMP on it.

Data-parallel invariant: `aggregate` divides by an explicit GLOBAL `normaliser` (see `loss_normaliser`:
sum its value over ranks), never by a local count, so the losses, gradients and "sum" metrics of the
ranks add up to what one rank computes on the whole batch. Metric keys ending in `_max` reduce with max
(`merge_metrics`, the one place that rule is written).

POLICY_LOSSES (algorithm.loss) and AGGREGATIONS (algorithm.loss_agg) hold them by name. A policy loss takes
(logprobs, base_logprobs, advantages, mask) and picks from the keyword arguments clip_low, clip_high and
clip_ratio_c (`**_` takes the rest). `policy_loss` alone reads config sections (AlgorithmConfig, KLConfig).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from nanoverl_async.algorithms.corrections import CORRECTIONS
from nanoverl_async.algorithms.kl import LOG_RATIO_CLAMP, entropy_bonus, kl_per_token

# AlgorithmConfig and KLConfig below are config.py's, named in (postponed) annotations only, never imported:
# config.py reaches these tables through validation.py, so importing it here would close a cycle.


def _per_token(advantages: Tensor) -> Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def _log_ratio(logprobs: Tensor, base_logprobs: Tensor, mask: Tensor) -> Tensor:
    """p - base on the mask, clamped to +-LOG_RATIO_CLAMP, 0 off it (padding garbage never reaches exp)."""
    return torch.where(mask, (logprobs - base_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)


def ppo_clip_loss(logprobs: Tensor, base_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                  clip_high: float, clip_ratio_c: float = 0.0, **_) -> tuple[Tensor, dict[str, Tensor]]:
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
              clip_high: float, **_) -> tuple[Tensor, dict[str, Tensor]]:
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
               clip_high: float, **_) -> tuple[Tensor, dict[str, Tensor]]:
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


# algorithm.loss: name -> fn(...) -> (token_loss [N, T], per-token metrics)
POLICY_LOSSES = {"ppo": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss}


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


def token_mean(loss: Tensor, mask: Tensor, max_tokens: int) -> tuple[Tensor, Tensor]:
    """DAPO: sum_{i,t} m l / (sampled tokens); every token weighs the same, so long answers weigh more."""
    return loss.sum(), mask.sum()


def seq_mean_token_mean(loss: Tensor, mask: Tensor, max_tokens: int) -> tuple[Tensor, Tensor]:
    """GRPO paper, GSPO: sum_i (sum_t m l / sum_t m) / (sequences with a sampled token)."""
    return (loss.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum(), mask.any(dim=1).sum()


def seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, max_tokens: int) -> tuple[Tensor, Tensor]:
    """Dr. GRPO: sum_{i,t} m l / (sequences * max_tokens), a constant per sequence (e.g. the generation budget)."""
    return loss.sum(), mask.any(dim=1).sum() * max_tokens


# algorithm.loss_agg: name -> fn(masked loss, mask, max_tokens) -> (local sum, normaliser share)
AGGREGATIONS = {"token-mean": token_mean, "seq-mean-token-mean": seq_mean_token_mean,
                "seq-mean-token-sum-norm": seq_mean_token_sum_norm}


def loss_normaliser(loss_mask: Tensor, mode: str, max_tokens: int = 0) -> Tensor:
    """This rank's share of the normaliser of `aggregate` (the second half of AGGREGATIONS[mode]); SUM it
    over data-parallel ranks (all-reduce). loss_mask [N, T] -> float64 scalar."""
    mask = loss_mask.bool()
    share = AGGREGATIONS[mode](mask, mask, max_tokens)[1].double()  # the share needs no loss: the mask stands in
    assert share > 0 or not mask.any(), f"aggregation '{mode}' has a zero normaliser (max_tokens = {max_tokens})"
    return share


def aggregate(token_loss: Tensor, loss_mask: Tensor, mode: str, normaliser: float | Tensor) -> Tensor:
    """Per-token loss [N, T] -> scalar: the masked sum of AGGREGATIONS[mode] divided by `normaliser`, the
    GLOBAL value of `loss_normaliser`. Rows without a masked token contribute 0."""
    mask = loss_mask.bool()
    return AGGREGATIONS[mode](torch.where(mask, token_loss, 0.0), mask, 0)[0] / normaliser


def merge_metrics(stacked: dict[str, Tensor], divisor: float | Tensor = 1.0) -> dict[str, Tensor]:
    """Each metric reduced over dim 0 (tokens, micro-batches, ranks or optimizer steps): the max for keys
    ending in `_max` (0 when empty), else the sum / divisor. Every other metric is a sum divided by a
    global count, so its sums over micro-batches and ranks add up to the whole batch's value."""
    return {key: (values.amax(dim=0) if values.numel() else values.new_zeros(values.shape[1:]))
            if key.endswith("_max") else values.sum(dim=0) / divisor for key, values in stacked.items()}


def reduce_token_metrics(metrics: dict[str, Tensor], loss_mask: Tensor, normaliser: float | Tensor,
                         dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Per-token metrics [N, T] -> detached scalars over the loss mask (merge_metrics: masked sum /
    normaliser, a token mean that adds up over ranks, or the masked max for keys ending in `_max`)."""
    mask = loss_mask.bool().flatten()
    return merge_metrics({key: torch.where(mask, values.detach().to(dtype).flatten(), 0.0)
                          for key, values in metrics.items()}, normaliser)


@dataclass
class LossInputs:
    """One micro-batch's per-token tensors for `policy_loss`: [N, T], token-indexed."""

    logprobs: Tensor  # log p under the current weights (differentiable)
    proximal_logprobs: Tensor  # log p_old: the learner before this step's update
    behaviour_logprobs: Tensor  # log mu: the generator that sampled each token
    advantages: Tensor  # [N] per sequence or [N, T] per token
    loss_mask: Tensor  # 1 on tokens in the loss
    ref_logprobs: Optional[Tensor] = None  # log pi_ref of a frozen reference (KL term)
    entropy: Optional[Tensor] = None  # H of the distribution that sampled each token (bonus; differentiable)


def policy_loss(x: LossInputs, algo: AlgorithmConfig, kl: KLConfig, tokens: float | Tensor,
                agg_normaliser: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The learner's loss: an off-policy correction (corrections.py), a policy loss, optional KL and entropy
    terms, aggregated once. Per sampled token, with c = CORRECTIONS[algo.correction](p_old, mu, ...):

        l_t = c.weight_t * [c.keep_t] * POLICY_LOSSES[algo.loss]_t(p, c.base, A)
              + kl.loss_coef * k(p, ref)_t - algo.entropy_coef * H_t
        loss = aggregate(l, loss_mask, algo.loss_agg, agg_normaliser)

    `tokens` is the GLOBAL sampled-token count: the metrics' divisor, and the loss's for token-mean;
    `agg_normaliser` is the global `loss_normaliser(..., algo.loss_agg)` (required for the seq-* modes).
    Metrics (detached scalars, adding up over ranks, `*_max` by max): the correction's (behaviour_kl,
    behaviour_kl_k1, is_weight_mean/_max, is_truncated_fraction or is_masked_fraction), the loss's
    (clip_fraction, ...), pg_loss, kl_loss.
    """
    assert agg_normaliser is not None or algo.loss_agg == "token-mean", \
        f"aggregation '{algo.loss_agg}' needs agg_normaliser (the global loss_normaliser)"
    agg_normaliser = tokens if agg_normaliser is None else agg_normaliser
    c = CORRECTIONS[algo.correction](x.proximal_logprobs, x.behaviour_logprobs, x.loss_mask, cap=algo.is_cap,
                                     low=algo.is_low, level=algo.is_level)
    pg, loss_metrics = POLICY_LOSSES[algo.loss](x.logprobs, c.base_logprobs, x.advantages, c.keep,
                                                clip_low=algo.clip.low, clip_high=algo.clip.high,
                                                clip_ratio_c=algo.clip.ratio_c)
    pg = torch.where(c.keep, c.weight.to(pg.dtype) * pg, 0.0)
    total = pg
    metrics = {**c.metrics, **{key: torch.where(c.keep, value, 0.0) for key, value in loss_metrics.items()}}
    if x.ref_logprobs is not None and kl.loss_coef > 0:
        kl_term = kl_per_token(x.logprobs, x.ref_logprobs.detach(), x.loss_mask, kl.estimator)
        total = total + kl.loss_coef * kl_term
        metrics["kl_loss"] = kl_term
    if x.entropy is not None and algo.entropy_coef > 0:
        total = total + entropy_bonus(x.entropy, x.loss_mask, algo.entropy_coef)
    out = reduce_token_metrics(metrics, x.loss_mask, tokens, x.logprobs.dtype)
    out["pg_loss"] = aggregate(pg, x.loss_mask, algo.loss_agg, agg_normaliser).detach()
    return aggregate(total, x.loss_mask, algo.loss_agg, agg_normaliser), out
