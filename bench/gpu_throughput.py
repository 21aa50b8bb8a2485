"""Tokens/s of the two GPU halves of a run: the transformers engine (generation) and one FSDP2 learner
rank on NCCL (training), on the built-in tiny model and on a Qwen2.5-0.5B-shaped model.

    python bench/gpu_throughput.py [--models tiny,qwen0.5b] [--out table.md]

No weights are downloaded: the 0.5B model has Qwen2.5-0.5B-Instruct's exact architecture (24 layers,
hidden 896, 14/2 heads, vocabulary 151,936, tied embeddings) with random weights, which is all that
throughput depends on (no request stops early: no stop tokens). Per model:
  - generate: C concurrent requests (C in 64 and 256) through `TransformersEngine`, each a random
    prompt and a fixed number of new tokens (`SHAPES`: 128 + 256 for the 0.5B model); generated
    tokens / wall-clock, after a warm-up;
  - train: `LearnerRank` (world size 1, NCCL, fp32 master weights, compute in the model dtype) runs
    `update` on 64 sequences (1,024 tokens, 896 sampled, for the 0.5B model); trained tokens /
    wall-clock over 3 updates after one warm-up; and the seconds of `publish_weights` (gather the full
    state dict to CPU and hand it to the ZeroMQ publisher thread).
Needs a CUDA GPU (falls back to CPU with --device cpu, for checking the script itself, tiny model only).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig

from nanoverl_async.config import AlgorithmConfig, KLConfig, LearnerConfig, ModelConfig
from nanoverl_async.generators.engine import SamplingParams
from nanoverl_async.generators.hf_engine import TransformersEngine
from nanoverl_async.learners.batch import collate, group_size_of, with_advantages
from nanoverl_async.learners.fsdp_rank import LearnerRank, LearnerSetup
from nanoverl_async.models import resolve_model_path
from nanoverl_async.trajectory import Trajectory

TRAIN_SEQUENCES = 64


@dataclass(frozen=True)
class Shape:
    """Token counts per model: the tiny model has 256 positions, so its requests are shorter."""

    prompt: int  # prompt tokens of a generation request
    new: int  # new tokens per request
    train_prompt: int  # prompt tokens (mask 0) of a training sequence
    train_sampled: int  # sampled tokens (mask 1) of a training sequence


SHAPES = {"tiny": Shape(32, 192, 32, 192), "qwen0.5b": Shape(128, 256, 128, 896)}


def qwen_shaped_model(directory: str) -> str:
    """Qwen2.5-0.5B-Instruct's architecture with random weights, saved in bfloat16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4_864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32_768,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         bos_token_id=151_643, eos_token_id=151_645)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def generation_rate(model_path: str, device: str, dtype: str, concurrency: int, vocab: int, shape: Shape) -> float:
    engine = TransformersEngine(model_path, device, dtype, seed=0, max_batch_size=max(256, concurrency))
    rng = np.random.default_rng(0)

    async def run(count: int, new_tokens: int) -> int:
        prompts = [rng.integers(10, vocab, shape.prompt).tolist() for _ in range(count)]
        done = await asyncio.gather(*(engine.generate(p, SamplingParams(new_tokens, 1.0, ())) for p in prompts))
        return sum(len(c.token_ids) for c in done)

    asyncio.run(run(min(8, concurrency), 16))  # warm-up: kernels, allocator
    _sync(device)
    started = time.perf_counter()
    tokens = asyncio.run(run(concurrency, shape.new))
    _sync(device)
    del engine
    return tokens / (time.perf_counter() - started)


def training_batch(vocab: int, shape: Shape, seed: int = 0):
    rng = np.random.default_rng(seed)
    length = shape.train_prompt + shape.train_sampled
    mask = np.array([0] * shape.train_prompt + [1] * shape.train_sampled, np.uint8)
    trajectories = [Trajectory(
        id=str(i), group_id=i // 8, prompt_index=i // 8, sample_index=i % 8,
        token_ids=rng.integers(10, vocab, length).astype(np.int32), loss_mask=mask,
        behaviour_logprobs=np.where(mask == 1, -rng.uniform(3, 6, length), 0).astype(np.float32),
        versions=np.where(mask == 1, 0, -1).astype(np.int32), reward=float(rng.random() < 0.5))
        for i in range(TRAIN_SEQUENCES)]
    return with_advantages(collate(trajectories), group_size_of(trajectories), AlgorithmConfig(), KLConfig(),
                           max_total_tokens=length + 1)


def training_rates(model_path: str, device: str, dtype: str, vocab: int, shape: Shape) -> tuple[float, float]:
    """(trained tokens/s, seconds per publish_weights) of one LearnerRank."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cfg = LearnerConfig(device=device, micro_batch_tokens=8_192, torch_threads=4)
    rank = LearnerRank(LearnerSetup(ModelConfig(path=model_path, dtype=dtype), cfg), 0, "127.0.0.1", port)
    batch = training_batch(vocab, shape)
    tokens = TRAIN_SEQUENCES * (shape.train_prompt + shape.train_sampled)
    rank.update(batch)  # warm-up
    _sync(device)
    started = time.perf_counter()
    for _ in range(3):
        rank.update(batch)
    _sync(device)
    train_rate = 3 * tokens / (time.perf_counter() - started)
    started = time.perf_counter()
    rank.publish_weights(rank.version)
    publish_s = time.perf_counter() - started
    rank.shutdown()
    return train_rate, publish_s


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,qwen0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    console = Console()
    table = Table(title=f"Throughput ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
                        f"torch {torch.__version__})")
    for column in ("model", "dtype", "generate C=64 tok/s", "generate C=256 tok/s", "train tok/s", "publish s"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            if name == "tiny":
                path, dtype = resolve_model_path("builtin:tiny"), "float32"
            elif name == "qwen0.5b":
                path, dtype = qwen_shaped_model(f"{scratch}/qwen"), "bfloat16"
            else:
                raise SystemExit(f"--models: unknown model '{name}' (tiny, qwen0.5b)")
            vocab, shape = AutoConfig.from_pretrained(path).vocab_size, SHAPES[name]
            gen = [generation_rate(path, args.device, dtype, c, vocab, shape) for c in (64, 256)]
            console.print(f"{name}: generate {gen[0]:,.0f} / {gen[1]:,.0f} tok/s")
            train, publish = training_rates(path, args.device, dtype, vocab, shape)
            console.print(f"{name}: train {train:,.0f} tok/s, publish {publish:.2f} s")
            table.add_row(name, dtype, f"{gen[0]:,.0f}", f"{gen[1]:,.0f}", f"{train:,.0f}", f"{publish:.2f}")
    console.print(table)
    if args.out:
        Console(file=open(args.out, "w"), width=140).print(table)


if __name__ == "__main__":
    main()
