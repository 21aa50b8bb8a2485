"""Advantage estimators and reward shaping: outcome rewards -> per-sequence [N] or per-token [N, T] advantages.

Layout: rewards [N] with N = groups * group_size, groups contiguous (the G samples of a prompt adjacent).
Per-token tensors are [N, T] and token-indexed; loss_mask is 1 exactly on tokens the policy sampled.
Token-level estimators (reinforce++, gae) run their recursion over SAMPLED tokens only: prompt, tool and
padding tokens are skipped, as if the sampled tokens of a row were one contiguous response (verl does the
same for multi-turn: observation tokens carry no value, TD error or discount step). They are computed on
the WHOLE batch before it is sharded over ranks, so batch statistics are global.

ADVANTAGES holds every estimator by name (algorithm.advantage). They share one calling convention: keyword
arguments each picks from (rewards, group_size, loss_mask, values, gamma, lam, kl_penalty; `**_` takes the
rest), so the learner calls ADVANTAGES[name](**inputs) whatever the estimator needs. Each returns the
advantages; gae returns (advantages, returns), the critic's targets too. The DAPO group filter lives in
buffer/replay.py, where groups complete.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    assert rewards.dim() == 1 and group_size >= 1 and rewards.numel() % group_size == 0, \
        f"rewards {tuple(rewards.shape)} do not split into groups of {group_size}"
    return rewards.float().view(-1, group_size)


def grpo_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6, **_) -> Tensor:
    """GRPO outcome advantages (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, sec. 4.1.2):

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

    rewards [N] with N = groups * group_size, groups contiguous -> advantages [N]. std is the sample
    std (Bessel-corrected, as in TRL and verl). A group whose rewards all tie gets A = 0 (it carries
    no signal); a single-sample group has no baseline and gets A = 0 too.
    """
    groups = _groups(rewards, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True, correction=1 if group_size > 1 else 0)
    return ((groups - mean) / (std + eps)).view(-1)


def drgrpo_advantages(rewards: Tensor, group_size: int, **_) -> Tensor:
    """Dr. GRPO advantages (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783):

        A_i = r_i - mean(r_group)      (no division by the group std: it biases towards easy/hard prompts)

    rewards [N] -> [N]. Pair it with `seq-mean-token-sum-norm` aggregation (no per-sequence length
    normalisation), the paper's other half. Tied groups and single-sample groups get A = 0.
    """
    groups = _groups(rewards, group_size)
    return (groups - groups.mean(dim=1, keepdim=True)).view(-1)


def rloo_advantages(rewards: Tensor, group_size: int, **_) -> Tensor:
    """RLOO advantages (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian et
    al. 2024, arXiv:2402.14740): the baseline of sample i is the mean of the OTHER samples of its group,

        A_i = r_i - 1/(G-1) sum_{j != i} r_j = G/(G-1) * (r_i - mean(r_group))

    rewards [N] -> [N]. A single-sample group has no other sample and gets A = 0.
    """
    groups = _groups(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(groups).view(-1)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others).view(-1)


def outcome_token_rewards(rewards: Tensor, loss_mask: Tensor, kl_penalty: Tensor | None = None) -> Tensor:
    """Per-token rewards for token-level estimators: the outcome reward r_i on the LAST sampled token of
    row i, minus an optional per-token KL penalty (see kl.kl_reward_penalty) on every sampled token:

        R_{i,t} = [t = last sampled token of i] * r_i - kl_penalty_{i,t}       (0 off the mask)

    rewards [N], loss_mask [N, T], kl_penalty [N, T] or None -> [N, T]. A row with no sampled token gets 0.
    """
    mask = loss_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=1, keepdim=True)  # -1 on a fully masked row
    out = torch.where(mask & (positions == last), rewards.float().unsqueeze(1), 0.0)
    if kl_penalty is not None:
        out = out - torch.where(mask, kl_penalty.float(), 0.0)
    return out


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries of the whole tensor (Bessel-corrected var, as
    verl's masked_whiten); 0 off the mask. [N, T] -> [N, T]."""
    mask = mask.bool()
    count = mask.sum().clamp(min=1)
    mean = torch.where(mask, values, 0.0).sum() / count
    var = torch.where(mask, (values - mean) ** 2, 0.0).sum() / (count - 1).clamp(min=1)
    return torch.where(mask, (values - mean) * torch.rsqrt(var + eps), 0.0)


