"""Off-policy corrections, chosen independently of the policy loss.

Per token: mu = behaviour logprob (the generator that sampled it), p_old = proximal logprob (the learner
before this step's update). A correction returns a `Correction`: the anchor the loss's ratio is taken
against (r = exp(p - base)), a DETACHED per-token weight multiplying the token's loss, a keep-mask of the
tokens allowed into the loss, and per-token metrics. Dropped tokens still count in the loss normaliser
(they contribute 0), so the normaliser stays a function of the loss masks alone.

IS weights w = p_old / mu are taken at a `level`:
  token:    w_{i,t} = exp(p_old_{i,t} - mu_{i,t})
  sequence: w_{i,t} = exp(sum_{s sampled} (p_old_{i,s} - mu_{i,s}))   (one weight per sequence, on each token)

Metrics are per-token [N, T] detached tensors; losses.reduce_token_metrics sums them over the loss mask
(divided by the normaliser) or, for keys ending in `_max`, takes the max.

CORRECTIONS holds them by name (algorithm.correction). Each takes (proximal_logprobs, behaviour_logprobs,
mask) and picks from the keyword arguments cap (algorithm.is_cap), low (is_low) and level (is_level);
`**_` takes the rest, so the loss calls CORRECTIONS[name](p_old, mu, mask, cap=..., low=..., level=...).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from nanoverl_async.algorithms.kl import LOG_RATIO_CLAMP, kl_per_token

IS_LEVELS = ("token", "sequence")


class Correction(NamedTuple):
    base_logprobs: Tensor  # [N, T] detached anchor of the ratio r = exp(p - base)
    weight: Tensor  # [N, T] detached IS weight per token (0 where keep is False)
    keep: Tensor  # [N, T] bool: sampled tokens that enter the loss
    metrics: dict[str, Tensor]  # per-token [N, T], detached


def is_log_weights(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, level: str) -> Tensor:
    """log w = log p_old - log mu per token (level token) or summed over the row's sampled tokens and
    broadcast to them (level sequence). [N, T] -> [N, T], 0 off the mask, detached."""
    assert level in IS_LEVELS, f"unknown IS level '{level}' (expected one of {IS_LEVELS})"
    mask = mask.bool()
    x = torch.where(mask, (proximal_logprobs - behaviour_logprobs).detach(), 0.0)
    if level == "sequence":
        x = torch.where(mask, x.sum(dim=1, keepdim=True), 0.0)
    return x


def _data_metrics(proximal: Tensor, behaviour: Tensor, mask: Tensor, log_weight: Tensor) -> dict[str, Tensor]:
    """What the data looks like, whatever the correction: k3 / k1 estimates of KL(mu || p_old) (staleness
    plus train/inference mismatch) and the largest untruncated IS weight at the correction's level (log
    ratios clamped to +-LOG_RATIO_CLAMP: a metric of e^20 ~ 5e8 means "wildly off-policy", never inf)."""
    proximal, behaviour = proximal.detach(), behaviour.detach()
    return {"behaviour_kl": kl_per_token(behaviour, proximal, mask, "k3"),
            "behaviour_kl_k1": kl_per_token(behaviour, proximal, mask, "k1"),
            "is_weight_max": torch.exp(log_weight.clamp(max=LOG_RATIO_CLAMP))}


def no_correction(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float = math.inf,
                  **_) -> Correction:
    """`none`, the naive off-policy baseline for ablations: r = exp(p - mu), w = 1, every sampled token kept.
    Its metrics still report what `decoupled` with this `cap` would apply (is_weight_mean of
    min(exp(p_old - mu), cap), is_truncated_fraction), to show how off-policy the data is."""
    decoupled = tis_correction(proximal_logprobs, behaviour_logprobs, mask, cap, "token")
    return Correction(behaviour_logprobs.detach(), torch.ones_like(decoupled.weight), decoupled.keep, decoupled.metrics)


def tis_correction(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float,
                   level: str = "token", **_) -> Correction:
    """`tis`, truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings
    you off-policy RL training"; Espeholt et al. 2018, "IMPALA", for the truncation):

        r = exp(p - p_old),   w = min(w_level, C)   (detached)

    The PPO ratio is anchored at the proximal policy, and the truncated weight corrects for the gap between
    the proximal and the behaviour policy. Metrics: is_weight_mean (of w), is_truncated_fraction (w_level > C).
    """
    mask = mask.bool()
    log_w = is_log_weights(proximal_logprobs, behaviour_logprobs, mask, level)
    weight = torch.exp(log_w.clamp(max=math.log(cap)))  # clamped in log space: no inf for extreme weights
    metrics = _data_metrics(proximal_logprobs, behaviour_logprobs, mask, log_w)
    metrics.update(is_weight_mean=weight, is_truncated_fraction=(log_w > math.log(cap)).float())
    return Correction(proximal_logprobs.detach(), weight, mask, metrics)


def decoupled_correction(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float,
                         **_) -> Correction:
    """`decoupled` PPO (Fu et al. 2025, "AReaL", arXiv:2505.24298; Hilton et al. 2021, "Batch size-invariance
    for policy optimization"): clip against the proximal policy p_old (recomputed by the learner), correct
    the behaviour -> proximal gap with a token-level truncated IS weight:

        r = exp(p - p_old),   w = min(exp(p_old - mu), C)   (detached)

    Numerically this is `tis` at token level; it is the project's default and its name in the literature.
    """
    return tis_correction(proximal_logprobs, behaviour_logprobs, mask, cap, "token")


def mis_correction(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float, low: float,
                   level: str = "token", **_) -> Correction:
    """`mis`, masked importance sampling (verl's rollout IS "mask" mode; IcePop, Ling team 2025): drop the
    tokens (level token) or whole sequences (level sequence) whose IS weight leaves [low, cap], weight the
    others by it:

        r = exp(p - p_old),   keep = low <= w_level <= cap,   w = w_level on kept tokens, 0 elsewhere

    Metrics: is_weight_mean (of w, 0 on dropped tokens), is_masked_fraction (sampled tokens dropped).
    """
    mask = mask.bool()
    log_w = is_log_weights(proximal_logprobs, behaviour_logprobs, mask, level)
    raw = torch.exp(log_w.clamp(max=math.log(cap) + 1.0))  # anything above cap is dropped anyway: no inf
    keep = mask & (raw >= low) & (raw <= cap)
    weight = torch.where(keep, raw, 0.0)
    metrics = _data_metrics(proximal_logprobs, behaviour_logprobs, mask, log_w)
    metrics.update(is_weight_mean=weight, is_masked_fraction=(mask & ~keep).float())
    return Correction(proximal_logprobs.detach(), weight, keep, metrics)


CORRECTIONS = {"none": no_correction, "tis": tis_correction, "decoupled": decoupled_correction,  # algorithm.correction
               "mis": mis_correction}
