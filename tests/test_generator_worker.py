"""GeneratorWorker against a fake buffer (ROUTER + PULL bound here) and a fake weights PUB.

Checks the lease protocol (version, max_groups <= max_groups_in_flight, retry while the gate is closed),
that every pushed trajectory decodes and validates and that each group is complete, that a published
weights version is applied and reported (interrupt and drain), that stop() ends run() promptly, and
that a failure in a task ends run() with that exception. No Ray.
"""

import asyncio
import threading
import time

import msgpack
import pytest
import torch
import xxhash
import zmq
import zmq.asyncio
from transformers import Qwen2Config, Qwen2ForCausalLM

from nanoverl_async.agents import multiply_task
from nanoverl_async.config import AgentConfig, Config, DataConfig, GeneratorConfig, WeightSyncConfig
from nanoverl_async.controller.preflight import prepare
from nanoverl_async.generators.worker import GeneratorClock, GeneratorWorker
from nanoverl_async.models.tiny import build_tokenizer
from nanoverl_async.wire.buckets import BucketSet
from nanoverl_async.wire.trajectory import decode
from nanoverl_async.agents.user_code import UserCodeError

GROUP_SIZE = 3


def tiny_model(vocab_size: int, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("worker_model")
    tokenizer = build_tokenizer()
    tiny_model(len(tokenizer), seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class FakeBuffer:
    """Leases `first_groups` groups, then only empty replies until a version >= `reopen_at` is reported."""

    def __init__(self, context, first_groups: int, reopen_at: int):
        self.router, self.pull = context.socket(zmq.ROUTER), context.socket(zmq.PULL)
        port_l = self.router.bind_to_random_port("tcp://127.0.0.1")
        port_t = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.endpoints = {"leases": f"tcp://127.0.0.1:{port_l}", "trajectories": f"tcp://127.0.0.1:{port_t}"}
        self.first_groups, self.reopen_at = first_groups, reopen_at
        self.requests, self.trajectories, self.leased_at = [], [], {}
        self.reported = 0

    async def serve(self, reply_error: bool = False):
        poller = zmq.asyncio.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        while True:
            for sock, _ in await poller.poll():
                if sock is self.pull:
                    self.trajectories.append(decode(await self.pull.recv()))
                    continue
                *envelope, payload = await self.router.recv_multipart()
                request = msgpack.unpackb(payload)
                self.requests.append(request)
                reply = {"error": "no"} if reply_error else self._reply(request)
                await self.router.send_multipart(envelope + [msgpack.packb(reply)])

    def _reply(self, request):
        if request["op"] == "report":
            self.reported = max(self.reported, request["version"])
            return {"ok": True}
        reopened = self.reported >= self.reopen_at and len(self.leased_at) == self.first_groups  # one more group
        if len(self.leased_at) >= self.first_groups and not reopened:
            return {"leases": []}
        group_id = len(self.leased_at)
        self.leased_at[group_id] = self.reported
        return {"leases": [{"group_id": group_id, "prompt_index": 100 + group_id,
                            "sample": multiply_task.make_prompt(0, group_id)}]}


def weights_messages(version: int, state_dict: dict, bucket_bytes: int = 32 * 1024) -> list[list[bytes]]:
    """A version as a publisher sends it over the socket: several buckets at this size, each one part."""
    published = BucketSet.of({k: v for k, v in state_dict.items() if k != "lm_head.weight"}, version, bucket_bytes)
    messages = []
    for index, payload in enumerate(published.payloads):
        payload = bytes(payload)
        notice = {"version": version, "bucket": index, "buckets": len(published.payloads), "nbytes": len(payload),
                  "offset": 0, "checksum": xxhash.xxh3_128(payload).hexdigest()}
        messages.append([msgpack.packb(notice), payload])
    return messages


def make_worker(model_dir, mode, env=None, sync_timeout_s=20.0, **agent):
    cfg = prepare(Config(generator=GeneratorConfig(max_groups_in_flight=2),  # roles get prepared configs
                         agent=AgentConfig(max_turns=2, max_new_tokens=8, max_total_tokens=40, **agent),
                         weight_sync=WeightSyncConfig(mode=mode, timeout_s=sync_timeout_s),
                         data=DataConfig(samples_per_prompt=GROUP_SIZE)))
    return GeneratorWorker(4, cfg, model_dir, env=env)


async def until(condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def weights_socket(context: zmq.asyncio.Context):
    """A PUB socket on a free loopback port, where a worker subscribes to weights: (the socket, its endpoint)."""
    pub = context.socket(zmq.PUB)
    return pub, f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"


@pytest.mark.parametrize("mode", ["interrupt", "drain"])
def test_leases_pushes_applies_weights_and_stops(model_dir, mode):
    async def main():
        context = zmq.asyncio.Context()
        buffer = FakeBuffer(context, first_groups=3, reopen_at=1)
        pub, weights_endpoint = weights_socket(context)
        serving = asyncio.ensure_future(buffer.serve())
        worker = make_worker(model_dir, mode)
        running = asyncio.ensure_future(worker.run(buffer.endpoints, weights_endpoint))
        try:
            await until(lambda: len(buffer.trajectories) >= 1)  # groups are in flight now
            messages = weights_messages(1, tiny_model(len(worker.tokenizer), seed=1).state_dict())
            assert len(messages) > 2
            while buffer.reported < 1:  # PUB drops messages sent before the subscription lands: resend
                for message in messages:
                    await pub.send_multipart(message)
                await asyncio.sleep(0.05)
            await until(lambda: len(buffer.trajectories) == 4 * GROUP_SIZE)
            assert worker.engine.version == 1 and [r["op"] for r in buffer.requests].count("report") == 1
            stopped_at = time.monotonic()
            worker.stop()
            await asyncio.wait_for(running, 5.0)
            assert time.monotonic() - stopped_at < 2.0
        finally:
            worker.stop()
            serving.cancel()
            context.destroy(linger=0)
        return buffer

    buffer = asyncio.run(asyncio.wait_for(main(), 120))
    leases = [r for r in buffer.requests if r["op"] == "lease"]
    assert all(r["generator_id"] == 4 and 1 <= r["max_groups"] <= 2 for r in leases)
    assert {r["version"] for r in leases} == {0, 1}  # the gate was retried with the new version
    assert {"op": "report", "generator_id": 4, "version": 1} in buffer.requests
    groups = {}
    for t in buffer.trajectories:
        groups.setdefault(t.group_id, []).append(t)
        assert t.prompt_index == 100 + t.group_id and t.generator_id == 4 and len(t.token_ids) <= 40
    assert {g: sorted(t.sample_index for t in ts) for g, ts in groups.items()} == {g: [0, 1, 2] for g in range(4)}
    for key in ("clock_ms", "busy_ms", "tool_wait_ms"):  # the generator's clock, as totals so far: never going back
        totals = [r[key] for r in leases]
        assert totals == sorted(totals), key
    assert 0 < leases[-1]["busy_ms"] + leases[-1]["tool_wait_ms"] <= leases[-1]["clock_ms"]  # it generated 4 groups
    for group_id, trajectories in groups.items():
        token_versions = {v for t in trajectories for v in t.versions[t.versions >= 0].tolist()}
        if buffer.leased_at[group_id] >= 1:  # leased after the report: only the new weights
            assert token_versions == {1}
        elif mode == "drain":  # in-flight episodes finished under the old weights before the swap
            assert token_versions == {0}


def test_generator_clock_gives_each_interval_to_the_state_seen_at_its_start():
    clock = GeneratorClock(now=0.0)
    clock.look(1.0, computing=True, episodes=True)  # 0-1: idle (not counted)
    clock.look(3.0, computing=False, episodes=True)  # 1-3: busy
    clock.look(3.5, computing=False, episodes=False)  # 3-3.5: every episode in flight waits on a tool
    clock.look(5.0, computing=True, episodes=False)  # 3.5-5: idle
    clock.look(5.25, computing=False, episodes=False)  # 5-5.25: busy
    assert clock.seconds == {"clock": 5.25, "busy": 2.25, "tool_wait": 0.5}
    assert clock.milliseconds() == {"clock_ms": 5250, "busy_ms": 2250, "tool_wait_ms": 500}


def test_failures_end_run_with_the_exception(model_dir):
    class BadEnv(multiply_task.MultiplyEnv):
        async def step(self, sample, message):
            raise ZeroDivisionError("score exploded")

    async def main(env, reply_error, first_groups=1, sync_timeout_s=20.0):
        context = zmq.asyncio.Context()
        buffer = FakeBuffer(context, first_groups=first_groups, reopen_at=99)
        pub, endpoint = weights_socket(context)
        serving = asyncio.ensure_future(buffer.serve(reply_error))
        try:
            worker = make_worker(model_dir, "interrupt", env, sync_timeout_s)
            await asyncio.wait_for(worker.run(buffer.endpoints, endpoint), 30)
        finally:
            serving.cancel()
            context.destroy(linger=0)

    env = BadEnv  # the worker makes one environment per episode
    with pytest.raises(UserCodeError, match=r"agent.env BadEnv.step\(\) raised ZeroDivisionError: score exploded at "
                                            r"test_generator_worker.py:\d+ in step"):
        asyncio.run(main(env, reply_error=False))
    with pytest.raises(RuntimeError, match="buffer refused"):
        asyncio.run(main(None, reply_error=True))
    with pytest.raises(TimeoutError, match="gate stayed closed for version 0"):  # no weights ever came
        asyncio.run(main(None, reply_error=False, first_groups=0, sync_timeout_s=0.3))


def test_a_hung_hook_ends_run_within_its_timeout_naming_its_line(model_dir):
    """A synchronous step() that never returns ends the generator's run with the one line the controller shows,
    at agent.hook_timeout_s: not at run.step_timeout_s, when the buffer gives up on the batch naming no hook."""
    release = threading.Event()

    class HungStep(multiply_task.MultiplyEnv):
        def step(self, sample, message):
            release.wait(30)

    async def main():
        context = zmq.asyncio.Context()
        buffer = FakeBuffer(context, first_groups=1, reopen_at=99)
        pub, endpoint = weights_socket(context)
        serving = asyncio.ensure_future(buffer.serve())
        try:
            worker = make_worker(model_dir, "interrupt", HungStep, hook_timeout_s=0.5)
            started = time.monotonic()
            with pytest.raises(UserCodeError, match=r"^agent.env HungStep.step\(\) \(defined at test_generator_worker"
                                                    r".py:\d+\) did not return within 0.5 s \(agent.hook_timeout_s\); "
                                                    r"it was at test_generator_worker.py:\d+ in step$"):
                await asyncio.wait_for(worker.run(buffer.endpoints, endpoint), 30)
            return time.monotonic() - started
        finally:
            serving.cancel()
            context.destroy(linger=0)

    try:
        assert asyncio.run(main()) < 10  # an episode's turns on the tiny model, then 0.5 s
    finally:
        release.set()


def test_stop_before_and_while_gated(model_dir):
    async def main():
        context = zmq.asyncio.Context()
        buffer = FakeBuffer(context, first_groups=0, reopen_at=99)  # the gate never opens
        endpoint = "tcp://127.0.0.1:9"  # nobody publishes weights
        serving = asyncio.ensure_future(buffer.serve())
        try:
            worker = make_worker(model_dir, "interrupt")
            worker.stop()
            await asyncio.wait_for(worker.run(buffer.endpoints, endpoint), 2.0)  # stopped before it started
            worker = make_worker(model_dir, "interrupt")
            running = asyncio.ensure_future(worker.run(buffer.endpoints, endpoint))
            await until(lambda: len(buffer.requests) >= 3)  # retrying against a closed gate
            worker.stop()
            await asyncio.wait_for(running, 2.0)
        finally:
            serving.cancel()
            context.destroy(linger=0)
        return buffer

    buffer = asyncio.run(main())
    # gated from the start: no episode, so no time busy or waiting on tools
    assert all({**r, "clock_ms": 0} == {"op": "lease", "generator_id": 4, "version": 0, "max_groups": 2, "clock_ms": 0,
                                         "busy_ms": 0, "tool_wait_ms": 0} for r in buffer.requests)
