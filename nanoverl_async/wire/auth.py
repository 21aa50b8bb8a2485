"""Where the run's ZeroMQ sockets bind, and CURVE on every one, loopback included: only the run's roles connect.

    host = placed_host(cfg.wire.host, on_cluster)   # preflight, once: "auto" -> 127.0.0.1, or NODE on a cluster
    keys = run_keys()                      # the controller, once per run
    bind_host(host, node_ip)               # a role that binds, on the node Ray placed it on
    serve(context, keys, *sockets)         # a role that binds (buffer, weights publisher), before socket.bind
    connect(socket, keys)                  # a role that connects (generators), before socket.connect

Why: a `wire.host` on a network lets any peer reach the sockets, and on 127.0.0.1 any process of this
machine (another user's included) could lease prompts as a generator, push trajectories that get trained,
or subscribe to the weights. With keys, every connection is encrypted (CurveZMQ: Curve25519 keys, the
server's public key must be known to start a handshake) and a ZAP handler admits only clients presenting
the run's client key; a peer without it never completes the handshake, so its messages never reach the
buffer and it learns nothing of the run's state. Cost: one handshake per connection, then encryption of
every byte sent (the weights are the largest messages), on ZeroMQ's I/O threads.
The keys are made fresh by the controller for each run and handed to the roles as arguments: never
written to the config, the logs or the checkpoint. `keys=None` (plain sockets) is for tests and benches
that build one component alone; every role of a run gets the keys.
A listening socket closes any connection that has not finished its handshake (ZMTP greeting, CURVE, the
ZAP check) within HANDSHAKE_TIMEOUT_MS, keys or not: a peer that connects and sends nothing, or stalls
halfway, holds a file descriptor that long, not libzmq's default 30 s, in which silent connections pile up
towards the process's limit of open files. Each listening socket also takes in no message larger than its
protocol allows (`zmq.MAXMSGSIZE`: CONTROL_MESSAGE_BYTES for subscriptions and lease requests; the buffer
bounds trajectories by the run's token limit), since until the handshake ends nothing else bounds what an
unknown peer makes it buffer: a peer may announce a frame of any size in its first bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional

import zmq
import zmq.auth.thread


@dataclass(frozen=True, repr=False)  # repr=False: secret keys never end up in logs or tracebacks
class CurveKeys:
    server_public: bytes  # z85, 40 bytes each
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


NODE = "node"  # bind on the address of the node the role was placed on (Ray's node IP)
HANDSHAKE_TIMEOUT_MS = 5000  # a handshake takes milliseconds; seconds leave room for a busy ZAP thread
# the largest subscription or lease request taken in (a few dozen bytes; CURVE's own commands need ~300)
CONTROL_MESSAGE_BYTES = 1 << 16


def placed_host(host: str, on_cluster: bool) -> str:
    """wire.host as the roles get it: "auto" is loopback on one machine, and on a cluster each role's own
    node address (NODE), since a socket bound on loopback cannot be reached from another node."""
    if host != "auto":
        return host
    return NODE if on_cluster else "127.0.0.1"


def bind_host(host: str, node_ip: str) -> str:
    """The address a role running on the node `node_ip` binds, for a host from `placed_host`."""
    return node_ip if host == NODE else host


def run_keys() -> CurveKeys:
    """Fresh keys for one run: a server pair (the buffer's and the publisher's sockets) and a client pair
    (every generator), each made by libsodium from the OS's random source."""
    return CurveKeys(*zmq.curve_keypair(), *zmq.curve_keypair())  # (public, secret) of the server, of the client


def serve(context: zmq.Context, keys: Optional[CurveKeys], *sockets: zmq.Socket) -> Callable[[], None]:
    """Make `sockets` (of `context`, before they bind) CURVE servers, and start the ZAP handler of `context`,
    which admits only clients presenting the run's client key. Returns what stops that handler: call it before
    the context ends. Without keys only the handshake timeout is set, and what it returns does nothing."""
    for socket in sockets:
        socket.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
    if keys is None:
        return lambda: None
    for socket in sockets:
        socket.curve_secretkey = keys.server_secret
        socket.curve_publickey = keys.server_public
        socket.curve_server = True
    authenticator = zmq.auth.thread.ThreadAuthenticator(context)
    authenticator.start()
    # the ZAP credentials check: the run's client key, and no other (pyzmq passes the client's key z85-encoded)
    run_clients = SimpleNamespace(callback=lambda domain, key: key == keys.client_public)
    authenticator.configure_curve_callback(domain="*", credentials_provider=run_clients)
    return authenticator.stop


def connect(socket: zmq.Socket, keys: Optional[CurveKeys]) -> None:
    """Make `socket` (before it connects) a CURVE client of the run's servers; nothing without keys."""
    if keys is None:
        return
    socket.curve_secretkey = keys.client_secret
    socket.curve_publickey = keys.client_public
    socket.curve_serverkey = keys.server_public
