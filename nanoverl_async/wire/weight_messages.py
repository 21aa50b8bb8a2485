"""The weights wire's messages (weights.py moves them): a bucket's notice, and over the socket its bytes in parts.

A message is two frames: a msgpack notice {"version", "bucket", "buckets", "nbytes", "offset", "checksum"
[, "segment"]} and a part of the bucket's bytes, [offset, offset + len) of nbytes. A bucket in shared memory
or on the GPU is one message, offset 0, its part empty ("segment" says where its bytes lie). Over the socket a
bucket is cut into parts of PART_BYTES (`messages`), so a subscriber holds one bucket in its own buffer, into
which `PartJoin` copies the parts in order, plus the few parts ZeroMQ holds (weights.RECEIVE_QUEUE and one on
its way in), never whole buckets queued beside the one it holds.

A subscriber checks every message (`read`) before anything else: a wrong framing, field, type, range or
part size is refused with one line naming what is wrong and the version it names (if that can be read).
Joining: a bucket's first part (offset 0) starts it; each later part must be the next one of the same
notice; a part out of order means parts were lost: the bucket is dropped (`PartJoin.add` says why), and so
is a bucket a new first part interrupts. The bucket's checksum and stamp are checked once it is whole.

Run alone: `python -m pytest tests/test_weights.py -q`.
"""

from __future__ import annotations

from typing import Optional

import msgpack
import numpy as np

from nanoverl_async.wire import shared_payloads
from nanoverl_async.wire.trajectory import check_fields, unpack_map

PART_BYTES = 1 << 20  # a socket message's share of a bucket: what a subscriber holds beyond its one buffer
NOTICE_INTS = ("version", "bucket", "buckets", "nbytes", "offset")
BUCKET_KEYS = ("version", "bucket", "buckets", "nbytes", "checksum")  # the same in every part of a bucket


class BadMessage(ValueError):
    """A message refused by `read`; `version` is the one it names, or None when that cannot be read."""

    def __init__(self, problem: str, version: Optional[int]):
        super().__init__(problem)
        self.version = version


def messages(notice: dict, payload, segment: Optional[dict] = None) -> list[list]:
    """A bucket's messages: its notice (version, bucket, buckets, nbytes, checksum) with "segment" and an empty
    part when the bytes lie elsewhere, else one message per part, each a view of `payload` (never a copy)."""
    if segment is not None:
        return [[msgpack.packb({**notice, "offset": 0, "segment": segment}), b""]]
    view = memoryview(payload).cast("B")
    return [[msgpack.packb({**notice, "offset": offset}), view[offset:offset + PART_BYTES]]
            for offset in range(0, max(len(view), 1), PART_BYTES)]


def read(frames: list) -> tuple[dict, memoryview]:
    """(notice, part) of a well-formed message; BadMessage naming what is wrong otherwise."""
    version = None
    try:
        if len(frames) != 2:
            raise ValueError(f"{len(frames)} frames, expected 2")
        notice, part = unpack_map(frames[0].bytes), frames[1].buffer
        check_fields(notice, {*NOTICE_INTS, "checksum"} | ({"segment"} & set(notice)))
        if not all(isinstance(notice[key], int) and not isinstance(notice[key], bool) for key in NOTICE_INTS):
            raise ValueError(f"version, bucket, buckets, nbytes and offset must be ints: {notice!r:.200}")
        version = notice["version"] if notice["version"] >= 0 else None
        index, count, nbytes, offset = notice["bucket"], notice["buckets"], notice["nbytes"], notice["offset"]
        if version is None or nbytes < 0 or not 0 <= index < count:
            raise ValueError(f"version {notice['version']}: bucket {index} of {count}, {nbytes} bytes")
        if not isinstance(notice["checksum"], str):
            raise ValueError(f"version {version}: checksum {notice['checksum']!r:.100} is not a string")
        if "segment" in notice:
            segment = notice["segment"]
            if len(part) or offset or not isinstance(segment, dict) or not (
                    isinstance(segment.get("path"), str) or isinstance(segment.get("cuda"), dict)
                    and set(segment["cuda"]) == {"uuid", *shared_payloads.HANDLE_FIELDS}):
                raise ValueError(f"version {version}: bad segment {segment!r:.200} (offset {offset})")
        elif offset < 0 or offset + len(part) > nbytes or not len(part) and nbytes:
            raise ValueError(f"version {version}: a part of {len(part)} bytes at offset {offset} of a bucket "
                             f"of {nbytes}")
        return notice, part
    except ValueError as problem:
        raise BadMessage(str(problem), version) from None


class PartJoin:
    """A subscriber's bucket being joined from its parts, in its one buffer (the module docstring)."""

    def __init__(self):
        self.bucket: Optional[tuple] = None  # BUCKET_KEYS of the bucket being joined, None between buckets
        self._filled = 0
        self._into: Optional[np.ndarray] = None

    def start(self, notice: dict, into: np.ndarray) -> None:
        """Join the bucket `notice` (a first part, none being joined) names into `into`."""
        self.bucket = tuple(notice[key] for key in BUCKET_KEYS)
        self._filled = 0
        self._into = into

    def add(self, notice: dict, part: memoryview) -> tuple[Optional[np.ndarray], Optional[tuple[int, str]]]:
        """(the whole bucket once `part` completes it, else None; (version, why) if the bucket is lost)."""
        if tuple(notice[key] for key in BUCKET_KEYS) != self.bucket:
            return None, None  # a part of a bucket not taken (a repeat, or one after a gap)
        if notice["offset"] != self._filled:
            return None, self.abandon()
        self._into[self._filled:self._filled + len(part)] = np.frombuffer(part, dtype=np.uint8)
        self._filled += len(part)
        if self._filled < notice["nbytes"]:
            return None, None
        whole, self.bucket, self._into = self._into[:self._filled], None, None
        return whole, None

    def abandon(self) -> Optional[tuple[int, str]]:
        """Stop joining; (version, why) the bucket being joined is lost, if one was."""
        if self.bucket is None:
            return None
        version, index, count, nbytes, _ = self.bucket
        self.bucket, self._into = None, None
        filled = self._filled
        return version, f"version {version}: bucket {index} of {count} lost a part after {filled} of {nbytes} bytes"
