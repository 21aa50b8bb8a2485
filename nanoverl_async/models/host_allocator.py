"""What a role's heap does with the blocks torch frees, on the CPU: kept for the next step, or handed back.

    tune_host_allocator(device, training_parameters)   # at start-up: "kept", "mapped" or ""

glibc's malloc (the C library torch allocates host tensors from) serves a block from its heap, or maps it
from the system when it is at least its mapping threshold, and hands the heap's free top back past its trim
threshold. By default both thresholds follow the largest block freed so far, a few MB for `builtin:tiny`, so
the heap is handed back at the end of each learner update and each engine step's tensors, and the next one
faults every page in again: 5-10 thousand page faults an update, 17-35 thousand an engine's batch of episodes
(docs/benchmarks.md "Steps without page faults, CPU"). An engine, and a learner of a small model, allocate the
same few sizes every step, so their heap keeps them ("kept"). A large model's learner update frees activations
of many sizes that the next allocations do not fit, so a heap that keeps them grows past the tensors alive
(+1.0-2.8 GB at the Qwen2.5-0.5B shape, docs/benchmarks.md "The fit check against the measured peak, CPU"):
a process that trains MAPPED_FROM_PARAMETERS or more maps blocks of MAPPED_BLOCK_BYTES and more, and hands
them back when freed ("mapped"). A GPU's memory is the device's: nothing is set there.

Run alone: `python -m pytest tests/test_host_allocator.py -q`.
"""

from __future__ import annotations

import ctypes

import torch

MAPPED_FROM_PARAMETERS = 100_000_000
MAPPED_BLOCK_BYTES = 2**20
KEPT_BLOCK_BYTES = 2**25  # glibc's largest mapping threshold on 64 bits (HEAP_MAX_SIZE / 2)
KEPT_TOP_BYTES = 2**30  # the free top a small model's heap keeps (it never frees this much between steps)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc's malloc.h)


def tune_host_allocator(device: torch.device, training_parameters: int = 0, libc_name: str = "libc.so.6") -> str:
    """Set this process's heap policy (glibc's mallopt of M_MMAP_THRESHOLD and M_TRIM_THRESHOLD:
    MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ from inside the process) for a role on `device` that trains
    a model of `training_parameters` (0: it trains none, an engine) -> "mapped" from MAPPED_FROM_PARAMETERS on
    (blocks of MAPPED_BLOCK_BYTES and more mapped, the free top trimmed past that size), "kept" below it (blocks
    up to KEPT_BLOCK_BYTES from the heap, the free top kept up to KEPT_TOP_BYTES); "" where nothing was set: on
    a GPU, or where the C library is not glibc or refuses a value."""
    if device.type != "cpu":
        return ""
    try:
        mallopt = ctypes.CDLL(libc_name).mallopt
    except (OSError, AttributeError):
        return ""
    mapped = training_parameters >= MAPPED_FROM_PARAMETERS
    block, top = (MAPPED_BLOCK_BYTES, MAPPED_BLOCK_BYTES) if mapped else (KEPT_BLOCK_BYTES, KEPT_TOP_BYTES)
    if mallopt(M_MMAP_THRESHOLD, block) == 1 and mallopt(M_TRIM_THRESHOLD, top) == 1:
        return "mapped" if mapped else "kept"
    return ""
