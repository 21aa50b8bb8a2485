"""A generator: leases prompt groups from the buffer, runs G agent episodes per group, pushes trajectories.

    worker = GeneratorWorker(0, cfg, model_dir)    # loads the model: may run while the other roles start
    await worker.run(service.endpoints, endpoint)   # until worker.stop() (thread-safe), or until something fails

Tasks on one asyncio loop (a plain class: Ray only wraps it, elsewhere):
  - lease loop: keeps up to `generator.max_groups_in_flight` groups running. It asks the buffer over a
    DEALER socket (docs/design.md "The lease protocol") with its current weights version; an
    empty reply means the admission gate is closed for that version, so it waits ~20 ms or until new
    weights arrive, then asks again with the version it then holds;
  - one task per leased group: G episodes concurrently (agent_loop.run_episode); each finished
    trajectory is PUSHed at once as `trajectory.encode(t)`;
  - weight loop: polls `weights.WeightSubscriber` for the buckets of the newest version and stages each
    (`engine.stage_weights`); the engine decodes nothing from a version's first bucket to its last.
    mode interrupt: at once (in-flight episodes continue under the new weights, their later tokens carry
    the new version). mode drain: before a version's first bucket, stop leasing and wait until the
    in-flight groups finish; resume once it is applied. Either way the applied version is reported to the
    buffer (`{"op": "report"}`), with how often the subscriber asked for weights again after dropping a
    version on the way (weights.py; absent while 0).
With run.trace, every episode's trajectory carries its spans, and each version's load (its receipt to its
application) waits in `trace` until the controller takes it (trace.py).

Fail loudly: every wait has a timeout that raises; an exception in any task ends `run()` with that
exception (so a supervisor sees a dead generator, never a silent hang). `stop()` ends `run()` promptly:
tasks are cancelled and sockets closed with linger 0.

Run alone: tests/test_generator_worker.py drives one against a fake buffer and a fake weights PUB.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Callable, Optional

import msgpack
import torch
import zmq
import zmq.asyncio

from nanoverl_async.agents import sandbox
from nanoverl_async.config import Config, GeneratorConfig, LoRAConfig
from nanoverl_async.agents.env import env_factory
from nanoverl_async.models.load import load_tokenizer
from nanoverl_async.models.lora import scaling
from nanoverl_async.agents.rewards import load_reward
from nanoverl_async.observe.trace import SpanLog
from nanoverl_async.agents.agent_loop import run_episode
from nanoverl_async.agents.engine import Engine
from nanoverl_async.wire.trajectory import encode
from nanoverl_async.agents.user_code import UserCodeError
from nanoverl_async.wire.weights import WeightSubscriber
from nanoverl_async.wire.auth import CurveKeys, connect

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.005  # how often a bounded wait re-checks its condition
REQUEST_TIMEOUT_S = 30.0  # one buffer request, or one trajectory push
GROUP_TIMEOUT_S = 600.0  # one group's G episodes
LEASE_RETRY_S = 0.02  # the wait before asking a closed gate again; the weights poll period
CLOCK_TICK_S = 0.01  # how often GeneratorClock looks (between engine steps: it waits for a running one)
EVAL_TEMPERATURE = 1e-3  # evaluation is (near-)greedy: engines sample with temperature > 0 only


class GeneratorClock:
    """Where a generator's time goes, in milliseconds since it started (`clock_ms`): `busy_ms`, its engine
    computing (requests running or queued), and `tool_wait_ms`, episodes in flight but nothing for the engine
    to compute: every one of them waits on a tool or its environment, the latency asynchronous generation
    exists to hide. The rest is idle (no episode: the gate closed, a lease on its way). Sampled: each interval
    between two looks goes to the state seen at its start. Sent with each lease request; the buffer turns two
    requests' totals into shares of the time between them (generators/busy_frac, generators/tool_wait_frac)."""

    def __init__(self, now: float):
        self.seconds = {"clock": 0.0, "busy": 0.0, "tool_wait": 0.0}
        self._last, self._state = now, "idle"

    def look(self, now: float, computing: bool, episodes: bool) -> None:
        self.seconds["clock"] += now - self._last
        if self._state in self.seconds:
            self.seconds[self._state] += now - self._last
        self._last, self._state = now, "busy" if computing else "tool_wait" if episodes else "idle"

    def milliseconds(self) -> dict[str, int]:
        """The totals as a lease request carries them: {"clock_ms", "busy_ms", "tool_wait_ms"}."""
        return {f"{state}_ms": int(seconds * 1000) for state, seconds in self.seconds.items()}


