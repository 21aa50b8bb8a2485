"""The engine's attention choices, timed one against another on one device (one layer's call each).

    python bench/attention_kernels.py [--device cuda]

Shapes of Qwen2.5-0.5B's attention (14 query heads sharing 2 kv heads of 64): a decode step (one query per row
over its blocks of the paged cache, gathered through a block table as `llama_forward` does: the gather is in
every variant's time, and timed alone) and a span of prompts. Variants: SDPA with grouped heads under
the engine's backends (model_runner.ATTENTION_BACKENDS: no cuDNN), SDPA with torch's default backends (cuDNN first
on Hopper), SDPA over the kv heads repeated (`_expanded_sdpa`, the engine's for blocks of queries on CUDA) and the
grouped matmuls (`_one_query_attention`, the engine's for decode). On CUDA each is also captured in a CUDA graph
and replayed, as the engine's decode step is (decode_graphs.py). Prints ms per call and each variant's largest
difference from the first. On an H200 (2026-11-27) this showed why the engine's decode had lost 5x: without
cuDNN, SDPA given a mask and grouped heads fell back to its math kernel.
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

import torch
from rich.console import Console
from rich.table import Table
from torch.nn.attention import sdpa_kernel

from nanoverl_async.generators.decode_graphs import capture
from nanoverl_async.generators.model_runner import ATTENTION_BACKENDS
from nanoverl_async.generators.llama_forward import _expanded_sdpa, _gqa_sdpa, _one_query_attention

HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64
BLOCK = 16  # positions per KV block (generator.kv_block_size's default)
# (name, rows, queries per row, attended positions), on CUDA and on the CPU
SHAPES = {"cuda": [("decode, 256 rows x 512", 256, 1, 512), ("decode, 64 rows x 8k", 64, 1, 8192),
                   ("64 prompts x 128", 64, 128, 128)],
          "cpu": [("decode, 64 rows x 128", 64, 1, 128), ("8 prompts x 32", 8, 32, 32)]}


def inputs(device: str, dtype: torch.dtype, rows: int, width: int, length: int):
    """q [rows, heads, width, d] (a transposed view, as the engine's), the pool [k|v, kv_heads, blocks, BLOCK, d]
    (twice the blocks the rows hold), the rows' blocks (a random block table, flat) and the additive mask
    [rows, 1, width, length] of rows at random lengths."""
    q = torch.randn(rows, width, HEADS, HEAD_DIM, device=device, dtype=dtype).transpose(1, 2)
    columns = -(-length // BLOCK)
    pool = torch.randn(2, KV_HEADS, 2 * rows * columns, BLOCK, HEAD_DIM, device=device, dtype=dtype)
    table = torch.randperm(2 * rows * columns, device=device)[: rows * columns]
    lens = torch.randint(max(width, length // 2), length + 1, (rows,), device=device)
    at = (lens[:, None] - width + torch.arange(width, device=device))[..., None]
    mask = torch.where(torch.arange(columns * BLOCK, device=device) <= at, 0.0, float("-inf")).to(dtype)[:, None]
    return q, pool, table, mask


def gathered(pool: torch.Tensor, table: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows' keys and values [k|v, kv_heads, rows, positions, d], as llama_forward gathers them."""
    return pool.index_select(2, table).view(2, KV_HEADS, rows, -1, HEAD_DIM)


def per_call_ms(call, device: str, repeats: int = 20) -> float:
    for _ in range(3):
        call()
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats * 1e3


def replayed_ms(call) -> str:
    """ms per replay of `call` captured as the engine captures its decode step, or why it could not be."""
    try:
        graph, _ = capture(call)
    except RuntimeError as error:
        return f"not captured: {str(error).splitlines()[0][:60]}"
    return f"{per_call_ms(graph.replay, 'cuda'):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=sorted(SHAPES))
    device = parser.parse_args().device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    table = Table(title=f"Attention per layer call, {HEADS} query heads on {KV_HEADS} kv heads of {HEAD_DIM} "
                        f"({name}, {dtype}, torch {torch.__version__})")
    for column in ("shape", "variant", "ms", *(["ms, replayed graph"] if device == "cuda" else []), "max |diff|"):
        table.add_column(column, justify="right")
    for label, rows, width, length in SHAPES[device]:
        q, pool, blocks, mask = inputs(device, dtype, rows, width, length)

        def by_rows(attention):  # the SDPA variants take [rows, kv_heads, positions, d]
            return lambda q, k, v, attn_mask: attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=attn_mask)

        variants = [("SDPA, grouped heads, engine's backends", by_rows(_gqa_sdpa), ATTENTION_BACKENDS),
                    ("SDPA, grouped heads, torch's default", by_rows(_gqa_sdpa), None),
                    ("SDPA, kv heads repeated (_expanded_sdpa)", by_rows(_expanded_sdpa), ATTENTION_BACKENDS)]
        if width == 1:
            variants.append(("grouped matmuls (_one_query_attention)", _one_query_attention, ATTENTION_BACKENDS))
        reference = None
        for variant, attention, backends in variants:
            with torch.inference_mode(), sdpa_kernel(backends) if backends else nullcontext():
                def call():
                    cached = gathered(pool, blocks, rows)
                    return attention(q, cached[0], cached[1], attn_mask=mask)

                out = call().float()
                reference = out if reference is None else reference
                timings = [f"{per_call_ms(call, device):.3f}", *([replayed_ms(call)] if device == "cuda" else [])]
            table.add_row(label, variant, *timings, f"{(out - reference).abs().max().item():.1e}")
        with torch.inference_mode():
            def gather():
                return gathered(pool, blocks, rows)

            timings = [f"{per_call_ms(gather, device):.3f}", *([replayed_ms(gather)] if device == "cuda" else [])]
        table.add_row(label, "the gather through the block table alone", *timings, "-")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
