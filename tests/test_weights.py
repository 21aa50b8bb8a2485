"""Weights wire protocol: round trip, newest wins, late joiners, spare payloads, corrupt payloads dropped (fast,
CPU)."""

import time

import msgpack
import pytest
import torch
import xxhash
import zmq
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from nanoverl_async.weights import WeightPublisher, WeightSubscriber, deserialise, serialise
from weight_waits import wait_newest, wait_sent

TIMEOUT_S = 10.0


def state(value: float) -> dict:
    return {"layer.weight": torch.full((3, 4), value), "layer.bias": torch.arange(4, dtype=torch.float32) + value,
            "steps": torch.tensor([int(value)], dtype=torch.int64)}


@pytest.fixture
def pair():
    publisher = WeightPublisher("127.0.0.1")
    subscriber = WeightSubscriber(publisher.endpoint)
    yield publisher, subscriber
    subscriber.close()
    publisher.close(timeout_s=5)


def test_round_trip(pair):
    publisher, subscriber = pair
    assert publisher.endpoint.startswith("tcp://127.0.0.1:")
    publisher.publish(1, serialise(state(1.0)))
    version, received = wait_newest(subscriber, current_version=0, timeout_s=TIMEOUT_S)
    assert version == 1 and received.keys() == state(1.0).keys()
    for name, tensor in state(1.0).items():
        assert torch.equal(received[name], tensor) and received[name].dtype == tensor.dtype
    assert subscriber.poll_newest(current_version=1) is None  # nothing newer queued: returns at once


def test_newest_wins_and_older_versions_are_ignored(pair):
    publisher, subscriber = pair
    publisher.publish(1, serialise(state(1.0)))
    wait_newest(subscriber, 0, TIMEOUT_S)
    for version in (2, 3, 4):
        publisher.publish(version, serialise(state(float(version))))
    wait_sent(publisher, 4, TIMEOUT_S)
    version, seen = 1, []
    while version < 4:  # sent is not yet delivered: a drain may stop before the newest arrives
        version, received = wait_newest(subscriber, current_version=version, timeout_s=TIMEOUT_S)
        seen.append(version)
    assert seen == sorted(set(seen)) and version == 4 and torch.equal(received["layer.weight"], torch.full((3, 4), 4.0))
    assert subscriber.poll_newest(current_version=4) is None
    assert publisher.counts["published"] == 4
    assert publisher.counts["sent"] + publisher.counts["superseded"] == 4


def test_late_subscriber_gets_the_latest_version(pair):
    publisher, _ = pair
    publisher.publish(5, serialise(state(5.0)))
    wait_sent(publisher, 5, TIMEOUT_S)
    late = WeightSubscriber(publisher.endpoint)
    try:
        version, received = wait_newest(late, current_version=0, timeout_s=TIMEOUT_S)
        assert version == 5 and torch.equal(received["layer.weight"], torch.full((3, 4), 5.0))
    finally:
        late.close()


def test_a_payload_comes_back_as_a_spare_only_once_a_newer_version_was_sent_and_zeromq_let_go_of_it(pair):
    publisher, subscriber = pair
    first, second, third = (serialise(state(float(v))) for v in (1, 2, 3))
    publisher.publish(1, first)
    wait_newest(subscriber, 0, TIMEOUT_S)
    assert publisher.take_spare() is None  # version 1 is the newest: a late subscriber would be sent it
    publisher.publish(2, second)
    wait_newest(subscriber, 1, TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S
    while (spare := publisher.take_spare()) is None:  # once ZeroMQ's send of version 1 is done
        assert time.monotonic() < deadline, "version 1's payload never came back"
        time.sleep(0.005)
    assert spare is first and publisher.take_spare() is None  # handed back once; version 2 is the newest
    publisher.publish(3, third)
    publisher.publish(4, spare)  # 3 is sent, or superseded before it was: a spare either way, as is 2
    wait_newest(subscriber, 2, TIMEOUT_S)
    spares = []
    while len(spares) < 2:
        assert time.monotonic() < deadline + TIMEOUT_S, f"spares {spares}"
        spares += [payload for payload in [publisher.take_spare()] if payload is not None]
        time.sleep(0.005)
    assert sorted(map(id, spares)) == sorted(map(id, (second, third))) and publisher.take_spare() is None


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
        good = safetensors_save(state(7.0))
        digest = xxhash.xxh3_128(good).hexdigest()
        header = {"version": 7, "nbytes": len(good), "checksum": digest}
        flipped = bytearray(good)
        flipped[-1] ^= 0xFF
        bad_messages = [
            [msgpack.packb({**header, "version": 9}), bytes(flipped)],  # corrupt payload
            [msgpack.packb({**header, "version": 9, "nbytes": len(good) + 1}), good],  # wrong nbytes
            [b"\xc1 not msgpack", good],  # undecodable header
            [msgpack.packb({"version": 9}), good],  # missing keys
            [msgpack.packb({**header, "version": 9})],  # one frame
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
