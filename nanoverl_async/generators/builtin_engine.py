"""The builtin engine (generator.engine: builtin): continuous batching with the project's own forward over a paged
KV cache; a thin coordinator of a scheduler (scheduler.py, pure Python) and a model runner (model_runner.py).

    engine = BuiltinEngine(model_dir, device="cpu", dtype="float32", seed=0)
    completion = await engine.generate(prompt_ids, SamplingParams(16, 1.0, (eos_id,)))
    engine.stage_weights(state_dict, version, (index, count))   # between two steps

Why: an episode's next turn, after a tool call, must not queue behind the slowest row of a running batch; the
design (continuous batching, paged and shared KV blocks, preemption, lockstep waves, weight swaps) is in
docs/design.md "The builtin engine".
Run alone: nothing to run; tests/test_engine.py and tests/test_kv_blocks.py drive it on tiny models.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

import torch

from nanoverl_async.agents.engine import Completion, SamplingParams
from nanoverl_async.generators.model_runner import ModelRunner, computing
from nanoverl_async.generators.scheduler import Admission, Scheduler
from nanoverl_async.generators.sequence import Request

LOCKSTEP_POLL_S = 0.001  # how often a lockstep engine checks whether every episode is waiting


class BuiltinEngine:
    """The `Engine` protocol (engine.py), continuously batched: a scheduler (scheduler.py) decides each step, and
    a model runner (model_runner.py) computes it."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "float32", seed: int = 0, *,
                 max_batch_size: int = 256, cuda_graphs: bool = True, kv_cache_memory: float | str = 0.0,
                 block_size: int = 16, num_blocks: Optional[int] = None, prefill_tokens: int = 8192,
                 lora_scaling: float = 0.0):
        """`num_blocks` (tests, benchmarks) sizes the pool in blocks instead of `kv_cache_memory`;
        `prefill_tokens` bounds the tokens a step computes for the requests it admits (a longer context is
        admitted alone): the activations of 256 8k-token prompts in one forward would not fit a GPU.
        `lora_scaling` > 0 (learner.lora): a version holds LoRA adapters, merged into the weights at this scale."""
        self.runner = ModelRunner(model_path, device, dtype, seed, rows=max_batch_size, block_size=block_size,
                                  num_blocks=num_blocks, kv_cache_memory=kv_cache_memory, cuda_graphs=cuda_graphs,
                                  lora_scaling=lora_scaling)
        self.device, self.model, self.cache = self.runner.device, self.runner.model, self.runner.cache
        self.scheduler = Scheduler(self.cache.pool, max_batch_size, prefill_tokens, seed)
        self.version = 0
        self.loading: Optional[int] = None  # the version whose buckets `stage_weights` is loading, until its last
        self._task: Optional[asyncio.Task] = None  # the step loop, on the loop of the latest `generate`
        # Counters, for tests and benchmarks: steps (one forward each, a replayed graph's included); shared blocks
        # copied before a row wrote into them (the per-request counts are each Completion's).
        self.decode_steps = self.cow_copies = 0

    @property
    def lockstep(self) -> Optional[Callable[[], int]]:
        """run.deterministic: the episodes that will still call `generate` (docs/design.md "Reproducible runs")."""
        return self.scheduler.lockstep

    @lockstep.setter
    def lockstep(self, live: Optional[Callable[[], int]]) -> None:
        self.scheduler.lockstep = live

    async def generate(self, input_ids: list[int], params: SamplingParams, *,
                       episode_id: Optional[str] = None) -> Completion:
        """See engine.Engine.generate (`episode_id` orders a lockstep wave; prefixes are found by hash)."""
        if len(input_ids) == 0:
            raise ValueError("generate needs at least one input token")
        vocabulary = self.model.config.vocab_size
        if not 0 <= min(input_ids) <= max(input_ids) < vocabulary:  # one bad id would fail the whole step
            raise ValueError(f"token ids {min(input_ids)}..{max(input_ids)} are not all in the model's "
                             f"vocabulary [0, {vocabulary})")
        unfit = self.scheduler.unfit(len(input_ids), f"max_new_tokens={params.max_new_tokens}",
                                     len(input_ids) + params.max_new_tokens - 1)  # the last sampled token: uncached
        if unfit:
            raise ValueError(unfit)
        loop = asyncio.get_running_loop()
        request = Request(list(input_ids), params, loop.create_future(), episode_id or "")
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self.scheduler.drop_loop(loop)
            self._task = loop.create_task(self._run(), name="engine-decode")
        self.scheduler.add(request)
        return await request.future

    def in_flight(self) -> int:
        return self.scheduler.in_flight()

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int, bucket: tuple[int, int] = (0, 1)
                      ) -> None:
        """Load `state_dict`, bucket (index, count) of weights `version`, now: on the event loop's thread, so between
        two steps (model_runner.ModelRunner.load). From a version's first bucket to its last (`loading`) no step
        runs, and then the running rows are computed again under the new weights (docs/design.md "Weights back
        to generators"). The worker stages only versions newer than the engine's, so they are >= 0."""
        index, count = bucket
        if index == 0:
            self.loading = version
        elif self.loading != version:
            raise ValueError(f"weights version {version} bucket {index} of {count} without its earlier buckets "
                             f"(loading {self.loading})")
        self.runner.load(state_dict, version, bucket)
        if index == count - 1:
            self.version, self.loading = version, None
            self.scheduler.new_weights(version)

    async def _run(self) -> None:
        scheduler = self.scheduler
        try:
            while scheduler.waiting or scheduler.running:
                # a version's buckets partly loaded (no step may mix two), or a lockstep wave not all waiting yet
                if self.loading is not None or scheduler.waits_for_wave():
                    await asyncio.sleep(LOCKSTEP_POLL_S)
                    continue
                with computing():
                    try:
                        self._step()
                    except Exception as error:  # the callers of its rows get it; later requests are served
                        scheduler.fail(scheduler.running, error)
                await asyncio.sleep(0)
        except BaseException as error:  # cancelled (its loop is closing) or a bug: no one may wait forever
            scheduler.fail(scheduler.running + scheduler.waiting, error)
            scheduler.waiting = []
            raise

    def _step(self) -> None:
        """One forward for every running row (its last sampled token) and for the waiting requests that fit
        (their context after its cached prefix), then a token sampled for each: requests join without a
        forward of their own. Finished rows leave, and the last rows move into their places."""
        while self.scheduler.short_of_blocks():  # the last rows wait for blocks to free
            self.scheduler.requeue(1, preempted=True)
        updates, copies = self.scheduler.grow()
        self.cache.write(updates, copies)
        self.cow_copies += len(copies)
        running = len(self.scheduler.running)
        admission = self._admissions()
        if not self.scheduler.running:
            return
        tokens, logprobs = self.runner.step(self.scheduler.running, running, admission)
        self.decode_steps += 1
        self.runner.compact(*self.scheduler.postprocess(tokens, logprobs, self.version))

    def _admissions(self) -> Admission:
        """Scheduler.admit, and the sampler reseeded for a lockstep wave (tests watch the admissions here)."""
        admission = self.scheduler.admit()
        if admission.wave_seed is not None:
            self.runner.generator.manual_seed(admission.wave_seed)
        return admission
