"""Micro-batches trained at once, each forward and backward on a thread of its own (learner.micro_batch_threads).

    passes = ThreadedPasses(threads=2)
    metrics = passes.accumulate(lambda start, stop: loss_of(rows start..stop), bounds, trained_parameters)
    optimizer.step()                                   # .grad holds the sum over every range of `bounds`

Why threads over micro-batches rather than intra-op threads (learner.torch_threads): on a CPU that the
learner shares with a generator, intra-op threads meet at a barrier after every op, so an op waits for
whichever of its threads another process has preempted. Threads that each own a whole micro-batch meet once,
at the end, and take a core whenever one is free. On the default job's batch with a second process holding one
core (docs/benchmarks.md "The learner on threads over micro-batches, CPU") two intra-op threads took 1.8x one
thread's time, two micro-batch threads 0.9x. One process only: the model's parameters are shared, not copied.

Deterministic: each thread sums its micro-batches' gradients in buffers of its own (torch.autograd.grad), in
order, and the threads' sums are added into `.grad` in thread order, whichever finishes first. The ranges are
those of `bounds`, split to at least one per thread (batch.split_to): the same rows, other packed layouts, so
the gradients equal a sequential pass's up to float rounding (tests/test_threaded_passes.py).

Run alone: `python -m pytest tests/test_threaded_passes.py -q`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from nanoverl_async.config import LearnerConfig
from nanoverl_async.learners.batch import split_to

Pass = Callable[[int, int], tuple[Tensor, dict]]  # rows [start, stop) -> (their loss, their metrics)


class ThreadedPasses:
    def __init__(self, threads: int):
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="micro-batch")  # its threads end with it

    @classmethod
    def where_usable(cls, learner: LearnerConfig, model: torch.nn.Module) -> Optional["ThreadedPasses"]:
        """learner.micro_batch_threads' passes where threads can share one model; elsewhere None (one pass at a
        time), so that a config's setting never stands in the way of another rank count or device: `model` as
        the rank built it must be a plain module (FSDP2's collectives and hooks run pass by pass: several ranks,
        or bfloat16 compute), on the CPU (a GPU runs one stream), not compiled (torch.compile is not thread-safe:
        learner.compile; pytorch/pytorch#118260), and without LoRA's dropout, whose random draws would interleave
        between the threads (a run would not repeat)."""
        usable = not isinstance(model, FSDPModule) and learner.device == "cpu" and not learner.compile \
            and not learner.lora.drops
        return cls(learner.micro_batch_threads) if usable and learner.micro_batch_threads > 1 else None

    def accumulate(self, loss_of: Pass, bounds: Sequence[tuple[int, int]],
                   parameters: Sequence[torch.nn.Parameter]) -> list[dict]:
        """The gradients of every range's loss added into `parameters`' .grad (None: set), the ranges split among
        the threads in contiguous runs; each range's metrics, in range order."""
        rows = bounds[-1][1] - bounds[0][0]
        ranges = split_to(list(bounds), max(len(bounds), min(self.threads, rows)))  # a thread may get none
        runs = [ranges[len(ranges) * i // self.threads:len(ranges) * (i + 1) // self.threads]
                for i in range(self.threads)]
        futures = [self.pool.submit(_summed_gradients, loss_of, run, parameters) for run in runs]
        metrics = []
        for future in futures:  # thread order, whichever finished first
            gradients, run_metrics = future.result()
            for parameter, gradient in zip(parameters, gradients):
                if gradient is not None:
                    parameter.grad = gradient if parameter.grad is None else parameter.grad + gradient
            metrics += run_metrics
        return metrics


def _summed_gradients(loss_of: Pass, ranges: Sequence[tuple[int, int]], parameters: Sequence[torch.nn.Parameter]
                      ) -> tuple[list[Optional[Tensor]], list[dict]]:
    """(the sum of the ranges' gradients, in order, per parameter: None where no loss reaches it; their metrics)."""
    sums: list[Optional[Tensor]] = [None] * len(parameters)
    metrics = []
    for start, stop in ranges:
        loss, range_metrics = loss_of(start, stop)
        gradients = torch.autograd.grad(loss, parameters, allow_unused=True)
        sums = [g if s is None else s if g is None else s + g for s, g in zip(sums, gradients)]
        metrics.append(range_metrics)
    return sums, metrics
