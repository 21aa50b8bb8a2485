"""A continuous-batching sampling engine: our own forward over a transformers checkpoint's weights.

    engine = TransformersEngine(model_dir, device="cpu", dtype="float32", seed=0)
    completion = await engine.generate(prompt_ids, SamplingParams(16, 1.0, (eos_id,)))

Why continuous batching: an episode's next turn (after a tool call) must not queue behind the slowest row of a
running batch. One runner task loops over steps: one forward computes the last sampled token of every running row
and the tokens of the requests that arrived meanwhile (a prompt, or a later turn's new tokens), laid end to end
(llama_forward.py), and a token is sampled for each. A row that samples a stop token or reaches max_new_tokens is
resolved at once and leaves. Between iterations the loop yields (`await asyncio.sleep(0)`) so ZeroMQ I/O and the
episodes keep flowing.

The forward is our own (llama_forward.py: the Llama family on the checkpoint's tensors under their transformers
names, `engine.model`, read without transformers' model classes; `load_state_dict` into it swaps them). One host
sync per forward: the `.tolist()` of the sampled tokens and logprobs. On CUDA each decode step replays a CUDA graph
(decode_graphs.py; `cuda_graphs=False` runs it eagerly).

Paged KV cache (kv_blocks.py; the design of vLLM and nano-vllm). One pool of `block_size`-position blocks,
allocated once, its size from `kv_cache_memory` (generator.kv_cache_memory: a fraction in (0, 1] of the device
memory free after the model loads, or a size such as "4GiB", a number above 1 being GiB; 0 = 0.5 on CUDA, 2GiB on
the CPU, whose pages are taken only as blocks are first used). Running rows are 0..R-1 of a block table: row r's
position p lies in block table[r, p // block_size].
A request is admitted, in arrival order, while a row and blocks for its context are free and the step computes at
most `prefill_tokens` for the requests it admits; each step, a row whose next token starts a block gets one, and
while the pool is short the most recently admitted rows are preempted: their blocks released, they go back to the
front of the queue with their tokens so far and are computed again (prompt and sampled tokens, under the current
weights) when admitted; the tokens they sampled keep their versions and logprobs. A request the whole pool cannot
hold (prompt + max_new_tokens - 1 positions: the last sampled token is never cached) is refused at once, and a row
that outgrew that check (a bug) fails when it is next admitted instead of waiting forever for room. Lengths are not
capped otherwise (as with HF, positions may pass max_position_embeddings).

Shared prefixes. Each full block is registered under the hash of its prefix (kv_blocks.prefix_hashes, chained from
the weights version): a request's context reuses the blocks of its longest registered prefix (its last token is
always computed, for its logits) and computes the rest. That serves an episode's later turn (its earlier turns'
blocks, released to an LRU queue, stay until evicted), another group with the same system prompt, and rows
recomputed after a preemption. Requests admitted together with the same context (the G samples of a group) compute
it once: the copies hold the same blocks (refcounts) and sample from the same logits; a row about to write into a
block other rows hold copies it first (copy on write). Each `Completion` counts its prefill tokens, those served
from cache and its preemptions; `cow_copies` and `cache.pool.peak` count the engine's (tests and benchmarks read
them).

Sampling (the behaviour policy mu of the loss): p = softmax(logits / temperature), one draw from p with a
`torch.Generator` seeded from the config seed; logprob = log p[token], in float32.

Lockstep (run.deterministic; docs/design.md "Reproducible runs"): a row's logits depend in their last bits on which
rows share its batch, so continuous batching makes runs differ wherever tool latencies do. With `lockstep` set (a
callable: the episodes that will still call `generate`), the engine waits until every such episode waits, admits
them as one wave sorted by episode id, reseeds its generator from the wave's make-up, and admits nothing more until
the wave has finished: the same seed gives the same tokens.

Weights (docs/design.md "Weights back to generators", mode interrupt): `stage_weights` must be called on the
event-loop thread, a bucket at a time; from a version's first bucket to its last (`loading`) the runner computes
nothing. The decode loop only yields between steps, so the new weights land between two steps: every
token sampled afterwards carries the new version, earlier tokens keep theirs. The running rows are then computed
again under the new weights (they are put back at the front of the queue, and no block of the old weights can
match), so every logprob is exactly that of the version it is tagged with given the whole context. (Keeping the
old keys/values, as PipelineRL does, is cheaper, but the tokens after a swap then come from a mixture of old
keys/values and new weights that no learner reproduces.)

Run alone: nothing to run; tests/test_engine.py and tests/test_kv_blocks.py drive it on tiny models."""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

import psutil
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanoverl_async.generators.decode_graphs import DecodeGraphs
from nanoverl_async.generators.engine import Completion, SamplingParams
from nanoverl_async.generators.kv_blocks import BlockPool, pool_blocks
from nanoverl_async.generators.llama_forward import LlamaModel, Tokens
from nanoverl_async.generators.model_runner import PagedCache
from nanoverl_async.generators.scheduler import Admission, Scheduler
from nanoverl_async.generators.sequence import Request
from nanoverl_async.models.load import DTYPES, on_device
from nanoverl_async.models.lora import MergedAdapters, gathered
from nanoverl_async.validation import kv_cache_budget

