"""Advantages, token logprobs and the importance-corrected policy loss: pure tensor functions.

Shapes: N sequences, T tokens, V vocabulary. Per-token tensors are [N, T] and token-indexed
(position j describes token j). Every function here is stateless and differentiable where it says so;
nothing knows about models, ranks or configs, so each can be checked by hand against its formula
(tests/test_algorithms.py does, token by token) and new estimators and losses sit beside these.

Data-parallel invariant: `policy_loss` divides sums by an explicit `normaliser` (the number of sampled
tokens over ALL ranks), never by a local count, so the losses, gradients and "sum" metrics of the ranks
add up to what one rank computes on the whole batch. Metrics whose key ends in `_max` reduce with max.

Run alone: `python -m pytest tests/test_algorithms.py -q`.
"""

from __future__ import annotations

import torch
from torch import Tensor

CORRECTIONS = ("decoupled", "none")


def grpo_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantages (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, sec. 4.1.2):

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

    rewards [N] with N = groups * group_size, groups contiguous -> advantages [N]. std is the sample
    std (Bessel-corrected, as in TRL and verl). A group whose rewards all tie gets A = 0 (it carries
    no signal); a single-sample group has no baseline and gets A = 0 too.
    """
    assert rewards.dim() == 1 and group_size >= 1 and rewards.numel() % group_size == 0, \
        f"rewards {tuple(rewards.shape)} do not split into groups of {group_size}"
    groups = rewards.float().view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True, correction=1 if group_size > 1 else 0)
    return ((groups - mean) / (std + eps)).view(-1)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """log softmax(logits / temperature)[target]: the logprob of each target under the distribution the
    generator samples from (it applies the same temperature). logits [..., V], targets [...] -> [...].
    Computed as gathered logit - logsumexp, in float32, without materialising a [..., V] log-softmax copy.
    Differentiable w.r.t. logits.
    """
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def token_entropy(logits: Tensor, temperature: float) -> Tensor:
    """Entropy H = logsumexp(z) - sum softmax(z) * z of softmax(z), z = logits / temperature.
    logits [..., V] -> [...]. Meant for metrics (call under no_grad); costs one [..., V] softmax.
    """
    scaled = logits.float() / temperature
    return torch.logsumexp(scaled, dim=-1) - (torch.softmax(scaled, dim=-1) * scaled).sum(dim=-1)


def kl_estimates(logp: Tensor, logq: Tensor, mask: Tensor, normaliser: float | Tensor) -> dict[str, Tensor]:
    """Monte-Carlo estimates of KL(q || p) from tokens sampled from q (Schulman 2020,
    http://joschu.net/blog/kl-approx.html), with log-ratio x = logp - logq on each sampled token:

        k1 = -x            (unbiased, can be negative)
        k3 = exp(x) - 1 - x (unbiased, >= 0, lower variance)

    Returns mask-weighted sums divided by `normaliser` (detached scalars).
    """
    x = torch.where(mask.bool(), (logp - logq).detach(), 0.0)  # 0 off the mask: both k vanish there
    return {"k1": -x.sum() / normaliser, "k3": (torch.expm1(x) - x).sum() / normaliser}


def policy_loss(logprobs: Tensor, proximal_logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor,
                loss_mask: Tensor, correction: str, clip_low: float, clip_high: float, is_cap: float,
                normaliser: float | Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance-corrected PPO clip loss, token-mean over `normaliser` tokens. Per sampled token, with
    p = logprobs (current, differentiable), p_old = proximal_logprobs, mu = behaviour_logprobs:

      decoupled (Fu et al. 2025, "AReaL", arXiv:2505.24298; truncated IS, Yao et al. 2025, "Your efficient
                 RL framework secretly brings you off-policy RL training"):
          r = exp(p - p_old),  w = min(exp(p_old - mu), C)   (w detached)
      none (naive off-policy baseline for ablations):
          r = exp(p - mu),     w = 1
      loss_t = -w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)   (clip-higher: Yu et al. 2025, "DAPO")
      loss   = sum_t mask_t * loss_t / normaliser

    All per-token inputs are [N, T]; advantages are [N] (one per sequence) or [N, T]. Masked-out tokens
    contribute exactly 0 (log ratios are zeroed before exp, so padding can never make NaN/inf). Metrics
    (detached, divided by `normaliser` like the loss, so they sum over data-parallel ranks):
    clip_fraction (tokens whose clipped branch is active), is_weight_mean (of min(exp(p_old - mu), C), under
    both corrections), is_truncated_fraction, is_weight_max (untruncated), and behaviour_kl (k3) /
    behaviour_kl_k1 estimates of KL(mu || p_old) on these tokens: staleness plus train/inference mismatch
    (the learner reports `mismatch_kl` on same-version tokens only, where the policies differ by mismatch).
    """
    assert correction in CORRECTIONS, f"unknown correction '{correction}' (expected one of {CORRECTIONS})"
    mask = loss_mask.bool()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    proximal_logprobs, behaviour_logprobs = proximal_logprobs.detach(), behaviour_logprobs.detach()
    is_log_ratio = torch.where(mask, proximal_logprobs - behaviour_logprobs, 0.0)
    raw_weight = torch.exp(is_log_ratio)
    truncated_weight = raw_weight.clamp(max=is_cap)
    if correction == "decoupled":
        log_ratio = torch.where(mask, logprobs - proximal_logprobs, 0.0)
        weight = truncated_weight
    else:
        log_ratio = torch.where(mask, logprobs - behaviour_logprobs, 0.0)
        weight = torch.ones_like(raw_weight)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    token_loss = -weight * torch.minimum(unclipped, clipped)
    loss = torch.where(mask, token_loss, 0.0).sum() / normaliser

    def token_mean(values: Tensor) -> Tensor:
        return torch.where(mask, values.detach().to(logprobs.dtype), 0.0).sum() / normaliser

    kl = kl_estimates(proximal_logprobs, behaviour_logprobs, mask, normaliser)
    metrics = {
        "clip_fraction": token_mean(clipped < unclipped),
        "is_weight_mean": token_mean(truncated_weight),  # reported under both corrections: it describes the data
        "is_truncated_fraction": token_mean(raw_weight > is_cap),
        "is_weight_max": torch.where(mask, raw_weight, 0.0).amax() if mask.numel() else raw_weight.new_zeros(()),
        "behaviour_kl": kl["k3"],
        "behaviour_kl_k1": kl["k1"],
    }
    return loss, metrics
