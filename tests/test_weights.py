"""Weights wire protocol, each version in several buckets: round trip, newest wins, never an older or equal
version, late joiners, corrupt buckets dropped, versions damaged on the way asked for again (and counted up to the
run's metrics, through a generator and the buffer); in place through shared memory: a second process reads a
version bit-equal, a bucket rewritten or forged is refused (fast, CPU). tests/test_weight_buckets.py: the split,
the stamps, the publisher's memory, a generator that never decodes with two versions."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from typing import Optional

import msgpack
import numpy as np
import pytest
import torch
import xxhash
import zmq
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from transformers import Qwen2Config, Qwen2ForCausalLM

from nanoverl_async.agents import multiply_task
from nanoverl_async.buffer.service import BufferService, parse_request
from nanoverl_async.config import AgentConfig, BufferConfig, Config, DataConfig, GeneratorConfig
from nanoverl_async.generators.worker import GeneratorWorker
from nanoverl_async.models.tiny import build_tokenizer
from nanoverl_async.observe.metrics import step_metrics
from nanoverl_async.controller.preflight import prepare
from nanoverl_async.wire import shared_payloads
from nanoverl_async.wire.buckets import BucketSet, stamp_metadata
from nanoverl_async.wire.payload_layout import deserialise, serialise
from nanoverl_async.wire import weight_messages
from nanoverl_async.wire import weights as weight_wire
from nanoverl_async.wire.weights import WeightPublisher, WeightSubscriber
from weight_waits import wait_newest, wait_sent, wait_subscribed

TIMEOUT_S = 10.0
PART = 100  # bytes a part where a test cuts buckets small: a bucket of these states is several parts
BUCKET_BYTES = 48  # state()'s weight alone, then its bias and steps: two buckets a version


def state(value: float) -> dict:
    return {"layer.weight": torch.full((3, 4), value), "layer.bias": torch.arange(4, dtype=torch.float32) + value,
            "steps": torch.tensor([int(value)], dtype=torch.int64)}


def buckets(version: int, state_dict: dict, bucket_bytes: int = BUCKET_BYTES) -> BucketSet:
    return BucketSet.of(state_dict, version, bucket_bytes)


def one_bucket(version: int, state_dict: dict) -> tuple[dict, bytes]:
    """(notice, payload) of a version sent whole in one bucket, as a publisher would over the socket."""
    payload = bytes(serialise(state_dict, stamp_metadata(version, 0, 1)))
    return {"version": version, "bucket": 0, "buckets": 1, "nbytes": len(payload), "offset": 0,
            "checksum": xxhash.xxh3_128(payload).hexdigest()}, payload


@pytest.fixture(params=["shared memory", "socket"])
def pair(request):
    publisher = WeightPublisher("127.0.0.1", shared_memory=request.param == "shared memory")
    subscriber = WeightSubscriber(publisher.endpoint)
    yield publisher, subscriber
    subscriber.close()
    publisher.close(timeout_s=5)


def test_round_trip(pair):
    publisher, subscriber = pair
    assert publisher.endpoint.startswith("tcp://127.0.0.1:")
    publisher.publish(1, buckets(1, state(1.0)))
    version, received = wait_newest(subscriber, current_version=0, timeout_s=TIMEOUT_S)
    assert version == 1 and received.keys() == state(1.0).keys()
    for name, tensor in state(1.0).items():
        assert torch.equal(received[name], tensor) and received[name].dtype == tensor.dtype
    assert subscriber.poll_bucket(held=1) is None  # nothing newer queued: returns at once


def test_newest_wins_and_older_versions_are_ignored(pair):
    publisher, subscriber = pair
    publisher.publish(1, buckets(1, state(1.0)))
    wait_newest(subscriber, 0, TIMEOUT_S)
    for version in (2, 3, 4):
        publisher.publish(version, buckets(version, state(float(version))))
    wait_sent(publisher, 4, TIMEOUT_S)
    version, seen = 1, []
    while version < 4:  # sent is not yet delivered: a drain may stop before the newest arrives
        version, received = wait_newest(subscriber, current_version=version, timeout_s=TIMEOUT_S)
        seen.append(version)
    assert seen == sorted(set(seen)) and version == 4 and torch.equal(received["layer.weight"], torch.full((3, 4), 4.0))
    assert subscriber.poll_bucket(held=4) is None
    assert publisher.counts["published"] == 4
    assert publisher.counts["sent"] + publisher.counts["superseded"] == 4


def test_a_version_older_than_or_equal_to_the_one_held_is_never_applied():
    context = zmq.Context()
    sender = context.socket(zmq.XPUB)
    subscriber = WeightSubscriber(f"tcp://127.0.0.1:{sender.bind_to_random_port('tcp://127.0.0.1')}")
    applied, held = [], 0
    try:
        assert sender.poll(timeout=int(TIMEOUT_S * 1000)) and sender.recv() == b"\x01"  # subscription arrived
        for version in (6, 5, 6, 7):  # one at a time: each is polled alone, none hides behind a newer one
            notice, payload = one_bucket(version, state(float(version)))
            sender.send_multipart([msgpack.packb(notice), payload])
            time.sleep(0.05)  # delivered: a version never applied is skipped, not lost
            if (newest := subscriber.poll_bucket(held)) is not None:
                held, weights, applied = newest.version, newest.tensors, applied + [newest.version]
        assert applied == [6, 7] and torch.equal(weights["layer.weight"], torch.full((3, 4), 7.0))
        assert subscriber.counts == {"received": 2, "dropped": 0, "from_shared_memory": 0, "refetched": 0}
    finally:
        subscriber.close()
        sender.close(linger=0)
        context.term()


class Tamperer:
    """Between a publisher and its subscribers (XSUB up, XPUB down, as zmq.proxy): damages the first copy of
    bucket 1 of each version in `versions` on its way (bucket 0 is applied by then: the generator holds part
    of the version), its payload's last byte or, for a notice naming a segment, its checksum; every later
    copy (asked for again) passes intact."""

    def __init__(self, endpoint: str, versions: set[int], drop: bool = False):
        self.versions, self.drop = set(versions), drop  # drop: lose the bucket instead of damaging it
        self._context = zmq.Context()
        self._up, self._down = self._context.socket(zmq.XSUB), self._context.socket(zmq.XPUB)
        self._down.setsockopt(zmq.XPUB_VERBOSE, 1)  # a repeated subscription (asking again) goes up too
        self._up.connect(endpoint)
        self.endpoint = f"tcp://127.0.0.1:{self._down.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for socket in (self._up, self._down):
            poller.register(socket, zmq.POLLIN)
        while not self._stop.is_set():
            for socket, _ in poller.poll(10):
                if socket is self._down:
                    self._up.send(self._down.recv())
                elif (frames := self._damaged(self._up.recv_multipart())) is not None:
                    self._down.send_multipart(frames)

    def _damaged(self, frames: list[bytes]) -> Optional[list[bytes]]:
        notice = msgpack.unpackb(frames[0])
        if notice["version"] not in self.versions or notice["bucket"] != 1:
            return frames
        self.versions.discard(notice["version"])
        if self.drop:
            return None
        if not frames[1]:
            return [msgpack.packb({**notice, "checksum": "0" * 32}), b""]
        return [frames[0], frames[1][:-1] + bytes([frames[1][-1] ^ 0xFF])]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._context.destroy(linger=0)


DAMAGED = 3  # k consecutive versions damaged on the way


@pytest.mark.parametrize("transport", ["shared memory", "socket", "socket in parts"])
@pytest.mark.parametrize("drop", [False, True], ids=["damaged", "lost"])
def test_versions_damaged_on_the_way_are_asked_for_again_and_the_newest_is_applied(transport, drop, monkeypatch):
    """Versions 2..k+1 arrive damaged (or lose their last bucket, or its first part: no gap shows, the wait for
    it does), one after another, and the publisher sends nothing newer (its learner waits for a batch these
    weights would open the gate for): each is asked for again and applied."""
    monkeypatch.setattr(weight_wire, "STALL_S", 0.2)
    if transport == "socket in parts":  # a pause of a loaded machine between two parts must not read as a loss
        monkeypatch.setattr(weight_messages, "PART_BYTES", PART)
        monkeypatch.setattr(weight_wire, "STALL_S", 1.0)
    publisher = WeightPublisher("127.0.0.1", shared_memory=transport == "shared memory")
    tamperer = Tamperer(publisher.endpoint, versions=set(range(2, DAMAGED + 2)), drop=drop)
    subscriber = WeightSubscriber(tamperer.endpoint)
    applied, held = [], 0
    try:
        wait_subscribed(publisher, 1, TIMEOUT_S)  # joined before version 1: no gap in it counts as a drop
        for version in range(1, DAMAGED + 2):
            publisher.publish(version, buckets(version, state(float(version))))
            held, weights = wait_newest(subscriber, current_version=held, timeout_s=TIMEOUT_S)
            applied.append(held)
        assert applied == list(range(1, DAMAGED + 2)) and not tamperer.versions  # each damaged once, each applied
        assert torch.equal(weights["layer.weight"], torch.full((3, 4), float(DAMAGED + 1)))
        assert subscriber.counts["dropped"] == subscriber.counts["refetched"] == DAMAGED
        assert subscriber.poll_bucket(held) is None and subscriber.counts["refetched"] == DAMAGED
    finally:
        subscriber.close()
        tamperer.close()
        publisher.close(timeout_s=5)


def test_a_generator_asks_again_for_damaged_versions_and_the_count_reaches_the_metrics(tmp_path):
    """A generator behind a Tamperer against a real buffer: it applies every version, reports each, and
    the buffer's batch carries `buffer/weights_refetched` = k into the step's metrics."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    torch.manual_seed(0)
    models = [Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                           tie_word_embeddings=True)) for _ in range(DAMAGED + 2)]
    models[0].save_pretrained(tmp_path)
    cfg = prepare(Config(generator=GeneratorConfig(max_groups_in_flight=1), data=DataConfig(samples_per_prompt=1),
                         agent=AgentConfig(max_turns=1, max_new_tokens=4, max_total_tokens=40)))
    service = BufferService(1, 1, 0, BufferConfig(lease_timeout_s=30), "127.0.0.1", cfg.generator, len(tokenizer),
                            lambda index: multiply_task.make_prompt(0, index))
    publisher = WeightPublisher("127.0.0.1")
    tamperer = Tamperer(publisher.endpoint, versions=set(range(2, DAMAGED + 2)))

    async def generate_while_publishing() -> None:
        worker = GeneratorWorker(0, cfg, str(tmp_path))
        running = asyncio.ensure_future(worker.run(service.endpoints, tamperer.endpoint))
        try:
            # the worker's subscription, through the tamperer, before version 1: a subscriber joining mid-version
            # misses its first buckets and rightly asks again, which would count one refetch more than DAMAGED
            deadline = time.monotonic() + 30
            while publisher.counts["subscriptions"] < 1:
                assert not running.done() and time.monotonic() < deadline, "the generator never subscribed"
                await asyncio.sleep(0.01)
            for version in range(1, DAMAGED + 2):
                service.publishing(version)
                weights = models[version].state_dict()
                published = {name: weights[name] for name in weights if name != "lm_head.weight"}
                publisher.publish(version, buckets(version, published, bucket_bytes=16 * 1024))  # several buckets
                deadline = time.monotonic() + 30
                while service.stats()["generator_versions"].get(0) != version:
                    assert not running.done() and time.monotonic() < deadline, f"version {version} never reported"
                    await asyncio.sleep(0.01)
        finally:
            worker.stop()
            await asyncio.wait_for(running, 10)

    try:
        asyncio.run(generate_while_publishing())
        batch = service.next_batch(0, timeout_s=30)
        metrics = step_metrics(0, 0, batch, {}, step_seconds=1.0, samples_trained=1)
        assert metrics["buffer/weights_refetched"] == DAMAGED and not tamperer.versions
    finally:
        tamperer.close()
        publisher.close(timeout_s=5)
        service.close()


