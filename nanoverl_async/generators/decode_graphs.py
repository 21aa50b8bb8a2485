"""The builtin engine's decode step on CUDA (model_runner.py), captured as CUDA graphs and replayed.

    graphs = DecodeGraphs(model, tokens, lens)        # the runner's fixed-address buffers
    logits = graphs.decode(kv, table, count, length)   # = model.paged(kv, table, *Tokens(decoding=(tokens[:count],
                                                       #   lens[:count], length)).tensors(device)), replayed

Why: a decode step of a small model launches ~25 kernels per layer, each costing more on the host (Python
dispatch, launch) than on the GPU, so eager decoding is host-bound well below the GPU's speed. A graph
replays all of a step's kernels with one launch (the technique of vLLM, SGLang and gpt-fast).

How: a graph fixes its shapes and addresses, so one is captured per (batch bucket, attention length
bucket), both powers of two, lazily on first use: `count` running rows run as the next bucket of rows
(the extra rows are free rows of the block table: they compute at position 0 and write it into the null
block, which nothing reads unmasked) over `length` rounded up to a power of two (at most the table's
positions; the mask hides the positions past each row's). Inputs are read where the engine keeps them
(`tokens`, `lens`, the block table, the pool), so a replay needs no copies; weights are swapped in place
(load_state_dict), so graphs outlive swaps; a widened block table is a new tensor, so every graph is
captured again. Only the layers are captured: the head runs on the live rows alone (its
[rows, vocab] output is the step's largest tensor, and a graph would hold one per bucket).

Run alone: nothing to run; tests/test_cuda.py checks replayed decoding against a full forward on a GPU, and
tests/test_engine.py the same on the CPU with each replay emulated (`step` run again, its inputs where captured).
"""

from __future__ import annotations

from typing import Callable

import torch

from nanoverl_async.generators.kv_blocks import NULL_BLOCK
from nanoverl_async.generators.llama_forward import LlamaModel, Tokens


def bucket(n: int, limit: int) -> int:
    """The power of two >= n, at most `limit`."""
    return min(1 << (n - 1).bit_length(), limit)


class DecodeGraphs:
    """Decode steps (Q = 1) replayed from CUDA graphs, one per (rows, length) bucket of the current table."""

    def __init__(self, model: LlamaModel, tokens: torch.Tensor, lens: torch.Tensor):
        self.model = model
        self.tokens = tokens  # the runner's next_tokens
        self.lens = lens  # the runner's lens
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool shared by the graphs of one table
        self.inputs = None  # the cache and block table the graphs were captured on

    def decode(self, kv: torch.Tensor, table: torch.Tensor, count: int, length: int) -> torch.Tensor:
        """Logits [count, V] float32 of the next token of rows 0..count-1 of the block table."""
        if self.inputs is None or kv is not self.inputs[0] or table is not self.inputs[1]:
            self.graphs.clear()  # a pool whose graphs are all gone is freed: the next graphs need a new one
            self.pool, self.inputs = torch.cuda.graph_pool_handle(), (kv, table)
        key = (bucket(count, table.shape[0]), bucket(max(length, 64), table.shape[1] * kv.shape[4]))  # fewer captures
        self.lens[count:key[0]] = 0  # free rows: position 0 of the null block
        table[count:key[0], 0] = NULL_BLOCK
        if key not in self.graphs:  # the warm-up run writes the same keys and values the replay will write
            self.graphs[key] = capture(lambda: self.step(kv, table, *key), self.pool)
        graph, hidden = self.graphs[key]
        graph.replay()
        return self.model.logits(hidden[:count])

    def step(self, kv: torch.Tensor, table: torch.Tensor, rows: int, length: int) -> torch.Tensor:
        """What a graph replays: the engine's eager decode of rows 0..rows-1 over `length` positions, up to the
        head (hidden states [rows, hidden])."""
        decoding = Tokens(decoding=(self.tokens[:rows], self.lens[:rows], length))
        return self.model.paged(kv, table, *decoding.tensors(kv.device), head=False)


def capture(step: Callable[[], torch.Tensor], pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`step` captured in a CUDA graph (in `pool`) -> (the graph, the output its replays write). One eager run
    on a side stream first, as CUDA graphs need: library handles, workspaces and plans are made outside the
    capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step()
    return graph, output
