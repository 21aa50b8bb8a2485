"""The learner's seconds a step on the default job's batch, at the asynchronous default job's one thread.

    python bench/learner_step.py [--threads 1] [--repeats 3] [--steps 5] [--compile] [--busy-core]

The batch is the one bench/learner_vs_torch.py builds: 16 prompts x 8 samples of the built-in task, answers
of a few to ~10 sampled tokens, `builtin:tiny`, float32, world size 1. A step is what the learner does
between two batches. With one optimizer step a batch (learner.ppo_epochs = minibatches = 1: the default
job) the update takes the proximal logprobs from its own forward (LearnerSetup.forwards); a separate
proximal forward before it is what a step costs otherwise. The two paths give the same loss, metrics and
gradients bit for bit (tests/test_fsdp.py). Interleaved A B B A per repeat; a warm-up step of each first.
The update alone also runs on two threads: two intra-op threads, or two micro-batch threads
(learner.micro_batch_threads: learners/threaded_passes.py); --busy-core spins a second process on one core
throughout, as the generator holds one beside the asynchronous learner. The row of `pack` alone on the batch is
the host's share of the update, the layout of its rows. The last column counts the pages the process faulted
in a step (the heap's policy: models/host_allocator.py).
With --compile the rank compiles its decoder layers (learner.compile); the eager rows then run the same
layers under torch.compiler.set_stance("force_eager"), and a last row gives the update compiled. The title
says how long the first compiled update took (the compile).
"""

from __future__ import annotations

import argparse
import resource
import socket
import statistics
import subprocess
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from learner_vs_torch import default_job_batch  # bench/, the script's folder

from nanoverl_async.config import LearnerConfig, ModelConfig
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.learners.packing import pack, prompt_lengths
from nanoverl_async.learners.setup import LearnerSetup
from nanoverl_async.learners.threaded_passes import ThreadedPasses
from nanoverl_async.models.load import resolve_model_path

MAX_TOTAL_TOKENS = 96  # configs/agent_grpo.yaml's agent.max_total_tokens


def step(rank: LearnerRank, batch, separate_forward: bool) -> None:
    """One learner step on `batch`: the update, after a separate proximal forward if asked."""
    batch.proximal_logprobs = torch.from_numpy(rank.compute(batch, "proximal_logprobs")) \
        if separate_forward else None
    rank.update(batch, 0)  # the same version each time: one minibatch, so no order it seeds


def seconds_a_step(run, steps: int) -> tuple[float, float]:
    """(seconds, page faults) a step: the faults are the pages the heap took from the system anew
    (models/host_allocator.py), a count the host's drift does not move."""
    faults, started = page_faults(), time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - started) / steps, (page_faults() - faults) / steps


def page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="learner.compile: a row for the compiled update")
    parser.add_argument("--busy-core", action="store_true",
                        help="a second process spins on one core throughout, as a generator beside the learner")
    args = parser.parse_args()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy_core else None
    torch.set_num_threads(args.threads)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    setup = LearnerSetup(model=ModelConfig(path=resolve_model_path("builtin:tiny")), max_total_tokens=MAX_TOTAL_TOKENS,
                         learner=LearnerConfig(torch_threads=args.threads, compile=args.compile))
    rank = LearnerRank(setup, 0, "127.0.0.1", port)
    batch = default_job_batch(rank.model.config.vocab_size)

    def eager(run):
        def in_eager():
            with torch.compiler.set_stance("force_eager"):
                run()
        return in_eager

    paths = {"separate proximal forward, then the update": eager(lambda: step(rank, batch, True)),
             "the update alone (p_old from its own forward)": eager(lambda: step(rank, batch, False)),
             "of which pack() (host)": lambda: pack(batch.input_ids, batch.attention_mask, rank.packs,
                                                    prompt_lengths(batch.loss_mask), rank.attention_cost,
                                                    batch.loss_mask)}
    two = ThreadedPasses(2)

    def on_two_threads(micro_batch: bool):
        def threaded():  # two intra-op threads, or two micro-batch threads of one intra-op thread each
            torch.set_num_threads(1 if micro_batch else 2)
            rank.passes = two if micro_batch else None
            try:
                step(rank, batch, False)
            finally:
                torch.set_num_threads(args.threads)
                rank.passes = None
        return eager(threaded)

    paths["the update alone, two intra-op threads (learner.torch_threads=2)"] = on_two_threads(False)
    paths["the update alone, two micro-batch threads (learner.micro_batch_threads=2)"] = on_two_threads(True)
    if args.compile:
        paths["the update alone, compiled (learner.compile)"] = lambda: step(rank, batch, False)
    names = list(paths)
    seconds, faults = {name: [] for name in names}, {name: [] for name in names}
    warm_up = {}
    try:
        for name in names:
            started = time.perf_counter()
            paths[name]()  # warm-up (the compiled path's: the compile)
            warm_up[name] = time.perf_counter() - started
        for _ in range(args.repeats):
            for name in names + names[::-1]:  # A B C C B A
                took, faulted = seconds_a_step(paths[name], args.steps)
                seconds[name].append(took)
                faults[name].append(faulted)
    finally:
        rank.shutdown()
        if spinner is not None:
            spinner.kill()
    baseline = statistics.median(seconds[names[0]])
    table = Table(title=f"learner seconds a step: {batch.size} sequences, {int(batch.loss_mask.sum())} sampled "
                        f"tokens, builtin:tiny, {args.threads} thread(s)" + (", a busy core beside" if args.busy_core
                                                                              else "") +
                        f", {args.repeats} repeats x 2 x {args.steps} steps" +
                        (f"; the first compiled update took {warm_up[names[-1]]:.1f} s" if args.compile else ""))
    for column in ("path", "median s", "range s", "/ separate forward", "page faults a step"):
        table.add_column(column)
    for name in names:
        median = statistics.median(seconds[name])
        table.add_row(name, f"{median:.3f}", f"{min(seconds[name]):.3f}-{max(seconds[name]):.3f}",
                      f"{median / baseline:.2f}", f"{statistics.median(faults[name]):,.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
