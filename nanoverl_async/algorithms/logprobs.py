"""Token logprobs and entropies from logits: the two places a [..., V] tensor is reduced to [...]."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float, rows: Optional[Tensor] = None) -> Tensor:
    """log softmax(logits / temperature)[target]: the logprob of each target under the distribution the
    generator samples from (it applies the same temperature). logits [..., V], targets [...] -> [...]; or,
    with `rows`, logits [P, V] and rows, targets [k] -> [k], where row rows[i] predicts targets[i] (rows may
    repeat: the last token of a prompt that several sequences share predicts each one's first token).
    Computed as gathered logit - logsumexp, in float32, without materialising a [..., V] log-softmax copy.
    Differentiable w.r.t. logits.
    """
    scaled = _scaled(logits, temperature)
    return _picked(scaled, targets, rows) - _at(torch.logsumexp(scaled, dim=-1), rows)


def token_entropy(logits: Tensor, temperature: float) -> Tensor:
    """Entropy H = logsumexp(z) - sum softmax(z) * z of softmax(z), z = logits / temperature.
    logits [..., V] -> [...]. Differentiable (for an entropy bonus); costs one [..., V] softmax, so call it
    under no_grad when it is only a metric.
    """
    scaled = _scaled(logits, temperature)
    return _entropy(scaled, torch.logsumexp(scaled, dim=-1))


def token_logprobs_and_entropy(logits: Tensor, targets: Tensor, temperature: float, entropy_grad: bool,
                               rows: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """token_logprobs (`rows` as there) and token_entropy of the same logits from one float32 z and one
    logsumexp: the [..., V] tensor is a training step's largest, so each pass over it counts. The entropy
    joins the autograd graph only if entropy_grad (an entropy bonus); otherwise it is a metric.
    """
    scaled = _scaled(logits, temperature)
    lse = torch.logsumexp(scaled, dim=-1)
    logprobs = _picked(scaled, targets, rows) - _at(lse, rows)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = _at(_entropy(scaled, lse), rows)
    return logprobs, entropy


def _picked(scaled: Tensor, targets: Tensor, rows: Optional[Tensor]) -> Tensor:
    """z[..., target], or z[rows[i], targets[i]]."""
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) if rows is None else scaled[rows, targets]


def _at(values: Tensor, rows: Optional[Tensor]) -> Tensor:
    return values if rows is None else values[rows]


def _entropy(scaled: Tensor, lse: Tensor) -> Tensor:
    """H = logsumexp(z) - sum softmax(z) * z, given z and its logsumexp."""
    return lse - (torch.softmax(scaled, dim=-1) * scaled).sum(dim=-1)


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """z = logits / temperature in float32 (no division pass at temperature 1)."""
    return logits.float() if temperature == 1 else logits.float() / temperature
