"""Token logprobs and entropies from logits: the two places a [..., V] tensor is reduced to [...]."""

from __future__ import annotations

import torch
from torch import Tensor


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
    logits [..., V] -> [...]. Differentiable (for an entropy bonus); costs one [..., V] softmax, so call it
    under no_grad when it is only a metric.
    """
    scaled = logits.float() / temperature
    return torch.logsumexp(scaled, dim=-1) - (torch.softmax(scaled, dim=-1) * scaled).sum(dim=-1)
