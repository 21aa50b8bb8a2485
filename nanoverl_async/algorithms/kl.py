"""KL estimators (as a metric, a loss term or a reward penalty) and the entropy bonus, per token.

Per-token tensors are [N, T] and token-indexed; `mask` is 1 on sampled tokens. Every term is exactly 0
off the mask (log-ratios are zeroed before exp, so padding garbage cannot make inf/NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor

# name -> k(x), x = log ref - log pi on a sampled token (kl.estimator; formulas in kl_per_token)
KL_ESTIMATORS = {"k1": lambda x: -x, "k2": lambda x: 0.5 * x * x, "k3": lambda x: torch.expm1(x) - x}
LOG_RATIO_CLAMP = 20.0  # |log ratio| bound before exp (as verl): exp(20) ~ 5e8, so nothing overflows to inf


def kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kind: str) -> Tensor:
    """Per-token Monte-Carlo estimate of KL(pi || ref) on tokens sampled from pi (Schulman 2020,
    http://joschu.net/blog/kl-approx.html), with x = log ref - log pi on each sampled token:

        k1 = -x                  (unbiased, can be negative)
        k2 = x^2 / 2             (biased, >= 0, low variance)
        k3 = exp(x) - 1 - x      (unbiased, >= 0, low variance; GRPO's KL term, DeepSeekMath eq. 4)

    logprobs, ref_logprobs, mask [N, T] -> [N, T], 0 off the mask. Differentiable w.r.t. logprobs (use it
    as a loss term: aggregate it like the policy loss) and ref_logprobs (detach the reference yourself).
    x is clamped to +-LOG_RATIO_CLAMP (no gradient beyond), so k3 stays finite for wildly different policies.
    """
    x = torch.where(mask.bool(), (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)
    return KL_ESTIMATORS[kind](x)


def kl_reward_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kind: str, coef: float) -> Tensor:
    """coef * k(pi, ref) per token, detached: the per-token KL penalty that REINFORCE++ and PPO subtract from
    the reward (Ouyang et al. 2022, "InstructGPT", eq. 2; Hu 2025, "REINFORCE++", arXiv:2501.03262).
    [N, T] -> [N, T], 0 off the mask. Pass it as `kl_penalty` to `outcome_token_rewards`.
    """
    return coef * kl_per_token(logprobs.detach(), ref_logprobs.detach(), mask, kind)


def kl_estimates(logp: Tensor, logq: Tensor, mask: Tensor, normaliser: float | Tensor) -> dict[str, Tensor]:
    """Metrics: k1 and k3 estimates of KL(q || p) from tokens sampled from q, i.e. kl_per_token(logq, logp),
    as mask-weighted sums divided by `normaliser` (detached scalars; they add up over data-parallel ranks).
    """
    logp, logq = logp.detach(), logq.detach()
    return {kind: kl_per_token(logq, logp, mask, kind).sum() / normaliser for kind in ("k1", "k3")}


def entropy_bonus(entropy: Tensor, mask: Tensor, coef: float) -> Tensor:
    """Per-token loss term -coef * H_t (maximising entropy; Williams & Peng 1991, Mnih et al. 2016 "A3C").
    entropy [N, T] token-indexed (H of the distribution that sampled token t, differentiable), mask [N, T]
    -> [N, T], 0 off the mask. Aggregate it like the policy loss.
    """
    return torch.where(mask.bool(), -coef * entropy, 0.0)
