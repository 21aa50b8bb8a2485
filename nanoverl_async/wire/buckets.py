"""A weights version in buckets: how the learner's state dict is split (`plan`), the one set of bucket payloads
the learner rewrites in place for each version (`BucketSet`), and which bucket a subscriber takes next
(`Assembly`). weights.py moves them; payload_layout.py lays out each bucket's bytes.

Split: in the state dict's order (the order learner rank 0 gathers its tensors), a bucket takes tensors while
their data stays within `bucket_bytes` (headers aside); a tensor larger than that gets a bucket of its own.
A version always has at least one bucket (an empty state dict, a version notice, is one empty bucket).

Stamps: each bucket's header metadata names its version ("version", 20 digits), its index ("bucket") and the
bucket count ("buckets"). The learner writes a bucket's new stamp BEFORE the first of its tensors for the next
version, so bytes of two versions in one bucket always carry the newer stamp. The publisher checksums a bucket
and then reads its stamp again: unchanged, the checksum is of one version's bytes only; changed, the learner
is writing a newer version and the older one is cut short. A subscriber's copy that matches the checksum thus
holds exactly that version's bucket, and its stamp must name the notice's version, index and count.

Assembly (a subscriber): buckets of a version are taken in index order, from bucket 0, each once. A bucket 0
of a newer version starts that one (newest wins; the one being assembled is abandoned); a bucket of a version
held or older than the one being assembled is skipped, and so is one taken already (a resend's repeat); a
bucket past the next one means the next was lost: a gap, reported once per version, after which the same
version's resend (weights.py asks for it) may fill the gap from where it was. A notice moves the assembly only
once its bucket's bytes passed their checks (`took`): a damaged version number never makes it wait.

Run alone: `python -m pytest tests/test_weights.py -q`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from nanoverl_async.wire.payload_layout import METADATA, data_bytes, empty_payload, read_header

STAMP_DIGITS = 20  # any int64 version; fixed width, so a new stamp rewrites only these bytes
UNSTAMPED = b"x" * STAMP_DIGITS  # a bucket no version was written into yet: it matches none
VERSION_KEY = b'"version":"'  # where the stamp's digits start in the header


def plan(entries: dict[str, tuple[torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> list[dict]:
    """The buckets' entries, in order (see the module docstring)."""
    buckets, size = [{}], 0
    for name, (dtype, shape) in entries.items():
        nbytes = data_bytes(dtype, shape)
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append({})
            size = 0
        buckets[-1][name] = (dtype, shape)
        size += nbytes
    return buckets


def stamp_metadata(version: int, index: int, count: int) -> dict[str, str]:
    """What a bucket's header metadata says, as a subscriber checks it."""
    return {"version": f"{version:0{STAMP_DIGITS}d}", "bucket": str(index), "buckets": str(count)}


