"""The builtin engine's scheduler: which requests run in a step, which wait, which are preempted. Pure Python (no
torch): it decides, and the model runner (model_runner.py) moves the tensors that follow.

    scheduler = Scheduler(pool, max_rows=256, prefill_tokens=8192, seed=0)   # pool: kv_blocks.BlockPool
    scheduler.add(request)                     # sequence.Request, at the back of the queue
    while scheduler.short_of_blocks():
        scheduler.requeue(1, preempted=True)   # the most recently admitted row goes back to the queue's front
    updates, copies = scheduler.grow()         # blocks for the running rows' next token
    admission = scheduler.admit()              # the waiting requests that fit, as rows after the running ones
    holes, movers = scheduler.postprocess(tokens, logprobs, version)   # after the runner sampled a token per row

Why apart from the tensors: the queue's order, the limits and preemption are where scheduling bugs live
(docs/design.md "The builtin engine"), and they are checked here without a model (tests/test_scheduler.py).
Run alone: nothing to run; tests/test_scheduler.py drives it on its own, tests/test_kv_blocks.py through the engine.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Sequence

from nanoverl_async.generators.kv_blocks import BlockPool, version_seed

if TYPE_CHECKING:  # sequence.py imports the engine protocol, and with it torch
    from nanoverl_async.generators.sequence import Request


class Admission(NamedTuple):
    """The requests a step admits, as rows after the running ones: first those that compute (each after its
    cached prefix, `offsets`), then the copies, which repeat the context of admitted request `sources[i]`;
    `wave_seed`: with lockstep, the seed of the wave's sampler (None otherwise)."""

    requests: list[Request]
    offsets: list[int]
    sources: list[int]
    wave_seed: Optional[int] = None


