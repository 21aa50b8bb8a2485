"""The bytes of one weights payload (a bucket of a version, weights.py): safetensors' layout, written and read
here rather than with safetensors' own functions, which hold the GIL while they copy a whole model, stalling
the learner's training thread (docs/benchmarks.md "Costs behind choices in the code"). The learner copies
each tensor straight into its slot (`empty_payload`; torch copies, GIL released), and a receiver's tensors view
its one copy of the bucket (`deserialise`: nothing is copied again).

Layout: an 8-byte little-endian header size, a JSON header {name: {dtype, shape, data_offsets}} (with, first,
"__metadata__": {key: str}, as safetensors allows), then the data; safetensors.torch.load reads it too.
checksum = xxh3_128 of a payload's host bytes (fast: docs/benchmarks.md "Weights to a generator on one host"),
or `shared_payloads.sum64` of a payload on the GPU.

Invariants: every slot starts aligned to its element size (widest dtypes first, data 8-byte aligned), so a
slot is a view, never a copy; `deserialise` refuses (ValueError) a header that does not fit its payload.
Run alone: `python -m pytest tests/test_weights.py -q`.
"""

from __future__ import annotations

import json
import math
from typing import Optional

import numpy as np
import torch
import xxhash

from nanoverl_async.wire import shared_payloads

SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
METADATA = "__metadata__"  # safetensors' key for string metadata in the header


def checksum(payload: bytes | memoryview | np.ndarray | torch.Tensor) -> str:
    """xxh3_128 of host bytes; of a uint8 tensor (a payload on the GPU), `shared_payloads.sum64` where it lies."""
    if isinstance(payload, torch.Tensor):
        return shared_payloads.sum64(payload)
    return xxhash.xxh3_128(payload).hexdigest()


def data_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def empty_payload(entries: dict[str, tuple[torch.dtype, tuple[int, ...]]], pin_memory: bool = False,
                  device: Optional[torch.device] = None, metadata: Optional[dict[str, str]] = None
                  ) -> tuple[np.ndarray | torch.Tensor, dict[str, torch.Tensor]]:
    """A payload for tensors of these dtypes and shapes, header written (`metadata` first in it), data not yet,
    and each tensor's slot in it, a view to copy that tensor into (the learner copies straight from its device,
    so a version is copied once). On a CUDA `device`, a uint8 tensor there; else a numpy array (bytes to zmq
    and xxhash without a copy) in pinned memory, or in shared memory where this machine offers it
    (wire/shared_payloads.py). Every key gets its own bytes (tied tensors too)."""
    header, offset = {} if metadata is None else {METADATA: metadata}, 0
    for name in sorted(entries, key=lambda name: -entries[name][0].itemsize):
        dtype, shape = entries[name]
        nbytes = data_bytes(dtype, shape)
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


def serialise(state_dict: dict[str, torch.Tensor], metadata: Optional[dict[str, str]] = None) -> np.ndarray:
    """The state dict as a payload (`empty_payload`)."""
    entries = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in state_dict.items()}
    payload, slots = empty_payload(entries, metadata=metadata)
    for name, tensor in state_dict.items():
        slots[name].copy_(tensor.detach())
    return payload


def read_header(payload: memoryview | np.ndarray | torch.Tensor) -> tuple[dict, torch.Tensor]:
    """(the JSON header, the data bytes as a uint8 tensor viewing `payload`); ValueError if the header does not
    fit the payload or is not a JSON map."""
    data = payload if isinstance(payload, torch.Tensor) else torch.frombuffer(payload, dtype=torch.uint8)
    if len(data) < 8:
        raise ValueError(f"a payload of {len(data)} bytes has no header size")
    size = int.from_bytes(data[:8].cpu().numpy().tobytes(), "little")
    if not 0 < size <= len(data) - 8:
        raise ValueError(f"header of {size} bytes in a payload of {len(data)}")
    header = json.loads(data[8:8 + size].cpu().numpy().tobytes())
    if not isinstance(header, dict):
        raise ValueError(f"the header is a {type(header).__name__}, not a map")
    return header, data[8 + size:]


def metadata_of(payload: memoryview | np.ndarray | torch.Tensor) -> dict:
    """The header's "__metadata__" ({} if none); ValueError as `read_header`."""
    metadata = read_header(payload)[0].get(METADATA, {})
    if not isinstance(metadata, dict):
        raise ValueError(f"{METADATA} is not a map: {metadata!r:.200}")
    return metadata


def deserialise(payload: memoryview | np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
    """`serialise`'s bytes (or `empty_payload`'s uint8 tensor on a GPU) -> tensors that view `payload` (and
    keep it alive); ValueError for a header that does not fit the payload, RuntimeError for a slot not aligned
    to its element size (neither `empty_payload` nor safetensors writes one)."""
    header, data = read_header(payload)
    tensors = {}
    for name, entry in header.items():
        if name == METADATA:
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise ValueError(f"tensor {name!r}: entry {entry!r:.200} lacks dtype, shape or data_offsets")
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        shape = entry["shape"]
        start, stop = entry["data_offsets"]
        if dtype is None:
            raise ValueError(f"tensor {name!r}: dtype {entry['dtype']!r} is not one of {', '.join(SAFETENSORS_DTYPES)}")
        count = math.prod(shape)
        if not 0 <= start <= stop <= len(data) or stop - start != count * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: bytes {start}-{stop} of {len(data)} for {count} x {dtype}")
        tensors[name] = data[start:stop].view(dtype).view(shape)
    return tensors
