"""`LearnerRank.update` against the bare PyTorch loop it wraps, on the same batches, side by side.

    python bench/learner_vs_torch.py [--threads 2] [--repeats 2] [--updates 5] [--device cpu|cuda]
                                     [--model tiny|wide-vocab|qwen0.5b] [--profile]

tiny (the default): the batch is shaped like the default job's (configs/agent_grpo.yaml): 16 groups x 8
episodes of the built-in `A*B?` task, lengths as measured in its runs: a prompt of 10 tokens, then a sampled
answer (40% of rows), a sampled call, a 5-token tool result and an answer (52%), or three turns of calls
(8%, up to ~70 tokens), so that, as in the job, a few long rows set the padded width.
wide-vocab: the same batch on a small body with Qwen2.5's 151,936-token vocabulary (bench/qwen_shape.py),
micro-batches of 2,048 tokens, float32: the LM head's cost with a real tokenizer, which LearnerRank runs
only where a sampled token is predicted (the bare loops: at every position, as one writes it by hand).
qwen0.5b (for a GPU): Qwen2.5-0.5B-Instruct's architecture with random weights (bench/qwen_shape.py),
64 sequences of 128 prompt + 896 sampled tokens, micro-batches of 8,192 tokens, bfloat16 compute over
float32 master weights (LearnerRank's FSDP2 mixed precision; torch.autocast in the bare loop).
The bare loop is what a user would write by hand: the Hugging Face model with float32 weights, AdamW,
a forward per micro-batch over the padded rows, token logprobs, the PPO clipped loss against the behaviour
logprobs (token mean), backward, gradient clipping, step; for tiny also over the packed rows LearnerRank
uses (packing.pack), which isolates the wrapper's own cost. `LearnerRank` runs the project's default
algorithm on the same rows (world size 1). Interleaved A, B, C, C, B, A; trained tokens/s as ranges,
and the seconds of LearnerRank.publish_weights (the full state dict gathered and handed to the publisher).
--profile adds a table of one more update of each under torch.profiler: its wall time, the time the GPU was
busy (kernels and copies), and the host's waits for the GPU (synchronising calls: count and seconds), which
is where a wrapper loses to the bare loop when its GPU work is no larger; on CUDA also, per system, where
those waits happen (one update under torch.cuda.set_sync_debug_mode: file:line and count; torch flags most
synchronising calls, not all; one made during backward counts at the line that called backward).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time
from contextlib import nullcontext

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from cuda_waits import host_wait_sites, print_wait_sites  # bench/, the script's folder

from nanoverl_async.config import AlgorithmConfig, KLConfig, LearnerConfig, ModelConfig
from nanoverl_async.learners.batch import collate, sequence_logprobs, token_budget_bounds, trimmed, with_advantages
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.learners.packing import attention_cost_per_position, pack, prompt_lengths
from nanoverl_async.learners.setup import LearnerSetup
from nanoverl_async.models.load import DTYPES, resolve_model_path
from nanoverl_async.wire.trajectory import Trajectory

GROUPS, GROUP_SIZE, MAX_TOTAL_TOKENS = 16, 8, 96
QWEN_SEQUENCES, QWEN_PROMPT, QWEN_SAMPLED, QWEN_MICRO_BATCH_TOKENS = 64, 128, 896, 8_192


def default_job_batch(vocab: int, seed: int = 0):
    """128 trajectories shaped like the default job's episodes, with GRPO advantages; the samples of a group
    share their 10-token prompt."""
    rng = np.random.default_rng(seed)
    prompts = np.random.default_rng(seed + 1).integers(10, vocab, (GROUPS, 10))
    trajectories = []
    for i in range(GROUPS * GROUP_SIZE):
        call, answer, shape = int(rng.integers(5, 10)), int(rng.integers(3, 7)), rng.random()
        turns = 0 if shape < 0.4 else 1 if shape < 0.92 else 3  # tool calls; 8% use every turn (16-token turns)
        mask = [0] * 10 + ([1] * call + [0] * 5) * min(turns, 1) + ([1] * 16 + [0] * 5) * max(turns - 1, 0)
        mask = np.array(mask + [1] * answer, np.uint8)
        token_ids = rng.integers(10, vocab, len(mask)).astype(np.int32)
        token_ids[:10] = prompts[i // GROUP_SIZE]
        trajectories.append(Trajectory(
            id=str(i), group_id=i // GROUP_SIZE, prompt_index=i // GROUP_SIZE, sample_index=i % GROUP_SIZE,
            token_ids=token_ids, loss_mask=mask,
            behaviour_logprobs=np.where(mask == 1, -rng.uniform(0.05, 2.0, len(mask)), 0).astype(np.float32),
            versions=np.where(mask == 1, 0, -1).astype(np.int32), reward=float(rng.random() < 0.5)))
    return with_advantages(collate(trajectories), GROUP_SIZE, AlgorithmConfig(), KLConfig(), MAX_TOTAL_TOKENS)


def qwen_batch(vocab: int, seed: int = 0, sequences: int = QWEN_SEQUENCES, prompt: int = QWEN_PROMPT,
               sampled: int = QWEN_SAMPLED):
    """64 sequences of 128 prompt + 896 sampled tokens (or as given), groups of 8, with GRPO advantages."""
    rng = np.random.default_rng(seed)
    length = prompt + sampled
    mask = np.array([0] * prompt + [1] * sampled, np.uint8)
    trajectories = [Trajectory(
        id=str(i), group_id=i // GROUP_SIZE, prompt_index=i // GROUP_SIZE, sample_index=i % GROUP_SIZE,
        token_ids=rng.integers(10, vocab, length).astype(np.int32), loss_mask=mask,
        behaviour_logprobs=np.where(mask == 1, -rng.uniform(3, 6, length), 0).astype(np.float32),
        versions=np.where(mask == 1, 0, -1).astype(np.int32), reward=float(rng.random() < 0.5))
        for i in range(sequences)]
    return with_advantages(collate(trajectories), GROUP_SIZE, AlgorithmConfig(), KLConfig(), length + 1)


class BareLoop:
    """The hand-written baseline: HF model, AdamW, PPO clip against the behaviour logprobs, token mean;
    over the padded batch (what a user writes) or, packed=True, over the same packed rows as LearnerRank
    with the head at every position (so that the difference is the wrapper's own cost, less the head
    positions it skips)."""

    def __init__(self, path: str, device: str, dtype: str = "float32", micro_batch_tokens: int = 0,
                 packed: bool = False, lr: float = 1e-4, clip: float = 0.2):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.device, self.packed, self.clip, self.micro_batch_tokens = device, packed, clip, micro_batch_tokens
        self.autocast = nullcontext() if dtype == "float32" else torch.autocast(device, DTYPES[dtype])
        self.attention_cost = attention_cost_per_position(self.model)  # rows as LearnerRank lays them out

    def update(self, batch) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        tokens = batch.loss_mask.sum()
        for start, stop in token_budget_bounds(batch.attention_mask.sum(dim=1).tolist(), self.micro_batch_tokens):
            self._backward(trimmed(batch, start, stop), tokens)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()

    def _backward(self, mb, tokens) -> None:
        ids, attention = mb.input_ids.to(self.device), mb.attention_mask.to(self.device)
        mask, old = mb.loss_mask.to(self.device), mb.behaviour_logprobs.to(self.device)
        advantages = mb.advantages.to(self.device)[:, None]
        with self.autocast:
            if self.packed:
                packing = pack(mb.input_ids, mb.attention_mask, prompts=prompt_lengths(mb.loss_mask),
                               attention_cost=self.attention_cost).to(self.device)
                logprobs = packing.logprobs(self.model, 1.0)
            else:
                logprobs = sequence_logprobs(self.model(input_ids=ids, attention_mask=attention).logits, ids, 1.0)
        ratio = torch.exp((logprobs - old) * mask)
        loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - self.clip, 1 + self.clip) * advantages)
        ((loss * mask).sum() / tokens.to(self.device)).backward()


def rate(update, batch, updates: int, device: str) -> float:
    """Trained (sampled) tokens per second over `updates` calls, after one warm-up call."""
    update(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(updates):
        update(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    return updates * int(batch.loss_mask.sum()) / (time.perf_counter() - started)


SYNCING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def profiled(update, batch, device: str) -> tuple[float, float, int, float]:
    """One update under torch.profiler: (wall s, GPU busy s, synchronising host calls, their s)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        update(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    busy = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA) / 1e6
    waits = [e for e in prof.key_averages() if e.key.startswith(SYNCING_CALLS)]
    return wall, busy, sum(e.count for e in waits), sum(e.self_cpu_time_total for e in waits) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny", choices=("tiny", "wide-vocab", "qwen0.5b"))
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        if args.model == "tiny":
            path, dtype, micro, max_total = resolve_model_path("builtin:tiny"), "float32", 0, MAX_TOTAL_TOKENS
        elif args.model == "wide-vocab":
            from qwen_shape import wide_vocab_model

            path, dtype, micro, max_total = wide_vocab_model(f"{scratch}/wide"), "float32", 2_048, MAX_TOTAL_TOKENS
        else:
            from qwen_shape import qwen_shaped_model

            path, dtype, micro = qwen_shaped_model(f"{scratch}/qwen"), "bfloat16", QWEN_MICRO_BATCH_TOKENS
            max_total = QWEN_PROMPT + QWEN_SAMPLED + 1
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        setup = LearnerSetup(model=ModelConfig(path=path, dtype=dtype), max_total_tokens=max_total,
                             learner=LearnerConfig(device=args.device, torch_threads=args.threads,
                                                   micro_batch_tokens=micro))
        rank = LearnerRank(setup, 0, "127.0.0.1", port)
        updates = {"bare": BareLoop(path, args.device, dtype, micro).update}
        if args.model != "qwen0.5b":  # its equal-length rows pack exactly as they pad
            updates["packed"] = BareLoop(path, args.device, dtype, micro, packed=True).update
        updates["learner"] = lambda batch: rank.update(batch, 0)  # one minibatch: no order for a version to seed
        vocab = rank.model.config.vocab_size
        batch = qwen_batch(vocab) if args.model == "qwen0.5b" else default_job_batch(vocab)
        rates = {name: [] for name in updates}
        order = list(updates)
        for repeat in range(args.repeats):  # A, B, C, C, B, A
            for name in order if repeat % 2 == 0 else order[::-1]:
                rates[name].append(rate(updates[name], batch, args.updates, args.device))
                print(f"repeat {repeat}: {name} {rates[name][-1]:,.0f} trained tok/s", flush=True)  # if cut short
        profiles = {name: profiled(update, batch, args.device) for name, update in updates.items()} \
            if args.profile else {}
        sites = {name: host_wait_sites(lambda: update(batch)) for name, update in updates.items()} \
            if args.profile and args.device == "cuda" else {}
        publish_s = []  # the first call also allocates the pinned host copies (GPU) that later calls reuse,
        for sent in range(2):  # once the publisher has sent (and freed) the previous version, as in a run
            while rank.publisher.counts["sent"] < sent:
                time.sleep(0.05)
            started = time.perf_counter()
            rank.publish_weights(rank.version)
            publish_s.append(time.perf_counter() - started)
        rank.shutdown()
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {args.threads} threads"
    table = Table(title=f"LearnerRank.update vs a bare PyTorch loop ({args.model} {dtype}, {device}, "
                        f"{batch.size} sequences, {int(batch.loss_mask.sum())} sampled tokens; "
                        f"publish_weights {publish_s[0]:.2f} s, then {publish_s[1]:.2f} s)")
    for column in ("", "trained tok/s (min-max)", "median", "LearnerRank / this (range)"):
        table.add_column(column, justify="right")
    ours = rates["learner"]
    labels = {"bare": "bare PyTorch loop, padded", "packed": "bare PyTorch loop, packed rows",
              "learner": "LearnerRank.update (packed; FSDP2 for bf16 or several ranks)"}
    for name, values in rates.items():
        table.add_row(labels[name], f"{min(values):,.0f}-{max(values):,.0f}", f"{statistics.median(values):,.0f}",
                      f"{min(ours) / max(values):.2f}-{max(ours) / min(values):.2f}x")
    Console(width=200).print(table)
    if profiles:
        table = Table(title="one more update of each under torch.profiler")
        for column in ("", "wall s", "GPU busy s", "host waits for the GPU", "their s"):
            table.add_column(column, justify="right")
        for name, (wall, busy, waits, waited) in profiles.items():
            table.add_row(labels[name], f"{wall:.3f}", f"{busy:.3f}", str(waits), f"{waited:.3f}")
        Console(width=200).print(table)
    for name, counts in sites.items():
        print_wait_sites(Console(width=200), f"{labels[name]}, one update", counts)

if __name__ == "__main__":
    main()
