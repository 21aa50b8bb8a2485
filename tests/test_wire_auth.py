"""CURVE on every socket, loopback included: the buffer's and the weight publisher's sockets admit only
peers holding the run's keys; a peer without them (or with other keys) gets nothing through, neither a
lease, nor a trajectory into the buffer, nor the weights. Real sockets on 127.0.0.1 and 0.0.0.0, no Ray.

Run alone: `python -m pytest tests/test_wire_auth.py -q` (~15 s).
"""

import contextlib
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from nanoverl_async.buffer.service import BufferService
from nanoverl_async.config import BufferConfig, GeneratorConfig
from nanoverl_async.wire.trajectory import Trajectory, encode
from nanoverl_async.wire.weights import WeightPublisher, WeightSubscriber, serialise
from nanoverl_async.wire.auth import CurveKeys, connect, run_keys
from weight_waits import wait_newest

REFUSED_WAIT_MS = 1500  # a refused peer's handshake never completes: nothing arrives in this time
HOSTS = ["127.0.0.1", "0.0.0.0"]  # loopback is no exception: any local process could connect there


def test_every_run_gets_fresh_keys_that_never_print():
    first, second = run_keys(), run_keys()
    assert len(first.server_public) == len(first.client_secret) == 40 and first.server_public != second.server_public
    assert first.client_public != second.client_public
    assert "secret" not in repr(first) and first.client_secret.decode() not in repr(first)


def dealer_and_push(service: BufferService, keys) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """What a generator holds, connected with `keys` (None: plain sockets)."""
    context = zmq.Context()
    dealer, push = context.socket(zmq.DEALER), context.socket(zmq.PUSH)
    for socket, endpoint in ((dealer, "leases"), (push, "trajectories")):
        connect(socket, keys)
        socket.connect(service.endpoints[endpoint])
    return context, dealer, push


def lease_request(endpoint: str, keys) -> dict | None:
    """A lease request from a fresh DEALER connected with `keys` (None: plain): the reply, or None
    (tests/netns_hosts.py sends the same from another network namespace)."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    connect(dealer, keys)
    dealer.connect(endpoint)
    dealer.send(msgpack.packb({"op": "lease", "generator_id": 0, "version": 0, "max_groups": 1}))
    reply = msgpack.unpackb(dealer.recv(), raw=False) if dealer.poll(REFUSED_WAIT_MS) else None
    context.destroy(linger=0)
    return reply


def trajectory(group_id: int, tokens: int) -> bytes:
    mask = np.ones(tokens, dtype=np.uint8)
    return encode(Trajectory(id=f"g{group_id}-{tokens}", group_id=group_id, prompt_index=0, sample_index=0,
                             token_ids=np.zeros(tokens, np.int32), loss_mask=mask,
                             behaviour_logprobs=np.full(tokens, -0.5, np.float32),
                             versions=np.zeros(tokens, np.int32), reward=1.0))


@pytest.mark.parametrize("host", HOSTS)
def test_the_buffer_admits_only_the_runs_keys(host):
    """Neither a lease nor a pushed trajectory of a peer without the run's client key reaches the buffer."""
    keys = run_keys()
    service = BufferService(1, 1, 0, BufferConfig(lease_timeout_s=30), host,
                            GeneratorConfig(replicas=1), 110, lambda index: {"index": index}, curve=keys)
    intruder_keys = CurveKeys(keys.server_public, keys.server_secret, *zmq.curve_keypair())
    peers = [dealer_and_push(service, k) for k in (None, intruder_keys, keys)]  # the last: the run's generator
    try:
        endpoint = service.endpoints["leases"]
        assert lease_request(endpoint, None) is None  # no keys: no handshake
        assert lease_request(endpoint, intruder_keys) is None  # knows the server, wrong client key
        assert service.stats()["leased"] == 0 and service.stats()["malformed_requests"] == 0  # nothing got in
        (lease,) = lease_request(endpoint, keys)["leases"]
        for _, _, push in peers[:2]:  # a whole group, if it got in
            with contextlib.suppress(zmq.Again):  # queued, or no pipe at all (the handshake was refused)
                push.send(trajectory(lease["group_id"], tokens=9), zmq.NOBLOCK)
        time.sleep(REFUSED_WAIT_MS / 1000)
        stats = service.stats()
        assert stats["groups_ready"] == 0 and stats["tokens_generated"] == 0 and stats["malformed"] == 0
        peers[2][2].send(trajectory(lease["group_id"], tokens=3))
        batch = service.next_batch(0, timeout_s=10)
        assert [len(t.token_ids) for t in batch.trajectories] == [3] and batch.stats["tokens_generated"] == 3
    finally:
        for context, _, _ in peers:
            context.destroy(linger=0)
        service.close()


@pytest.mark.parametrize("host", HOSTS)
def test_only_the_runs_generators_receive_the_weights(host):
    keys = run_keys()
    publisher = WeightPublisher(host, keys)
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
