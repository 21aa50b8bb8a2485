"""Versioned weights from learner rank 0 to the generators, in buckets, newest wins; ZeroMQ PUB/SUB carries
every bucket's notice (no pickle, ever), and the bucket's bytes go one of three ways.

Wire (wire/buckets.py splits a version, payload_layout.py lays out a bucket, weight_messages.py frames it):
    frame 0: msgpack {"version": int, "bucket": int, "buckets": int, "nbytes": int, "offset": int,
                      "checksum": str [, "segment": {...}]}
    frame 1: the bucket's tensors in safetensors' layout, stamped with version, bucket and buckets in its
             header's metadata, from byte `offset` (a part); empty when "segment" names where the bytes lie
How a bucket travels (the publisher picks, per version):
  - socket: in frame 1, in parts of weight_messages.PART_BYTES, one message each; the only way between
    machines (a publisher bound beyond loopback);
  - shared memory (a publisher on loopback, so every subscriber is on its machine, and Linux): each bucket
    is a memfd segment the learner wrote (wire/shared_payloads.py), "segment": {"path": ...};
  - CUDA IPC (`device_handles`, set when learner rank 0 and every generator share one GPU): each bucket is
    on that GPU, "segment": {"cuda": handle}; no host round trip at all (tests/test_cuda.py, GPU only).
Memory: the learner writes every version into ONE set of buckets (`writable_buckets`), bucket by bucket as it
gathers its tensors, and publishes the version once every bucket is written; so the publisher holds about one
version (socket sends are views of it, never copies).
A subscriber holds one bucket beyond its model: it copies a segment's bucket, or a socket bucket's parts, into
one buffer of its own (ZeroMQ holds RECEIVE_QUEUE more parts received and one on its way in), checks it, and
hands it on; the caller copies it into its model before the next poll.
checksum = xxh3_128 of the bucket's bytes, or `shared_payloads.sum64` (on the GPU) for CUDA IPC: it catches
a bucket damaged on its way, or rewritten by the learner (its next version) while a subscriber read it; the
bucket's stamp catches one whose checksum was taken as the learner rewrote it.
A version with a dropped bucket is asked for again: the subscriber subscribes once more, and the publisher
answers every subscription with every bucket of its newest version (as it does a late joiner). Otherwise a
learner waiting for a batch that only newer weights could open the admission gate for would never publish
the version that ends the wait.

Invariants:
  - `WeightPublisher.publish` never blocks the training loop: checksums and sends happen on one background
    thread, which alone owns the socket. If publishing falls behind, only the newest version is sent; one
    whose buckets the learner starts rewriting before they are sent is cut short (counted as superseded).
  - A subscriber that joins late is sent the newest version when its subscription arrives (XPUB); one that
    joins while a version is being sent sees the rest of it first: a gap, counted as dropped, then all of it.
  - `WeightSubscriber.poll_bucket` never blocks on the socket (but for PART_WAIT_MS at a time, for the next
    part of a bucket it joins): it drops (counts and logs in one line) any message whose framing, fields,
    part, checksum or stamp is wrong, and returns the next bucket of the version being assembled
    (wire/buckets.py `Assembly`), only ever of a version newer than the caller holds. Every wait that can
    block (`close`) has a timeout.
  - A poll that dropped a bucket of a version newer than the caller holds asks for the newest again, once per
    version (`counts["refetched"]`): a publisher whose newest version is itself bad is not made to resend it
    without end. A part-taken version or bucket whose next bucket or part does not come within STALL_S lost it
    (a lost last part leaves no gap): that counts as a dropped bucket too.
A bucket rewritten while it is still being sent over a slow socket arrives torn and is dropped: a subscriber
that needs longer than a training step to receive a version misses it and takes the next.

Run alone: `python -m pytest tests/test_weights.py tests/test_weight_buckets.py -q`.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import deque
from typing import Optional

import numpy as np
import torch
import zmq

from nanoverl_async.wire import shared_payloads
from nanoverl_async.wire.auth import CONTROL_MESSAGE_BYTES, CurveKeys, connect, serve
from nanoverl_async.wire.buckets import Assembly, Bucket, BucketSet, stamp_problem
from nanoverl_async.wire.payload_layout import checksum, deserialise
from nanoverl_async.wire.weight_messages import BadMessage, PartJoin, messages, read

log = logging.getLogger(__name__)

# Messages queued per subscriber: notices and views of the learner's buckets (never copies), a few versions'
# parts (a 7B bfloat16 version is 14,000 parts); a subscriber further behind misses parts, then asks again.
SEND_QUEUE = 1 << 16
RECEIVE_QUEUE = 4  # messages queued on a subscriber: over the socket, each is a part
POLL_INTERVAL_S = 0.02  # how often the send thread checks for new work and new subscribers
# A part-taken version or bucket whose next bucket or part has not come for this long lost it on the way (a
# part lost last leaves no gap to see): dropped and asked for again. Longer than a part takes over a slow link.
STALL_S = 10.0
PART_WAIT_MS = 50  # how long a poll waits for the next part of a bucket being joined before it returns None


class WeightPublisher:
    """Binds an XPUB socket on `host` (random port); `endpoint` is what generators connect to. On loopback
    (Linux) buckets in shared memory are sent by path (`shared_memory`; None: decide so); `device_handles`
    (off until the launcher finds rank 0 and every generator on one GPU) puts them on the GPU, sent by handle."""

    def __init__(self, host: str = "127.0.0.1", curve: Optional[CurveKeys] = None,
                 shared_memory: Optional[bool] = None):
        if shared_memory is None:  # bound on loopback, only processes of this machine can subscribe
            try:
                shared_memory = host == "localhost" or ipaddress.ip_address(host).is_loopback
            except ValueError:  # a host name
                shared_memory = False
        self.shared_memory = shared_memory and shared_payloads.AVAILABLE
        self.device_handles = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._bound = threading.Event()
        self._pending: Optional[tuple[int, BucketSet]] = None
        self._buckets: Optional[BucketSet] = None  # what `writable_buckets` hands out, version after version
        self._closing = False
        self.endpoint = ""
        self.error: Optional[BaseException] = None
        self.sent_version = -1  # newest version whose every bucket was sent
        self._superseded = -1  # newest version counted as superseded
        self.counts = {"published": 0, "sent": 0, "superseded": 0, "subscriptions": 0}  # joins and asks again
        self._thread = threading.Thread(target=self._run, args=(host, curve), name="weight-publisher", daemon=True)
        self._thread.start()
        if not self._bound.wait(timeout=30) or not self.endpoint:
            raise RuntimeError(f"weight publisher could not bind on {host}: {self.error!r}")

    def writable_buckets(self, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]], device: torch.device,
                         bucket_bytes: int) -> BucketSet:
        """The set learner rank 0 (on `device`) writes its next version into: the one written before when
        it fits (every version has the same layout), else a new one, on the GPU with `device_handles`, else
        pinned from a GPU (its copies do not block), else in shared memory where available."""
        on_device = device.type == "cuda" and self.device_handles
        if self._buckets is None or not self._buckets.fits(entries, bucket_bytes, on_device):
            self._buckets = None  # the old set's memory goes before the new one's is taken
            self._buckets = BucketSet(entries, bucket_bytes, pin_memory=device.type == "cuda",
                                      device=device if on_device else None)
        return self._buckets

    def publish(self, version: int, buckets: BucketSet) -> None:
        """Queue `version`, written into `buckets` (`BucketSet.begin(version)`, then every tensor), for sending
        and return at once; the learner may start writing its next version into them whenever it likes."""
        if self.error is not None:
            raise RuntimeError("weight publisher thread failed") from self.error
        buckets.finish(version)
        with self._lock:
            if self._pending is not None:
                self.counts["superseded"] += 1
            self._pending = (version, buckets)
            self.counts["published"] += 1
        self._wake.set()

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is pending, then stop the thread (never waits longer than timeout_s)."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            log.error("weight publisher thread did not stop within %.0f s", timeout_s)

    def _messages(self, version: int, buckets: BucketSet, index: int, built: dict[int, list]) -> Optional[list]:
        """Bucket `index`'s messages (built, checksummed, at its first send), or None if the learner is writing a
        newer version into it: its bytes are no longer (or soon not) this version's."""
        if buckets.stamp(index) != version:
            return None
        if index not in built:
            payload = buckets.payloads[index]
            notice = {"version": version, "bucket": index, "buckets": len(buckets.payloads), "nbytes": len(payload),
                      "checksum": checksum(payload)}
            if buckets.stamp(index) != version:  # rewritten while summed: the sum may mix two versions
                return None
            segment = None
            if isinstance(payload, torch.Tensor):  # on the GPU: only ever with device_handles
                segment = {"cuda": shared_payloads.device_handle(payload)}
            elif self.shared_memory and (path := shared_payloads.path_of(payload)) is not None:
                segment = {"path": path}
            built[index] = messages(notice, payload, segment)
        return built[index]

    def _run(self, host: str, curve: Optional[CurveKeys]) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.XPUB)
        stop_authenticator = serve(context, curve, socket)  # only the run's generators may subscribe
        socket.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # see every subscription, not only the first per topic
        socket.setsockopt(zmq.MAXMSGSIZE, CONTROL_MESSAGE_BYTES)  # what comes in: subscriptions only
        latest: Optional[tuple[int, BucketSet]] = None  # newest version published
        built: dict[int, list] = {}  # its messages, by bucket
        queue: deque[int] = deque()  # its buckets still to send, in order
        try:
            port = socket.bind_to_random_port(f"tcp://{host}")
            self.endpoint = f"tcp://{host}:{port}"
            self._bound.set()
            while True:
                subscriptions = 0
                while socket.poll(0, zmq.POLLIN):
                    subscriptions += socket.recv()[:1] == b"\x01"  # \x01 = subscribe, \x00 = unsubscribe
                self.counts["subscriptions"] += subscriptions
                with self._lock:
                    pending, self._pending = self._pending, None
                if pending is not None:
                    if latest is not None:
                        self._supersede(latest[0])
                    latest = pending
                    built = {}
                    queue = deque(range(len(pending[1].payloads)))
                elif subscriptions and latest is not None:
                    every = list(range(len(latest[1].payloads)))
                    if list(queue)[-len(every):] != every:  # one whole pass queued serves every new subscriber
                        queue.extend(every)
                if queue:
                    self._send_next(socket, latest, built, queue)
                if self._closing and self._pending is None and not queue:
                    break
                if not queue:
                    self._wake.wait(timeout=POLL_INTERVAL_S)
                    self._wake.clear()
        except BaseException as error:  # surfaced to the caller by publish
            self.error = error
            log.exception("weight publisher thread failed")
        finally:
            self._bound.set()
            socket.close(linger=1000)  # give the last buckets a moment to leave
            stop_authenticator()
            context.term()

    def _supersede(self, version: int) -> None:
        """Count `version` superseded if it was never sent whole (once, however often it is cut short)."""
        if self.sent_version < version and self._superseded < version:
            self._superseded = version
            self.counts["superseded"] += 1

    def _send_next(self, socket: zmq.Socket, latest: tuple[int, BucketSet], built: dict, queue: deque) -> None:
        """Send the next queued bucket of `latest`, one per turn, so a newer version or a subscriber is seen
        between two buckets."""
        version, buckets = latest
        index = queue.popleft()
        bucket = self._messages(version, buckets, index, built)
        if bucket is None:  # the learner writes a newer version: what is left of this one would be torn
            self._supersede(version)
            queue.clear()
            return
        for message in bucket:
            socket.send_multipart(message, copy=False)  # views of the bucket: never a copy of a version
        if index == len(buckets.payloads) - 1 and self.sent_version < version:
            self.sent_version = version
            self.counts["sent"] += 1