def test_a_reports_refetch_count_is_a_non_negative_int_and_only_a_report_carries_one():
    report = {"op": "report", "generator_id": 0, "version": 0}
    assert parse_request(msgpack.packb({**report, "weights_refetched": 0}))["weights_refetched"] == 0
    for bad, field in (({**report, "weights_refetched": -1}, "weights_refetched"),
                       ({**report, "weights_refetched": True}, "weights_refetched"),
                       ({"op": "lease", "generator_id": 0, "version": 0, "max_groups": 1, "weights_refetched": 1},
                        "weights_refetched")):
        with pytest.raises(ValueError, match=f"field '{field}'"):
            parse_request(msgpack.packb(bad))


def test_late_subscriber_gets_the_latest_version(pair):
    publisher, _ = pair
    publisher.publish(5, buckets(5, state(5.0)))
    wait_sent(publisher, 5, TIMEOUT_S)
    late = WeightSubscriber(publisher.endpoint)
    try:
        version, received = wait_newest(late, current_version=0, timeout_s=TIMEOUT_S)
        assert version == 5 and torch.equal(received["layer.weight"], torch.full((3, 4), 5.0))
    finally:
        late.close()


def test_the_payload_is_safetensors_received_as_views_and_a_header_that_does_not_fit_is_refused():
    tied = torch.randn(2, 2)
    sent = {"w": torch.randn(3, 5, dtype=torch.bfloat16), "b": torch.randn(7), "ids": torch.arange(4),
            "flags": torch.tensor([True, False]), "empty": torch.zeros(0, 3), "embed": tied, "head": tied}
    payload = bytearray(serialise(sent))
    for received in (deserialise(memoryview(payload)), safetensors_load(bytes(payload))):  # ours and theirs
        assert received.keys() == sent.keys()
        for name, tensor in sent.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    received = deserialise(memoryview(payload))
    start = torch.frombuffer(payload, dtype=torch.uint8).data_ptr()
    assert start <= received["w"].data_ptr() < start + len(payload)  # a view: nothing was copied
    size = int.from_bytes(payload[:8], "little")
    header = payload[8:8 + size].decode()
    for bad in (payload[:8 + size + 10],  # data cut short
                (10 ** 9).to_bytes(8, "little") + payload[8:],  # header size past the end
                payload[:8] + header.replace('"BF16"', '"XX99"').encode() + payload[8 + size:]):  # unknown dtype
        with pytest.raises(ValueError):
            deserialise(memoryview(bytearray(bad)))