class BucketSet:
    """The payloads of one version's buckets (`payloads`, each `empty_payload`'s kind of memory), which learner
    rank 0 writes every version into: `begin(version)`, `write` each tensor, and the publisher's `finish`."""

    def __init__(self, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]], bucket_bytes: int,
                 pin_memory: bool = False, device: Optional[torch.device] = None):
        self.entries, self.bucket_bytes = dict(entries), bucket_bytes
        self.payloads: list[np.ndarray | torch.Tensor] = []
        self._slots: dict[str, torch.Tensor] = {}
        self._bucket_of: dict[str, int] = {}
        buckets = plan(entries, bucket_bytes)
        for index, bucket in enumerate(buckets):
            metadata = {"version": UNSTAMPED.decode(), "bucket": str(index), "buckets": str(len(buckets))}
            payload, slots = empty_payload(bucket, pin_memory, device, metadata)
            self.payloads.append(payload)
            self._slots.update(slots)
            self._bucket_of.update(dict.fromkeys(bucket, index))
        first = self.payloads[0]
        header = bytes(self._host(first, 0, 8 + int.from_bytes(bytes(self._host(first, 0, 8)), "little")))
        self._stamp_at = header.index(VERSION_KEY) + len(VERSION_KEY)  # the same in every bucket: metadata first
        self.version = -1
        self._written = set()
        self._stamped = set()

    @classmethod
    def of(cls, state_dict: dict[str, torch.Tensor], version: int, bucket_bytes: int) -> "BucketSet":
        """A new set holding `state_dict` as `version` (tests, benchmarks; the learner reuses one set)."""
        buckets = cls({name: (t.dtype, tuple(t.shape)) for name, t in state_dict.items()}, bucket_bytes)
        buckets.begin(version)
        for name, tensor in state_dict.items():
            buckets.write(name, tensor.detach())
        return buckets

    def fits(self, entries: dict, bucket_bytes: int, on_device: bool) -> bool:
        """Whether the next version (these tensors, this bucket size, on the GPU or not) can be written here."""
        return entries == self.entries and bucket_bytes == self.bucket_bytes and \
            isinstance(self.payloads[0], torch.Tensor) == on_device

    def begin(self, version: int) -> None:
        """The next `write`s are of `version`."""
        self.version = version
        self._written = set()
        self._stamped = set()

    def write(self, name: str, tensor: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy `tensor` into its slot, stamping its bucket with the version first (the module docstring)."""
        index = self._bucket_of[name]
        if index not in self._stamped:
            self._stamp(index)
        self._slots[name].copy_(tensor, non_blocking=non_blocking)
        self._written.add(name)

    def finish(self, version: int) -> None:
        """Check that every tensor was written as `version`, and stamp the buckets with none (an empty state
        dict's); RuntimeError if not: publishing it would send another version's bytes under this one's name."""
        missing = set(self.entries) - self._written
        if version != self.version or missing:
            raise RuntimeError(f"weights version {version}: the buckets were begun as {self.version} and "
                               f"{len(missing)} tensors were not written ({sorted(missing)[:3]})")
        for index in set(range(len(self.payloads))) - self._stamped:
            self._stamp(index)

    def stamp(self, index: int) -> Optional[int]:
        """The version bucket `index` holds or is being written with (None before the first)."""
        digits = bytes(self._host(self.payloads[index], self._stamp_at, self._stamp_at + STAMP_DIGITS))
        return int(digits) if digits.isdigit() else None

    def _stamp(self, index: int) -> None:
        digits = np.frombuffer(f"{self.version:0{STAMP_DIGITS}d}".encode(), dtype=np.uint8)
        payload = self.payloads[index]
        if isinstance(payload, torch.Tensor):  # on the GPU: in stream order, before the tensors' copies
            payload[self._stamp_at:self._stamp_at + STAMP_DIGITS].copy_(torch.from_numpy(digits.copy()))
        else:
            payload[self._stamp_at:self._stamp_at + STAMP_DIGITS] = digits
        self._stamped.add(index)

    @staticmethod
    def _host(payload: np.ndarray | torch.Tensor, start: int, stop: int) -> np.ndarray:
        part = payload[start:stop]
        return part.cpu().numpy() if isinstance(part, torch.Tensor) else part


class Bucket(NamedTuple):
    """What a subscriber hands on: bucket `index` of `count` of weights `version`, its tensors."""
    version: int
    index: int
    count: int
    tensors: dict[str, torch.Tensor]


def stamp_problem(data: np.ndarray | torch.Tensor, version: int, index: int, count: int) -> str:
    """Why a bucket's bytes are not bucket `index` of `count` of `version` by their own stamp ("" if they are)."""
    metadata = read_header(data)[0].get(METADATA)
    wanted = stamp_metadata(version, index, count)
    if not isinstance(metadata, dict) or {key: metadata.get(key) for key in wanted} != wanted:
        return f"its bytes are stamped {metadata!r:.200}, the notice says version {version}, bucket {index} of {count}"
    return ""


class Assembly:
    """A subscriber's progress through one version's buckets (the module docstring)."""

    def __init__(self):
        self.version = -1
        self.count = 0
        self.next = 0
        self._gap_reported = -1  # the version whose gap was reported

    def verdict(self, held: int, version: int, index: int, count: int) -> str:
        """"take", "skip" or "gap" for bucket `index` of `count` of `version`, with `held` applied. Nothing
        changes until `took`: a notice is trusted only once its bucket's bytes were checked (a damaged version
        number must not make the assembly wait for a version that never comes)."""
        if version <= held or version < self.version:
            return "skip"
        expected = self.next if (version, count) == (self.version, self.count) else 0  # a new one starts at 0
        if index < expected:
            return "skip"
        if index == expected:
            return "take"
        if self._gap_reported == version:
            return "skip"
        self._gap_reported = version
        return "gap"

    def stalled(self, held: int) -> bool:
        """Whether a version newer than `held` is part-taken, its next bucket still to come, and no loss of it
        reported yet."""
        return self.version > held and 0 < self.next < self.count and self._gap_reported != self.version

    def lost(self, version: int) -> None:
        """The bucket "take" named was dropped: the gap it leaves is that loss, not another."""
        self._gap_reported = version

    def took(self, version: int, index: int, count: int) -> bool:
        """The bucket "take" named is checked and handed on; whether it completed its version."""
        self.version = version
        self.count = count
        self.next = index + 1
        return self.next == self.count
