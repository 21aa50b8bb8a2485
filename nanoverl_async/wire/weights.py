"""Versioned weights from learner rank 0 to the generators, newest wins; ZeroMQ PUB/SUB carries every
version's notice (no pickle, ever), and the weights themselves go one of three ways.

Wire (one multipart message per version):
    frame 0: msgpack {"version": int, "nbytes": int, "checksum": str[, "segment": {...}]}
    frame 1: the full state dict in safetensors' layout (`serialise`; safetensors.torch.load reads it too):
             an 8-byte little-endian header size, a JSON header {name: {dtype, shape, data_offsets}}, data;
             empty when "segment" names where the payload lies instead
How the payload travels (the publisher picks, per version):
  - socket: in frame 1; the only way between machines (a publisher bound beyond loopback);
  - shared memory (a publisher on loopback, so every subscriber is on its machine, and Linux): the payload
    is a memfd segment the learner wrote (wire/shared_payloads.py), "segment": {"path": ...};
  - CUDA IPC (`device_handles`, set when learner rank 0 and every generator share one GPU): the payload is
    on that GPU, "segment": {"cuda": handle}; no host round trip at all.
A subscriber copies a segment's payload into memory of its own (two buffers, alternating) and checks the
copy, so a payload the learner rewrote meanwhile (it reuses one only after a newer version was sent) fails
the check and is dropped, never applied: the newer one is on its way.
A dropped version is asked for again: the subscriber subscribes once more, and the publisher answers every
subscription with its newest version (as it does a late joiner). Otherwise a learner waiting for a batch that
only newer weights could open the admission gate for would never publish the version that ends the wait.
checksum = xxh3_128 of the payload's bytes (0.05 s for 358M bfloat16 parameters on one core;
bench/weights_latency.py), or `shared_payloads.sum64` (on the GPU) for CUDA IPC: it catches a payload damaged
or mis-framed on its way (CURVE, when on, authenticates the sender).
Both ends are written here rather than with safetensors' own functions, which hold the GIL while they copy
a whole model (about 1 s each way for 360M bfloat16 parameters on 2 cores): here the learner copies each
tensor straight into its slot of the payload (`empty_payload`; torch copies, GIL released), and the
receiver's tensors view the received frame or its own copy of the segment.

Invariants:
  - `WeightPublisher.publish` never blocks the training loop: the checksum and sending happen on one
    background thread, which alone owns the socket. If publishing falls behind, only the newest pending
    version is sent (older pending ones are counted as superseded, never sent out of order).
  - A subscriber that joins late is sent the latest version when its subscription arrives (the publisher
    is an XPUB socket), so it never waits a whole training step for its first weights.
  - A payload handed to `publish` is the publisher's until `take_spare` hands it back, which it does only
    once a newer version was sent after it and ZeroMQ is done with every send of it (tracked): no version
    is overwritten on the socket; one in place may be, while a subscriber copies it, and then fails the check.
  - `WeightSubscriber.poll_newest` never blocks on the socket: it drains what is queued, drops (counts and
    logs) any message whose framing, nbytes or checksum is wrong, and returns only the newest version greater
    than the caller's, a version in place once copied and checked. Every wait that can block (`close`) has a
    timeout.
  - A poll that dropped a version newer than the one it leaves the caller holding asks for the newest again,
    once per dropped version (`counts["refetched"]`): a copy damaged again waits for the next version, so a
    publisher whose newest version is itself bad is not made to resend it without end.

Run alone: `python -m pytest tests/test_weights.py -q`.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import threading
from collections import deque
from typing import Optional

import msgpack
import numpy as np
import torch
import xxhash
import zmq

from nanoverl_async.wire import shared_payloads
from nanoverl_async.wire.auth import CONTROL_MESSAGE_BYTES, CurveKeys, connect, serve
from nanoverl_async.wire.trajectory import check_fields, unpack_map

log = logging.getLogger(__name__)

HIGH_WATER_MARK = 4  # queued messages per peer; each may be a whole model, so keep few
POLL_INTERVAL_S = 0.02  # how often the send thread checks for new work and new subscribers
SPARE_PAYLOADS = 2  # sent payloads kept for the publisher's caller to write later versions into


def checksum(payload: bytes | memoryview | np.ndarray | torch.Tensor) -> str:
    """xxh3_128 of host bytes; of a uint8 tensor (a payload on the GPU), `shared_payloads.sum64` where it lies."""
    if isinstance(payload, torch.Tensor):
        return shared_payloads.sum64(payload)
    return xxhash.xxh3_128(payload).hexdigest()


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def empty_payload(entries: dict[str, tuple[torch.dtype, tuple[int, ...]]], pin_memory: bool = False,
                  device: Optional[torch.device] = None) -> tuple[np.ndarray | torch.Tensor, dict[str, torch.Tensor]]:
    """A payload in safetensors' layout for tensors of these dtypes and shapes, header written, data not yet,
    and each tensor's slot in it, a view to copy that tensor into (`serialise`; the learner copies straight
    from its device, so a version is copied once). On a CUDA `device`, a uint8 tensor there; else a numpy
    array (bytes to zmq and xxhash without a copy) in pinned memory, or in shared memory where this machine
    offers it (wire/shared_payloads.py). Every key gets its own bytes (tied tensors too), widest dtypes first, so
    that every slot starts aligned to its element size."""
    header, offset = {}, 0
    for name in sorted(entries, key=lambda name: -entries[name][0].itemsize):
        dtype, shape = entries[name]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    prefix = bytearray(len(encoded).to_bytes(8, "little") + encoded)
    size = len(prefix) + offset
    if device is not None and device.type == "cuda":
        payload = torch.empty(size, dtype=torch.uint8, device=device)
    elif pin_memory or not shared_payloads.AVAILABLE:
        payload = torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory)  # not zero-filled
    else:
        payload = torch.from_numpy(shared_payloads.shared_bytes(size))
    payload[:len(prefix)] = torch.frombuffer(prefix, dtype=torch.uint8).to(payload.device)
    return (payload if payload.is_cuda else payload.numpy()), deserialise(payload)  # the slots: views, as received


def serialise(state_dict: dict[str, torch.Tensor]) -> np.ndarray:
    """The state dict as a payload (`empty_payload`)."""
    payload, slots = empty_payload({name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in state_dict.items()})
    for name, tensor in state_dict.items():
        slots[name].copy_(tensor.detach())
    return payload


def deserialise(payload: memoryview | np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
    """`serialise`'s bytes (or `empty_payload`'s uint8 tensor on a GPU) -> tensors that view `payload` (and
    keep it alive); ValueError for a header that does not fit the payload, RuntimeError for a slot not aligned
    to its element size (neither `empty_payload` nor safetensors writes one)."""
    data = payload if isinstance(payload, torch.Tensor) else torch.frombuffer(payload, dtype=torch.uint8)
    size = int.from_bytes(data[:8].cpu().numpy().tobytes(), "little")
    if not 0 < size <= len(data) - 8:
        raise ValueError(f"header of {size} bytes in a payload of {len(data)}")
    header = json.loads(data[8:8 + size].cpu().numpy().tobytes())
    data = data[8 + size:]
    tensors = {}
    for name, entry in header.items():
        dtype, shape, (start, stop) = SAFETENSORS_DTYPES.get(entry["dtype"]), entry["shape"], entry["data_offsets"]
        if dtype is None:
            raise ValueError(f"tensor {name!r}: dtype {entry['dtype']!r} is not one of {', '.join(SAFETENSORS_DTYPES)}")
        count = math.prod(shape)
        if not 0 <= start <= stop <= len(data) or stop - start != count * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: bytes {start}-{stop} of {len(data)} for {count} x {dtype}")
        tensors[name] = data[start:stop].view(dtype).view(shape)
    return tensors


class WeightPublisher:
    """Binds an XPUB socket on `host` (random port); `endpoint` is what generators connect to. On loopback
    (Linux) payloads in shared memory are sent by path (`shared_memory`; None: decide so); `device_handles`
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
        self._pending: Optional[tuple[int, np.ndarray]] = None
        # payloads no longer the newest version, each with its sends (none if superseded): `take_spare`'s
        self._retired: deque[tuple[list[zmq.MessageTracker], np.ndarray]] = deque(maxlen=SPARE_PAYLOADS)
        self._closing = False
        self.endpoint = ""
        self.error: Optional[BaseException] = None
        self.sent_version = -1  # newest version sent so far
        self.counts = {"published": 0, "sent": 0, "superseded": 0}
        self._thread = threading.Thread(target=self._run, args=(host, curve), name="weight-publisher", daemon=True)
        self._thread.start()
        if not self._bound.wait(timeout=30) or not self.endpoint:
            raise RuntimeError(f"weight publisher could not bind on {host}: {self.error!r}")

    def publish(self, version: int, payload: np.ndarray) -> None:
        """Queue `version` (its state dict as `serialise` or `empty_payload` lays it out) for sending and
        return at once. The publisher owns `payload` from now on, until `take_spare` hands it back."""
        if self.error is not None:
            raise RuntimeError("weight publisher thread failed") from self.error
        with self._lock:
            if self._pending is not None:
                self.counts["superseded"] += 1
                self._retired.append(([], self._pending[1]))
            self._pending = (version, payload)
            self.counts["published"] += 1
        self._wake.set()

    def writable_payload(self, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                         device: torch.device) -> tuple[np.ndarray | torch.Tensor, dict[str, torch.Tensor]]:
        """Where learner rank 0 (on `device`) writes its next version, and the slots in it: a spare
        (`take_spare`) of this layout and kind, else a new `empty_payload`, on the GPU with `device_handles`,
        else pinned from a GPU (its copies do not block), else in shared memory where available."""
        on_device = device.type == "cuda" and self.device_handles
        payload = self.take_spare()
        if payload is not None and isinstance(payload, torch.Tensor) == on_device:
            slots = deserialise(payload)
            if {name: (slot.dtype, tuple(slot.shape)) for name, slot in slots.items()} == entries:
                return payload, slots
        return empty_payload(entries, pin_memory=device.type == "cuda", device=device if on_device else None)

    def take_spare(self) -> Optional[np.ndarray | torch.Tensor]:
        """A payload published earlier that is no longer needed (a newer version was sent after it, and
        ZeroMQ has let go of it), to write the next version into: a fresh one of a large model spends as long
        in page faults as in the copy. None if there is none yet."""
        with self._lock:
            for index, (sends, payload) in enumerate(self._retired):
                if all(send.done for send in sends):
                    del self._retired[index]
                    return payload
        return None

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is pending, then stop the thread (never waits longer than timeout_s)."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            log.error("weight publisher thread did not stop within %.0f s", timeout_s)

    def _frames(self, version: int, payload: np.ndarray | torch.Tensor) -> list:
        """A version's message: its notice, and its payload unless the notice names where it lies."""
        notice = {"version": version, "nbytes": len(payload), "checksum": checksum(payload)}
        if isinstance(payload, torch.Tensor):  # on the GPU: only ever with device_handles
            notice["segment"] = {"cuda": shared_payloads.device_handle(payload)}
        elif self.shared_memory and (path := shared_payloads.path_of(payload)) is not None:
            notice["segment"] = {"path": path}
        return [msgpack.packb(notice), b"" if "segment" in notice else payload]

    def _run(self, host: str, curve: Optional[CurveKeys]) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.XPUB)
        stop_authenticator = serve(context, curve, socket)  # only the run's generators may subscribe
        socket.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # see every subscription, not only the first per topic
        socket.setsockopt(zmq.MAXMSGSIZE, CONTROL_MESSAGE_BYTES)  # what comes in: subscriptions only
        latest: Optional[tuple[list, np.ndarray | torch.Tensor]] = None  # newest version sent (frames, payload)
        sends: list[zmq.MessageTracker] = []  # latest's sends: to every subscriber, then to each late one
        try:
            port = socket.bind_to_random_port(f"tcp://{host}")
            self.endpoint = f"tcp://{host}:{port}"
            self._bound.set()
            while True:
                new_subscriber = False
                while socket.poll(0, zmq.POLLIN):
                    new_subscriber |= socket.recv()[:1] == b"\x01"  # \x01 = subscribe, \x00 = unsubscribe
                with self._lock:
                    pending, self._pending = self._pending, None
                    if pending is not None and latest is not None:  # the version sent last becomes a spare
                        self._retired.append((sends, latest[1]))
                if pending is not None:
                    version, payload = pending
                    latest = (self._frames(version, payload), payload)
                    sends = [socket.send_multipart(latest[0], copy=False, track=True)]
                    self.sent_version = version
                    self.counts["sent"] += 1
                elif new_subscriber and latest is not None:
                    sends.append(socket.send_multipart(latest[0], copy=False, track=True))
                if self._closing and self._pending is None:
                    break
                self._wake.wait(timeout=POLL_INTERVAL_S)
                self._wake.clear()
        except BaseException as error:  # surfaced to the caller by publish
            self.error = error
            log.exception("weight publisher thread failed")
        finally:
            self._bound.set()
            socket.close(linger=1000)  # give the last version a moment to leave
            stop_authenticator()
            context.term()