def test_corrupt_and_mismatched_payloads_are_dropped_and_counted():
    context = zmq.Context()
    sender = context.socket(zmq.XPUB)
    port = sender.bind_to_random_port("tcp://127.0.0.1")
    subscriber = WeightSubscriber(f"tcp://127.0.0.1:{port}")
    try:
        assert sender.poll(timeout=int(TIMEOUT_S * 1000)) and sender.recv() == b"\x01"  # subscription arrived
        header, good = one_bucket(7, state(7.0))
        flipped = bytearray(good)
        flipped[-1] ^= 0xFF
        unstamped = safetensors_save(state(7.0))  # checksummed, but its bytes do not say which version they are
        other, stamped_as_8 = one_bucket(8, state(7.0))
        bad_messages = [
            [msgpack.packb({**header, "version": 10**12}), good],  # a damaged version number: waits for nothing
            [msgpack.packb(header), bytes(flipped)],  # corrupt payload
            [msgpack.packb({**header, "nbytes": len(good) + 1}), good],  # wrong nbytes
            [b"\xc1 not msgpack", good],  # undecodable header
            [msgpack.packb({"version": 7}), good],  # missing keys
            [msgpack.packb(header)],  # one frame
            [msgpack.packb({**header, "bucket": 1}), good],  # bucket 1 of 1
            [msgpack.packb({**header, "bucket": -1}), good],  # a negative index
            [msgpack.packb({**header, "buckets": 0}), good],  # no buckets
            [msgpack.packb({**header, "bucket": True}), good],  # not an int
            [msgpack.packb({**header, "version": -3}), good],  # a negative version
            [msgpack.packb({**header, "nbytes": len(unstamped), "checksum": xxhash.xxh3_128(unstamped).hexdigest()}),
             unstamped],
            [msgpack.packb({**other, "version": 7}), stamped_as_8],  # version 8's bytes named version 7
        ]
        for frames in bad_messages + [[msgpack.packb(header), good]]:
            sender.send_multipart(frames)
        version, received = wait_newest(subscriber, current_version=0, timeout_s=TIMEOUT_S)
        assert version == 7 and torch.equal(received["layer.bias"], state(7.0)["layer.bias"])
        assert subscriber.counts["dropped"] == len(bad_messages)
        assert subscriber.counts["received"] == 1
    finally:
        subscriber.close()
        sender.close(linger=0)
        context.term()