def reinforce_pp_advantages(rewards: Tensor, loss_mask: Tensor, gamma: float = 1.0,
                            kl_penalty: Tensor | None = None, eps: float = 1e-8, **_) -> Tensor:
    """REINFORCE++ advantages (Hu 2025, "REINFORCE++", arXiv:2501.03262): discounted per-token returns of
    R = outcome_token_rewards(rewards, loss_mask, kl_penalty), then normalised over the whole batch:

        G_{i,t} = sum_{s >= t, s sampled} gamma^{(# sampled tokens from t to s) - 1} R_{i,s}
        A_{i,t} = (G_{i,t} - mean(G)) / sqrt(var(G) + eps)      (mean/var over all sampled tokens)

    The discount steps over sampled tokens only (tool/prompt tokens skipped). rewards [N], loss_mask [N, T],
    kl_penalty [N, T] or None -> [N, T], 0 off the mask. G is GAE's advantage with V = 0 and lambda = 1:
    delta_t = R_t, A_t = R_t + gamma * A_{t'}, the same recursion.
    """
    values = torch.zeros(loss_mask.shape, dtype=torch.float32, device=loss_mask.device)
    returns, _ = gae_advantages(rewards, loss_mask, values, gamma, 1.0, kl_penalty, whiten=False)
    return masked_whiten(returns, loss_mask.bool(), eps)


def gae_advantages(rewards: Tensor, loss_mask: Tensor, values: Tensor, gamma: float, lam: float,
                   kl_penalty: Tensor | None = None, whiten: bool = True, **_) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438) over sampled tokens, on
    R = outcome_token_rewards(rewards, loss_mask, kl_penalty). values[:, t] is the critic's V of the state
    in which token t is sampled (token-indexed, like logprobs). For sampled token t, with t' the NEXT
    SAMPLED token of the row (prompt/tool tokens skipped; V = 0 and A = 0 after the last sampled token):

        delta_t = R_t + gamma * V_{t'} - V_t,      A_t = delta_t + gamma * lam * A_{t'},      returns_t = A_t + V_t

    rewards [N], loss_mask, values, kl_penalty [N, T] -> (advantages, returns) [N, T], 0 off the mask.
    Advantages are whitened over the batch's sampled tokens when `whiten` (as verl and the PPO reference
    code); returns (the critic's targets) never are. Nothing is differentiable: inputs are detached.
    """
    assert values is not None, "gae needs the critic's values (LearnerPool.prepare computes them)"
    mask = loss_mask.bool()
    rewards, values = outcome_token_rewards(rewards, loss_mask, kl_penalty).detach(), values.detach().float()
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    next_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        on = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(on, advantage, 0.0)
        next_value = torch.where(on, values[:, t], next_value)
        next_advantage = torch.where(on, advantage, next_advantage)
    returns = torch.where(mask, advantages + values, 0.0)
    return (masked_whiten(advantages, mask) if whiten else advantages), returns


ADVANTAGES = {"grpo": grpo_advantages, "drgrpo": drgrpo_advantages, "rloo": rloo_advantages,  # algorithm.advantage
              "reinforce++": reinforce_pp_advantages, "gae": gae_advantages}


def overlong_penalty(lengths: Tensor, max_length: int, buffer_length: int, penalty: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, "DAPO", arXiv:2503.14476, eq. 13), added to the reward:

        0                                          if L <= L_max - L_buf
        -penalty * (L - (L_max - L_buf)) / L_buf   if L_max - L_buf < L <= L_max
        -penalty                                   if L > L_max

    lengths [N] (tokens of each response) -> [N] float. buffer_length = 0 turns it off (all zeros).
    """
    lengths = lengths.float()
    if buffer_length <= 0:
        return torch.zeros_like(lengths)
    start = max_length - buffer_length
    return -penalty * ((lengths - start) / buffer_length).clamp(min=0.0, max=1.0)

