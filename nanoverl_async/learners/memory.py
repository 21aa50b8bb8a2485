"""Learner memory: the peak one rank is predicted to reach in an update (checked before any role starts:
controller/fit_check.py) and the peaks it used, per step (the `memory/*` metrics, documented in docs/metrics.md).

    prediction = predict_peak(Workload(...))                          # the parts, in bytes; .total
    learner_fit_error(lambda ranks: predict_peak(...), 1, available, "GPU memory (NVIDIA H100)")  # None: fits
    peak_memory(device)   # {"memory/learner_peak_host_gb": ..., on a GPU also ..._device_gb}, then reset

The prediction adds five parts (`Prediction`), each from the model's shape and the learner settings:
  - state: a trained parameter's float32 weight, gradient and AdamW's two moments (16 bytes: ZeRO's
    mixed-precision Adam count, Rajbhandari et al. 2020, section 3.1, with float32 gradients in place of its
    16-bit weights and gradients) and a frozen model's weights (the KL reference in float32; a LoRA run's base
    at model.dtype), sharded over the FSDP2 ranks. The gradients count as held through the forward: with
    several micro-batches they are (accumulated), with one they are not, so there it is an upper bound;
  - the compute copy (`compute_copy_bytes`): FSDP2's unsharded weights in the compute dtype, and on one rank
    the trained parameters' gradients in that dtype as well;
  - activations (`activation_bytes`): what autograd keeps for backward of one micro-batch;
  - logits (`logits_bytes`): the head's [trained tokens, vocabulary] tensors, or one chunk's;
  - runtime (`RUNTIME_BYTES`): what a rank's process holds besides tensors.
It is checked against bench/fit_check.py's measured peaks (docs/benchmarks.md "The fit check against the
measured peak, CPU"). Not counted: the whole float32 model each rank loads before it shards it (at start-up,
before any update; more than a rank's share only beyond 4 ranks), and a critic's own compute copy and
activations (trained after the policy's are freed, on the same body without the wide head: no larger).
What the prediction counts is tensors; on the CPU the process also holds what its allocator keeps of freed
ones, which a large model's rank returns to the system (models/host_allocator.py).

Run alone: `python -m pytest tests/test_learner_memory.py -q`.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist

GB = 1e9  # every memory/* metric and message is in GB of 10^9 bytes
TRAINED_BYTES = 4 + 4 + 4 + 4  # per parameter: fp32 weight, fp32 gradient, AdamW exp_avg and exp_avg_sq
REFERENCE_BYTES = 4  # per parameter of the KL reference model: its fp32 weight


def learner_state_bytes(trained: int, frozen_bytes: int, world_size: int) -> int:
    """Bytes of persistent state one rank holds: (16 x trained parameters + the frozen weights' bytes) /
    world_size, rounded up (FSDP2 shards every tensor over the ranks, the last shard padded)."""
    return math.ceil((TRAINED_BYTES * trained + frozen_bytes) / world_size)


# What a rank's process holds besides tensors, the part no shape predicts. cpu: the resident memory of a
# LearnerRank process on a model of a few thousand parameters after an update (bench/fit_check.py prints it as
# its "runtime" row), rounded up. cuda: what nvidia-smi's total loses to the CUDA context, cuBLAS and NCCL
# workspaces and the caching allocator's slack, an estimate, not yet measured. Both:
# docs/benchmarks.md "Costs behind choices in the code".
RUNTIME_BYTES = {"cpu": int(0.45 * GB), "cuda": int(1.0 * GB)}
# float32 [tokens, vocabulary] tensors alive at once around the head: z = logits.float() / T kept for
# backward, the logsumexp's exp, the entropy metric's softmax and product, and in backward z's gradient; as
# bench/fit_check.py's method measured them (docs/benchmarks.md "Costs behind choices in the code").
LOGITS_COPIES = 5


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What activations and logits grow with, from a transformers config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> "Architecture":
        text = config.get_text_config()
        heads = text.num_attention_heads
        return cls(hidden=text.hidden_size, intermediate=text.intermediate_size, layers=text.num_hidden_layers,
                   heads=heads, kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, vocab=text.vocab_size)


def layer_activation_bytes(arch: Architecture, tokens: int, compute_bytes: int, row: int) -> int:
    """Bytes one decoder layer keeps for backward over `tokens` tokens packed in rows of `row`, b = compute_bytes
    (2 in bfloat16), q = heads x head_dim:

        tokens x (8h + b (4h + 4q + 4i + row) + 4 heads + 8)

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1)
    count 34h + 5 a s bytes a token for a GPT layer in 16 bits; this is that count redone for what a Llama /
    Qwen2 layer saves here (term by term with torch.autograd.graph.saved_tensors_hooks,
    tests/test_learner_memory.py): each of the 2 RMSNorms its float32 input and normalised output (4h + bh,
    twice) and its float32 1/rms (4, twice); the q/k/v projections their shared input (bh); scaled dot-product
    attention q, k, v (k and v repeated to the query's heads: transformers does so whenever a mask is given, as
    for a group's shared prompt, packing.Packing) and the output, which the output projection keeps too (4bq);
    the fused kernel's logsumexp (4 bytes a head), never the a x s scores (Korthikanti's 5as term); the mask
    itself, [row, row] a row in the compute dtype (b row a token); the SwiGLU MLP its input (bh), the gate's
    output, the up projection's, their product's other factor and the down projection's input (4bi); no
    dropout (eval mode). Without a mask, k and v are kept at their own heads: an overestimate of 2b(q - kv)."""
    h = arch.hidden
    i = arch.intermediate
    q = arch.heads * arch.head_dim
    return tokens * (8 * h + compute_bytes * (4 * h + 4 * q + 4 * i + row) + 4 * arch.heads + 8)


def activation_bytes(arch: Architecture, tokens: int, compute_bytes: int, checkpointing: bool, row: int) -> int:
    """Bytes kept for backward over one micro-batch of `tokens` in rows of `row`: every layer's
    (`layer_activation_bytes`), or with learner.activation_checkpointing each layer's input (bh a token) and one
    layer's recomputed in its backward; plus the final norm's (4h + bh) and the head's input (bh), a token each."""
    one = layer_activation_bytes(arch, tokens, compute_bytes, row)
    layers = arch.layers * tokens * compute_bytes * arch.hidden + one if checkpointing else arch.layers * one
    return layers + tokens * (4 + 2 * compute_bytes) * arch.hidden


