"""Tokens/s of `BuiltinEngine` (continuous batching) against bare `model.generate` and the previous
batch-at-a-time engine, on the same prompts and the same forced lengths.

    python bench/engine_vs_generate.py [--device cpu|cuda] [--model tiny|qwen0.5b] [--repeats 2] [--profile]

Workloads (no stop tokens; every length is forced by max_new_tokens, and by min_new_tokens for generate):
  - throughput: C in 16, 64, 256 concurrent requests of one random prompt and N new tokens each;
    generate gets them as one [C, prompt] batch (do_sample, temperature 1, full distribution); each
    system runs the batch again until MIN_ROW_S have passed (the wall column shows the whole run);
  - multi-turn: 64 episodes x 3 turns; turn lengths drawn in 8..48 new tokens, then a 50 ms
    `asyncio.sleep` ("tool latency"), then 4 tool-result tokens appended before the next turn. The
    engines run the episodes as concurrent coroutines; generate runs them turn by turn in lockstep
    batches (left-padded, the longest turn's length for every row, each row cut to its own length,
    one 50 ms sleep per turn). Tokens counted: the forced lengths, never the padding.
The old engine is the batch-at-a-time version at OLD_ENGINE_REF, loaded from git into a temporary
module at start (no old code is kept in the package; --old-ref '' leaves it out where there is no git
history). On cuda the engine also runs with its CUDA graphs off ("new, eager"). Systems run interleaved (A, B, C, C, B, A, ...)
and each cell shows the mean with the range over repeats (ratios: of the means, with the range of
the per-repeat ratios). --profile on cuda adds, for one more run of the largest C and of the multi-turn
workload, where the new engine's host waited for the GPU, per engine step (cuda_waits.py; the design is one
wait per step, for the sampled tokens). torch uses 2 threads throughout. The machine may be shared: each run waits
(--max-wait) until other processes are quiet, and the table reports the most CPU other processes
used during any run of a row (from /proc/stat: Linux only).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from statistics import mean

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, AutoModelForCausalLM

from cuda_waits import host_wait_sites, print_wait_sites  # bench/, the script's folder
from nanoverl_async.agents.engine import SamplingParams
from nanoverl_async.generators.builtin_engine import BuiltinEngine
from nanoverl_async.models.load import DTYPES, resolve_model_path


OLD_ENGINE_REF = "5c0e5bdef43e08afc6a475d2562f79de69d1151f"  # the last commit with the batch-at-a-time engine
OLD_ENGINE_PATH = "nanoverl_async/generators/hf_engine.py"  # its file there, and its class TransformersEngine
SHAPES = {"tiny": (32, 128), "qwen0.5b": (128, 256)}  # (prompt tokens, new tokens) of the throughput rows
EPISODES, TURNS, TURN_TOKENS, TOOL_TOKENS, TOOL_LATENCY_S = 64, 3, (8, 48), 4, 0.05
QUIET_CORES = 0.2  # a run starts once other processes use less than this for 2 s
MIN_ROW_S = 2.0  # a throughput run repeats its batch until this long: one pass at C=16 on the CPU is ~0.6 s of noise


def old_engine_class(ref: str):
    """The engine as committed at `ref` (OLD_ENGINE_PATH's class), imported from a temporary file."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "show", f"{ref}:{OLD_ENGINE_PATH}"], cwd=root, check=True, capture_output=True,
                            text=True).stdout
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "old_hf_engine.py")
        with open(path, "w") as file:
            file.write(source)
        spec = importlib.util.spec_from_file_location("old_hf_engine", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return module.TransformersEngine


class Bare:
    """model.generate on a left-padded batch: the baseline every framework starts from."""

    def __init__(self, path: str, device: str, dtype: str):
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
        self.pad = self.model.config.pad_token_id or 0

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                      top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      pad_token_id=self.pad)
        return out[:, width:].tolist()


