"""A request's state in the builtin engine: what it asked for, what it has sampled so far, the KV blocks it holds.

    request = Request(prompt_ids, SamplingParams(16, 1.0), loop.create_future(), episode_id="0-3-1")
    request.context()          # prompt + sampled tokens: what a recomputation after a preemption computes
    request.completion         # token_ids, logprobs, versions, counters: the caller's result when it ends

Why a module of its own: the scheduler (scheduler.py, no torch) decides on requests, the block pool
(kv_blocks.py) hands them blocks, the model runner (model_runner.py) reads their tokens and blocks, and the engine
(builtin_engine.py) resolves their futures; none of them owns the state.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from nanoverl_async.agents.engine import Completion, SamplingParams


@dataclass
class Request:
    """One `generate` call, from its arrival to its result: waiting, running (row i of the block table), or
    back in the queue after a preemption with its sampled tokens, which keep their versions and logprobs."""

    input_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    episode_id: str = ""
    completion: Completion = field(default_factory=Completion)
    blocks: list[int] = field(default_factory=list)  # while running: position p is in blocks[p // block_size]
    hashes: list[bytes] = field(default_factory=list)  # of its context's full blocks (kv_blocks.prefix_hashes)
    seed: bytes = b""  # the seed `hashes` chain from

    def length(self) -> int:
        """Tokens so far: the prompt and the sampled ones (all but the last are in the cache)."""
        return len(self.input_ids) + len(self.completion.token_ids)

    def context(self) -> list[int]:
        return self.input_ids + self.completion.token_ids

    def tokens(self, begin: int, end: int) -> list[int]:
        """The context's tokens [begin, end), without building the whole context."""
        cut = len(self.input_ids)
        return self.input_ids[begin:end] + self.completion.token_ids[max(0, begin - cut):max(0, end - cut)]
