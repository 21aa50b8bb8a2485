"""`LearnerRank.update` against the bare PyTorch loop it wraps, on the same batches, side by side.

    python bench/learner_vs_torch.py [--threads 2] [--repeats 2] [--updates 5] [--device cpu]

The batch is shaped like the default job's (configs/agent_grpo.yaml): 16 groups x 8 episodes of the
built-in `A*B?` task, lengths as measured in its runs: a prompt of 10 tokens, then a sampled answer (40%
of rows), a sampled call, a 5-token tool result and an answer (52%), or three turns of calls (8%, up to
~70 tokens), so that, as in the job, a few long rows set the padded width. The bare loop is what a user would write by hand: the Hugging Face model in
fp32, AdamW, one forward over the padded batch, token logprobs, the PPO clipped loss against the
behaviour logprobs (token mean), backward, gradient clipping, step; once over the padded batch, and once
over the packed rows LearnerRank uses (batch.pack), which isolates the wrapper's own cost. `LearnerRank`
runs the project's default algorithm on the same rows (world size 1). Interleaved A, B, C, C, B, A;
trained tokens/s as ranges.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from nanoverl_async.config import AlgorithmConfig, KLConfig, LearnerConfig, ModelConfig
from nanoverl_async.learners.batch import collate, pack, sequence_logprobs, with_advantages
from nanoverl_async.learners.fsdp_rank import LearnerRank, LearnerSetup
from nanoverl_async.models import resolve_model_path
from nanoverl_async.trajectory import Trajectory

GROUPS, GROUP_SIZE, MAX_TOTAL_TOKENS = 16, 8, 96


def default_job_batch(vocab: int, seed: int = 0):
    """128 trajectories shaped like the default job's episodes, with GRPO advantages."""
    rng = np.random.default_rng(seed)
    trajectories = []
    for i in range(GROUPS * GROUP_SIZE):
        call, answer, shape = int(rng.integers(5, 10)), int(rng.integers(3, 7)), rng.random()
        turns = 0 if shape < 0.4 else 1 if shape < 0.92 else 3  # tool calls; 8% use every turn (16-token turns)
        mask = [0] * 10 + ([1] * call + [0] * 5) * min(turns, 1) + ([1] * 16 + [0] * 5) * max(turns - 1, 0)
        mask = np.array(mask + [1] * answer, np.uint8)
        trajectories.append(Trajectory(
            id=str(i), group_id=i // GROUP_SIZE, prompt_index=i // GROUP_SIZE, sample_index=i % GROUP_SIZE,
            token_ids=rng.integers(10, vocab, len(mask)).astype(np.int32), loss_mask=mask,
            behaviour_logprobs=np.where(mask == 1, -rng.uniform(0.05, 2.0, len(mask)), 0).astype(np.float32),
            versions=np.where(mask == 1, 0, -1).astype(np.int32), reward=float(rng.random() < 0.5)))
    return with_advantages(collate(trajectories), GROUP_SIZE, AlgorithmConfig(), KLConfig(), MAX_TOTAL_TOKENS)


class BareLoop:
    """The hand-written baseline: HF model, AdamW, PPO clip against the behaviour logprobs, token mean;
    over the padded batch (what a user writes) or, packed=True, over the same packed rows as LearnerRank
    (so that the difference is the wrapper's own cost)."""

    def __init__(self, path: str, device: str, packed: bool = False, lr: float = 1e-4, clip: float = 0.2):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.device, self.packed, self.clip = device, packed, clip

    def update(self, batch) -> None:
        ids, attention = batch.input_ids.to(self.device), batch.attention_mask.to(self.device)
        mask, old = batch.loss_mask.to(self.device), batch.behaviour_logprobs.to(self.device)
        advantages = batch.advantages.to(self.device)[:, None]
        self.optimizer.zero_grad(set_to_none=True)
        if self.packed:
            packing = pack(ids, attention)
            logits = self.model(input_ids=packing.input_ids, position_ids=packing.position_ids, use_cache=False).logits
            logprobs = packing.unpack(sequence_logprobs(logits, packing.input_ids, 1.0))
        else:
            logprobs = sequence_logprobs(self.model(input_ids=ids, attention_mask=attention).logits, ids, 1.0)
        ratio = torch.exp((logprobs - old) * mask)
        loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - self.clip, 1 + self.clip) * advantages)
        ((loss * mask).sum() / mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model_path("builtin:tiny")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    setup = LearnerSetup(model=ModelConfig(path=path), max_total_tokens=MAX_TOTAL_TOKENS,
                         learner=LearnerConfig(device=args.device, torch_threads=args.threads))
    rank = LearnerRank(setup, 0, "127.0.0.1", port)
    updates = {"bare": BareLoop(path, args.device).update, "packed": BareLoop(path, args.device, packed=True).update,
               "learner": rank.update}
    batch = default_job_batch(rank.model.config.vocab_size)
    rates = {name: [] for name in updates}
    for _ in range(args.repeats):  # A, B, C, C, B, A
        for name in ("bare", "packed", "learner", "learner", "packed", "bare"):
            rates[name].append(rate(updates[name], batch, args.updates, args.device))
    rank.shutdown()
    table = Table(title=f"LearnerRank.update vs a bare PyTorch loop ({args.device}, {args.threads} threads, "
                        f"{batch.size} sequences, {int(batch.loss_mask.sum())} sampled tokens)")
    for column in ("", "trained tok/s (min-max)", "median", "LearnerRank / this (range)"):
        table.add_column(column, justify="right")
    ours = rates["learner"]
    for name, label in (("bare", "bare PyTorch loop, padded"), ("packed", "bare PyTorch loop, packed rows"),
                        ("learner", "LearnerRank.update (FSDP2, packed)")):
        values = rates[name]
        table.add_row(label, f"{min(values):,.0f}-{max(values):,.0f}", f"{statistics.median(values):,.0f}",
                      f"{min(ours) / max(values):.2f}-{max(ours) / min(values):.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
