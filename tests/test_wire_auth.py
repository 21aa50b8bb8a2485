"""CURVE on every socket, loopback included: the buffer's and the weight publisher's sockets admit only
peers holding the run's keys; a peer without them (or with other keys) gets nothing through, neither a
lease, nor a trajectory into the buffer, nor the weights. A peer that never finishes its handshake is
disconnected after the handshake timeout, and one that announces a larger frame than the socket takes at
once. Real sockets on 127.0.0.1 and 0.0.0.0, no Ray.

Run alone: `python -m pytest tests/test_wire_auth.py -q` (~15 s).
"""

import contextlib
import socket
import struct
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from nanoverl_async.buffer.service import TRAJECTORY_BYTES_PER_TOKEN, BufferService
from nanoverl_async.config import BufferConfig, GeneratorConfig
from nanoverl_async.wire.trajectory import Trajectory, encode
from nanoverl_async.wire.buckets import BucketSet
from nanoverl_async.wire.weights import WeightPublisher, WeightSubscriber
from nanoverl_async.wire import auth
from nanoverl_async.wire.auth import CurveKeys, connect, run_keys
from weight_waits import wait_newest

REFUSED_WAIT_MS = 1500  # a refused peer's handshake never completes: nothing arrives in this time
HOSTS = ["127.0.0.1", "0.0.0.0"]  # loopback is no exception: any local process could connect there
# ZMTP 3.0's greeting of a CURVE client: signature, version, mechanism, as-server = 0, filler (64 bytes)
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + bytes(32)


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
        publisher.publish(1, BucketSet.of({"w": torch.ones(3)}, 1, bucket_bytes=2**20))
        version, state = wait_newest(ours, current_version=0, timeout_s=20)
        assert version == 1 and torch.equal(state["w"], torch.ones(3))
        time.sleep(REFUSED_WAIT_MS / 1000)  # time enough for a subscriber that could connect to get it too
        assert theirs.poll_bucket(0) is None and theirs.counts["received"] == 0
    finally:
        ours.close()
        theirs.close()
        publisher.close()


def raw_connections(endpoint: str, count: int, first_bytes: bytes = b"") -> list[socket.socket]:
    """`count` plain TCP connections to a ZeroMQ endpoint, each sending `first_bytes` and then nothing."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    connections = [socket.create_connection((host, int(port)), timeout=5) for _ in range(count)]
    for connection in connections:
        connection.sendall(first_bytes)
        connection.setblocking(False)
    return connections


def closed(connection: socket.socket) -> bool:
    """Whether the server closed the connection (the client reads EOF, or a reset), without blocking."""
    try:
        while connection.recv(4096):  # the server's own greeting comes first
            pass
        return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def long_frame(size: int) -> bytes:
    """A ZMTP command frame's flags (long, command) and its announced size: what a CURVE HELLO starts with."""
    return b"\x06" + struct.pack(">Q", size)


def test_peers_that_never_finish_the_handshake_are_disconnected_on_every_listening_socket(monkeypatch):
    """Silent connections, and ones that stop after the greeting's first bytes, to the buffer's PULL and ROUTER
    and the publisher's XPUB: open still halfway through the handshake timeout, all closed soon after it."""
    timeout_s = 2.0
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT_MS", int(timeout_s * 1000), raising=False)
    keys = run_keys()
    service = BufferService(1, 1, 0, BufferConfig(lease_timeout_s=30), "127.0.0.1", GeneratorConfig(replicas=1),
                            110, lambda index: {"index": index}, curve=keys, max_tokens=8)
    publisher = WeightPublisher("127.0.0.1", keys)
    peers = []
    try:
        opened = time.monotonic()
        for endpoint in (*service.endpoints.values(), publisher.endpoint):
            peers += raw_connections(endpoint, 10) + raw_connections(endpoint, 10, GREETING[:11])
        time.sleep(max(0.0, timeout_s / 2 - (time.monotonic() - opened)))
        assert not any(closed(peer) for peer in peers)  # a slow handshake has the whole timeout
        while not all(closed(peer) for peer in peers):
            assert time.monotonic() - opened < timeout_s + 2.0, \
                f"{sum(not closed(peer) for peer in peers)} of {len(peers)} connections still open"
            time.sleep(0.05)
        assert lease_request(service.endpoints["leases"], keys)["leases"]  # the run's own peers still get in
    finally:
        for peer in peers:
            peer.close()
        publisher.close()
        service.close()


def test_a_frame_larger_than_a_listening_socket_takes_is_refused_before_the_handshake_ends():
    """Each socket's bound exact: a frame announced one byte over it ends the connection at once, one at the
    bound is read on (it waits for the bytes, until the handshake timeout)."""
    keys = run_keys()
    service = BufferService(1, 1, 0, BufferConfig(lease_timeout_s=30), "127.0.0.1", GeneratorConfig(replicas=1),
                            110, lambda index: {"index": index}, curve=keys, max_tokens=8)
    publisher = WeightPublisher("127.0.0.1", keys)
    bounds = {service.endpoints["leases"]: auth.CONTROL_MESSAGE_BYTES, publisher.endpoint: auth.CONTROL_MESSAGE_BYTES,
              service.endpoints["trajectories"]: 8 * TRAJECTORY_BYTES_PER_TOKEN + (1 << 20)}
    peers = {}
    try:
        for endpoint, bound in bounds.items():
            peers[endpoint, bound + 1], peers[endpoint, bound] = (
                raw_connections(endpoint, 1, GREETING + long_frame(size))[0] for size in (bound + 1, bound))
        deadline = time.monotonic() + auth.HANDSHAKE_TIMEOUT_MS / 2000
        while not all(closed(peers[endpoint, bound + 1]) for endpoint, bound in bounds.items()):
            assert time.monotonic() < deadline, "a frame over the bound was read on"
            time.sleep(0.01)
        assert not any(closed(peers[endpoint, bound]) for endpoint, bound in bounds.items())
    finally:
        for peer in peers.values():
            peer.close()
        publisher.close()
        service.close()
