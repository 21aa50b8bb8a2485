"""The inference engine interface the agent loop and the generator worker program against: what the agent loop
needs of an engine, so it sits here with the loop and both engines (generators/) import it downward.

An engine turns token ids into sampled token ids, one request at a time from the caller's point of
view, while batching concurrent requests internally. It is the only place that touches weights on the
generator side: `stage_weights` swaps in a new version at a safe point, a bucket at a time, and every
sampled token records the version of the weights that produced it.

Invariants every engine keeps (tests/test_engine.py checks the transformers one):
  - `Completion.logprobs[i]` is log softmax(logits / temperature)[token_ids[i]]: the log-probability of
    the token under the distribution actually sampled (the behaviour policy mu of the loss);
  - `Completion.versions[i]` is the engine's `version` when token i was sampled (>= 0), and every token
    is sampled with the weights of one version only (none while a version's buckets are being loaded);
  - generation stops after a stop token (which is included in `token_ids`, finish_reason "stop") or
    after `max_new_tokens` tokens (finish_reason "length"), whichever comes first.

Implementations: `generators/builtin_engine.BuiltinEngine` (CPU/GPU, the embedded default) and
`generators/sglang_engine.SGLangEngine` (SGLang servers on GPUs); `generators/worker.make_engine` picks one
from `generator.engine`.
Run alone: nothing to run; see generators/builtin_engine.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int  # at most this many sampled tokens (>= 1)
    temperature: float = 1.0  # > 0; logprobs are of softmax(logits / temperature)
    stop_token_ids: tuple[int, ...] = ()  # sampling one of these ends the request (it is kept)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy decoding is not a sampling policy), "
                             f"got {self.temperature}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)  # sampled tokens, the stop token included
    logprobs: list[float] = field(default_factory=list)  # behaviour logprob of each sampled token
    versions: list[int] = field(default_factory=list)  # weight version that sampled each token
    finish_reason: str = ""  # stop | length
    # context tokens the engine prefilled for this request (again after a preemption or a weight swap), and
    # how many of them it served from its prefix cache; as SGLang's meta_info cached_tokens
    prefill_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0  # times the request was put back in the queue because the KV cache was full


class Engine(Protocol):
    version: int  # weights version currently loaded (training steps, i.e. batches, the weights have seen)

    async def generate(self, input_ids: list[int], params: SamplingParams, *,
                       episode_id: Optional[str] = None) -> Completion:
        """Sample a continuation of `input_ids`; concurrent calls are batched by the engine. `episode_id`
        (optional) names the episode, so a pool of servers keeps its turns on one server (prefix cache)."""

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int, bucket: tuple[int, int] = (0, 1)
                      ) -> None:
        """Load `state_dict`, bucket (index, count) of weights `version` (wire/buckets.py), at the next safe point
        (between decode steps). Buckets come in index order; a bucket 0 starts a version (abandoning one not
        complete), and the last completes it. From a version's first bucket to its last, the engine decodes
        nothing: it never computes with weights of two versions. The tensors are valid only during the call."""

    def in_flight(self) -> int:
        """Requests generating or waiting to (0: the engine has nothing to compute; worker.GeneratorClock)."""
