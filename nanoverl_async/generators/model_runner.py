"""The builtin engine's model runner: everything on the device. A step lays out the rows' new tokens end to end
(llama_forward.Tokens), runs the forward (llama_forward.LlamaModel; on CUDA the running rows' decode replays a
CUDA graph, decode_graphs.py), samples a token for each row and hands tokens and logprobs back as host lists:
the step's one host sync. It holds the pool of keys and values and the block table (`PagedCache`), which follow
what the scheduler's block pool decided, and loads weights in place.

    runner = ModelRunner(model_dir, "cpu", "float32", seed=0, rows=256, block_size=16)   # runner.cache.pool
    runner.cache.write(*scheduler.grow())
    running = len(scheduler.running)                          # these decode; the admitted rows follow
    tokens, logprobs = runner.step(scheduler.running, running, scheduler.admit())
    runner.compact(*scheduler.postprocess(tokens, logprobs, version))

Why apart from the scheduler (scheduler.py): it decides in Python on requests, this moves tensors; on a GPU
each host sync here would stall the next step's kernels (tests/test_engine.py checks there is one).
Run alone: nothing to run; tests/test_engine.py drives it through the engine.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Sequence

import psutil
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanoverl_async.generators.decode_graphs import DecodeGraphs
from nanoverl_async.generators.kv_blocks import NULL_BLOCK, BlockPool, pool_blocks
from nanoverl_async.generators.llama_forward import LlamaModel, Tokens
from nanoverl_async.generators.scheduler import Admission
from nanoverl_async.generators.sequence import Request
from nanoverl_async.models.host_allocator import tune_host_allocator
from nanoverl_async.models.load import DTYPES, on_device
from nanoverl_async.models.lora import MergedAdapters, gathered
from nanoverl_async.validation import kv_cache_budget

DEFAULT_KV_MEMORY = {"cuda": 0.5, "cpu": "2GiB"}  # kv_cache_memory=0: half the free GPU memory; on the CPU a size
# cuDNN's attention, which torch prefers on Hopper GPUs, builds a new plan for each new sequence length
# (pytorch/pytorch#155958), and the engine meets new lengths at every eager step: it uses the others.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextmanager
def computing():
    """What a step runs under: no autograd, and attention without cuDNN (ATTENTION_BACKENDS)."""
    with torch.inference_mode(), sdpa_kernel(ATTENTION_BACKENDS):
        yield


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator):
    """logits [R, V] float32, temperatures [R, 1] -> (tokens [R] int64, logprobs [R] float32).

    The logprob is of the distribution actually sampled, softmax(logits / T), so that it is the
    behaviour probability mu of the importance-corrected loss.
    """
    logprobs = torch.log_softmax(logits / temperatures, dim=-1)
    # The draw: argmax p / E with E ~ Exp(1) picks i with probability p_i (torch.multinomial does the
    # same, with noise that costs 3x as much on CPU).
    clocks = torch.rand(logprobs.shape, generator=generator, device=logprobs.device).log_().neg_()
    tokens = (logprobs.exp() / clocks).argmax(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class ModelRunner:
    """The model, its KV cache and the per-row buffers of one engine: rows 0..R-1 of the block table are the
    scheduler's running rows, in its order."""

    def __init__(self, model_path: str, device: str, dtype: str, seed: int, *, rows: int, block_size: int,
                 num_blocks: Optional[int] = None, kv_cache_memory: float | str = 0.0, cuda_graphs: bool = True,
                 lora_scaling: float = 0.0):
        """The pool holds `num_blocks` blocks, or as many as `kv_cache_memory` (generator.kv_cache_memory) of the
        memory free once the model is loaded; `lora_scaling` > 0: versions are LoRA adapters (models/lora.py)."""
        self.device = torch.device(device)
        self.model = LlamaModel(model_path, self.device, DTYPES[dtype])
        tune_host_allocator(self.device)  # an engine's steps allocate the same few sizes, whatever the model
        self.adapters = MergedAdapters(dict(self.model.named_parameters()), lora_scaling) if lora_scaling else None
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._loaded: set[int] = set()  # the parameters (data pointers) the loading version has loaded so far
        self._adapter_parts: dict[str, torch.Tensor] = {}  # with LoRA, the loading version's adapters so far
        if num_blocks is None:
            auto = kv_cache_budget(kv_cache_memory) == (0, 0)  # 0, also when written "0" or 0.0
            budget = DEFAULT_KV_MEMORY[self.device.type] if auto else kv_cache_memory
            free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else \
                psutil.virtual_memory().available  # bytes free once the model is loaded
            num_blocks = pool_blocks(budget, free, self.model.block_bytes(block_size))
        self.cache = PagedCache(self.model, BlockPool(num_blocks, block_size), rows, self.device)
        self.lens = torch.zeros(rows, dtype=torch.long, device=self.device)  # cached tokens per row
        self.next_tokens = torch.zeros(rows, dtype=torch.long, device=self.device)  # last sampled, not cached
        self.temps = torch.ones(rows, 1, dtype=torch.float32, device=self.device)
        self.graphs = DecodeGraphs(self.model, self.next_tokens, self.lens) if (
            cuda_graphs and self.device.type == "cuda") else None  # decode replayed from CUDA graphs

    def step(self, rows: Sequence[Request], running: int, admission: Admission) -> tuple[list[int], list[float]]:
        """One forward for rows 0..running-1 (each its last sampled token) and the rows the scheduler admitted
        after them (their context past its cached prefix), then a token sampled for every row of `rows` ->
        (tokens, logprobs) on the host."""
        self.cache.zero_fresh()  # the blocks placed for the admitted rows
        logits = self._logits(rows, running, admission)
        tokens, logprobs = sample_tokens(logits, self.temps[:len(rows)], self.generator)
        self.next_tokens[:len(rows)] = tokens
        sampled, logps = torch.stack((tokens.double(), logprobs.double())).tolist()  # the step's one host sync
        return [int(token) for token in sampled], logps

    def _logits(self, rows: Sequence[Request], running: int, admission: Admission) -> torch.Tensor:
        """The logits [len(rows), V] of each row's next token: on CUDA the running rows' decode replays a graph,
        and the admitted rows follow in one forward; else all in one."""
        logits, tokens = [], Tokens()
        if running:
            length = max(r.length() for r in rows[:running])
            if self.graphs is not None:
                logits.append(self.graphs.decode(self.cache.kv, self.cache.table, running, length))
            else:
                tokens = Tokens(decoding=(self.next_tokens[:running], self.lens[:running], length))
        # New rows: their tokens past their cached prefix, then their block tables, lengths and temperatures
        # (set after a graph's replay has read the free rows)
        new, offsets = admission.requests, admission.offsets
        if new:
            tokens.add(running, offsets, [r.context()[offset:] for r, offset in zip(new, offsets)], admission.sources)
            self.cache.seat(running, new)
            seated = slice(running, running + len(new))
            self.lens[seated] = on_device(torch.tensor([r.length() for r in new]), self.device)
            self.temps[seated, 0] = on_device(torch.tensor([r.params.temperature for r in new], dtype=torch.float32),
                                              self.device)
        if tokens.spans:
            logits.append(self.model.paged(self.cache.kv, self.cache.table, *tokens.tensors(self.device)))
        if running:
            self.lens[:running] += 1
        return torch.cat(logits) if len(logits) > 1 else logits[0]

    def compact(self, holes: list[int], movers: list[int]) -> None:
        """Rows `movers` of the buffers and the block table move into rows `holes`, as the scheduler's did."""
        if holes:
            dst, src = (on_device(torch.tensor(rows), self.device) for rows in (holes, movers))
            for buffer in (self.lens, self.next_tokens, self.temps, self.cache.table):
                buffer[dst] = buffer[src]

    def load(self, state_dict: dict[str, torch.Tensor], version: int, bucket: tuple[int, int]) -> None:
        """Bucket (index, count) of weights `version` into the model, in place; with LoRA the buckets hold the
        version's adapters, kept until the last one and then merged into the base weights (models/lora.py),
        since a layer's A and B may lie in two buckets."""
        index, count = bucket
        if index == 0:
            self._loaded = set()
        if self.adapters is None:
            self._load(state_dict, version, index, count)
        elif (adapters := gathered(self._adapter_parts, state_dict, bucket)) is not None:
            self.adapters.merge(adapters)  # checked first: refused adapters leave the model as it was

    def _load(self, state_dict: dict[str, torch.Tensor], version: int, index: int, count: int) -> None:
        """Bucket `index` of `count` of a whole state dict into the model, in place, checked before loading: a
        refused bucket leaves the model as it was (mixed, if an earlier bucket of this version is in: the engine
        then decodes nothing until a whole version is)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        unexpected = [k for k in state_dict if k not in params]
        shapes = [k for k in state_dict if k in params and tuple(state_dict[k].shape) != tuple(params[k].shape)]
        loaded = self._loaded | {params[k].data_ptr() for k in state_dict if k in params}
        # A tied parameter (lm_head = embed_tokens) may appear once in a state dict.
        missing = [k for k, v in params.items() if v.data_ptr() not in loaded] if index == count - 1 else []
        if missing or unexpected or shapes:
            raise KeyError(f"weights version {version} do not fit the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}, wrong shape {shapes[:5]}")
        self.model.load_state_dict(state_dict, strict=False)  # in place: the forward reads the same tensors
        self._loaded = loaded


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
