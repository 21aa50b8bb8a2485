"""Weight payloads another process on the same machine reads in place: host memory that other processes map
by path, and CUDA memory they map by IPC handle. weights.py decides when to use them; this module only
allocates, names, opens and checksums.

Host: a payload is a memfd (Linux), mapped here and named `/proc/<pid>/fd/<fd>`, which any process of the
same user on this machine can open and map. Unlike a file in /dev/shm it needs no cleanup and leaks nothing
when its process is killed, and it is not bounded by /dev/shm's size (64 MB in many containers).

CUDA: a payload on a GPU is shared by torch's CUDA IPC (`torch.multiprocessing.reductions.reduce_tensor`, as
verl's and slime's colocated paths share weights), its handle sent as plain msgpack-able fields (never
pickled); the reader maps it on the device with the same UUID, whatever CUDA_VISIBLE_DEVICES numbers it.
xxh3 would need GPU bytes on the host, so a device payload is checked by `sum64` on the GPU instead.

Invariants: a segment's path is valid while its payload lives in the writing process; readers copy a payload
out before checking it (weights.py), so a payload rewritten meanwhile fails the check and is never applied.
Host readers copy by read(), never mapping the writer's memory.

Run alone: tests/test_weights.py (host memory and sum64 on CPU), tests/test_cuda.py (the CUDA handles).
"""

from __future__ import annotations

import inspect
import mmap
import os
import sys
import weakref
from typing import Optional

import numpy as np
import torch

AVAILABLE = sys.platform == "linux" and hasattr(os, "memfd_create")  # memfd: Linux only; elsewhere the socket
SUM64_CHUNK = 1 << 24  # 8-byte words summed per chunk (128 MB)
# what of reduce_tensor's rebuild arguments crosses (bytes, ints, a bool); the rest is the same for every payload
HANDLE_FIELDS = ("tensor_offset", "storage_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle",
                 "ref_counter_offset", "event_handle", "event_sync_required")
_PATHS: dict[int, tuple[str, int]] = {}  # address of a shared payload -> (path other processes open, nbytes)


def shared_bytes(nbytes: int) -> np.ndarray:
    """`nbytes` of zero-filled memory that other processes of this machine can map by `path_of` it."""
    fd = os.memfd_create("nanoverl-weights", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    mapping = mmap.mmap(fd, nbytes)
    array = np.frombuffer(mapping, dtype=np.uint8)
    _PATHS[array.ctypes.data] = (f"/proc/{os.getpid()}/fd/{fd}", nbytes)
    # when the last view of it is gone: its path is forgotten, its fd closed
    weakref.finalize(mapping, _PATHS.pop, array.ctypes.data, None)
    weakref.finalize(mapping, os.close, fd)
    return array


def path_of(payload: np.ndarray) -> Optional[str]:
    """The path another process maps `payload` (host memory) by, if it is a whole `shared_bytes` segment; else
    None."""
    path, nbytes = _PATHS.get(payload.ctypes.data, (None, -1))
    return path if nbytes == payload.nbytes else None


def read_segment(path: str, into: np.ndarray) -> None:
    """Copy the segment at `path` into `into` (its whole length) by read(), not by mapping it: the reader's page
    tables never take the writer's pages, so its memory grows by its own copy only. FileNotFoundError: gone (its
    writer freed it); ValueError: not `len(into)` bytes long; other OSError: not openable from this process."""
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        if size != len(into):
            raise ValueError(f"{path}: {size} bytes, the notice says {len(into)}")
        view, done = memoryview(into), 0
        while done < size:
            read = file.readinto(view[done:])
            if not read:
                raise ValueError(f"{path}: ended after {done} of {size} bytes")
            done += read


def sum64(payload: torch.Tensor) -> str:
    """Integrity check of a uint8 payload where it lies (GPU or CPU): the wrapping sums of its 8-byte words per
    chunk of SUM64_CHUNK words, combined as sum_k (k + 1) * chunk_k, and of its trailing bytes. Integer sums
    are exact in any order, so both ends agree; a torn write (bytes of two versions) changes it."""
    whole = payload.numel() // 8 * 8
    words = payload[:whole].view(torch.int64)
    total = torch.zeros((), dtype=torch.int64, device=payload.device)
    for index, chunk in enumerate(words.split(SUM64_CHUNK)):
        total += chunk.sum() * (index + 1)
    tail = payload[whole:].to(torch.int64).sum()
    return f"sum64:{total.item() & (2 ** 64 - 1):016x}:{tail.item():x}"


def device_handle(payload: torch.Tensor) -> dict:
    """CUDA IPC: what another process on this machine needs to map `payload` (a whole uint8 CUDA tensor)."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(payload)
    fields = dict(zip(inspect.signature(rebuild).parameters, args))
    return {"uuid": str(torch.cuda.get_device_properties(payload.device).uuid), **{k: fields[k] for k in HANDLE_FIELDS}}


def open_device_handle(handle: dict, nbytes: int) -> torch.Tensor:
    """The payload `device_handle` describes, mapped on the local device with its UUID; RuntimeError if this
    process sees no such device."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    local = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid)
             == handle["uuid"]]
    if not local:
        raise RuntimeError(f"the learner's GPU {handle['uuid']} is not visible to this process")
    return rebuild_cuda_tensor(**rebuild_arguments(handle, nbytes, local[0]))


def rebuild_arguments(handle: dict, nbytes: int, device: int) -> dict:
    """torch's rebuild_cuda_tensor arguments for a whole uint8 payload of `nbytes`, mapped on local `device`."""
    return {"tensor_cls": torch.Tensor, "tensor_size": (nbytes,), "tensor_stride": (1,),
            "storage_cls": torch.storage.TypedStorage, "dtype": torch.uint8, "storage_device": device,
            "requires_grad": False, **{key: handle[key] for key in HANDLE_FIELDS}}