class WeightSubscriber:
    """Connects a SUB socket to a WeightPublisher's endpoint; `counts` holds received/dropped/refetched totals.
    A state dict `poll_newest` returns stays valid until it returns a newer one (it views the frame, or one of
    the two copies of shared payloads, which alternate)."""

    def __init__(self, endpoint: str, curve: Optional[CurveKeys] = None):
        self.endpoint = endpoint
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        connect(self._socket, curve)
        self._socket.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self.counts = {"received": 0, "dropped": 0, "from_shared_memory": 0, "refetched": 0}
        self._segments = shared_payloads.SegmentReader()
        self._copies: list = [None, None]  # this process's copies of shared payloads; [0] is free
        self._missed = -1  # the newest version the current poll dropped
        self._asked_for = -1  # the newest version asked for again (`_ask_again`)

    def poll_newest(self, current_version: int) -> Optional[tuple[int, dict[str, torch.Tensor]]]:
        """(version, state_dict) of the newest valid queued version > current_version, else None. Never blocks
        on the socket; a payload in shared memory is copied (only the newest) and checked first. A version
        dropped on the way and newer than the one returned (or held) is asked for again."""
        self._missed = -1
        newest = self._newest(current_version)
        self._ask_again(current_version if newest is None else newest[0])
        return newest

    def _newest(self, current_version: int) -> Optional[tuple[int, dict[str, torch.Tensor]]]:
        """`poll_newest`, but for asking again."""
        newest: tuple[int, Optional[memoryview], Optional[dict]] = (current_version, None, None)  # as `_check`'s
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            checked = self._check(frames, current_version)
            if checked is None:
                continue
            self.counts["received"] += 1
            if checked[0] > newest[0]:
                newest = checked
        version, payload, notice = newest
        if payload is None and notice is not None:
            payload = self._copy_segment(version, notice)
        if payload is None:
            return None
        try:
            return version, deserialise(payload)
        except Exception as error:  # a checksummed payload that is not safetensors: a sender bug
            return self._drop(f"version {version}: not safetensors ({error})", version)

    def _ask_again(self, held: int) -> None:
        """Subscribe once more if this poll dropped a version newer than `held` and not yet asked for: the
        publisher answers every subscription with its newest version (a SUB socket sends a repeated
        subscription on, and the publisher's XPUB_VERBOSE passes it up)."""
        if self._missed > max(held, self._asked_for):
            self._asked_for = self._missed
            self._socket.setsockopt(zmq.SUBSCRIBE, b"")
            self.counts["refetched"] += 1
            log.info("asked %s for the newest weights again (version %d was dropped)", self.endpoint, self._missed)

    def _copy_segment(self, version: int, notice: dict) -> Optional[np.ndarray | torch.Tensor]:
        """Our copy of the payload a notice names, if its checksum matches (else None: dropped, counted, logged).
        RuntimeError when this process cannot map it at all: then no version ever could be applied."""
        segment, nbytes = notice["segment"], notice["nbytes"]
        try:
            if "cuda" in segment:
                source = shared_payloads.open_device_handle(segment["cuda"], nbytes)
            else:
                source = self._segments.view(segment["path"], nbytes)
        except (FileNotFoundError, ValueError) as error:  # freed or replaced since: a newer version was sent
            return self._drop(f"version {version}: payload gone ({error})", version)
        except (OSError, RuntimeError) as error:
            raise RuntimeError(f"weights version {version}: cannot map the learner's payload ({error}); learner "
                               f"rank 0 must share this machine (and, for CUDA IPC, this GPU)") from error
        copy = self._copies[0]  # host or device memory, as the source
        if copy is None or type(copy) is not type(source) or len(copy) != nbytes or \
                isinstance(copy, torch.Tensor) and copy.device != source.device:
            copy = self._copies[0] = torch.empty_like(source) if "cuda" in segment else np.empty_like(source)
        copy[:] = source
        del source  # the learner may free or reuse it once no reader maps it
        if checksum(copy) != notice["checksum"]:
            return self._drop(f"version {version}: checksum mismatch (rewritten while it was read)", version)
        self._copies.reverse()  # the other copy is written next: this one stays valid until a newer version
        self.counts["from_shared_memory"] += 1
        return copy

    def _drop(self, problem: str, version: int) -> None:
        self.counts["dropped"] += 1
        self._missed = max(self._missed, version)
        log.warning("dropped a weights message from %s: %s", self.endpoint, problem)

    def _check(self, frames: list, current_version: int) -> Optional[tuple[int, Optional[memoryview], dict]]:
        """(version, payload, notice) of a well-formed message, or None (dropped, counted, logged); the payload
        is None when the notice names a segment (checked once copied: `_copy_segment`). A dropped message whose
        version cannot be read counts as the version after `current_version`."""
        version = current_version + 1
        try:
            if len(frames) != 2:
                raise ValueError(f"{len(frames)} frames, expected 2")
            header, payload = unpack_map(frames[0].bytes), frames[1].buffer
            check_fields(header, {"version", "nbytes", "checksum"} | ({"segment"} & set(header)))
            if not all(isinstance(header[key], int) for key in ("version", "nbytes")):
                raise ValueError(f"version and nbytes must be ints: {header!r:.200}")
            version, segment = header["version"], header.get("segment")
            if "segment" in header:
                if len(payload) or not isinstance(segment, dict) or not (
                        isinstance(segment.get("path"), str) or isinstance(segment.get("cuda"), dict)):
                    raise ValueError(f"version {version}: bad segment {segment!r:.200}")
                return version, None, header
            if header["nbytes"] != len(payload):
                raise ValueError(f"version {version}: {len(payload)} bytes, header says {header['nbytes']}")
            if header["checksum"] != checksum(payload):
                raise ValueError(f"version {version}: checksum mismatch")
            return version, payload, header
        except ValueError as problem:
            return self._drop(str(problem), version)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