needs_memfd = pytest.mark.skipif(not shared_payloads.AVAILABLE, reason="shared memory payloads need Linux")
READER = """
import json, sys
from safetensors.torch import save_file
from nanoverl_async.wire.weights import WeightSubscriber
sys.path.insert(0, "tests")
from weight_waits import wait_newest
subscriber = WeightSubscriber(sys.argv[1])
version, received = wait_newest(subscriber, 0, float(sys.argv[3]) if len(sys.argv) > 3 else 60)
save_file({name: tensor.cpu().clone() for name, tensor in received.items()}, sys.argv[2])
print(json.dumps({"version": version, "devices": sorted({t.device.type for t in received.values()}), **subscriber.counts}))
"""


@needs_memfd
def test_a_second_process_reads_the_version_bit_equal_through_shared_memory(tmp_path):
    publisher = WeightPublisher("127.0.0.1")
    assert publisher.shared_memory  # loopback on Linux: every subscriber is on this machine
    sent = {"w": torch.randn(64, 33, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1)),
            "b": torch.randn(7, generator=torch.Generator().manual_seed(2)), "ids": torch.arange(5)}
    published = buckets(3, sent, bucket_bytes=64 * 33 * 2)  # w alone, then b and ids
    assert len(published.payloads) == 2 and all(shared_payloads.path_of(p) is not None for p in published.payloads)
    try:
        publisher.publish(3, published)
        wait_sent(publisher, 3, TIMEOUT_S)
        reader = subprocess.run([sys.executable, "-c", READER, publisher.endpoint, str(tmp_path / "got.safetensors")],
                                capture_output=True, text=True, timeout=120)
        assert reader.returncode == 0, reader.stderr[-2000:]
        report = json.loads(reader.stdout.splitlines()[-1])
        assert report["version"] == 3 and report["from_shared_memory"] == 2 and report["dropped"] == 0
        got = safetensors_load((tmp_path / "got.safetensors").read_bytes())
        assert got.keys() == sent.keys()
        for name, tensor in sent.items():  # bit-equal: the same bytes, not only close values
            assert got[name].dtype == tensor.dtype and torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8))
    finally:
        publisher.close(timeout_s=5)


