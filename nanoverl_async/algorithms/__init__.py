"""The algorithm family: advantages, off-policy corrections, policy/value losses, KL; pure tensor functions.

Shapes: N sequences, T tokens, V vocabulary. Per-token tensors are [N, T] and token-indexed (position j
describes token j); masks are 1 exactly on tokens the policy sampled. Every function is stateless and
differentiable only where it says so; nothing knows about models or ranks, and only `policy_loss` reads
config sections, so each one can be checked by hand against its formula (tests/test_algorithms.py and
tests/test_losses.py do, token by token).

  advantages.py   ADVANTAGES: grpo, drgrpo, rloo, reinforce++, gae; DAPO overlong penalty
  corrections.py  CORRECTIONS: none, decoupled (AReaL), tis, mis: anchor, detached IS weight, keep-mask
  losses.py       POLICY_LOSSES: ppo (clip-higher, dual clip), gspo, cispo; AGGREGATIONS; value loss; `policy_loss`
  kl.py           KL_ESTIMATORS: k1/k2/k3 as metric, loss term or reward penalty; entropy bonus
  logprobs.py     token logprobs and entropies from logits

To add an estimator, a correction or a loss, write a function beside these with the same shapes and
calling convention, add it to its module's table (a dict literal: name -> function), and test it against a
naive loop: the config accepts the name and the learner dispatches to it from then on.
Run alone: `python -m pytest tests/test_algorithms.py tests/test_losses.py -q`.
"""

from nanoverl_async.algorithms.advantages import (ADVANTAGES, drgrpo_advantages, gae_advantages, grpo_advantages,
                                                  outcome_token_rewards, overlong_penalty, reinforce_pp_advantages,
                                                  rloo_advantages)
from nanoverl_async.algorithms.corrections import CORRECTIONS, IS_LEVELS
from nanoverl_async.algorithms.kl import KL_ESTIMATORS, entropy_bonus, kl_estimates, kl_per_token, kl_reward_penalty
from nanoverl_async.algorithms.logprobs import token_entropy, token_logprobs, token_logprobs_and_entropy
from nanoverl_async.algorithms.losses import (AGGREGATIONS, POLICY_LOSSES, LossInputs, aggregate, cispo_loss,
                                              gspo_loss, loss_normaliser, merge_metrics, policy_loss, ppo_clip_loss,
                                              reduce_token_metrics, value_loss)