LOCKSTEP_POLL_S = 0.001  # how often a lockstep engine checks whether every episode is waiting
DEFAULT_KV_MEMORY = {"cuda": 0.5, "cpu": "2GiB"}  # kv_cache_memory=0: half the free GPU memory; on the CPU a size
# cuDNN's attention, which torch prefers on Hopper GPUs, builds a new plan for each new sequence length
# (pytorch/pytorch#155958), and the engine meets new lengths at every eager step: it uses the others.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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


class TransformersEngine:
    """The `Engine` protocol (engine.py) on a transformers causal LM, continuously batched."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "float32", seed: int = 0, *,
                 max_batch_size: int = 256, cuda_graphs: bool = True, kv_cache_memory: float | str = 0.0,
                 block_size: int = 16, num_blocks: Optional[int] = None, prefill_tokens: int = 8192,
                 lora_scaling: float = 0.0):
        """`num_blocks` (tests, benchmarks) sizes the pool in blocks instead of `kv_cache_memory`;
        `prefill_tokens` bounds the tokens a step computes for the requests it admits (a longer context is
        admitted alone): the activations of 256 8k-token prompts in one forward would not fit a GPU.
        `lora_scaling` > 0 (learner.lora): a version holds LoRA adapters, merged into the weights at this scale."""
        self.device = torch.device(device)
        self.model = LlamaModel(model_path, self.device, DTYPES[dtype])
        self.adapters = MergedAdapters(dict(self.model.named_parameters()), lora_scaling) if lora_scaling else None
        self.version = 0
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._runner: Optional[asyncio.Task] = None
        self.loading: Optional[int] = None  # the version whose buckets `stage_weights` is loading, until its last
        self._loaded: set[int] = set()  # the parameters (data pointers) it loaded so far
        self._adapter_parts: dict[str, torch.Tensor] = {}  # with LoRA, the loading version's adapters so far
        if num_blocks is None:
            auto = kv_cache_budget(kv_cache_memory) == (0, 0)  # 0, also when written "0" or 0.0
            budget = DEFAULT_KV_MEMORY[self.device.type] if auto else kv_cache_memory
            free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else \
                psutil.virtual_memory().available  # bytes free once the model is loaded
            num_blocks = pool_blocks(budget, free, self.model.block_bytes(block_size))
        self.cache = PagedCache(self.model, BlockPool(num_blocks, block_size), max_batch_size, self.device)
        self.scheduler = Scheduler(self.cache.pool, max_batch_size, prefill_tokens, seed)
        self._lens = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)  # cached tokens per row
        self._next = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)  # last sampled, not cached
        self._temps = torch.ones(max_batch_size, 1, dtype=torch.float32, device=self.device)
        self._graphs = DecodeGraphs(self.model, self._next, self._lens) if (
            cuda_graphs and self.device.type == "cuda") else None  # decode replayed from CUDA graphs
        # Counters, for tests and benchmarks: steps (one forward each, a replayed graph's included); shared blocks
        # copied before a row wrote into them (the per-request counts are each Completion's).
        self.decode_steps = self.cow_copies = 0

    @property
    def lockstep(self) -> Optional[Callable[[], int]]:
        """run.deterministic: the episodes that will still call `generate` (see "Lockstep" above)."""
        return self.scheduler.lockstep

    @lockstep.setter
    def lockstep(self, live: Optional[Callable[[], int]]) -> None:
        self.scheduler.lockstep = live

    @property
    def _rows(self) -> list[Request]:
        """The running rows (tests watch them between steps)."""
        return self.scheduler.running

    async def generate(self, input_ids: list[int], params: SamplingParams, *,
                       episode_id: Optional[str] = None) -> Completion:
        """See engine.Engine.generate (`episode_id` orders a lockstep wave; prefixes are found by hash)."""
        if len(input_ids) == 0:
            raise ValueError("generate needs at least one input token")
        vocabulary = self.model.config.vocab_size
        if not 0 <= min(input_ids) <= max(input_ids) < vocabulary:  # one bad id would fail the whole step
            raise ValueError(f"token ids {min(input_ids)}..{max(input_ids)} are not all in the model's "
                             f"vocabulary [0, {vocabulary})")
        unfit = self.scheduler.unfit(len(input_ids), f"max_new_tokens={params.max_new_tokens}",
                                     len(input_ids) + params.max_new_tokens - 1)  # the last sampled token is never cached
        if unfit:
            raise ValueError(unfit)
        loop = asyncio.get_running_loop()
        request = Request(list(input_ids), params, loop.create_future(), episode_id or "")
        if self._runner is None or self._runner.done() or self._runner.get_loop() is not loop:
            self.scheduler.drop_loop(loop)
            self._runner = loop.create_task(self._run(), name="engine-decode")
        self.scheduler.add(request)
        return await request.future

    def in_flight(self) -> int:
        return self.scheduler.in_flight()

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int, bucket: tuple[int, int] = (0, 1)
                      ) -> None:
        """Load `state_dict`, bucket (index, count) of weights `version`, now (a safe point: see the module
        docstring). The worker stages only versions newer than the engine's, so they are >= 0. With LoRA the
        buckets hold the version's adapters, kept until the last one and then merged into the base weights
        (models/lora.py), since a layer's A and B may lie in two buckets."""
        index, count = bucket
        if index == 0:
            self.loading, self._loaded = version, set()
        elif self.loading != version:
            raise ValueError(f"weights version {version} bucket {index} of {count} without its earlier buckets "
                             f"(loading {self.loading})")
        if self.adapters is None:
            self._load(state_dict, version, index, count)
        elif (adapters := gathered(self._adapter_parts, state_dict, bucket)) is not None:
            self.adapters.merge(adapters)  # checked first: refused adapters leave the model as it was
        if index == count - 1:
            self.version, self.loading = version, None
            self.scheduler.new_weights(version)

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

    async def _run(self) -> None:
        scheduler = self.scheduler
        try:
            while scheduler.waiting or scheduler.running:
                # a version's buckets partly loaded (no step may mix two), or a lockstep wave not all waiting yet
                if self.loading is not None or scheduler.waits_for_wave():
                    await asyncio.sleep(LOCKSTEP_POLL_S)
                    continue
                with torch.inference_mode(), sdpa_kernel(ATTENTION_BACKENDS):
                    try:
                        self._step()
                    except Exception as error:  # the callers of its rows get it; later requests are served
                        scheduler.fail(scheduler.running, error)
                await asyncio.sleep(0)
        except BaseException as error:  # cancelled (its loop is closing) or a bug: no one may wait forever
            scheduler.fail(scheduler.running + scheduler.waiting, error)
            scheduler.waiting = []
            raise

    def _step(self) -> None:
        """One forward for every running row (its last sampled token) and for the waiting requests that fit
        (their context after its cached prefix), then a token sampled for each: requests join without a
        forward of their own. On CUDA the running rows' decode replays a graph, and the others follow in one
        forward."""
        while self.scheduler.short_of_blocks():  # the last rows wait for blocks to free
            self._requeue(1, preempted=True)
        updates, copies = self.scheduler.grow()
        self.cache.write(updates, copies)
        self.cow_copies += len(copies)
        running = len(self._rows)
        new, offsets, sources, _ = self._admissions()
        self.cache.zero_fresh()
        if not self._rows:
            return
        logits, tokens = [], Tokens()
        if running:
            length = max(r.length() for r in self._rows[:running])
            if self._graphs is not None:
                logits.append(self._graphs.decode(self.cache.kv, self.cache.table, running, length))
            else:
                tokens = Tokens(decoding=(self._next[:running], self._lens[:running], length))
        # New rows: their tokens past their cached prefix, then their block tables, lengths and temperatures
        # (set after a graph's replay has read the free rows)
        if new:
            tokens.add(running, offsets, [r.context()[offset:] for r, offset in zip(new, offsets)], sources)
            self.cache.seat(running, new)
            rows = slice(running, running + len(new))
            self._lens[rows] = on_device(torch.tensor([r.length() for r in new]), self.device)
            self._temps[rows, 0] = on_device(torch.tensor([r.params.temperature for r in new], dtype=torch.float32),
                                            self.device)
        if tokens.spans:
            logits.append(self.model.paged(self.cache.kv, self.cache.table, *tokens.tensors(self.device)))
        if running:
            self._lens[:running] += 1
        self._emit(torch.cat(logits) if len(logits) > 1 else logits[0])

    def _requeue(self, count: int, preempted: bool = False) -> None:
        """Scheduler.requeue (tests watch the preemptions here)."""
        self.scheduler.requeue(count, preempted)

    def _admissions(self) -> Admission:
        """Scheduler.admit, and a lockstep wave's sampler reseeded (tests watch the admissions here)."""
        admission = self.scheduler.admit()
        if admission.wave_seed is not None:
            self._generator.manual_seed(admission.wave_seed)
        return admission

    def _emit(self, logits: torch.Tensor) -> None:
        """Sample a token for every row from `logits`, record it, resolve finished rows and drop them (their
        blocks released): the last running rows move into their places in the table, so rows stay in 0..R-1."""
        rows = len(self._rows)
        tokens, logprobs = sample_tokens(logits, self._temps[:rows], self._generator)
        self._next[:rows] = tokens
        self.decode_steps += 1
        sampled, logps = torch.stack((tokens.double(), logprobs.double())).tolist()  # the step's one host sync
        holes, movers = self.scheduler.postprocess([int(token) for token in sampled], logps, self.version)
        if holes:
            dst, src = (on_device(torch.tensor(rows), self.device) for rows in (holes, movers))
            for buffer in (self._lens, self._next, self._temps, self.cache.table):
                buffer[dst] = buffer[src]
