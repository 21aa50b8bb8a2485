"""Learner memory: the least a rank needs (checked before any role starts: preflight.py) and the peaks it
used, per step (the `memory/*` metrics, documented in docs/metrics.md).

    learner_fit_error(trained, frozen_bytes, world_size, available, "GPU memory (NVIDIA H100)")  # None: fits
    peak_memory(device)   # {"memory/learner_peak_host_gb": ..., on a GPU also ..._device_gb}, then reset

The start-up bound counts only what must persist through a step: a trained model's float32 weights,
float32 gradients and AdamW's two float32 moments (16 bytes a parameter: ZeRO's mixed-precision Adam
count, Rajbhandari et al. 2020, section 3.1, with float32 gradients in place of its 16-bit weights and
gradients) and a frozen model's weights (4 bytes a parameter for the KL reference in float32; a LoRA run's
base at its dtype's, 2 in bfloat16), sharded over the FSDP2 ranks. Activations,
logits and the 16-bit compute copy come on top, so passing it is necessary, not sufficient; failing it is
certain. Not counted either: the whole float32 model each rank loads before it shards it (4 bytes a
parameter, more than a rank's share only beyond 4 ranks).

Run alone: `python -m pytest tests/test_learner_memory.py -q`.
"""

from __future__ import annotations

import math
import resource
import sys
from typing import Optional

import torch
import torch.distributed as dist

GB = 1e9  # every memory/* metric and message is in GB of 10^9 bytes
TRAINED_BYTES = 4 + 4 + 4 + 4  # per parameter: fp32 weight, fp32 gradient, AdamW exp_avg and exp_avg_sq
REFERENCE_BYTES = 4  # per parameter of the KL reference model: its fp32 weight


def learner_state_bytes(trained: int, frozen_bytes: int, world_size: int) -> int:
    """Bytes of persistent state one rank holds: (16 x trained parameters + the frozen weights' bytes) /
    world_size, rounded up (FSDP2 shards every tensor over the ranks, the last shard padded)."""
    return math.ceil((TRAINED_BYTES * trained + frozen_bytes) / world_size)


def learner_fit_error(trained: int, frozen_bytes: int, world_size: int, available: int, where: str,
                      ranks_share_it: bool = False) -> Optional[str]:
    """None if the learner's persistent state fits in `available` bytes (`where` says of what), else one line
    with the numbers and what to change. Fits exactly when needed <= available. ranks_share_it: every rank's
    share lands in the same memory (CPU ranks on one host), so more ranks do not help."""
    per_rank = learner_state_bytes(trained, frozen_bytes, world_size)
    needed = per_rank * world_size if ranks_share_it else per_rank
    if needed <= available:
        return None
    counted = f"{trained / 1e9:.2f}B trained parameters x {TRAINED_BYTES} bytes (fp32 weights, gradients, AdamW's " \
              f"2 moments)" + (f" + {frozen_bytes / GB:.1f} GB of frozen weights" if frozen_bytes else "")
    ranks = math.ceil(learner_state_bytes(trained, frozen_bytes, 1) / max(available, 1))  # the fewest whose shares fit
    remedy = "a smaller model, or learner.device=cuda" if ranks_share_it else \
        f"learner.world_size >= {ranks} (one GPU each), or a smaller model"
    return (f"the learner cannot fit: {counted} / {world_size} rank{'s' if world_size > 1 else ''} = "
            f"{needed / GB:.1f} GB > {available / GB:.1f} GB of {where}, before activations; use {remedy}")


def peak_memory(device: torch.device, over_ranks: bool = False) -> dict[str, float]:
    """This process's peak memory since the previous call (or its start), in GB, then the peaks reset:
    resident host memory (Linux: VmHWM, reset through /proc/self/clear_refs; elsewhere the peak since the
    process started) and, on a GPU, the bytes PyTorch's allocator held in tensors and reserved. over_ranks
    (collective): the largest of every rank's."""
    out = {"memory/learner_peak_host_gb": _peak_resident_bytes() / GB}
    if device.type == "cuda":
        out["memory/learner_peak_device_gb"] = torch.cuda.max_memory_allocated(device) / GB
        out["memory/learner_peak_device_reserved_gb"] = torch.cuda.max_memory_reserved(device) / GB
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # Linux >= 4.0: resets the peak resident set size to the current one
    except OSError:
        pass  # not Linux: the peak stays the process's lifetime peak
    if over_ranks:
        largest = torch.tensor(list(out.values()), dtype=torch.float64, device=device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        out = dict(zip(out, largest.tolist()))
    return out


def _peak_resident_bytes() -> int:
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
