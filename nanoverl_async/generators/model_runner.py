"""The builtin engine's tensors on the device.

Run alone: nothing to run; tests/test_engine.py drives it through the engine.
"""

from __future__ import annotations

from typing import Sequence

import torch

from nanoverl_async.generators.kv_blocks import NULL_BLOCK, BlockPool
from nanoverl_async.models.load import on_device


class PagedCache:
    """The pool's keys and values [layers, k|v, kv_heads, blocks, block_size, head_dim] (`LlamaModel.cache`) and
    the block table [rows, columns] of the running rows on the device, as `pool` (kv_blocks.BlockPool, the
    scheduler's) hands out their blocks."""

    def __init__(self, model, pool: BlockPool, rows: int, device: torch.device):
        self.pool = pool
        self.kv = model.cache(pool.num_blocks, pool.block_size)
        self.table = torch.full((rows, max(1, 256 // pool.block_size)), NULL_BLOCK, dtype=torch.long, device=device)
        self.zeroed = 0  # blocks 0..zeroed-1 are zeroed or written: garbage could be NaN, and 0 x NaN = NaN
        self.zero_fresh()

    def write(self, updates: list[tuple[int, int, int]], copies: list[tuple[int, int]]) -> None:
        """What `BlockPool.grow` decided: the blocks (from, to) rows write into their own copies of, and the block
        table's new entries (row, column, block)."""
        self.zero_fresh()
        if copies:
            source, target = on_device(torch.tensor(copies).T, self.table.device)
            self.kv[:, :, :, target] = self.kv[:, :, :, source]
        if updates:
            self._widen(max(column for _, column, _ in updates) + 1)
            index, columns, blocks = on_device(torch.tensor(updates).T, self.table.device)
            self.table[index, columns] = blocks

    def seat(self, start: int, rows: Sequence) -> None:
        """`rows` (requests: their `blocks`) become rows start.. of the block table."""
        width = max(len(row.blocks) for row in rows)
        self._widen(width)
        table = [row.blocks + [NULL_BLOCK] * (width - len(row.blocks)) for row in rows]
        self.table[start:start + len(rows), :width] = on_device(torch.tensor(table), self.table.device)

    def _widen(self, columns: int) -> None:
        """Widen the block table, doubling, to at least `columns` (a new tensor: graphs are captured again)."""
        old = self.table
        if columns > old.shape[1]:
            self.table = torch.full((old.shape[0], max(columns, 2 * old.shape[1])), NULL_BLOCK, dtype=old.dtype,
                                    device=old.device)
            self.table[:, :old.shape[1]] = old

    def zero_fresh(self) -> None:
        """Zero the blocks handed out for the first time (on the CPU, their pages are taken only now)."""
        if self.pool.fresh > self.zeroed:
            self.kv[:, :, :, self.zeroed:self.pool.fresh] = 0
            self.zeroed = self.pool.fresh
