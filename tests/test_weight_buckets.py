"""A weights version in buckets (wire/buckets.py): the split at its exact boundaries, a round trip of every dtype
through several buckets, the stamps, one set of buckets reused (and a version the learner started rewriting never
sent), the subscriber's assembly; and a generator fed buckets by a fake publisher: it never decodes with two
versions, a version whose bucket is damaged is dropped and asked for again, the next whole one is applied, and a
part-loaded version with nothing newer ends the run within weight_sync.timeout_s (fast, CPU)."""

import asyncio
import time

import msgpack
import pytest
import torch
import xxhash
import zmq
import zmq.asyncio

from nanoverl_async.wire.buckets import Assembly, BucketSet, plan, stamp_problem
from nanoverl_async.wire.payload_layout import deserialise
from nanoverl_async.wire.weights import WeightPublisher, WeightSubscriber
from test_generator_worker import FakeBuffer, make_worker, tiny_model, until
from test_generator_worker import model_dir  # noqa: F401 (a fixture these tests take)
from weight_waits import wait_newest, wait_sent, wait_subscribed

TIMEOUT_S = 10.0
F32, U8 = torch.float32, torch.uint8


def test_the_split_at_its_boundaries():
    """64-byte buckets: a tensor of exactly 64 bytes fills one; two of 32 share one; one of 65 (a byte over)
    gets its own, and the next tensor starts another; an empty state dict is one empty bucket."""
    entries = {"a": (F32, (16,)), "b": (F32, (8,)), "c": (F32, (8,)), "d": (U8, (65,)), "e": (F32, (1,)),
               "f": (F32, (15,)), "g": (U8, (1,)), "h": (F32, (0, 3))}
    assert [list(bucket) for bucket in plan(entries, 64)] == [["a"], ["b", "c"], ["d"], ["e", "f"], ["g", "h"]]
    assert [list(bucket) for bucket in plan(entries, 65)] == [["a"], ["b", "c"], ["d"], ["e", "f", "g", "h"]]
    # every tensor alone, but the empty one, which adds no byte to the last
    assert [list(bucket) for bucket in plan(entries, 1)] == [["a"], ["b"], ["c"], ["d"], ["e"], ["f"], ["g", "h"]]
    assert plan({}, 64) == [{}]