class GeneratorWorker:
    def __init__(self, generator_id: int, cfg: Config, model_path: str, *, env: Optional[Callable] = None):
        """`model_path`: model.path as the launcher resolved it (models/load.py: a directory, or a Hub id)."""
        torch.set_num_threads(cfg.generator.torch_threads)  # this process is the generator's own
        self.generator_id = generator_id
        self.generator = cfg.generator
        self.agent = cfg.agent
        self.weight_sync = cfg.weight_sync
        self.keep_messages = cfg.run.log_samples > 0  # the controller writes some episodes to samples.jsonl
        self.trace = SpanLog(cfg.run.trace)  # run.trace: episodes carry their spans; weight loads kept here
        self.group_size = cfg.data.samples_per_prompt
        # One environment per episode: `env` (a no-argument factory) or agent.env (filled in by preflight.py).
        self.make_env = env or env_factory(cfg.agent.env, load_reward(cfg.reward.path, cfg.reward.name),
                                           cfg.agent.env_args)
        sandbox.set_isolation(cfg.agent.sandbox)  # the `python` tool runs in this process
        self.tokenizer = load_tokenizer(model_path)
        lora = cfg.learner.lora if cfg.learner.lora.rank else None  # versions hold adapters
        self.engine = make_engine(cfg.generator, model_path, generator_id=generator_id, seed=cfg.run.seed,
                                  dtype=cfg.model.dtype, lora=lora)  # generator.engine: builtin or sglang
        # Episodes that will still call the engine, plus a lease request in flight (it may bring more):
        # with run.deterministic the engine waits for all of them before each wave (docs/design.md "Reproducible runs"),
        # and leases and evaluations each wait until none is left, so they never share a wave.
        self._live = 0
        self.lockstep = cfg.run.deterministic
        if self.lockstep:
            self.engine.lockstep = lambda: self._live
        self._stop_requested = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._error: Optional[BaseException] = None
        self._groups: set[asyncio.Task] = set()
        self._draining = False

    def stop(self) -> None:
        """End `run()` promptly. Safe from any thread, before or during `run()`."""
        self._stop_requested = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    async def run(self, buffer_endpoints: dict, weights_endpoint: str, curve: Optional[CurveKeys] = None) -> None:
        """Lease, generate and apply weights until `stop()`: the buffer's sockets (BufferService.endpoints)
        and the learner's weights publisher, with the run's keys (wire/auth.py)."""
        self.buffer_endpoints = buffer_endpoints
        self._wake, self._new_weights = asyncio.Event(), asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self.clock = GeneratorClock(time.monotonic())
        self._lock = asyncio.Lock()  # one request on the DEALER at a time: replies come back in order
        context = zmq.asyncio.Context()
        subscriber, tasks = None, []
        # subscriber.poll_bucket runs on a thread of its own, where its socket lives from its first poll to its
        # close (never shared): checking a whole version took seconds for a large model, and the engine decodes on
        # this event loop (docs/benchmarks.md "Costs behind choices in the code"). A bucket in the learner's shared
        # memory, or on this GPU by CUDA IPC, is copied and checked there too (weights.py).
        self._weights_thread = ThreadPoolExecutor(1, thread_name_prefix=f"generator-{self.generator_id}-weights")
        try:
            self._dealer, self._push = context.socket(zmq.DEALER), context.socket(zmq.PUSH)
            for socket, name in ((self._dealer, "leases"), (self._push, "trajectories")):
                connect(socket, curve)
                socket.connect(buffer_endpoints[name])
            subscriber = WeightSubscriber(weights_endpoint, curve)
            if not self._stop_requested:
                tasks = [self._spawn(self._lease_loop(), "lease-loop"),
                         self._spawn(self._weight_loop(subscriber), "weights"),
                         self._spawn(self._clock_loop(), "clock")]
                await self._wake.wait()
        finally:
            pending = tasks + list(self._groups)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5.0)
            context.destroy(linger=0)  # closes both sockets without waiting on unsent messages
            if subscriber is not None:
                await self._loop.run_in_executor(self._weights_thread, subscriber.close)
            self._weights_thread.shutdown()
            self._loop = None
        if self._error is not None:
            raise self._error

    def _spawn(self, coroutine, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine, name=f"generator-{self.generator_id}-{name}")
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task) -> None:
        self._groups.discard(task)
        # Not after stop(): a task may outlive its cancellation (Python 3.11's asyncio.wait_for can swallow one)
        # and then read the reply to a request stop() cut off, such as a weights report's.
        if not task.cancelled() and task.exception() is not None and self._error is None and not self._stop_requested:
            self._error = task.exception()
            log.error("generator %d: task %s failed: %r", self.generator_id, task.get_name(), self._error,
                      exc_info=None if isinstance(self._error, UserCodeError) else self._error)  # it names its line
            self._wake.set()

    async def _wait_until(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"generator {self.generator_id}: waited {timeout_s:.0f} s for {what}")
            await asyncio.sleep(WAIT_POLL_S)

    async def _request(self, message: dict) -> dict:
        """One request/reply with the buffer's ROUTER (REQ-style envelope: empty frame, then the map)."""
        async with self._lock:
            await self._dealer.send_multipart([b"", msgpack.packb(message)])
            if not await self._dealer.poll(timeout=int(REQUEST_TIMEOUT_S * 1000)):
                raise TimeoutError(f"generator {self.generator_id}: no reply from the buffer at "
                                   f"{self.buffer_endpoints['leases']} within {REQUEST_TIMEOUT_S:.0f} s "
                                   f"to {message['op']!r}")
            frames = await self._dealer.recv_multipart()
        reply = msgpack.unpackb(frames[-1], raw=False)
        if not isinstance(reply, dict) or "error" in reply:
            raise RuntimeError(f"generator {self.generator_id}: buffer refused {message}: {reply}")
        return reply

    async def _lease_loop(self) -> None:
        limit = self.generator.max_groups_in_flight
        gated_since, gated_version = 0.0, None
        while True:
            await self._wait_until(lambda: not self._draining and len(self._groups) < limit
                                   and not (self.lockstep and self._live),
                                   GROUP_TIMEOUT_S + self.weight_sync.timeout_s, "a free group slot")
            version = self.engine.version
            self._live += 1  # the request in flight (see __init__); a failed one ends the worker
            reply = await self._request({"op": "lease", "generator_id": self.generator_id, "version": version,
                                         "max_groups": limit - len(self._groups), **self.clock.milliseconds()})
            self._live += self.group_size * len(reply["leases"]) - 1
            for lease in reply["leases"]:
                self._groups.add(self._spawn(self._run_group(lease), f"group-{lease['group_id']}"))
            if reply["leases"]:
                gated_version = None
                continue
            # The gate is closed for this version: retry soon, at once if new weights arrive.
            if gated_version != version:
                gated_since, gated_version = time.monotonic(), version
            elif time.monotonic() - gated_since > self.weight_sync.timeout_s:
                raise TimeoutError(f"generator {self.generator_id}: the buffer gate stayed closed for version "
                                   f"{version} and no newer weights arrived within {self.weight_sync.timeout_s:.0f} s")
            self._new_weights.clear()
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._new_weights.wait(), LEASE_RETRY_S)

    async def _clock_loop(self) -> None:
        while True:
            self.clock.look(time.monotonic(), self.engine.in_flight() > 0, bool(self._groups))
            await asyncio.sleep(CLOCK_TICK_S)

    async def _run_group(self, lease: dict) -> None:
        episodes = [self._track(self._episode(lease, i)) for i in range(self.group_size)]
        try:
            done, running = await asyncio.wait(episodes, timeout=GROUP_TIMEOUT_S,
                                               return_when=asyncio.FIRST_EXCEPTION)
            for episode in done:
                episode.result()  # raises a failed episode's error
            if running:
                raise TimeoutError(f"generator {self.generator_id}: group {lease['group_id']} did not finish "
                                   f"within {GROUP_TIMEOUT_S:.0f} s")
        finally:  # a failed sibling (or a timeout) must not leave the others running unowned
            for episode in episodes:
                episode.cancel()
            # Wait for them to unwind, so no episode pushes after run() has closed the sockets.
            await asyncio.gather(*episodes, return_exceptions=True)

    async def _episode(self, lease: dict, sample_index: int) -> None:
        trajectory = await run_episode(self.engine, self.tokenizer, lease["sample"], self.make_env(), self.agent,
                                       self.generator.temperature, group_id=lease["group_id"],
                                       sample_index=sample_index, prompt_index=lease["prompt_index"],
                                       generator_id=self.generator_id,
                                       keep_messages=self.keep_messages, trace=self.trace.enabled)
        await asyncio.wait_for(self._push.send(encode(trajectory)), REQUEST_TIMEOUT_S)

    def _track(self, episode) -> asyncio.Future:
        """Run an episode counted in `_live` (counted by whoever scheduled it) until it ends, however it ends."""
        future = asyncio.ensure_future(episode)
        future.add_done_callback(lambda _: setattr(self, "_live", self._live - 1))
        return future

    async def evaluate(self, samples: list[dict], min_version: int = 0) -> dict:
        """One near-greedy episode per sample, once weights `min_version` or newer are loaded -> eval/*
        metrics (nothing pushed)."""
        await self._wait_until(lambda: self.engine.version >= min_version and not (self.lockstep and self._live),
                               self.weight_sync.timeout_s + GROUP_TIMEOUT_S, f"weights version {min_version}")
        version = self.engine.version
        self._live += len(samples)
        episodes = await asyncio.gather(*(self._track(
            run_episode(self.engine, self.tokenizer, sample, self.make_env(), self.agent, EVAL_TEMPERATURE,
                        prompt_index=i, generator_id=self.generator_id, trajectory_id=f"eval-{i}"))
            for i, sample in enumerate(samples)))
        calls = sum(t.tool_calls for t in episodes)
        return {"eval/reward_mean": sum(t.reward for t in episodes) / len(episodes), "eval/version": version,
                "eval/episodes": len(episodes), "eval/tool_calls_mean": calls / len(episodes),
                "eval/tool_error_rate": sum(t.tool_errors for t in episodes) / max(1, calls),
                "eval/turns_mean": sum(t.num_turns for t in episodes) / len(episodes)}

    async def _weight_loop(self, subscriber: WeightSubscriber) -> None:
        """Stage each bucket the subscriber hands on, in order, until a version's last one completes it. From a
        version's first bucket to its last the engine decodes nothing; if the rest never comes (a bucket lost,
        and the version rewritten by the learner meanwhile), a newer version's buckets replace it, asked for by
        the subscriber. A generator that stays without a whole version for weight_sync.timeout_s fails loudly."""
        partial = None  # the version part-loaded
        progress = 0.0  # its last bucket's time
        received = 0.0  # its first bucket's time
        while True:
            bucket = await self._loop.run_in_executor(self._weights_thread, subscriber.poll_bucket, self.engine.version)
            if bucket is None:
                if partial is not None and time.monotonic() - progress > self.weight_sync.timeout_s:
                    raise TimeoutError(f"generator {self.generator_id}: weights version {partial} is part-loaded and "
                                       f"no bucket of a whole version came within {self.weight_sync.timeout_s:.0f} s")
                await asyncio.sleep(WAIT_POLL_S if partial is not None else LEASE_RETRY_S)
                continue
            if bucket.index == 0:
                received = time.time()  # a version's load: from its first bucket's receipt to its application
                if partial is None and self.weight_sync.mode == "drain":
                    await self._drain(bucket.version)
            self.engine.stage_weights(bucket.tensors, bucket.version, (bucket.index, bucket.count))
            partial, progress = None if bucket.index == bucket.count - 1 else bucket.version, time.monotonic()
            bucket = None  # its tensors go before the next poll: over the socket they hold a bucket's frame
            if partial is None:
                await self._applied(subscriber, self.engine.version, received)

    async def _drain(self, version: int) -> None:
        """Mode drain: stop leasing and wait until the in-flight groups finish before a version's first bucket."""
        self._draining = True  # the lease loop starts no new group meanwhile
        # `_live` also counts a lease request in flight: the groups its reply brings start under the
        # old weights, so they must finish before the swap too.
        await self._wait_until(lambda: not self._groups and not self._live, self.weight_sync.timeout_s,
                               f"in-flight groups to finish before applying weights version {version}")

    async def _applied(self, subscriber: WeightSubscriber, version: int, received: float) -> None:
        self.trace.add("weights", f"weights v{version}", received, time.time(), version=version,
                       mode=self.weight_sync.mode)
        self._draining = False
        self._new_weights.set()
        log.info("generator %d: applied weights version %d (%s)", self.generator_id, version, self.weight_sync.mode)
        report = {"op": "report", "generator_id": self.generator_id, "version": version}
        if subscriber.counts["refetched"]:  # versions dropped on the way and asked for again: buffer/weights_refetched
            report["weights_refetched"] = subscriber.counts["refetched"]
        await self._request(report)


def make_engine(generator: GeneratorConfig, model_path: str, *, generator_id: int, seed: int,
                dtype: str = "float32", lora: Optional[LoRAConfig] = None) -> Engine:
    """The engine `generator.engine` names (validation.py checks the name), for generator `generator_id`
    (imports are lazy: sglang is an optional extra, and its engine launches its servers here); `lora`
    (learner.lora): weight versions are LoRA adapters (models/lora.py)."""
    seed = seed * 10_007 + generator_id  # replicas sample differently from one config seed
    if generator.engine == "sglang":
        from nanoverl_async.generators.sglang_engine import SGLangEngine

        return SGLangEngine(model_path, generator.sglang, generator_id=generator_id, seed=seed, dtype=dtype, lora=lora)
    from nanoverl_async.generators.builtin_engine import BuiltinEngine

    return BuiltinEngine(model_path, generator.device, dtype, seed=seed, kv_cache_memory=generator.kv_cache_memory,
                         block_size=generator.kv_block_size,
                         lora_scaling=scaling(lora) if lora else 0.0)