@needs_memfd
@pytest.mark.parametrize("pair", ["shared memory"], indirect=True)
def test_a_shared_payload_rewritten_after_its_notice_is_refused_and_the_newest_valid_version_wins(pair):
    publisher, subscriber = pair
    wait_subscribed(publisher, 1, TIMEOUT_S)  # joined before version 1: no late-joiner pass adds a third copy
    torn = buckets(1, state(1.0))
    publisher.publish(1, torn)
    wait_sent(publisher, 1, TIMEOUT_S)
    torn.payloads[1][-1] ^= 0xFF  # the learner writing the next version into it while the generator reads it
    deadline, taken = time.monotonic() + TIMEOUT_S, []
    while subscriber.counts["dropped"] < 2:  # the copy it was sent, and the one it asked for again: torn too
        taken += [bucket.index for bucket in [subscriber.poll_bucket(held=0)] if bucket is not None]
        assert time.monotonic() < deadline
        time.sleep(0.005)
    for _ in range(20):  # asked for once only: the publisher is not made to resend a bad version without end
        assert subscriber.poll_bucket(held=0) is None
        time.sleep(0.01)
    assert taken == [0], "a torn bucket was handed on"  # bucket 0 once (its resend is a repeat): never bucket 1
    assert subscriber.counts["dropped"] == 2 and subscriber.counts["refetched"] == 1
    assert subscriber.counts["from_shared_memory"] == 1
    for version in (2, 3, 4):  # written into the same buckets, as the learner does: 2 and 3 may be cut short
        torn.begin(version)
        for name, tensor in state(float(version)).items():
            torn.write(name, tensor)
        publisher.publish(version, torn)
    wait_sent(publisher, 4, TIMEOUT_S)
    version = 1
    while version < 4:
        version, received = wait_newest(subscriber, current_version=version, timeout_s=TIMEOUT_S)
    assert all(torch.equal(received[name], tensor) for name, tensor in state(4.0).items())


