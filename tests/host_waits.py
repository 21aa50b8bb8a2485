"""`HostWaits`: the ops that would make the host wait for a GPU, recorded on the CPU (tests of the learner's
micro-batch and the engine's step, which are meant to wait once per step at most, for what they return).

    with HostWaits() as waits:
        step()
    assert waits.ops == []
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops after which the host must wait for a GPU: reading a value (.item(), float(t), a tensor in an `if`:
# `item` under inference mode, else `_local_scalar_dense`), or sizing an output by the values (nonzero,
# masked_select, unique; indexing by a boolean mask, below)
HOST_WAITS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "unique", "_unique2",
              "unique_consecutive", "unique_dim"}


class HostWaits(TorchDispatchMode):
    """Records the ops run under it that would make the host wait for the GPU, were the tensors there. (A copy
    to the host, .cpu() or .tolist(), does not show: on the CPU it is no op.)"""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_WAITS or (name == "index" and any(index is not None and index.dtype in (torch.bool, torch.uint8)
                                                           for index in args[1])):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))
