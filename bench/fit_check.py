"""The learner's start-up fit check (controller/fit_check.py, learners/memory.py) beside the peak one update
measures: Qwen2.5-0.5B's shape with random weights (bench/qwen_shape.py), one rank, bfloat16 compute over
float32 master weights, on the CPU (host peak) or a GPU (device peak); one table.

    python bench/fit_check.py [--size 0.5b] [--tokens 512,2048] [--chunk 512] [--lora-rank 16] [--limit-gb 12]
    python bench/fit_check.py --smoke      # a tiny shape: seconds

Settings: plain; learner.activation_checkpointing with learner.logits_chunk_tokens=--chunk; LoRA
(learner.lora.rank=--lora-rank); LoRA with both. Each runs in a process of its own (spawned, as in
bench/scale.py: a peak is then the setting's own): the rank is built, AdamW's moments are made by one step on
zero gradients (they persist through every later update; this saves a warm-up update's minutes and leaves the
weights as they were), then one update of sequences of 64 prompt + 448 sampled tokens (bench/scale.py's
shape, halved so that a micro-batch can hold one) in two micro-batches of --tokens tokens each
(learner.micro_batch_tokens), so the second runs with the first's gradients held, as every update of several
micro-batches does. A setting predicted above --limit-gb is not run (the machine's other users). Measured:
that update's peak (memory/learner_peak_host_gb, on a GPU memory/learner_peak_device_gb). Predicted: the same config's
fit_check.learner_prediction, of which the runtime part (on a GPU, the CUDA context, which the device peak
leaves out, is not compared). The "runtime" row is that constant's measurement: the resident memory of a rank
on a model of a few thousand parameters, after one update.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch
from rich.console import Console
from rich.table import Table
from transformers import Qwen2Config

from learner_vs_torch import qwen_batch  # bench/, the script's folder
from qwen_shape import qwen2_5_config, random_model
from scale import free_port

from nanoverl_async.config import load_config
from nanoverl_async.learners.batch import take_rows
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.learners.memory import GB, RUNTIME_BYTES, peak_memory
from nanoverl_async.learners.setup import LearnerSetup
from nanoverl_async.controller.fit_check import learner_prediction

SMOKE = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=True)
PROMPT, SAMPLED = 64, 448


def settings(chunk: int, lora_rank: int) -> dict[str, list[str]]:
    """Label -> the learner's config overrides."""
    saving = ["learner.activation_checkpointing=true", f"learner.logits_chunk_tokens={chunk}"]
    lora = [f"learner.lora.rank={lora_rank}"]
    return {"plain": [], f"checkpointed, logits in {chunk}s": saving, f"LoRA r={lora_rank}": lora,
            f"LoRA r={lora_rank}, checkpointed, logits in {chunk}s": lora + saving}


def run_config(path: str, device: str, tokens: int, sequence: int, threads: int, overrides: list[str]):
    return load_config(None, [f"model.path={path}", "model.dtype=bfloat16", f"learner.device={device}",
                              f"learner.micro_batch_tokens={tokens}", f"agent.max_total_tokens={sequence + 1}",
                              f"learner.torch_threads={threads}", "algorithm.entropy_coef=0", *overrides])


def measure(cfg, vocab: int, prompt: int, sampled: int) -> float:
    """GB: the peak of one update (module docstring), in this process."""
    setup = LearnerSetup(model=cfg.model, learner=cfg.learner, max_total_tokens=cfg.agent.max_total_tokens)
    rank = LearnerRank(setup, 0, "127.0.0.1", free_port())
    try:
        for parameter in (p for group in rank.optimizer.param_groups for p in group["params"]):
            parameter.grad = torch.zeros_like(parameter)
        rank.optimizer.step()  # zero gradients: AdamW's moments exist, the weights unchanged
        rank.optimizer.zero_grad(set_to_none=True)
        sequences = 2 * cfg.learner.micro_batch_tokens // (prompt + sampled)  # two micro-batches
        batch = take_rows(qwen_batch(vocab, sequences=-(-sequences // 8) * 8, prompt=prompt, sampled=sampled),
                          torch.arange(sequences))
        peak_memory(rank.device)  # the window starts here
        metrics = rank.update(batch, 0)
    finally:
        rank.shutdown()
    return metrics["memory/learner_peak_device_gb" if cfg.learner.device == "cuda" else "memory/learner_peak_host_gb"]


def in_own_process(function, *args):
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b")
    parser.add_argument("--tokens", default="512,2048", help="learner.micro_batch_tokens, each")
    parser.add_argument("--limit-gb", type=float, default=12.0, help="run no setting predicted above this")
    parser.add_argument("--chunk", type=int, default=512, help="learner.logits_chunk_tokens when checkpointed")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape and batch, on the CPU")
    args = parser.parse_args()
    prompt, sampled = (16, 48) if args.smoke else (PROMPT, SAMPLED)
    tokens = [int(size) for size in args.tokens.split(",")]
    if args.smoke:
        args.device, tokens, args.chunk = "cpu", [prompt + sampled, 2 * (prompt + sampled)], 32
    config = SMOKE if args.smoke else qwen2_5_config(args.size)
    runtime = RUNTIME_BYTES[args.device] if args.device == "cuda" else 0  # not in the device peak
    shape = "tiny" if args.smoke else args.size
    table = Table(title=f"The fit check's prediction against one update's peak: {shape} shape, one rank on "
                        f"{args.device}, bfloat16 over fp32 master weights, sequences of {prompt} prompt + {sampled} "
                        f"sampled tokens")
    for column in ("setting", "micro-batch tokens", "predicted GB", "its parts GB", "measured peak GB",
                   "predicted / measured"):
        table.add_column(column, justify="left" if column in ("setting", "its parts GB") else "right")
    with tempfile.TemporaryDirectory() as scratch:
        path = random_model(config, f"{scratch}/model", args.device)
        tiny = random_model(SMOKE, f"{scratch}/tiny")
        rows = []
        for size in tokens:
            for label, overrides in settings(args.chunk, args.lora_rank).items():
                cfg = run_config(path, args.device, size, prompt + sampled, args.threads, overrides)
                predicted = (learner_prediction(cfg).total - runtime) / GB
                started = time.perf_counter()
                peak = in_own_process(measure, cfg, config.vocab_size, prompt, sampled) \
                    if predicted <= args.limit_gb else None
                rows.append([label, f"{size:,}", f"{predicted:.2f}", learner_prediction(cfg).parts(),
                             f"{peak:.2f}" if peak else f"not run (> --limit-gb {args.limit_gb:g})",
                             f"{predicted / peak:.2f}" if peak else ""])
                print(" | ".join(rows[-1]), f"({time.perf_counter() - started:.0f} s)", flush=True)
        if args.device == "cpu":
            small = run_config(tiny, "cpu", 64, 64, args.threads, [])
            runtime_peak = in_own_process(measure, small, SMOKE.vocab_size, 16, 48)
            rows.append(["runtime (the tiny shape)", "64", f"{RUNTIME_BYTES['cpu'] / GB:.2f}", "",
                         f"{runtime_peak:.2f}", f"{RUNTIME_BYTES['cpu'] / GB / runtime_peak:.2f}"])
    for row in rows:
        table.add_row(*row)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
