"""A continuous-batching sampling engine: our own forward over a transformers model's weights.

    engine = TransformersEngine(model_dir, device="cpu", dtype="float32", seed=0)
    completion = await engine.generate(prompt_ids, SamplingParams(16, 1.0, (eos_id,)))

Why continuous batching: an episode's next turn (after a tool call) must not queue behind the slowest
row of a running batch. One runner task loops over steps: one forward computes the last sampled token of
every running row and the tokens of the requests that arrived meanwhile (a prompt, or a later turn's new
tokens), laid end to end (llama_forward.py), and a token is sampled for each. A row that samples a stop
token or reaches max_new_tokens is resolved at once and leaves.
Between iterations the loop yields (`await asyncio.sleep(0)`) so ZeroMQ I/O and the episodes keep flowing.

The forward is our own (llama_forward.py: the Llama family on the HF model's own tensors, so
`load_state_dict` into `engine.model` swaps them) with a KV cache of row slots [layers, k|v, slots,
kv_heads, positions, head_dim]: the running rows hold slots 0..R-1 (a finished row's slot takes the last
row), so attention reads one view with a per-row length mask, and the cache only grows (doubling) when a
row or a length outgrows it. Lengths are not capped (as with HF, positions may pass
max_position_embeddings). One host sync per forward: the `.tolist()` of the sampled tokens and logprobs.
On CUDA each decode step replays a CUDA graph (decode_graphs.py; `cuda_graphs=False` runs it eagerly).

Turns of one episode (`episode_id`): when a row finishes, its cache is kept (the `max_batch_size` most
recent episodes). The episode's next turn starts with the same tokens plus the tool's, so it gets the
kept cache back and computes only its new tokens, instead of its whole history again. The kept cache
must be of the current weights (unless `recompute_cache_on_swap=False`, which reuses any cache anyway).
The samples of one group arrive together with the same prompt: it is computed once per admission, and the
others get its cache and logits, then sample on their own (`_copies_last`).

Sampling (the behaviour policy mu of the loss): p = softmax(logits / temperature), one draw from p with
a `torch.Generator` seeded from the config seed; logprob = log p[token], in float32.

Lockstep (run.deterministic; docs/design.md "Reproducible runs"): a row's logits depend in their last bits
on which rows share its batch, so continuous batching makes runs differ wherever tool latencies do. With
`lockstep` set (a callable: the episodes that will still call `generate`), the engine waits until every
such episode waits, admits them as one wave sorted by episode id, reseeds its generator from the wave's
make-up, and admits nothing more until the wave has finished: the same seed gives the same tokens.

Weights (docs/design.md "Weights back to generators", mode interrupt): `stage_weights` must be called on the
event-loop thread. The decode loop only yields between steps, so the new weights land between two
steps: every token sampled afterwards carries the new version, earlier tokens keep theirs. By default
the running rows' KV cache is then recomputed under the new weights (in the next step's forward), so every
logprob is exactly that of the version it is tagged with given the whole context. With
`recompute_cache_on_swap=False` the cache of earlier tokens stays, as PipelineRL does: cheaper, but the
tokens after a swap come from a mixture (old keys/values, new weights) that no learner reproduces; the
decoupled loss still uses their recorded logprobs.

Run alone: python -m nanoverl_async.generators.hf_engine MODEL_DIR   (samples a few tokens)
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM

from nanoverl_async.generators.decode_graphs import DecodeGraphs
from nanoverl_async.generators.engine import Completion, SamplingParams
from nanoverl_async.generators.llama_forward import LlamaForward, Tokens
from nanoverl_async.models import DTYPES, on_device

LOCKSTEP_POLL_S = 0.001  # how often a lockstep engine checks whether every episode is waiting
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


def _copies_last(requests: list, kept: list) -> tuple[list, list, list[int]]:
    """Requests that repeat an earlier request's prompt without a kept cache (the samples of one group arrive
    together) move after the others, with, for each, the row among the others whose prompt it repeats: the
    prompt is computed once (`_step`), as SGLang's radix cache would share it. -> (requests, kept, sources)."""
    firsts, copies, row_of = [], [], {}
    for request, reuse in zip(requests, kept):
        prompt = tuple(request.input_ids) if reuse is None else None
        if prompt is not None and prompt in row_of:
            copies.append((request, reuse, row_of[prompt]))
            continue
        if prompt is not None:
            row_of[prompt] = len(firsts)
        firsts.append((request, reuse, None))
    ordered = firsts + copies
    return [r for r, _, _ in ordered], [k for _, k, _ in ordered], [source for _, _, source in copies]