class WeightSubscriber:
    """Connects a SUB socket to a WeightPublisher's endpoint; `counts` holds received (buckets handed on),
    dropped, from_shared_memory (buckets copied from a segment) and refetched totals. The tensors of a bucket
    `poll_bucket` returns stay valid until the next poll (they view the frame, or this subscriber's one copy)."""

    def __init__(self, endpoint: str, curve: Optional[CurveKeys] = None):
        self.endpoint = endpoint
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        connect(self._socket, curve)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self.counts = {"received": 0, "dropped": 0, "from_shared_memory": 0, "refetched": 0}
        self._assembly = Assembly()
        self._join = PartJoin()  # a socket bucket's parts, joined into `_copy`
        self._copy: Optional[np.ndarray | torch.Tensor] = None  # our copy of a bucket: a segment's, or joined parts
        self._progress = time.monotonic()  # when a bucket was last handed on, or a part joined
        self._missed = -1  # the newest version the current poll dropped a bucket of
        self._asked_for = -1  # the newest version asked for again (`_ask_again`)

    def poll_bucket(self, held: int) -> Optional[Bucket]:
        """The next bucket of a version newer than `held` (the caller's complete version), checked, else None.
        Never blocks on the socket, but for PART_WAIT_MS at a time for the next part of a bucket it joins (its
        parts come back to back). A bucket dropped on the way, of a version newer than the one the caller
        holds or now assembles, has that version asked for again."""
        self._missed = -1
        bucket = self._next_bucket(held)
        if bucket is not None:
            self._progress = time.monotonic()
        elif (self._assembly.stalled(held) or self._join.bucket is not None) and \
                time.monotonic() - self._progress > STALL_S:
            version = self._assembly.version
            lost = self._join.abandon() or (version, f"version {version}: bucket {self._assembly.next} of "
                                                     f"{self._assembly.count}")
            self._lose((lost[0], f"{lost[1]}: nothing more came within {STALL_S:.0f} s"))
        self._ask_again(held if bucket is None else max(held, bucket.version))
        return bucket

    def _next_bucket(self, held: int) -> Optional[Bucket]:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if self._join.bucket is not None and self._socket.poll(PART_WAIT_MS):
                    continue  # a bucket's parts come back to back: a caller's sleep between each would cost
                return None
            try:
                notice, part = read(frames)
            except BadMessage as problem:  # a version that cannot be read counts as the one after `held`
                self._drop(str(problem), held + 1 if problem.version is None else problem.version)
                continue
            version = notice["version"]
            index = notice["bucket"]
            count = notice["buckets"]
            if notice["offset"] == 0:  # a bucket starts: one being joined lost its last parts
                self._lose(self._join.abandon())
                verdict = self._assembly.verdict(held, version, index, count)
                if verdict == "gap":
                    self._drop(f"version {version}: bucket {index} of {count} came before bucket "
                               f"{self._assembly.next}, which never did", version)
                if verdict != "take":
                    continue
                if "segment" not in notice:
                    self._join.start(notice, self._buffer(notice["nbytes"], None))
            if "segment" in notice:
                data = self._copy_segment(notice)
            else:
                data, lost = self._join.add(notice, part)
                self._lose(lost)
                if data is None:
                    if self._join.bucket is not None:  # a part joined: its bucket is on its way
                        self._progress = time.monotonic()
                    continue
            tensors = None if data is None else self._open(notice, data)
            if tensors is None:
                self._assembly.lost(version)
                continue
            self._assembly.took(version, index, count)
            self._asked_for = min(self._asked_for, version)  # what was asked for beyond a checked version: unsure
            self.counts["received"] += 1
            return Bucket(version, index, count, tensors)

    def _ask_again(self, held: int) -> None:
        """Subscribe once more if this poll dropped a bucket of a version newer than `held` and not yet asked
        for: the publisher answers every subscription with its newest version (a SUB socket sends a repeated
        subscription on, and the publisher's XPUB_VERBOSE passes it up)."""
        if self._missed > max(held, self._asked_for):
            self._asked_for = self._missed
            self._socket.setsockopt(zmq.SUBSCRIBE, b"")
            self.counts["refetched"] += 1
            log.info("asked %s for the newest weights again (version %d was dropped)", self.endpoint, self._missed)

    def _open(self, notice: dict, data: np.ndarray | torch.Tensor) -> Optional[dict[str, torch.Tensor]]:
        """The tensors of a whole bucket (viewing our copy) if it is the one its notice names, else None
        (dropped): damaged on the way, or rewritten by the learner while it was read."""
        version = notice["version"]
        index = notice["bucket"]
        count = notice["buckets"]
        where = f"version {version} bucket {index} of {count}"
        if checksum(data) != notice["checksum"]:
            return self._drop(f"{where}: checksum mismatch (damaged, or rewritten while it was read)", version)
        try:
            problem = stamp_problem(data, version, index, count)
            if problem:
                return self._drop(f"{where}: {problem}", version)
            tensors = deserialise(data)
        except Exception as error:  # checksummed bytes that are not safetensors: a sender bug
            return self._drop(f"{where}: not safetensors ({error})", version)
        if "segment" in notice:
            self.counts["from_shared_memory"] += 1
        return tensors

    def _copy_segment(self, notice: dict) -> Optional[np.ndarray | torch.Tensor]:
        """Our copy of the bucket a notice names (None if it is gone: dropped, counted, logged). RuntimeError
        when this process cannot map it at all: then no version ever could be applied."""
        segment = notice["segment"]
        nbytes = notice["nbytes"]
        version = notice["version"]
        where = f"version {version} bucket {notice['bucket']} of {notice['buckets']}"
        try:
            if "cuda" in segment:
                source = shared_payloads.open_device_handle(segment["cuda"], nbytes)
                copy = self._buffer(nbytes, source.device)[:nbytes]
                copy.copy_(source)
                del source  # the learner may free or reuse it once no reader maps it
            else:
                copy = self._buffer(nbytes, None)[:nbytes]
                shared_payloads.read_segment(segment["path"], copy)
        except (FileNotFoundError, ValueError) as error:  # freed or replaced since: a newer version was sent
            return self._drop(f"{where}: bucket gone ({error})", version)
        except TypeError as error:  # a CUDA handle's fields of the wrong types: not one a publisher wrote
            return self._drop(f"{where}: bad CUDA handle ({error})", version)
        except (OSError, RuntimeError) as error:
            raise RuntimeError(f"weights {where}: cannot map the learner's payload ({error}); learner rank 0 "
                               f"must share this machine (and, for CUDA IPC, this GPU)") from error
        return copy

    def _buffer(self, nbytes: int, device: Optional[torch.device]) -> np.ndarray | torch.Tensor:
        """This subscriber's one copy buffer (host, or on `device` for CUDA IPC), grown to the largest bucket."""
        copy = self._copy
        if copy is None or len(copy) < nbytes or (device is None) != isinstance(copy, np.ndarray) or \
                device is not None and copy.device != device:
            self._copy = copy = None  # the old buffer goes before the new one is taken
            self._copy = copy = np.empty(nbytes, dtype=np.uint8) if device is None else \
                torch.empty(nbytes, dtype=torch.uint8, device=device)
        return copy

    def _lose(self, lost: Optional[tuple[int, str]]) -> None:
        """A bucket lost part-joined ((version, why), if one was) is a dropped one."""
        if lost is not None:
            self._assembly.lost(lost[0])
            self._drop(lost[1], lost[0])

    def _drop(self, problem: str, version: int) -> None:
        self.counts["dropped"] += 1
        self._missed = max(self._missed, version)
        log.warning("dropped a weights message from %s: %s", self.endpoint, problem)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