def throughput(system, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[float, float]:
    """(tokens/s, wall s) of len(prompts) concurrent requests of `new_tokens` each, the whole batch of
    requests run again until MIN_ROW_S have passed."""
    async def run():
        return await asyncio.gather(*(system.generate(p, SamplingParams(new_tokens, 1.0)) for p in prompts))

    _sync(device)
    started, tokens = time.perf_counter(), 0
    while tokens == 0 or time.perf_counter() - started < MIN_ROW_S:
        if isinstance(system, Bare):
            tokens += sum(map(len, system.generate(prompts, new_tokens)))
        else:
            tokens += sum(len(c.token_ids) for c in asyncio.run(run()))
        _sync(device)
    wall = time.perf_counter() - started
    assert tokens % (len(prompts) * new_tokens) == 0
    return tokens / wall, wall


def multi_turn(system, prompts: list[list[int]], lengths: np.ndarray, tools: np.ndarray, device: str):
    """(tokens/s, wall s) of the multi-turn workload; lengths[e, t] new tokens, tools[e, t] the result ids."""
    _sync(device)
    started = time.perf_counter()
    if isinstance(system, Bare):
        contexts = [list(p) for p in prompts]
        for turn in range(TURNS):
            outs = system.generate(contexts, int(lengths[:, turn].max()))
            for context, out, n, tool in zip(contexts, outs, lengths[:, turn], tools[:, turn]):
                context += out[:n] + (tool.tolist() if turn < TURNS - 1 else [])
            if turn < TURNS - 1:
                time.sleep(TOOL_LATENCY_S)  # the batch's tools run side by side: one latency per turn
        tokens = int(lengths.sum())
    else:
        async def episode(e: int) -> int:
            context, done = list(prompts[e]), 0
            for turn in range(TURNS):
                completion = await system.generate(context, SamplingParams(int(lengths[e, turn]), 1.0),
                                                   episode_id=f"episode-{e}")  # its turns share a cache
                context += completion.token_ids
                done += len(completion.token_ids)
                if turn < TURNS - 1:
                    await asyncio.sleep(TOOL_LATENCY_S)
                    context += tools[e, turn].tolist()
            return done

        async def run():
            return await asyncio.gather(*(episode(e) for e in range(len(prompts))))

        tokens = sum(asyncio.run(run()))
        assert tokens == int(lengths.sum())
    _sync(device)
    wall = time.perf_counter() - started
    return tokens / wall, wall


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process)."""
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), time.process_time()


def _others(before: tuple[float, float], after: tuple[float, float], wall: float) -> float:
    """Cores other processes kept busy between two _cpu_seconds()."""
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall


def quietly(measure, max_wait_s: float) -> tuple[float, float, float]:
    """Wait (at most max_wait_s) until other processes use < QUIET_CORES for 2 s (the machine is shared),
    then measure() -> (tok/s, wall s, cores other processes used meanwhile)."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        before = _cpu_seconds()
        time.sleep(2)
        if _others(before, _cpu_seconds(), 2.0) < QUIET_CORES:
            break
    before, started = _cpu_seconds(), time.perf_counter()
    rate, wall = measure()
    return rate, wall, _others(before, _cpu_seconds(), time.perf_counter() - started)


def interleaved(systems: dict, repeats: int, measure, max_wait_s: float) -> dict[str, list[tuple]]:
    """measure(system) per system, in the order A, B, C, C, B, A, ... -> name -> [(tok/s, wall s, others)]."""
    results = {name: [] for name in systems}
    names = list(systems)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            results[name].append(quietly(lambda: measure(systems[name]), max_wait_s))
    return results


def cell(runs: list[tuple]) -> str:
    rates = [run[0] for run in runs]
    return f"{mean(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f})"