class Scheduler:
    """The waiting queue and the running rows (row i of `running` is row i of the block table) of one engine,
    over its `BlockPool`."""

    def __init__(self, pool: BlockPool, max_rows: int, prefill_tokens: int, seed: int):
        self.pool, self.max_rows, self.prefill_tokens, self.seed = pool, max_rows, prefill_tokens, seed
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.lockstep: Optional[Callable[[], int]] = None  # run.deterministic: the episodes that will call again
        self.chain_seed = version_seed(0)  # the first link of the prefix hashes: the weights version's

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def drop_loop(self, loop) -> None:
        """Requests left by an event loop that has gone (a previous asyncio.run) can never be answered: they are
        dropped and the rows' blocks released."""
        self.waiting = [r for r in self.waiting if r.future.get_loop() is loop]
        self.release(self.running)

    def unfit(self, input_tokens: int, more: str, positions: int) -> str:
        """Why a request of `input_tokens` input tokens + `more` could never run: its `positions` of KV cache are
        more than the whole pool holds ("" if they are not)."""
        held = self.pool.capacity * self.pool.block_size
        return f"{input_tokens} input tokens + {more} need {positions} positions of KV cache; " \
               f"generator.kv_cache_memory holds {held}" if positions > held else ""

    def in_flight(self) -> int:
        return len(self.waiting) + sum(not r.future.done() for r in self.running)

    def waits_for_wave(self) -> bool:
        """With lockstep, a wave starts once every episode that will still call waits (some may be in a tool)."""
        return self.lockstep is not None and not self.running and len(self.waiting) < self.lockstep()

    def short_of_blocks(self) -> bool:
        """Whether the running rows' next tokens need more blocks than are free (else every row may take one)."""
        return self.pool.free() < len(self.running) and self.pool.need(self.running) > self.pool.free()

    def grow(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        """Blocks for the running rows' next token: kv_blocks.BlockPool.grow."""
        return self.pool.grow(self.running, self.chain_seed)

    def requeue(self, count: int, preempted: bool = False) -> None:
        """Put the last `count` running rows back at the front of the queue, in order: their blocks are released
        (full ones stay cached under their hashes), and they are computed again when admitted."""
        rows = self.running[len(self.running) - count:]
        del self.running[len(self.running) - count:]
        self.release(rows)
        self.waiting[:0] = [r for r in rows if not r.future.done()]  # a cancelled one is dropped
        if preempted:
            for request in rows:
                request.completion.preemptions += 1

    def release(self, rows: Sequence[Request]) -> None:
        for request in rows:
            self.pool.release_row(request)
        if rows is self.running:
            self.running = []

    def new_weights(self, version: int) -> None:
        """Weights `version` are in: no cached block can match again, and the running rows are computed again
        under them, from the queue's front."""
        self.chain_seed = version_seed(version)
        self.pool.forget()
        self.requeue(len(self.running))

    def fail(self, requests: Sequence[Request], error: BaseException) -> None:
        """The callers of `requests` get `error` (or are cancelled with the engine); the running rows are released."""
        for request in requests:
            if not request.future.done():
                request.future.set_exception(error) if isinstance(error, Exception) else request.future.cancel()
        self.release(self.running)

    def admit(self) -> Admission:
        """The waiting requests that fit, in order: a free row, and blocks for their context past its cached
        prefix, while the step computes at most `prefill_tokens` for them (the first of a step, and a lockstep
        wave, whatever they compute). They become the rows after the running ones."""
        start = len(self.running)
        if not self.waiting or start >= self.max_rows or (self.lockstep is not None and self.running):
            return Admission([], [], [])
        wave_seed = self._wave_seed() if self.lockstep is not None else None
        firsts, offsets, copies, sources, index_of, taken, computed = [], [], [], [], {}, 0, 0
        for request in self.waiting:
            if start + len(firsts) + len(copies) == self.max_rows:
                break
            if not request.future.done() and (unfit := self.unfit(
                    len(request.input_ids), f"{len(request.completion.token_ids)} sampled tokens", request.length())):
                request.future.set_exception(ValueError(unfit))  # only a row past generate's check: never placed
            if not request.future.done():  # else cancelled while it waited (or refused): dropped
                context = request.context()
                source = index_of.get(tuple(context))
                if source is not None:  # a copy: its whole context is served from its source's blocks
                    self.pool.share(request, firsts[source])
                    offset = len(context)
                    copies.append(request)
                    sources.append(source)
                else:
                    most = self.prefill_tokens - computed if firsts and self.lockstep is None else float("inf")
                    offset = self.pool.place(request, context, self.chain_seed, most)
                    if offset is None:  # no blocks for it, or the step's prefill is full
                        break
                    computed += len(context) - offset
                    index_of[tuple(context)] = len(firsts)
                    firsts.append(request)
                    offsets.append(offset)
                request.completion.prefill_tokens += len(context)
                request.completion.cached_tokens += offset
            taken += 1
        del self.waiting[:taken]
        self.running += firsts + copies
        return Admission(firsts + copies, offsets, sources, wave_seed)

    def _wave_seed(self) -> int:
        """Sort the queue by episode id (a lockstep wave is admitted in the same order in every run) -> the
        sampler's seed for the wave, from the engine's seed and the wave's make-up."""
        self.waiting.sort(key=lambda r: r.episode_id)
        wave = ";".join(f"{r.episode_id}:{len(r.input_ids)}" for r in self.waiting)
        return int.from_bytes(hashlib.blake2b(f"{self.seed}|{wave}".encode(), digest_size=8).digest(), "little") >> 1

    def postprocess(self, tokens: list[int], logprobs: list[float], version: int) -> tuple[list[int], list[int]]:
        """Record the token sampled for each running row, under weights `version`; resolve the rows that finished
        and release them -> (holes, movers): the rows they leave and the last rows that move into them, so rows
        stay 0..R-1 (the runner moves their tensors the same way)."""
        done = []
        for row, (token, logprob) in enumerate(zip(tokens, logprobs)):
            request = self.running[row]
            completion = request.completion
            completion.token_ids.append(token)
            completion.logprobs.append(logprob)
            completion.versions.append(version)
            if token in request.params.stop_token_ids:
                completion.finish_reason = "stop"
            elif len(completion.token_ids) >= request.params.max_new_tokens:
                completion.finish_reason = "length"
            if completion.finish_reason or request.future.done():  # done here = the caller was cancelled
                if not request.future.done():
                    request.future.set_result(completion)
                done.append(row)
        self.release([self.running[row] for row in done])
        keep, gone = len(self.running) - len(done), set(done)
        holes = [row for row in done if row < keep]
        movers = [row for row in range(keep, len(self.running)) if row not in gone]
        for hole, mover in zip(holes, movers):
            self.running[hole] = self.running[mover]
        del self.running[keep:]
        return holes, movers
