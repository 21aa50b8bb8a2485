"""How large a model and micro-batch the learner holds on one GPU, and how fast it trains them: Qwen2.5 shapes
with random weights (bench/qwen_shape.py), one table.

    python bench/scale.py [--sizes 0.5b,1.5b,3b,7b] [--tokens 4096,16384] [--updates 2] [--chunk 4096]
    python bench/scale.py --smoke      # on the CPU: a tiny shape and sizes, and 7B refused at start-up
    python bench/scale.py --sizes 7b --lora 16   # LoRA (learner.lora.rank=16, all-linear) over a bfloat16 base

For each shape, first the start-up check (controller/fit_check.py, learners/memory.py: the predicted peak of one
rank's update against the GPU's memory) at the smallest setting measured below. A shape that fails it is not
built; its row shows the one line a launch prints. Otherwise the shape is written with random weights
and, for each memory setting (plain; learner.activation_checkpointing with learner.logits_chunk_tokens =
--chunk), one LearnerRank (world size 1, bfloat16 compute over fp32 master weights, FSDP2) trains, at each
micro-batch size (learner.micro_batch_tokens), a batch of sequences of 128 prompt + 896 sampled tokens, two
micro-batches of the largest size: whether it fits (else OOM), trained (sampled) tokens/s over --updates
updates after a warm-up one, and the last update's peak device memory (memory/learner_peak_device_gb; on the
CPU, host). Then, once per shape, the seconds from publish_weights to a subscriber (in the measuring process)
holding the version, the learner's default transport (weights.py), the median of three.

Each (shape, memory setting) is measured in a process of its own (`measured`: spawned, it inherits no memory,
CUDA state or allocator cache), so that its peak is its own: measured one after the other in one process, the
second setting's peak sat on what the first left behind (issue 41: on the CPU, activation checkpointing read
10.67 GB right after the plain setting and 8.88 GB alone, so the table showed checkpointing raising memory).

Not measured here (listed under the table): publish-to-applied with learner and generator on one GPU
(issue 32 item 2, in place), and the default agent job's samples/s async against sync at each shape
(bench/async_vs_sync.py with model.path set to the shape's directory; minutes a run, a device call of its own).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import shutil
import socket
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Optional

import torch
from rich.console import Console
from rich.table import Table
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner_vs_torch import GROUP_SIZE, qwen_batch, rate  # bench/, the script's folder
from qwen_shape import QWEN2_5, qwen2_5_config, random_model

from nanoverl_async.config import LearnerConfig, LoRAConfig, ModelConfig, load_config
from nanoverl_async.learners.fsdp_rank import LearnerRank
from nanoverl_async.learners.memory import GB, learner_fit_error, predict_peak
from nanoverl_async.learners.setup import LearnerSetup
from nanoverl_async.controller.fit_check import learner_workload
from nanoverl_async.wire.weights import WeightSubscriber

PROMPT, SAMPLED = 128, 896
SMOKE = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=True)
SMOKE_PROMPT, SMOKE_SAMPLED, SMOKE_TOKENS, SMOKE_CHUNK = 16, 48, [128, 256], 32


def parameters(config: Qwen2Config) -> int:
    with torch.device("meta"):  # shapes only
        return sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())


def billions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e7 else f"{count / 1e6:.2f}M"


def device_memory(device: str) -> tuple[int, str]:
    """(bytes, what) of the memory one learner rank runs in: the GPU's, or on the CPU this machine's."""
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory, f"GPU memory ({torch.cuda.get_device_name()})"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def publish_to_received(rank: LearnerRank, versions: int = 3) -> float:
    """The median seconds from `publish_weights` to a WeightSubscriber (in this process) holding the version,
    each published once the previous one arrived, as the learner publishes one per step."""
    subscriber, seconds = WeightSubscriber(rank.weights_endpoint()), []
    try:
        for version in range(1, versions + 1):
            started = time.perf_counter()
            rank.publish_weights(version)
            while (bucket := subscriber.poll_bucket(version - 1)) is None or bucket.index < bucket.count - 1:
                assert time.perf_counter() - started < 120, f"version {version} not received in 120 s"
                time.sleep(0.002 if bucket is None else 0)
            seconds.append(time.perf_counter() - started)
    finally:
        subscriber.close()
    return statistics.median(seconds)


def measured(path: str, device: str, tokens: list[int], batch_shape: dict, updates: int, threads: int,
             checkpointing: bool, chunk: int, publish: bool, lora: int = 0) -> tuple[dict[int, tuple], Optional[float]]:
    """`measure` in a fresh spawned process (module docstring). A process killed meanwhile (the host's OOM
    killer) leaves no result: its sizes read "killed"."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(measure, path, device, tokens, batch_shape, updates, threads, checkpointing, chunk,
                               publish, lora).result()
        except BrokenProcessPool:
            return {size: ("killed", None, None) for size in tokens}, None


