"""A batched sampling engine on plain transformers: our own decode loop with a KV cache.

    engine = TransformersEngine(model_dir, device="cpu", dtype="float32", seed=0)
    completion = await engine.generate(prompt_ids, SamplingParams(16, 1.0, (eos_id,)))

How it batches: `generate` queues a request and awaits its future. One runner task takes every queued
request (up to `max_batch_size`) as one batch, left-pads it (attention mask 0 on the padding,
position_ids = cumsum(mask) - 1), prefills it into a `DynamicCache` and decodes one token per step for
all rows. A row that samples one of its stop tokens or reaches its max_new_tokens is resolved at once
(its episode can call a tool meanwhile) and compacted out of the batch and the cache. Requests that
arrive while a batch runs wait for the next batch. Between decode steps the loop yields to the event
loop (`await asyncio.sleep(0)`) so ZeroMQ I/O and the other episodes keep flowing.

Sampling (the behaviour policy mu of the loss): p = softmax(logits / temperature), one draw from p with
a `torch.Generator` seeded from the config seed; logprob = log p[token], in float32.

Weights (docs/design.md "Weights back to generators", mode interrupt): `stage_weights` must be called on the
event-loop thread. The decode loop only yields between steps, so the new weights land between two
steps: every token sampled afterwards carries the new version, earlier tokens keep theirs. By default
the running batch's KV cache is then recomputed under the new weights (one prefill per swap), so every
logprob is exactly that of the version it is tagged with given the whole context. With
`recompute_cache_on_swap=False` the cache of earlier tokens stays, as PipelineRL does: cheaper, but the
tokens after a swap come from a mixture (old keys/values, new weights) that no learner reproduces; the
decoupled loss still uses their recorded logprobs.

Run alone: python -m nanoverl_async.generators.hf_engine MODEL_DIR   (samples a few tokens)
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from nanoverl_async.generators.engine import Completion, SamplingParams
from nanoverl_async.models import DTYPES



def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator):
    """logits [R, V] float32, temperatures [R, 1] -> (tokens [R] int64, logprobs [R] float32).

    The logprob is of the distribution actually sampled, softmax(logits / T), so that it is the
    behaviour probability mu of the importance-corrected loss.
    """
    logprobs = torch.log_softmax(logits / temperatures, dim=-1)
    tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


@dataclass
class _Request:
    input_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    completion: Completion = field(default_factory=Completion)


@dataclass
class _Batch:
    """The rows still decoding. The cache covers seqs[:, :cache length]; the rest is fed next step."""

    requests: list[_Request]
    seqs: torch.Tensor  # int64 [R, L] left-padded prompt + sampled tokens
    mask: torch.Tensor  # int64 [R, L] 1 on real tokens, 0 on the left padding
    temperatures: torch.Tensor  # float32 [R, 1]
    cache: Optional[DynamicCache] = None
    cache_version: int = -1  # the weights version the cache was computed with


class TransformersEngine:
    """The `Engine` protocol (engine.py) on a transformers causal LM, batched, with a KV cache."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "float32", seed: int = 0, *,
                 version: int = 0, max_batch_size: int = 256, recompute_cache_on_swap: bool = True):
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).to(self.device).eval()
        self.version = version
        self.max_batch_size = max_batch_size
        self.recompute_cache_on_swap = recompute_cache_on_swap
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._pending: list[_Request] = []
        self._running: list[_Request] = []
        self._runner: Optional[asyncio.Task] = None
        self.decode_steps = 0  # forward passes (prefills included), for metrics and tests
        self.tokens_generated = 0
        self.weight_swaps = 0

    async def generate(self, input_ids: list[int], params: SamplingParams, *,
                       episode_id: Optional[str] = None) -> Completion:
        """See engine.Engine.generate (`episode_id` is ignored: one process, one cache)."""
        if len(input_ids) == 0:
            raise ValueError("generate needs at least one input token")
        loop = asyncio.get_running_loop()
        request = _Request(list(input_ids), params, loop.create_future())
        if self._runner is None or self._runner.done() or self._runner.get_loop() is not loop:
            # Requests left by a loop that has gone (a previous asyncio.run) can never be answered.
            self._pending = [r for r in self._pending if r.future.get_loop() is loop]
            self._runner = loop.create_task(self._run_batches(), name="engine-decode")
        self._pending.append(request)
        return await request.future

    def in_flight(self) -> int:
        return len(self._pending) + sum(not r.future.done() for r in self._running)

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load `state_dict` as weights `version` now (a safe point: see the module docstring)."""
        if version < 0:
            raise ValueError(f"weight versions are >= 0, got {version}")
        self._check_fits(state_dict, version)  # before loading: a refused version leaves the model intact
        self.model.load_state_dict(state_dict, strict=False)
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

    async def _run_batches(self) -> None:
        while self._pending:
            requests = self._pending[: self.max_batch_size]
            del self._pending[: len(requests)]
            self._running = requests
            try:
                batch = self._new_batch(requests)
                while batch.requests:
                    with torch.inference_mode():
                        self._step(batch)
                    await asyncio.sleep(0)
            except BaseException as error:  # callers must see the failure, not wait forever
                cancelled = not isinstance(error, Exception)
                for request in requests + (self._pending if cancelled else []):
                    if not request.future.done():
                        request.future.cancel() if cancelled else request.future.set_exception(error)
                if cancelled:
                    raise
            finally:
                self._running = []

    def _new_batch(self, requests: list[_Request]) -> _Batch:
        length = max(len(r.input_ids) for r in requests)
        seqs = torch.zeros((len(requests), length), dtype=torch.long)
        mask = torch.zeros_like(seqs)
        for row, request in enumerate(requests):  # left padding: the last column is every row's last token
            n = len(request.input_ids)
            seqs[row, length - n:] = torch.tensor(request.input_ids, dtype=torch.long)
            mask[row, length - n:] = 1
        temperatures = torch.tensor([[r.params.temperature] for r in requests], dtype=torch.float32)
        return _Batch(requests, seqs.to(self.device), mask.to(self.device), temperatures.to(self.device))

    def _forward(self, batch: _Batch) -> torch.Tensor:
        """Feed what the cache lacks (the whole batch after a reset); return last logits [R, V] fp32."""
        if batch.cache is None or (self.recompute_cache_on_swap and batch.cache_version != self.version):
            batch.cache = DynamicCache(config=self.model.config)
        start = batch.cache.get_seq_length()
        positions = (batch.mask.cumsum(-1) - 1).clamp(min=0)  # padding gets 0; it is masked anyway
        out = self.model(input_ids=batch.seqs[:, start:], attention_mask=batch.mask,
                         position_ids=positions[:, start:], cache=batch.cache, use_cache=True, logits_to_keep=1)
        batch.cache_version = self.version
        self.decode_steps += 1
        return out.logits[:, -1].float()

    def _step(self, batch: _Batch) -> None:
        """One forward, one token per row, resolve finished rows, compact them out."""
        tokens, logprobs = sample_tokens(self._forward(batch), batch.temperatures, self._generator)
        keep = []
        for row, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
            request = batch.requests[row]
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
                    request.future.set_result(completion)
            else:
                keep.append(row)
        self.tokens_generated += len(batch.requests)
        batch.seqs = torch.cat([batch.seqs, tokens[:, None]], dim=1)
        batch.mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)
        if len(keep) < len(batch.requests):
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            batch.requests = [batch.requests[row] for row in keep]
            batch.seqs, batch.mask = batch.seqs[index], batch.mask[index]
            batch.temperatures = batch.temperatures[index]
            if keep:
                batch.cache.batch_select_indices(index)


async def _demo(model_path: str) -> None:
    engine = TransformersEngine(model_path)
    prompts = [[1, 2, 3], [4, 5], [6]]
    completions = await asyncio.gather(*(engine.generate(p, SamplingParams(8, 1.0)) for p in prompts))
    for prompt, completion in zip(prompts, completions):
        print(prompt, "->", completion)


if __name__ == "__main__":
    asyncio.run(_demo(sys.argv[1]))
