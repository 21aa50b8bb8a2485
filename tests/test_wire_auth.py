"""CURVE off loopback: with wire.host beyond 127.0.0.1 the buffer's and the weight publisher's sockets
admit only peers holding the run's keys; a peer without them (or with other keys) gets nothing through.
Real sockets bound on 0.0.0.0, no Ray.

Run alone: `python -m pytest tests/test_wire_auth.py -q` (~10 s).
"""

import time

import msgpack
import torch
import zmq

from nanoverl_async.buffer.service import BufferService
from nanoverl_async.config import BufferConfig, GeneratorConfig
from nanoverl_async.weights import WeightPublisher, WeightSubscriber, serialise
from nanoverl_async.wire_auth import CurveKeys, connect, run_keys
from weight_waits import wait_newest

REFUSED_WAIT_MS = 1500  # a refused peer's handshake never completes: nothing arrives in this time


def test_loopback_needs_no_keys_and_any_other_host_gets_fresh_ones():
    assert run_keys("127.0.0.1") is None and run_keys("localhost") is None and run_keys("::1") is None
    first, second = run_keys("0.0.0.0"), run_keys("10.1.2.3")
    assert len(first.server_public) == len(first.client_secret) == 40 and first.server_public != second.server_public
    assert "secret" not in repr(first) and first.client_secret.decode() not in repr(first)


def lease_request(endpoint: str, keys) -> dict | None:
    """A lease request from a fresh DEALER connected with `keys` (None: plain): the reply, or None."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    connect(dealer, keys)
    dealer.connect(endpoint)
    dealer.send(msgpack.packb({"op": "lease", "generator_id": 0, "version": 0, "max_groups": 1}))
    reply = msgpack.unpackb(dealer.recv(), raw=False) if dealer.poll(REFUSED_WAIT_MS) else None
    context.destroy(linger=0)
    return reply


def test_the_buffer_admits_only_the_runs_keys():
    keys = run_keys("0.0.0.0")
    service = BufferService(1, 1, 0, BufferConfig(lease_timeout_s=30), "0.0.0.0",
                            GeneratorConfig(replicas=1), 110, lambda index: {"index": index}, curve=keys)
    try:
        intruder_keys = CurveKeys(keys.server_public, keys.server_secret, *zmq.curve_keypair())
        assert lease_request(service.endpoints["leases"], None) is None  # no keys: no handshake
        assert lease_request(service.endpoints["leases"], intruder_keys) is None  # knows the server, wrong client key
        assert service.stats()["leased"] == 0 and service.stats()["malformed_requests"] == 0  # nothing got in
        assert len(lease_request(service.endpoints["leases"], keys)["leases"]) == 1  # the run's own generator
    finally:
        service.close()


def test_only_the_runs_generators_receive_the_weights():
    keys = run_keys("0.0.0.0")
    publisher = WeightPublisher("0.0.0.0", keys)
    ours, theirs = WeightSubscriber(publisher.endpoint, keys), WeightSubscriber(publisher.endpoint)
    try:
        publisher.publish(1, serialise({"w": torch.ones(3)}))
        version, state = wait_newest(ours, current_version=0, timeout_s=20)
        assert version == 1 and torch.equal(state["w"], torch.ones(3))
        time.sleep(REFUSED_WAIT_MS / 1000)  # time enough for a subscriber that could connect to get it too
        assert theirs.poll_newest(0) is None and theirs.counts["received"] == 0
    finally:
        ours.close()
        theirs.close()
        publisher.close()