def measure(path: str, device: str, tokens: list[int], batch_shape: dict, updates: int, threads: int,
            checkpointing: bool, chunk: int, publish: bool, lora: int = 0) -> tuple[dict[int, tuple], Optional[float]]:
    """{micro-batch tokens: (fits, trained tok/s, peak GB)} of one LearnerRank with these memory settings on
    qwen_batch(**batch_shape) (built here: a batch is cheaper to build than to send), and (publish) the median
    seconds publish_weights -> a subscriber holds the version. A size that runs out of memory is OOM, and so is
    every larger one (not tried)."""
    batch = qwen_batch(**batch_shape)
    learner = LearnerConfig(device=device, torch_threads=threads, activation_checkpointing=checkpointing,
                            logits_chunk_tokens=chunk, lora=LoRAConfig(rank=lora))
    setup = LearnerSetup(model=ModelConfig(path=path, dtype="bfloat16"), learner=learner,
                         max_total_tokens=batch.input_ids.shape[1] + 1)
    results, publish_s, rank = {}, None, None
    peak_key = "memory/learner_peak_device_gb" if device == "cuda" else "memory/learner_peak_host_gb"
    try:
        rank = LearnerRank(setup, 0, "127.0.0.1", free_port())
        for size in tokens:
            rank.cfg = dataclasses.replace(rank.cfg, micro_batch_tokens=size)  # read at each update
            last = {}
            speed = rate(lambda b: last.update(rank.update(b, 0)), batch, updates, device)
            results[size] = ("yes", speed, last[peak_key])
        if publish:
            publish_s = publish_to_received(rank)
    except torch.OutOfMemoryError:
        results.update({size: ("OOM", None, None) for size in tokens if size not in results})
    finally:
        if rank is not None:
            rank.shutdown()
    return results, publish_s


def shape_rows(name: str, config: Qwen2Config, args, scratch: str) -> list[list[str]]:
    """The table's rows of one shape: its start-up check, then each setting x micro-batch size."""
    count = parameters(config)
    available, where = device_memory(args.device)
    config.save_pretrained(f"{scratch}/{name}-config")  # the config alone: the check counts on the meta device
    sequence = SMOKE_PROMPT + SMOKE_SAMPLED if args.smoke else PROMPT + SAMPLED
    smallest = load_config(None, [f"model.path={scratch}/{name}-config", "model.dtype=bfloat16",
                                  f"agent.max_total_tokens={sequence + 1}",
                                  f"learner.micro_batch_tokens={min(args.tokens)}", f"learner.device={args.device}",
                                  "learner.activation_checkpointing=true", f"learner.logits_chunk_tokens={args.chunk}",
                                  f"learner.lora.rank={args.lora}"])  # with LoRA: the base frozen in bfloat16
    work = learner_workload(smallest)
    refused = learner_fit_error(lambda ranks: predict_peak(work, ranks), 1, available, where,
                                ranks_share_it=args.device == "cpu")
    if refused:
        print(f"{name}: {refused}", flush=True)
        return [[name, billions(count), refused, "", "", "", "", "", ""]]
    print(f"{name}: {billions(count)} parameters, writing random weights", flush=True)
    path = random_model(config, f"{scratch}/{name}", args.device)
    prompt, sampled = (SMOKE_PROMPT, SMOKE_SAMPLED) if args.smoke else (PROMPT, SAMPLED)
    sequences = -(-2 * max(args.tokens) // (prompt + sampled) // GROUP_SIZE) * GROUP_SIZE  # whole groups
    batch_shape = {"vocab": config.vocab_size, "sequences": sequences, "prompt": prompt, "sampled": sampled}
    rows = []
    prefix = f"LoRA r{args.lora}, " if args.lora else ""
    for label, checkpointing, chunk in ((f"{prefix}plain", False, 0), (f"{prefix}checkpointed, logits in {args.chunk}s",
                                                                        True, args.chunk)):
        results, publish_s = measured(path, args.device, args.tokens, batch_shape, args.updates, args.threads,
                                      checkpointing, chunk, publish=not checkpointing, lora=args.lora)
        for size, (fits, speed, peak) in results.items():
            rows.append([name, billions(count), "passes", label, f"{size:,}", fits,
                         f"{speed:,.0f}" if speed else "", f"{peak:.1f}" if peak else "",
                         f"{publish_s:.2f}" if publish_s is not None and size == args.tokens[0] else ""])
            print(" | ".join(rows[-1]), flush=True)  # if the call is cut short
    shutil.rmtree(path)  # 15 GB at 7B: one shape on disk at a time
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(QWEN2_5), help=f"of {', '.join(QWEN2_5)}")
    parser.add_argument("--tokens", default="4096,16384", help="micro-batch sizes (learner.micro_batch_tokens)")
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=4_096, help="learner.logits_chunk_tokens when checkpointed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny shape, tiny sizes, one update")
    parser.add_argument("--lora", type=int, default=0, help="learner.lora.rank (all-linear); 0: the whole model")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.tokens, args.updates, args.chunk = "cpu", SMOKE_TOKENS, 1, SMOKE_CHUNK
        shapes = {"tiny": SMOKE, "7b": qwen2_5_config("7b")}  # 7B: refused by the start-up check, not built
        shapes = {"tiny": SMOKE} if args.lora else shapes  # with LoRA 7B passes the check here, and would be built
    else:
        args.tokens = [int(size) for size in args.tokens.split(",")]
        shapes = {size: qwen2_5_config(size) for size in args.sizes.split(",")}
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        rows = [row for name, config in shapes.items() for row in shape_rows(name, config, args, scratch)]
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {args.threads} threads"
    available, _ = device_memory(args.device)
    table = Table(title=f"The learner at scale: one rank on {device} ({available / GB:.0f} GB), bfloat16 compute "
                        f"over fp32 master weights, AdamW; random weights")
    for column in ("shape", "parameters", "start-up check", "memory setting", "micro-batch tokens", "fits",
                   "trained tok/s", "peak GB", "publish -> received s"):
        table.add_column(column, justify="right" if column != "start-up check" else "left")
    for row in rows:
        table.add_row(*row)
    Console(width=220).print(table)
    print("TODO (not measured by this script): publish -> applied with learner and generator on one GPU (issue 32 "
          "item 2); the default agent job's samples/s, async vs sync, per shape: bench/async_vs_sync.py "
          "model.path=<shape dir> model.dtype=bfloat16 learner.device=cuda generator.device=cuda ...")


if __name__ == "__main__":
    main()
