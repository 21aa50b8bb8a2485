"""What a learner rank is built from (`LearnerSetup`), apart from the rank itself (fsdp_rank.py), so that the
controller, which builds it, never imports FSDP or a model class (seconds of start-up).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from nanoverl_async.config import (AlgorithmConfig, CriticConfig, KLConfig, LearnerConfig, ModelConfig,
                                   ReferenceConfig)
from nanoverl_async.wire.auth import CurveKeys

PROCESS_GROUP_TIMEOUT_S = 600  # a collective that waits longer than this fails loudly instead of hanging


@dataclass(frozen=True)
class LearnerSetup:
    """What every learner rank is built from: the config sections it reads, and three values from others."""

    model: ModelConfig  # path: a Hugging Face directory (builtin: names resolved); dtype: compute and publish
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)  # KL's frozen policy; "" = model.path
    critic: CriticConfig = field(default_factory=CriticConfig)  # algorithm.advantage=gae only
    wire_host: str = "127.0.0.1"  # where rank 0's weight publisher binds (wire.host as placed, wire/auth.py)
    temperature: float = 1.0  # generator.temperature: logprobs of the distribution the generators sample
    seed: int = 0  # run.seed
    max_total_tokens: int = 0  # agent.max_total_tokens: overlong limit, seq-mean-token-sum-norm's constant
    curve: Optional[CurveKeys] = None  # the run's wire keys (wire/auth.py)
    bucket_mb: int = 512  # weight_sync.bucket_mb: rank 0 publishes each version in buckets of this size

    @property
    def forwards(self) -> list[str]:
        """The TrainBatch fields that `LearnerPool.prepare` computes by a forward before the update
        (LearnerRank.compute). The proximal logprobs only with several optimizer steps per batch: with one,
        the update's own forward runs on the very weights that define p_old, so its detached logprobs ARE
        p_old, bit for bit (tests/test_fsdp.py), and a separate forward would cost a third of the update (unless
        LoRA's dropout makes that forward differ from one in eval mode)."""
        learner = self.learner
        needed = {"proximal_logprobs": learner.ppo_epochs * learner.minibatches > 1 or learner.lora.drops,
                  "reference_logprobs": self.kl.loss_coef > 0 or self.kl.reward_coef > 0,
                  "values": self.algorithm.advantage == "gae"}
        return [name for name, wanted in needed.items() if wanted]