@dataclass
class _Kept:
    """A finished turn's cache, for the episode's next turn: the tokens it holds (all but the last sampled,
    which is never cached), their keys and values [layers, 2, kv_heads, tokens, head_dim], the version."""

    tokens: list[int]
    kv: torch.Tensor
    version: int


@dataclass
class _Request:
    input_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    episode_id: str = ""
    completion: Completion = field(default_factory=Completion)

    def length(self) -> int:
        """Tokens so far: the prompt and the sampled ones (all but the last are in the cache)."""
        return len(self.input_ids) + len(self.completion.token_ids)


class TransformersEngine:
    """The `Engine` protocol (engine.py) on a transformers causal LM, continuously batched."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "float32", seed: int = 0, *,
                 version: int = 0, max_batch_size: int = 256, recompute_cache_on_swap: bool = True,
                 cuda_graphs: bool = True):
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).to(self.device).eval()
        self.forward = LlamaForward(self.model, model_path)
        self.version = version
        self.max_batch_size = max_batch_size
        self.recompute_cache_on_swap = recompute_cache_on_swap
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self.seed = seed
        self.lockstep: Optional[Callable[[], int]] = None  # run.deterministic: see "Lockstep" above
        self._pending: list[_Request] = []
        self._rows: list[_Request] = []  # the running rows; row i owns cache slot i
        self._runner: Optional[asyncio.Task] = None
        self._kv: Optional[torch.Tensor] = None  # the slot cache, allocated and grown by _reserve
        self._kept: OrderedDict[str, _Kept] = OrderedDict()  # episode id -> its last turn's cache, oldest first
        self._cache_version = version  # the weights version the running rows' cache was computed with
        self._lens = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)  # cached tokens per slot
        self._next = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)  # last sampled, not cached
        self._temps = torch.ones(max_batch_size, 1, dtype=torch.float32, device=self.device)
        self._graphs = DecodeGraphs(self.forward, self._next, self._lens) if (
            cuda_graphs and self.device.type == "cuda") else None  # decode replayed from CUDA graphs
        self.decode_steps = 0  # steps (one forward each, a replayed graph's included), for metrics and tests
        self.reused_tokens = 0  # cached tokens an episode's later turns did not compute again
        self.tokens_generated = 0
        self.weight_swaps = 0

    async def generate(self, input_ids: list[int], params: SamplingParams, *,
                       episode_id: Optional[str] = None) -> Completion:
        """See engine.Engine.generate (`episode_id` orders a lockstep wave; there is one cache)."""
        if len(input_ids) == 0:
            raise ValueError("generate needs at least one input token")
        vocabulary = self.model.get_input_embeddings().num_embeddings
        if not 0 <= min(input_ids) <= max(input_ids) < vocabulary:  # one bad id would fail the whole step
            raise ValueError(f"token ids {min(input_ids)}..{max(input_ids)} are not all in the model's "
                             f"vocabulary [0, {vocabulary})")
        loop = asyncio.get_running_loop()
        request = _Request(list(input_ids), params, loop.create_future(), episode_id or "")
        if self._runner is None or self._runner.done() or self._runner.get_loop() is not loop:
            # Requests left by a loop that has gone (a previous asyncio.run) can never be answered.
            self._pending = [r for r in self._pending if r.future.get_loop() is loop]
            self._rows = []
            self._runner = loop.create_task(self._run(), name="engine-decode")
        self._pending.append(request)
        return await request.future

    def in_flight(self) -> int:
        return len(self._pending) + sum(not r.future.done() for r in self._rows)

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load `state_dict` as weights `version` now (a safe point: see the module docstring)."""
        if version < 0:
            raise ValueError(f"weight versions are >= 0, got {version}")
        self._check_fits(state_dict, version)  # before loading: a refused version leaves the model intact
        self.model.load_state_dict(state_dict, strict=False)  # in place: the forward reads the same tensors
        self.version = version
        self.weight_swaps += 1

    def _check_fits(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False)) | dict(self.model.named_buffers())
        given = {params[k].data_ptr() for k in state_dict if k in params}
        # A tied parameter (lm_head = embed_tokens) may appear once in a state dict.
        missing = [k for k, v in self.model.state_dict().items() if k not in state_dict and v.data_ptr() not in given]
        unexpected = [k for k in state_dict if k not in params]
        shapes = [k for k in state_dict if k in params and tuple(state_dict[k].shape) != tuple(params[k].shape)]
        if missing or unexpected or shapes:
            raise KeyError(f"weights version {version} do not fit the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}, wrong shape {shapes[:5]}")

    async def _run(self) -> None:
        try:
            while self._pending or self._rows:
                if self.lockstep is not None and not self._rows and len(self._pending) < self.lockstep():
                    await asyncio.sleep(LOCKSTEP_POLL_S)  # some episode is still in a tool call
                    continue
                with torch.inference_mode(), sdpa_kernel(ATTENTION_BACKENDS):
                    self._guarded(self._step)
                await asyncio.sleep(0)
        except BaseException as error:  # cancelled (its loop is closing) or a bug: no one may wait forever
            for request in self._rows + self._pending:
                if not request.future.done():
                    request.future.set_exception(error) if isinstance(error, Exception) else request.future.cancel()
            self._rows, self._pending = [], []
            raise

    def _guarded(self, step: Callable[[], None]) -> None:
        """Run `step`; if it fails, the callers of its rows get the exception, and later requests are served."""
        try:
            step()
        except Exception as error:
            for request in self._rows:
                if not request.future.done():
                    request.future.set_exception(error)
            self._rows = []

    def _step(self) -> None:
        """One forward for every running row (its last sampled token, or its whole context again if the
        weights changed under it) and for the waiting requests that fit (a prompt, or a later turn's tokens
        after its episode's kept cache), then a token sampled for each: requests join without a forward of
        their own. On CUDA the running rows' decode replays a graph, and the others follow in one forward."""
        running = len(self._rows)
        new, kept, sources = self._admissions()
        if not self._rows:
            return
        self._reserve(len(self._rows), max(r.length() for r in self._rows))
        recompute = running and self.recompute_cache_on_swap and self._cache_version != self.version
        logits, tokens = [], Tokens()
        if recompute:
            tokens.add(0, [0] * running, [r.input_ids + r.completion.token_ids for r in self._rows[:running]])
            self._lens[:running] = on_device(torch.tensor([r.length() for r in self._rows[:running]]), self.device)
        elif running:
            length = max(r.length() for r in self._rows[:running])
            if self._graphs is not None:
                logits.append(self._graphs.decode(self._kv, running, length))
            else:
                tokens = Tokens(decoding=(self._next[:running], self._lens[:running], length))
        if new:
            self._stage(running, new, kept[:len(new) - len(sources)], tokens)
        if tokens.blocks or tokens.decoding:
            logits.append(self.forward(self._kv, *tokens.tensors(self.device)))
        if running and not recompute:
            self._lens[:running] += 1
        logits = torch.cat(logits) if len(logits) > 1 else logits[0]
        for row, source in enumerate(sources, start=len(self._rows) - len(sources)):
            cached = len(self._rows[row].input_ids)
            self._kv[:, :, row, :, :cached] = self._kv[:, :, running + source, :, :cached]
            self.reused_tokens += cached
        if sources:  # the copies sample from the logits of the rows whose prompt they repeat
            logits = torch.cat([logits, logits[on_device(torch.tensor(sources) + running, self.device)]])
        self._emit(0, logits)

    def _admissions(self) -> tuple[list[_Request], list[Optional[_Kept]], list[int]]:
        """The waiting requests that fit, moved into the rows after the running ones: (them, the kept cache
        each continues, and for the copies among them the rows whose prompt they repeat: `_copies_last`)."""
        start = len(self._rows)
        if not self._pending or start >= self.max_batch_size or (self.lockstep is not None and self._rows):
            return [], [], []
        if self.lockstep is not None:
            self._pending.sort(key=lambda r: r.episode_id)
            wave = ";".join(f"{r.episode_id}:{len(r.input_ids)}" for r in self._pending)
            self._generator.manual_seed(int.from_bytes(
                hashlib.blake2b(f"{self.seed}|{wave}".encode(), digest_size=8).digest(), "little") >> 1)
        new = [r for r in self._pending[: self.max_batch_size - start] if not r.future.done()]
        del self._pending[: self.max_batch_size - start]
        new, kept, sources = _copies_last(new, [self._reusable(r) for r in new])
        self._rows += new
        return new, kept, sources

    def _stage(self, start: int, new: list[_Request], kept: list[Optional[_Kept]], tokens: Tokens) -> None:
        """New rows in slots start..: a row with a kept cache gets it back and computes only the tokens after it
        (`tokens`); the rows after len(kept) copy another's prompt (`_step` copies its cache after the forward)."""
        offsets = [len(k.tokens) if k else 0 for k in kept]
        for row, (reused, offset) in enumerate(zip(kept, offsets), start=start):
            if offset:
                self._kv[:, :, row, :, :offset] = reused.kv
        self.reused_tokens += sum(offsets)
        tokens.add(start, offsets, [r.input_ids[offset:] for r, offset in zip(new, offsets)])
        rows = slice(start, start + len(new))
        self._lens[rows] = on_device(torch.tensor([len(r.input_ids) for r in new]), self.device)
        self._temps[rows, 0] = on_device(torch.tensor([r.params.temperature for r in new], dtype=torch.float32),
                                        self.device)

    def _reusable(self, request: _Request) -> Optional[_Kept]:
        """The kept cache of the request's episode, if the request continues exactly those tokens."""
        kept = self._kept.pop(request.episode_id, None) if request.episode_id else None
        if kept is None or (self.recompute_cache_on_swap and kept.version != self.version):
            return None
        cached = len(kept.tokens)
        return kept if cached < len(request.input_ids) and request.input_ids[:cached] == kept.tokens else None

    def _reserve(self, rows: int, length: int) -> None:
        """Grow the slot cache, doubling, to at least `rows` slots of `length` positions."""
        old = self._kv
        if old is not None and rows <= old.shape[2] and length <= old.shape[4]:
            return
        slots = max(8, 1 << (rows - 1).bit_length(), old.shape[2] if old is not None else 0)
        positions = max(64, 1 << (length - 1).bit_length(), old.shape[4] if old is not None else 0)
        self._kv = self.forward.cache(min(slots, self.max_batch_size), positions)
        if old is not None:
            self._kv[:, :, : old.shape[2], :, : old.shape[4]] = old

    def _emit(self, start: int, logits: torch.Tensor) -> None:
        """Sample a token for rows start.. from `logits`, record it, resolve finished rows, compact."""
        end = len(self._rows)
        tokens, logprobs = sample_tokens(logits, self._temps[start:end], self._generator)
        self._next[start:end] = tokens
        self._cache_version = self.version
        self.decode_steps += 1
        self.tokens_generated += end - start
        sampled, logps = torch.stack((tokens.double(), logprobs.double())).tolist()  # the step's one host sync
        done = []
        for row, token, logprob in zip(range(start, end), sampled, logps):
            request, token = self._rows[row], int(token)
            completion = request.completion
            completion.token_ids.append(token)
            completion.logprobs.append(logprob)
            completion.versions.append(self.version)
            if token in request.params.stop_token_ids:
                completion.finish_reason = "stop"
            elif len(completion.token_ids) >= request.params.max_new_tokens:
                completion.finish_reason = "length"
            if completion.finish_reason or request.future.done():  # done here = the caller was cancelled
                if not request.future.done():
                    self._keep(request, row)
                    request.future.set_result(completion)
                done.append(row)
        if done:
            self._compact(done)

    def _keep(self, request: _Request, row: int) -> None:
        """Keep a finished row's cache for its episode's next turn (the max_batch_size most recent episodes)."""
        if not request.episode_id:
            return
        cached = request.length() - 1
        self._kept[request.episode_id] = _Kept(request.input_ids + request.completion.token_ids[:-1],
                                               self._kv[:, :, row, :, :cached].clone(), self.version)
        self._kept.move_to_end(request.episode_id)
        while len(self._kept) > self.max_batch_size:
            self._kept.popitem(last=False)

    def _compact(self, done: list[int]) -> None:
        """Drop finished rows; the last running rows move into their slots, so rows stay in 0..R-1."""
        keep, gone = len(self._rows) - len(done), set(done)
        holes = [row for row in done if row < keep]
        movers = [row for row in range(keep, len(self._rows)) if row not in gone]
        if holes:
            length = max(self._rows[row].length() for row in movers)
            dst, src = (on_device(torch.tensor(rows), self.device) for rows in (holes, movers))
            self._kv[:, :, dst, :, :length] = self._kv[:, :, src, :, :length]
            for buffer in (self._lens, self._next, self._temps):
                buffer[dst] = buffer[src]
            for hole, mover in zip(holes, movers):
                self._rows[hole] = self._rows[mover]
        del self._rows[keep:]


async def _demo(model_path: str) -> None:
    engine = TransformersEngine(model_path)
    prompts = [[1, 2, 3], [4, 5], [6]]
    completions = await asyncio.gather(*(engine.generate(p, SamplingParams(8, 1.0)) for p in prompts))
    for prompt, completion in zip(prompts, completions):
        print(prompt, "->", completion)


if __name__ == "__main__":
    asyncio.run(_demo(sys.argv[1]))
