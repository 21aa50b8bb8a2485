"""Tokens/s of `BuiltinEngine` at the scale RL runs it, beside transformers' static-cache compiled
`generate` in the same call (issue 31): Qwen2.5-0.5B and 1.5B shapes (random weights, bfloat16), 64 and 256
concurrent requests, contexts of 1k and 8k tokens, under a KV cache budget.

    python bench/engine_at_scale.py --device cuda                  # the table (one GPU; ~10 min with compiles)
    python bench/engine_at_scale.py --smoke                        # a tiny shape on the CPU: checks it runs

Workload: R requests, each a random prompt of (context - N) tokens and N new tokens forced (no stop tokens;
generate gets min_new_tokens=N), G samples per prompt (--group; 1 = no shared prefixes). The engine gets R
concurrent `generate` calls, after a warm-up pass of the same requests with 4 new tokens (CUDA graph captures,
the allocator); its columns: tok/s (generated tokens over the wall time, prefill included), the peak KV memory
(its most blocks in use x their bytes) and the pool's size, preemptions, the share of prefill tokens served
from cached blocks. generate (at the R x context cells of --generate-at) gets the R prompts as one
left-padded batch with cache_implementation="static": on CUDA it compiles the forward itself (its documented
fast path); the first call (compile included) is timed apart, the second is the row's tok/s. Its KV memory is
the static cache: R x context positions. Each shape's generate rows run before its engine is made, and free
their memory (a cell that runs out of memory says so and the table goes on).

Run alone as above; nothing imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: qwen_shape
from qwen_shape import QWEN_BODY  # noqa: E402

from nanoverl_async.agents.engine import SamplingParams  # noqa: E402
from nanoverl_async.generators.builtin_engine import BuiltinEngine  # noqa: E402

VOCAB = 151_936
MIB = 2 ** 20
SHAPES = {  # Qwen2.5's published configs; tiny: for --smoke
    "0.5b": dict(QWEN_BODY, vocab_size=VOCAB),
    "1.5b": dict(QWEN_BODY, vocab_size=VOCAB, hidden_size=1_536, intermediate_size=8_960, num_hidden_layers=28,
                 num_attention_heads=12),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
}


def shaped_model(shape: str, directory: str, device: str, dtype: torch.dtype) -> Qwen2ForCausalLM:
    """A random-weight model of `shape`, made on `device` (fast) and saved in `directory` for the engine."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(max_position_embeddings=32_768, **SHAPES[shape])).to(dtype).eval()
    model.save_pretrained(directory)
    return model


def kv_bytes_per_token(model: Qwen2ForCausalLM) -> int:
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * model.dtype.itemsize


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_generate(model, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[float, float]:
    """(compile-and-first-call s, tok/s of the second call) of static-cache generate on one left-padded batch."""
    ids = torch.tensor(prompts, device=device)  # every prompt has the same length: no padding needed
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                  top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, cache_implementation="static",
                  pad_token_id=0)
    walls = []
    for _ in range(2):
        sync(device)
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**kwargs)
        sync(device)
        walls.append(time.perf_counter() - started)
        assert out.shape == (len(prompts), len(prompts[0]) + new_tokens)
    return walls[0], len(prompts) * new_tokens / walls[1]


def run_engine(engine: BuiltinEngine, warm_up: list[list[int]], prompts: list[list[int]], new_tokens: int,
               device: str) -> dict:
    """tok/s, peak KV blocks, preemptions and prefix hits of one pass of `prompts`, after a pass of `warm_up`
    (other prompts of the same shape: the timed pass finds none of its blocks cached)."""
    async def one_pass(batch: list[list[int]], tokens: int) -> list:
        return await asyncio.gather(*(engine.generate(p, SamplingParams(tokens, 1.0)) for p in batch))

    asyncio.run(one_pass(warm_up, 4))
    engine.cache.pool.peak = engine.cache.pool.in_use()
    sync(device)
    started = time.perf_counter()
    completions = asyncio.run(one_pass(prompts, new_tokens))
    sync(device)
    wall = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for c in completions)
    assert tokens == len(prompts) * new_tokens
    # the per-request counts (engine.Completion), as the agent loop sums them for metrics.jsonl
    prefilled = sum(c.prefill_tokens for c in completions)
    return {"tok/s": tokens / wall, "peak blocks": engine.cache.pool.peak,
            "preemptions": sum(c.preemptions for c in completions),
            "prefix hit": sum(c.cached_tokens for c in completions) / max(1, prefilled)}