def ratio(a: list[tuple], b: list[tuple]) -> str:
    """Ratio of the mean rates, with the range of the per-repeat ratios (repeat i of both ran in one pass)."""
    pairs = [x[0] / y[0] for x, y in zip(a, b)]
    return f"{mean(x[0] for x in a) / mean(y[0] for y in b):.2f}x ({min(pairs):.2f}-{max(pairs):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--concurrency", default="16,64,256")
    parser.add_argument("--repeats", type=int, default=2, help="runs per system per row (interleaved)")
    parser.add_argument("--old-ref", default=OLD_ENGINE_REF, help="git commit of the old engine ('' = leave it out)")
    parser.add_argument("--max-wait", type=float, default=300, help="seconds to wait for a quiet machine per run")
    parser.add_argument("--profile", action="store_true", help="on cuda: where the engine's host waits, per step")
    args = parser.parse_args()
    torch.set_num_threads(2)
    console = Console(width=220)
    load = _loadavg()
    with tempfile.TemporaryDirectory() as scratch:
        if args.model == "tiny":
            path, dtype = resolve_model_path("builtin:tiny"), "float32"
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from qwen_shape import qwen_shaped_model

            path, dtype = qwen_shaped_model(f"{scratch}/qwen"), "bfloat16"
        vocab, (prompt_len, new_tokens) = AutoConfig.from_pretrained(path).vocab_size, SHAPES[args.model]
        concurrency = [int(c) for c in args.concurrency.split(",")]
        batch = max(256, *concurrency, EPISODES)
        systems = {"new engine": BuiltinEngine(path, args.device, dtype, seed=0, max_batch_size=batch)}
        if args.device == "cuda":  # what the CUDA graphs (decode_graphs.py) bring
            systems["new, eager"] = BuiltinEngine(path, args.device, dtype, seed=0, max_batch_size=batch,
                                                  cuda_graphs=False)
        if args.old_ref:
            systems["old engine"] = old_engine_class(args.old_ref)(path, args.device, dtype, seed=0,
                                                                   max_batch_size=batch)
        systems["generate"] = Bare(path, args.device, dtype)
        rng = np.random.default_rng(0)
        for system in systems.values():  # warm-up: kernels, allocator, the new engine's cache
            throughput(system, [rng.integers(10, vocab, prompt_len).tolist() for _ in range(8)], 16, args.device)
        rows = []
        for c in concurrency:
            prompts = [rng.integers(10, vocab, prompt_len).tolist() for _ in range(c)]
            runs = interleaved(systems, args.repeats, lambda s: throughput(s, prompts, new_tokens, args.device),
                              args.max_wait)
            rows.append((f"throughput C={c}", f"{c} x {new_tokens}", runs))
            console.print(f"C={c}: " + ", ".join(f"{n} {cell(r)} tok/s" for n, r in runs.items()))
        rng = np.random.default_rng(1)  # the same episodes whatever --concurrency is
        prompts = [rng.integers(10, vocab, int(n)).tolist() for n in rng.integers(prompt_len // 2, prompt_len + 1,
                                                                                      EPISODES)]
        lengths = rng.integers(TURN_TOKENS[0], TURN_TOKENS[1] + 1, (EPISODES, TURNS))
        tools = rng.integers(10, vocab, (EPISODES, TURNS, TOOL_TOKENS))
        runs = interleaved(systems, args.repeats, lambda s: multi_turn(s, prompts, lengths, tools, args.device),
                           args.max_wait)
        rows.append((f"multi-turn {EPISODES}x{TURNS}", f"{int(lengths.sum())} tok", runs))
        waits = {}  # workload -> (sites, engine steps)
        if args.profile and args.device == "cuda":
            engine = systems["new engine"]
            wide = [rng.integers(10, vocab, prompt_len).tolist() for _ in range(concurrency[-1])]
            for name, workload in ((f"throughput C={concurrency[-1]}",
                                    lambda: throughput(engine, wide, new_tokens, "cuda")),
                                   ("multi-turn", lambda: multi_turn(engine, prompts, lengths, tools, "cuda"))):
                steps = engine.decode_steps
                waits[name] = host_wait_sites(workload), engine.decode_steps - steps
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    table = Table(title=f"Engine vs generate: {args.model} {dtype} ({device}, torch {torch.__version__}); "
                        f"tok/s mean (range of {args.repeats}); load average {load} -> {_loadavg()}")
    baselines = [s for s in systems if s != "new engine"]
    for column in ("workload", "tokens", *systems, f"wall s ({'/'.join(systems)})", *(f"new/{s}" for s in baselines),
                   "others' CPU (cores, max)"):
        table.add_column(column, justify="right")
    for name, tokens, runs in rows:
        walls = "/".join(f"{mean(run[1] for run in runs[s]):.2f}" for s in systems)
        others = max(run[2] for s in systems for run in runs[s])
        table.add_row(name, tokens, *(cell(runs[s]) for s in systems), walls,
                      *(ratio(runs["new engine"], runs[s]) for s in baselines), f"{others:.2f}")
    console.print(table)
    for name, (sites, steps) in waits.items():
        print_wait_sites(console, f"new engine, {name}", sites, ("step", steps))


def _loadavg() -> str:
    with open("/proc/loadavg") as file:
        return " ".join(file.read().split()[:3])


if __name__ == "__main__":
    main()