@needs_memfd
def test_forged_segment_notices_are_dropped_and_one_that_cannot_be_mapped_fails_loudly(tmp_path):
    context = zmq.Context()
    sender = context.socket(zmq.XPUB)
    port = sender.bind_to_random_port("tcp://127.0.0.1")
    subscriber = WeightSubscriber(f"tcp://127.0.0.1:{port}")
    good = serialise(state(5.0), stamp_metadata(5, 0, 1))
    path = shared_payloads.path_of(good)
    notice = {"version": 5, "bucket": 0, "buckets": 1, "nbytes": len(good), "offset": 0,
              "checksum": xxhash.xxh3_128(good).hexdigest(), "segment": {"path": path}}
    unreadable = tmp_path / "unreadable"
    unreadable.write_bytes(bytes(len(good)))
    unreadable.chmod(0)
    try:
        assert sender.poll(timeout=int(TIMEOUT_S * 1000)) and sender.recv() == b"\x01"
        forged = [{**notice, "checksum": "0" * 32},  # bytes that are not the version's
                  {**notice, "nbytes": len(good) + 8},  # a segment of another size
                  {**notice, "segment": {"path": str(tmp_path / "gone")}},  # freed since
                  {**notice, "segment": {"path": 7}},  # malformed
                  {**notice, "segment": {"cuda": {"uuid": "GPU-0"}}}]  # a CUDA handle without its fields
        for bad in forged:
            sender.send_multipart([msgpack.packb(bad), b""])
            assert wait_dropped(subscriber, forged.index(bad) + 1) is None
        sender.send_multipart([msgpack.packb({**notice, "segment": {"path": path}}), b"trailing payload"])
        assert wait_dropped(subscriber, len(forged) + 1) is None  # a segment and a payload: which one?
        sender.send_multipart([msgpack.packb(notice), b""])
        version, received = wait_newest(subscriber, current_version=0, timeout_s=TIMEOUT_S)
        assert version == 5 and torch.equal(received["layer.bias"], state(5.0)["layer.bias"])
        if os.geteuid() != 0:  # root reads any file
            sender.send_multipart([msgpack.packb({**notice, "version": 6, "segment": {"path": str(unreadable)}}), b""])
            with pytest.raises(RuntimeError, match="cannot map the learner's payload"):
                wait_newest(subscriber, current_version=5, timeout_s=TIMEOUT_S)
    finally:
        subscriber.close()
        sender.close(linger=0)
        context.term()


