"""The paged KV cache's bookkeeping, in pure Python (no torch: the scheduler decides with it): which blocks of
the pool each row holds, how many rows share each block, which full blocks hold which prefix (by hash)
(`BlockPool`). The tensors themselves (the pool of keys and values, the block table) are model_runner.py's
`PagedCache`, which applies what the pool hands out.

    pool = BlockPool(num_blocks=1024, block_size=16)
    hashes = prefix_hashes(context, 16, seed=version_seed(3))   # one per full block of the context
    hits = pool.match(hashes)                                  # the longest cached prefix, as blocks
    if pool.fits(hits, 4):
        blocks = pool.take(hits) + pool.allocate(4)            # shared (refcounted) + own blocks
    pool.release(blocks)                                        # full blocks stay cached under their hash
    offset = pool.place(request, request.context(), seed)      # the same for a request (sequence.Request)

Each block holds `block_size` consecutive positions of one context. A block is in use (held by at least one
row: its refcount), cached (held by none, its keys and values reusable by a request whose prefix hashes
to it, until evicted), or never used yet. Invariants:
  - block 0 is the null block, never handed out: a CUDA graph's padding rows point at it and write there
    (decode_graphs.py), and the table's unused entries start there; `capacity` = num_blocks - 1 and
    `in_use()` <= capacity always;
  - hash i of a context = blake2b(hash i-1 + the token ids of block i), chained from a seed that names the
    weights version the keys and values were computed with: a block computed under other weights never
    matches (vLLM's automatic prefix caching and nano-vllm's hashes chain the same way);
  - `allocate` takes released blocks that hold no prefix first (they are released to the front of the queue,
    and after a weight swap every block is one), then never-used blocks, then the least recently released (LRU:
    a later turn of the same episode, or another group with the same system prompt, finds its prefix while it
    is fresh). So the pool's memory is reused while it is warm, and grows only with the blocks in use at once.

Run alone: nothing to run; tests/test_kv_blocks.py checks it on its own and through the engine.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from itertools import takewhile
from typing import Optional, Sequence

from nanoverl_async.validation import kv_cache_budget

NULL_BLOCK = 0
GIB = 2 ** 30


def version_seed(version: int) -> bytes:
    """The first link of the hash chains of blocks computed under weights `version`."""
    return version.to_bytes(8, "little", signed=True)


def block_hash(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of one full block: its tokens, chained after the hash of the blocks before it."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes(), digest_size=16).digest()


def prefix_hashes(tokens: Sequence[int], block_size: int, seed: bytes, known: Sequence[bytes] = ()) -> list[bytes]:
    """The hashes of the full blocks of `tokens`, continuing `known` (the hashes of its first blocks)."""
    hashes = list(known)
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        hashes.append(block_hash(hashes[-1] if hashes else seed, tokens[start:start + block_size]))
    return hashes


def pool_blocks(kv_cache_memory: float | str, free_bytes: int, block_bytes: int) -> int:
    """Blocks of `block_bytes` in the budget `generator.kv_cache_memory` (validation.kv_cache_budget): a fraction
    in (0, 1] of `free_bytes` (the device memory free once the model is loaded), or a size (4GiB, 512MiB; a
    number above 1: GiB). At least one block besides the null one. The engine replaces 0 by its default."""
    fraction, size = kv_cache_budget(kv_cache_memory)
    budget = fraction * free_bytes if fraction else size
    blocks = int(budget // block_bytes)
    if blocks < 2:
        raise ValueError(f"generator.kv_cache_memory={kv_cache_memory} is {budget / GIB:.3g} GiB: less than two "
                         f"KV blocks of {block_bytes} bytes")
    return blocks


class BlockPool:
    """Refcounts, the LRU queue of released blocks and the prefix-hash map of a pool of `num_blocks` blocks, and
    the blocks of rows: a row is a request (sequence.Request): `blocks`, `hashes` (of its context's full blocks),
    `seed` (theirs), `length()` (its tokens; all but the last sampled one are cached), `tokens(begin, end)`."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.capacity = num_blocks - 1  # block 0 is the null block
        self.fresh = 1  # blocks fresh.. have never been handed out
        self.refs: dict[int, int] = {}  # block in use -> rows holding it
        self.released: OrderedDict[int, None] = OrderedDict()  # held by no row, evicted first to last
        self.block_of: dict[bytes, int] = {}  # prefix hash -> the full block holding it
        self.hash_of: dict[int, bytes] = {}
        self.peak = 0  # the most blocks in use at once

    def in_use(self) -> int:
        return len(self.refs)

    def free(self) -> int:
        """Blocks `allocate` can hand out now (never used, or released; a cached prefix is then evicted)."""
        return self.num_blocks - self.fresh + len(self.released)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest prefix of `hashes`."""
        return list(takewhile(lambda block: block is not None, map(self.block_of.get, hashes)))

    def fits(self, hits: Sequence[int], count: int) -> bool:
        """Whether `take(hits)` then `allocate(count)` can be done (a released hit stops being free)."""
        return self.free() - sum(block in self.released for block in hits) >= count

    def take(self, blocks: Sequence[int]) -> list[int]:
        """One more holder of each of `blocks` (a shared prefix); -> `blocks`."""
        for block in blocks:
            self.refs[block] = self.refs.get(block, 0) + 1
            self.released.pop(block, None)
        self.peak = max(self.peak, len(self.refs))
        return list(blocks)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks of one holder each: released ones that hold no prefix first (nothing cached is lost,
        and their memory is warm: a never-used block costs its pages and its zeroing), then never-used ones,
        then the least recently released."""
        if count > self.free():
            raise RuntimeError(f"{count} KV blocks asked, {self.free()} free: the engine checks `fits` first")
        blocks = []
        while len(blocks) < count and self.released and next(iter(self.released)) not in self.hash_of:
            blocks.append(self.released.popitem(last=False)[0])
        fresh = range(self.fresh, min(self.fresh + count - len(blocks), self.num_blocks))
        self.fresh += len(fresh)
        blocks += fresh
        while len(blocks) < count:
            block, _ = self.released.popitem(last=False)
            self.block_of.pop(self.hash_of.pop(block, None), None)  # the prefix it held, if any, is evicted
            blocks.append(block)
        return self.take(blocks)

    def release(self, blocks: Sequence[int]) -> None:
        """One holder fewer for each of `blocks` (a row's, first to last); a block no row holds is queued for
        reuse: last if it holds a full prefix (the tail of a context first), else first."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]
                self.released[block] = None
                if block not in self.hash_of:
                    self.released.move_to_end(block, last=False)

    def register(self, key: bytes, block: int) -> None:
        """`block` is full and holds the prefix hashed to `key` (a prefix already held elsewhere keeps its block)."""
        if key not in self.block_of and block not in self.hash_of:
            self.block_of[key], self.hash_of[block] = block, key

    def forget(self) -> None:
        """Drop every prefix hash (the weights changed: no cached block can be matched again)."""
        self.block_of.clear()
        self.hash_of.clear()

    def need(self, rows: Sequence) -> int:
        """The most blocks `grow(rows)` takes."""
        size = self.block_size
        return sum((row.length() - 1) % size == 0 or self.refs[row.blocks[-1]] > 1 for row in rows)

    def grow(self, rows: Sequence, seed: bytes) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        """Running rows 0.. write their last sampled token in this step: each gets a new block where that token
        starts one, or its own copy of its last block if other rows hold it (copy on write), and a block it
        fills is registered under its prefix hash (chained from `seed`) -> (the block table's new entries
        (row, column, block), the blocks to copy (from, to)), for the runner to apply."""
        size, refs = self.block_size, self.refs
        updates, copies = [], []
        for index, row in enumerate(rows):  # every step: kept lean
            cached = row.length() - 1
            offset = cached % size
            if offset == 0 or refs[row.blocks[-1]] > 1:
                block = self.allocate(1)[0]
                if offset:  # copy on write: the last block is shared, the row writes into its own copy
                    copies.append((row.blocks.pop(), block))
                    self.release(copies[-1][:1])
                row.blocks.append(block)
                updates.append((index, cached // size, block))
            if offset == size - 1 and row.seed == seed and len(row.hashes) == (column := cached // size):
                row.hashes.append(block_hash(row.hashes[-1] if column else seed, row.tokens(cached + 1 - size,
                                                                                           cached + 1)))
                self.register(row.hashes[-1], row.blocks[column])
        return updates, copies

    def place(self, row, context: list[int], seed: bytes, most: float = float("inf")) -> Optional[int]:
        """Blocks for `row`'s context: those of its longest cached prefix (short of its last token, which is
        computed for its logits), and new ones for the rest -> the prefix's length, or None if they do not fit
        or the rest is more than `most` tokens.
        Its full blocks are registered under their hashes at once: a row placed after it in the same step reads
        them in the same forward, after each layer has written them."""
        size = self.block_size
        row.hashes = prefix_hashes(context, size, seed, row.hashes if row.seed == seed else [])
        row.seed = seed
        hits = self.match(row.hashes[: (len(context) - 1) // size])
        need = -(-len(context) // size) - len(hits)
        if len(context) - len(hits) * size > most or not self.fits(hits, need):
            return None
        row.blocks = self.take(hits) + self.allocate(need)
        for column in range(len(hits), len(row.hashes)):
            self.register(row.hashes[column], row.blocks[column])
        return len(hits) * size

    def share(self, copy, source) -> None:
        """`copy` repeats `source`'s context: it holds the same blocks."""
        copy.blocks = self.take(source.blocks)
        copy.hashes, copy.seed = list(source.hashes), source.seed

    def release_row(self, row) -> None:
        self.release(row.blocks)
        row.blocks = []