def logits_bytes(vocab: int, trained_tokens: int, chunk_tokens: int) -> int:
    """LOGITS_COPIES float32 [rows, vocabulary] tensors: rows = the trained tokens of a micro-batch, or with
    learner.logits_chunk_tokens at most a chunk of them (packing.chunked_head: one chunk's logits at a time)."""
    rows = min(trained_tokens, chunk_tokens) if chunk_tokens else trained_tokens
    return LOGITS_COPIES * 4 * vocab * rows


def compute_copy_bytes(parameters: int, root_parameters: int, layers: int, world_size: int,
                       compute_bytes: int, trained: int = 0) -> int:
    """FSDP2's unsharded copy of the policy's weights in the compute dtype (fsdp_rank._sharded_model): one rank
    keeps the whole model unsharded through an update (LearnerRank._train), several hold the root's (embedding,
    final norm, head) and two layers' at a time (the one computing and the one prefetched); one float32 rank
    runs the plain model: none. One rank also holds the `trained` parameters' unsharded gradients in the
    compute dtype beside their float32 accumulation (it syncs only after the last micro-batch), which the fit
    check once missed (docs/benchmarks.md "The fit check against the measured peak, CPU"); several ranks reduce
    each layer's at once (not counted)."""
    if world_size == 1:
        return 0 if compute_bytes == 4 else compute_bytes * (parameters + trained)
    return compute_bytes * (root_parameters + 2 * math.ceil((parameters - root_parameters) / layers))


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one rank trains: the parameters counted (controller/fit_check.learner_parameters), the policy's shape,
    and the learner settings that size an update."""

    trained: int  # trained parameters (policy or its adapters, critic)
    frozen_bytes: int  # frozen weights' bytes (the KL reference, a LoRA base)
    arch: Architecture  # the policy's
    parameters: int  # the policy's, adapters included
    root_parameters: int  # the policy's outside its decoder layers
    compute_bytes: int  # model.dtype's bytes
    tokens: int  # a micro-batch's
    row: int  # the longest row they are packed in
    trained_tokens: int  # at most this many of them have logits
    checkpointing: bool = False
    chunk_tokens: int = 0
    device: str = "cpu"


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The peak of one update on one rank, in bytes, by part (module docstring)."""

    state: int
    compute_copy: int
    activations: int
    logits: int
    runtime: int

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def parts(self) -> str:
        return " + ".join(f"{value / GB:.2f} {name.replace('_', ' ')}" for name, value in
                          dataclasses.asdict(self).items())


def predict_peak(work: Workload, world_size: int) -> Prediction:
    """The peak one of `world_size` ranks reaches in an update of `work` (module docstring)."""
    return Prediction(learner_state_bytes(work.trained, work.frozen_bytes, world_size),
                      compute_copy_bytes(work.parameters, work.root_parameters, work.arch.layers, world_size,
                                         work.compute_bytes, work.trained),
                      activation_bytes(work.arch, work.tokens, work.compute_bytes, work.checkpointing, work.row),
                      logits_bytes(work.arch.vocab, work.trained_tokens, work.chunk_tokens),
                      RUNTIME_BYTES[work.device])


def learner_fit_error(predict: Callable[[int], Prediction], world_size: int, available: int, where: str,
                      ranks_share_it: bool = False, remedies: tuple[str, ...] = ()) -> Optional[str]:
    """None if predict(world_size), a rank's peak, fits in `available` bytes (`where` says of what), else one
    line with the prediction's parts and what to change: `remedies` (settings the caller knows would lower it)
    and, where ranks have memory of their own, the fewest ranks whose prediction fits. Fits exactly when
    needed <= available. ranks_share_it: every rank's peak lands in the same memory (CPU ranks on one host)."""
    prediction = predict(world_size)
    needed = prediction.total * (world_size if ranks_share_it else 1)
    if needed <= available:
        return None
    fits = next((ranks for ranks in range(world_size + 1, 1025) if predict(ranks).total <= available), None)
    more = [] if ranks_share_it else [f"learner.world_size >= {fits} (one GPU each)"] if fits else []
    shared = f" x {world_size} ranks on one host" if ranks_share_it and world_size > 1 else ""
    return (f"the learner cannot fit: an update's peak is predicted at {prediction.total / GB:.1f} GB a rank "
            f"({prediction.parts()} GB){shared} > {available / GB:.1f} GB of {where}; use "
            f"{', '.join([*remedies, *more]) or 'a smaller model'}")


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