def every_dtype(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    tied = torch.randn(4, 8, generator=generator)
    return {"embed": tied, "w": torch.randn(16, 9, generator=generator).to(torch.bfloat16), "head": tied,
            "b": torch.randn(7, generator=generator), "half": torch.randn(5, generator=generator).half(),
            "ids": torch.randint(0, 1000, (6,), generator=generator), "flags": torch.rand(3, generator=generator) > 0.5,
            "empty": torch.zeros(0, 3), "big": torch.randn(70, generator=generator)}


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared memory", "socket"])
def test_a_version_in_several_buckets_round_trips_exactly(shared_memory):
    sent = every_dtype(0)
    published = BucketSet.of(sent, 1, bucket_bytes=128)  # "big" (280 bytes) gets a bucket of its own
    assert len(published.payloads) == len(plan({n: (t.dtype, tuple(t.shape)) for n, t in sent.items()}, 128)) > 3
    publisher = WeightPublisher("127.0.0.1", shared_memory=shared_memory)
    subscriber = WeightSubscriber(publisher.endpoint)
    try:
        wait_subscribed(publisher, 1, TIMEOUT_S)
        publisher.publish(1, published)
        version, received = wait_newest(subscriber, 0, TIMEOUT_S)
        assert version == 1 and received.keys() == sent.keys()
        for name, tensor in sent.items():  # bit-equal, names and dtypes
            assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape, name
            assert torch.equal(received[name].view(torch.uint8), tensor.view(torch.uint8)), name
        assert subscriber.counts["received"] == len(published.payloads) and subscriber.counts["dropped"] == 0
        assert subscriber.counts["from_shared_memory"] == (len(published.payloads) if shared_memory else 0)
    finally:
        subscriber.close()
        publisher.close(timeout_s=5)


def test_a_bucket_is_stamped_before_its_bytes_change_and_finish_refuses_a_part_written_version():
    buckets = BucketSet.of({"a": torch.ones(16), "b": torch.ones(16)}, 1, bucket_bytes=64)
    assert [buckets.stamp(i) for i in (0, 1)] == [1, 1]
    assert [stamp_problem(p, 1, i, 2) for i, p in enumerate(buckets.payloads)] == ["", ""]
    assert "the notice says version 2, bucket 0 of 2" in stamp_problem(buckets.payloads[0], 2, 0, 2)
    assert stamp_problem(buckets.payloads[0], 1, 1, 2) != ""  # bucket 0's bytes named bucket 1
    buckets.begin(2)
    buckets.write("a", torch.full((16,), 2.0))
    assert [buckets.stamp(i) for i in (0, 1)] == [2, 1]  # bucket 1 still holds version 1, whole
    assert torch.equal(deserialise(buckets.payloads[1])["b"], torch.ones(16))
    with pytest.raises(RuntimeError, match="1 tensors were not written"):
        buckets.finish(2)
    empty = BucketSet.of({}, 7, bucket_bytes=64)
    assert empty.stamp(0) is None  # nothing written: no version's bytes yet
    empty.finish(7)
    assert empty.stamp(0) == 7 and deserialise(empty.payloads[0]) == {}


def test_the_learner_writes_every_version_into_one_set_and_a_version_it_started_rewriting_is_never_sent():
    publisher = WeightPublisher("127.0.0.1")
    entries = {"a": (F32, (16,)), "b": (F32, (16,))}
    subscriber = late = None
    try:
        first = publisher.writable_buckets(entries, torch.device("cpu"), 64)
        assert publisher.writable_buckets(entries, torch.device("cpu"), 64) is first  # reused, version after version
        assert publisher.writable_buckets(entries, torch.device("cpu"), 128) is not first  # another split
        buckets = publisher.writable_buckets(entries, torch.device("cpu"), 64)
        subscriber = WeightSubscriber(publisher.endpoint)
        write(buckets, 1, 1.0)
        publisher.publish(1, buckets)
        assert wait_newest(subscriber, 0, TIMEOUT_S)[0] == 1
        buckets.begin(2)
        buckets.write("a", torch.full((16,), 2.0))  # the learner is writing version 2 into bucket 0
        late = WeightSubscriber(publisher.endpoint)  # ... when a generator joins: version 1 is torn, never sent
        wait_subscribed(publisher, 2, TIMEOUT_S)
        with pytest.raises(TimeoutError):
            wait_newest(late, 0, 1.0)
        assert late.counts["received"] == 0 and publisher.counts["superseded"] == 0  # version 1 was sent whole
        buckets.write("b", torch.full((16,), 2.0))
        publisher.publish(2, buckets)
        for reader in (subscriber, late):  # the newest, to the late joiner too
            version, received = wait_newest(reader, 1 if reader is subscriber else 0, TIMEOUT_S)
            assert version == 2 and torch.equal(received["b"], torch.full((16,), 2.0))
        wait_sent(publisher, 2, TIMEOUT_S)
    finally:
        for reader in (subscriber, late):
            if reader is not None:
                reader.close()
        publisher.close(timeout_s=5)


def write(buckets: BucketSet, version: int, value: float) -> None:
    buckets.begin(version)
    for name, (dtype, shape) in buckets.entries.items():
        buckets.write(name, torch.full(shape, value, dtype=dtype))


def test_the_assembly_takes_each_bucket_once_in_order_and_newest_wins():
    assembly, verdicts = Assembly(), []
    for held, version, index, count in [(0, 1, 0, 3), (0, 1, 0, 3), (0, 1, 1, 3),  # take, repeat, take
                                        (0, 1, 2, 3),  # take: version 1 whole
                                        (1, 1, 0, 3), (1, 2, 1, 3), (1, 2, 2, 3),  # held; gap (once); skip
                                        (1, 2, 0, 3), (1, 3, 0, 2), (1, 2, 1, 3),  # take; newer wins; older skipped
                                        (1, 3, 1, 2)]:
        verdicts.append(assembly.verdict(held, version, index, count))
        if verdicts[-1] == "take":
            assembly.took(version, index, count)
    assert verdicts == ["take", "skip", "take", "take", "skip", "gap", "skip", "take", "take", "skip", "take"]


class FakePublisher:
    """An XPUB a test drives by hand: sends buckets of versions, damaged or not, and counts subscriptions (a
    generator's first, then each asking again)."""

    def __init__(self, context: zmq.asyncio.Context):
        self.socket = context.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.subscriptions = 0

    async def subscribed(self, count: int) -> None:
        while self.subscriptions < count:
            assert await self.socket.poll(int(TIMEOUT_S * 1000)), "no subscription came"
            self.subscriptions += (await self.socket.recv())[:1] == b"\x01"

    async def send(self, version: int, state_dict: dict, indices=None, damaged: int = -1) -> int:
        """Buckets `indices` (all) of `version`, bucket `damaged` with its last byte flipped; the bucket count."""
        published = BucketSet.of(state_dict, version, bucket_bytes=32 * 1024)
        count = len(published.payloads)
        for index in range(count) if indices is None else indices:
            payload = bytes(published.payloads[index])
            notice = {"version": version, "bucket": index, "buckets": count, "nbytes": len(payload),
                      "offset": 0, "checksum": xxhash.xxh3_128(payload).hexdigest()}
            if index == damaged:
                payload = payload[:-1] + bytes([payload[-1] ^ 0xFF])
            await self.socket.send_multipart([msgpack.packb(notice), payload])
        return count


def published(vocab_size: int, seed: int) -> dict:
    weights = tiny_model(vocab_size, seed=seed).state_dict()
    return {name: tensor for name, tensor in weights.items() if name != "lm_head.weight"}  # tied to the embedding


def watch_steps(engine, versions: dict[int, dict]) -> list:
    """Record, at every engine step, which of `versions` the engine's weights are (None: a mix of two)."""
    seen, step = [], engine._step

    def checked_step():
        params = dict(engine.model.named_parameters())
        seen.append(next((version for version, weights in versions.items()
                          if all(torch.equal(params[name], tensor) for name, tensor in weights.items())), None))
        return step()

    engine._step = checked_step
    return seen


def test_a_generator_never_decodes_with_two_versions_and_replaces_a_damaged_one_with_the_next(model_dir):
    async def main():
        context = zmq.asyncio.Context()
        buffer, publisher = FakeBuffer(context, first_groups=3, reopen_at=2), FakePublisher(context)
        serving = asyncio.ensure_future(buffer.serve())
        worker = make_worker(model_dir, "interrupt")
        vocab = len(worker.tokenizer)
        versions = {0: {name: p.detach().clone() for name, p in worker.engine.model.named_parameters()},
                    1: published(vocab, 1), 2: published(vocab, 2)}
        seen = watch_steps(worker.engine, versions)
        running = asyncio.ensure_future(worker.run(buffer.endpoints, publisher.endpoint))
        try:
            await publisher.subscribed(1)
            await until(lambda: len(buffer.trajectories) >= 1 and seen)  # decoding under version 0
            count = await publisher.send(1, versions[1], indices=range(2))  # the first buckets of version 1 ...
            assert count > 3
            await until(lambda: worker.engine.loading == 1)
            steps = len(seen)
            await publisher.send(1, versions[1], indices=[2], damaged=2)  # ... one damaged, the rest lost
            await publisher.subscribed(2)  # the generator asks again
            await asyncio.sleep(0.2)
            assert worker.engine.loading == 1 and worker.engine.version == 0 and len(seen) == steps  # no step
            await publisher.send(2, versions[2])  # the newest, whole
            await until(lambda: buffer.reported == 2)
            await until(lambda: len(buffer.trajectories) == 4 * 3)
            assert worker.engine.version == 2 and worker.engine.loading is None
        finally:
            worker.stop()
            await asyncio.wait_for(running, 10)
            serving.cancel()
            context.destroy(linger=0)
        return buffer, seen

    buffer, seen = asyncio.run(asyncio.wait_for(main(), 120))
    assert None not in seen and 0 in seen and 2 in seen and 1 not in seen  # version 1 never whole, never mixed
    assert [r["version"] for r in buffer.requests if r["op"] == "report"] == [2]
    assert {v for t in buffer.trajectories for v in t.versions[t.versions >= 0].tolist()} <= {0, 2}


def test_a_part_loaded_version_with_nothing_newer_ends_the_run_within_the_timeout(model_dir):
    async def main():
        context = zmq.asyncio.Context()
        buffer, publisher = FakeBuffer(context, first_groups=100, reopen_at=99), FakePublisher(context)
        serving = asyncio.ensure_future(buffer.serve())
        worker = make_worker(model_dir, "interrupt", sync_timeout_s=1.0)
        running = asyncio.ensure_future(worker.run(buffer.endpoints, publisher.endpoint))
        try:
            await publisher.subscribed(1)
            await publisher.send(1, published(len(worker.tokenizer), 1), indices=[0])
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="weights version 1 is part-loaded"):
                await asyncio.wait_for(running, 30)
            assert time.monotonic() - started < 10
        finally:
            worker.stop()
            serving.cancel()
            context.destroy(linger=0)

    asyncio.run(main())