def workload(requests: int, context: int, new_tokens: int, group: int, vocab: int, salt: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(requests * 100_003 + context * 7 + salt)
    prompts = torch.randint(10, vocab, (-(-requests // group), context - new_tokens), generator=generator).tolist()
    return [prompts[i // group] for i in range(requests)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--requests", default="64,256")
    parser.add_argument("--contexts", default="1024,8192", help="prompt + new tokens")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--group", type=int, default=1, help="samples per prompt (they share its blocks)")
    parser.add_argument("--kv-cache-memory", default="0", help="generator.kv_cache_memory: 0.9, 40GiB (0 = auto)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=0, help="the pool in blocks instead (0: from the memory)")
    parser.add_argument("--generate-at", default="256x1024", help="RxC cells where generate runs too: all, none")
    parser.add_argument("--smoke", action="store_true", help="tiny shape, tiny sizes, CPU: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.shapes, args.requests, args.contexts, args.new_tokens = "cpu", "tiny", "4,8", "48,96", 16
        args.kv_blocks, args.block_size, args.generate_at, args.group = 40, 8, "all", 2  # 8 x 96 positions preempt
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    requests, contexts = [int(r) for r in args.requests.split(",")], [int(c) for c in args.contexts.split(",")]
    cells = [(r, c) for c in contexts for r in requests]
    generate_at = set(cells) if args.generate_at == "all" else {
        tuple(map(int, cell.split("x"))) for cell in args.generate_at.split(",") if cell not in ("", "none")}
    console, rows = Console(width=200), []
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as scratch:
            model = shaped_model(shape, scratch, args.device, dtype)
            per_token, vocab = kv_bytes_per_token(model), model.config.vocab_size
            generated = {}
            for cell in sorted(generate_at & set(cells)):
                try:
                    generated[cell] = run_generate(model, workload(*cell, args.new_tokens, 1, vocab), args.new_tokens,
                                                   args.device)
                except torch.OutOfMemoryError:
                    generated[cell] = None
                gc.collect()
                torch.cuda.empty_cache() if args.device == "cuda" else None
                console.print(f"{shape} generate {cell}: {generated[cell]}")
            del model
            gc.collect()
            torch.cuda.empty_cache() if args.device == "cuda" else None
            engine = BuiltinEngine(scratch, args.device, "bfloat16" if args.device == "cuda" else "float32",
                                   seed=0, max_batch_size=max(requests), kv_cache_memory=args.kv_cache_memory,
                                   block_size=args.block_size, num_blocks=args.kv_blocks or None)
            block_bytes = engine.model.block_bytes(args.block_size)
            for cell in cells:
                result = run_engine(engine, workload(*cell, args.new_tokens, args.group, vocab, salt=1),
                                    workload(*cell, args.new_tokens, args.group, vocab), args.new_tokens, args.device)
                console.print(f"{shape} engine {cell}: {result}")
                rows.append((shape, cell, result, generated.get(cell, "-"), block_bytes, per_token,
                             engine.cache.pool.capacity * block_bytes))
            del engine
            gc.collect()
            torch.cuda.empty_cache() if args.device == "cuda" else None
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    table = Table(title=f"Engine at scale ({device}, torch {torch.__version__}): {args.new_tokens} new tokens per "
                        f"request, {args.group} sample(s) per prompt, block {args.block_size}")
    for column in ("shape", "requests", "context", "engine tok/s", "peak KV MiB", "pool MiB", "preemptions",
                   "prefix hit", "generate tok/s", "generate compile+1st s", "static KV MiB", "engine/generate"):
        table.add_column(column, justify="right")
    for shape, (r, c), result, generated, block_bytes, per_token, pool in rows:
        gen = ("-", "-") if generated == "-" else ("OOM", "-") if generated is None else (
            f"{generated[1]:,.0f}", f"{generated[0]:.1f}")
        ratio = f"{result['tok/s'] / generated[1]:.2f}x" if generated not in ("-", None) else "-"
        peak = result["peak blocks"] * block_bytes
        table.add_row(shape, str(r), str(c), f"{result['tok/s']:,.0f}", f"{peak / MIB:,.1f}", f"{pool / MIB:,.1f}",
                      str(result["preemptions"]), f"{result['prefix hit']:.2f}", *gen,
                      f"{r * c * per_token / MIB:,.1f}", ratio)
    console.print(table)


if __name__ == "__main__":
    main()