def wait_dropped(subscriber: WeightSubscriber, dropped: int):
    """Poll until `dropped` messages were dropped; what the last poll returned."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        result = subscriber.poll_bucket(held=0)
        if subscriber.counts["dropped"] >= dropped or result is not None:
            return result
        assert time.monotonic() < deadline, f"dropped {subscriber.counts['dropped']}, waiting for {dropped}"
        time.sleep(0.005)


def test_a_bucket_is_cut_into_parts_that_view_it_and_only_a_segment_is_one_empty_message(monkeypatch):
    monkeypatch.setattr(weight_messages, "PART_BYTES", PART)
    notice, payload = one_bucket(3, state(3.0))
    del notice["offset"]
    payload = np.frombuffer(bytearray(payload), dtype=np.uint8)
    parts = weight_messages.messages(notice, payload)
    assert len(parts) == -(-len(payload) // PART) > 2
    assert [msgpack.unpackb(head)["offset"] for head, _ in parts] == list(range(0, len(payload), PART))
    assert all(len(part) == PART for _, part in parts[:-1]) and 0 < len(parts[-1][1]) <= PART
    assert b"".join(bytes(part) for _, part in parts) == payload.tobytes()
    payload[0] ^= 0xFF  # views, not copies: the learner's next version shows through until it is checked
    assert bytes(parts[0][1])[0] == payload[0]
    assert weight_messages.messages({**notice, "nbytes": 0}, np.empty(0, dtype=np.uint8))[0][1].nbytes == 0
    (head, part), = weight_messages.messages(notice, payload, segment={"path": "/proc/self/fd/3"})
    assert msgpack.unpackb(head)["offset"] == 0 and part == b""


def frames_of(notice: dict, part: bytes) -> list:
    return [zmq.Frame(msgpack.packb(notice)), zmq.Frame(part)]


@pytest.mark.parametrize("offset, size, nbytes, good", [
    (0, 10, 10, True), (9, 1, 10, True),  # the last part ends exactly at nbytes
    (9, 2, 10, False), (10, 1, 10, False),  # one byte past the end
    (-1, 1, 10, False), (0, 0, 10, False),  # before the start; an empty part of a bucket with bytes
    (0, 0, 0, True),  # an empty bucket's one part
])
def test_a_part_must_lie_inside_its_bucket(offset, size, nbytes, good):
    notice = {"version": 1, "bucket": 0, "buckets": 1, "nbytes": nbytes, "offset": offset, "checksum": "0" * 32}
    if good:
        assert weight_messages.read(frames_of(notice, bytes(size)))[0] == notice
    else:
        with pytest.raises(weight_messages.BadMessage, match="part of"):
            weight_messages.read(frames_of(notice, bytes(size)))
    segment = {**notice, "offset": 1, "segment": {"path": "/x"}}  # a segment is always one message at 0
    with pytest.raises(weight_messages.BadMessage, match="bad segment"):
        weight_messages.read(frames_of(segment, b""))


def test_socket_parts_are_joined_into_one_buffer_and_a_bucket_that_lost_a_part_is_asked_for_again(monkeypatch):
    """Parts arrive, are joined into the subscriber's one buffer (the tensors handed on view it); a bucket whose
    middle part was lost, one a new bucket interrupts, and one whose last part never comes are each dropped
    once and asked for again; the resend is applied."""
    monkeypatch.setattr(weight_messages, "PART_BYTES", PART)
    monkeypatch.setattr(weight_wire, "STALL_S", 1.0)  # a loaded machine's pause between two parts is no loss
    context = zmq.Context()
    sender = context.socket(zmq.XPUB)
    sender.setsockopt(zmq.XPUB_VERBOSE, 1)
    port = sender.bind_to_random_port("tcp://127.0.0.1")
    subscriber = WeightSubscriber(f"tcp://127.0.0.1:{port}")

    def parts(version: int) -> list:
        notice, payload = one_bucket(version, state(float(version)))
        del notice["offset"]
        return weight_messages.messages(notice, np.frombuffer(payload, dtype=np.uint8))

    def asked_again(times: int) -> None:
        for _ in range(times):
            assert sender.poll(timeout=int(TIMEOUT_S * 1000)) and sender.recv() == b"\x01"

    try:
        asked_again(1)  # joined
        for version, sent in ((1, [parts(1)[0], *parts(1)[2:]]),  # a middle part lost
                              (2, parts(2)[:-1])):  # the last part never comes: the wait for it ends
            for frames in sent:
                sender.send_multipart(frames)
            assert wait_dropped(subscriber, version) is None
            assert subscriber.counts["dropped"] == subscriber.counts["refetched"] == version
            asked_again(1)
            for frames in parts(version):
                sender.send_multipart(frames)
            held, received = wait_newest(subscriber, current_version=version - 1, timeout_s=TIMEOUT_S)
            assert held == version and torch.equal(received["layer.weight"], state(float(version))["layer.weight"])
        for frames in parts(3)[:2] + parts(3):  # cut short by its own resend starting
            sender.send_multipart(frames)
        held, received = wait_newest(subscriber, current_version=2, timeout_s=TIMEOUT_S)
        assert held == 3 and torch.equal(received["layer.weight"], state(3.0)["layer.weight"])
        assert subscriber.counts["dropped"] == 3 and subscriber.counts["refetched"] in (2, 3)  # asked, or it came first
        assert subscriber.counts["received"] == 3
        monkeypatch.setattr(weight_wire, "STALL_S", TIMEOUT_S)  # parts sent one poll apart: never a stall here
        bucket, deadline = None, time.monotonic() + TIMEOUT_S
        sender.send_multipart(parts(4)[0])
        for frames in parts(4)[1:]:
            assert subscriber.poll_bucket(held=3) is None  # nothing is handed on before the last part
            sender.send_multipart(frames)
        while bucket is None:
            bucket = subscriber.poll_bucket(held=3)
            assert time.monotonic() < deadline, "version 4's last part was not joined"
        start = subscriber._copy.ctypes.data
        assert all(start <= tensor.data_ptr() < start + len(subscriber._copy) for tensor in bucket.tensors.values())
    finally:
        subscriber.close()
        sender.close(linger=0)
        context.term()


def test_sum64_is_equal_for_equal_bytes_and_catches_a_torn_payload_and_its_tail():
    generator = torch.Generator().manual_seed(0)
    old = torch.randint(0, 256, (3 * 8 * 5 + 3,), dtype=torch.uint8, generator=generator)
    new = torch.randint(0, 256, old.shape, dtype=torch.uint8, generator=generator)
    torn = torch.cat([new[:40], old[40:]])
    assert shared_payloads.sum64(old) == shared_payloads.sum64(old.clone())
    assert len({shared_payloads.sum64(p) for p in (old, new, torn)}) == 3
    tail = old.clone()
    tail[-1] ^= 1  # the bytes after the last whole 8-byte word count too
    assert shared_payloads.sum64(tail) != shared_payloads.sum64(old)
    for chunk in (1, 2, 16):  # chunked or not, the same bytes give the same sum; swapped chunks do not
        shared_payloads.SUM64_CHUNK, previous = chunk, shared_payloads.SUM64_CHUNK
        try:
            words = old[:120].view(torch.int64)
            swapped = torch.cat([words[8:], words[:8]]).view(torch.uint8)
            assert shared_payloads.sum64(old[:120]) == shared_payloads.sum64(old[:120].clone())
            assert chunk == 16 or shared_payloads.sum64(swapped) != shared_payloads.sum64(old[:120])
        finally:
            shared_payloads.SUM64_CHUNK = previous


def test_the_cuda_handle_fields_sent_are_arguments_of_torchs_rebuild():
    """The CUDA IPC path runs only on a GPU (tests/test_cuda.py); this pins its contract with torch here."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    handle = {key: 0 for key in shared_payloads.HANDLE_FIELDS}
    arguments = shared_payloads.rebuild_arguments(handle, nbytes=64, device=0)
    inspect.signature(rebuild_cuda_tensor).bind(**arguments)  # every parameter, each once, by name
    assert arguments["tensor_size"] == (64,) and arguments["dtype"] == torch.uint8
