"""A continuous-batching sampling engine: our own forward over a transformers model's weights.

    engine = TransformersEngine(model_dir, device="cpu", dtype="float32", seed=0)
    completion = await engine.generate(prompt_ids, SamplingParams(16, 1.0, (eos_id,)))

Why continuous batching: an episode's next turn (after a tool call) must not queue behind the slowest
row of a running batch. One runner task loops: decode one token for every running row, then prefill
the requests that arrived meanwhile (one right-padded batch) so they decode with the others from the
next step on. A row that samples a stop token or reaches max_new_tokens is resolved at once and leaves.
Between iterations the loop yields (`await asyncio.sleep(0)`) so ZeroMQ I/O and the episodes keep flowing.

Why our own forward: at these sizes HF's per-step cache concatenation, mask building and position
re-derivation cost more than the math. `_LlamaForward` runs the Llama family (llama, mistral, qwen2,
qwen3; other model types are refused) on the HF model's own parameter tensors (`load_state_dict` into
`engine.model` swaps them) with a KV cache of row slots [layers, k|v, slots, kv_heads, positions,
head_dim]: the running rows hold slots 0..R-1 (a finished row's slot takes the last row), so attention
reads one view with a per-row length mask, and the cache only grows (doubling) when a row or a length
outgrows it. Lengths are not capped (as with HF, positions may pass max_position_embeddings). One host
sync per forward: the `.tolist()` of the sampled tokens and logprobs.

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
the running rows' KV cache is then recomputed under the new weights (one prefill per swap), so every
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
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from nanoverl_async.generators.engine import Completion, SamplingParams
from nanoverl_async.models import DTYPES

LOCKSTEP_POLL_S = 0.001  # how often a lockstep engine checks whether every episode is waiting


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


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """HF's RMSNorm, op for op: normalize in float32, cast back, then scale."""
    x32 = x.float()
    return norm.weight * (x32 * x32.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon).rsqrt_()).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _LlamaForward:
    """Prefill and decode of the Llama family on the HF model's parameters and a slot KV cache."""

    FAMILY = ("llama", "mistral", "qwen2", "qwen3")
    ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # fixed frequencies (no per-length update)

    def __init__(self, model, model_path: str):
        config = model.config
        if config.model_type not in self.FAMILY:
            raise ValueError(f"model.path={model_path!r}: model_type {config.model_type!r} is not supported by the "
                             f"transformers engine (it runs {', '.join(self.FAMILY)}); try generator.engine=sglang")
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type") not in self.ROPE_TYPES:
            raise ValueError(f"model.path={model_path!r}: config.rope_parameters={rope} is not supported by the "
                             f"transformers engine (rope_type must be one of {', '.join(self.ROPE_TYPES)})")
        self.model, self.layers = model, model.model.layers
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        rotary = model.model.rotary_emb  # HF derived these from config.rope_parameters
        self.inv_freq, self.rope_scale = rotary.inv_freq.float(), rotary.attention_scaling
        sliding = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None) or ["sliding_attention" if sliding else "full_attention"] * len(
            self.layers)
        if set(types) - {"full_attention", "sliding_attention"}:
            raise ValueError(f"model.path={model_path!r}: config.layer_types={types} is not supported")
        self.windows = [sliding if kind == "sliding_attention" else None for kind in types]

    def cache(self, slots: int, positions: int) -> torch.Tensor:
        weight = self.model.get_input_embeddings().weight
        return torch.zeros((len(self.layers), 2, slots, self.kv_heads, positions, self.head_dim),
                           dtype=weight.dtype, device=weight.device)

    def prefill(self, kv: torch.Tensor, ids: torch.Tensor, last: torch.Tensor, start: int) -> torch.Tensor:
        """Rows start..start+n-1 from position 0: ids [n, P] right-padded, `last` [n] the index of each
        row's last token -> its logits [n, V] float32. The padding's keys are written, never attended."""
        n, length = ids.shape
        cos, sin = self._rope(torch.arange(length, device=ids.device)[None])
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        masks = {w: causal.triu(1 - w) if w else None for w in set(self.windows)}

        def attend(layer: int, q, k, v):
            kv[layer, 0, start:start + n, :, :length] = k
            kv[layer, 1, start:start + n, :, :length] = v
            mask = masks[self.windows[layer]]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)

        hidden = self._layers(F.embedding(ids.flatten(), self.model.get_input_embeddings().weight), n, cos, sin,
                              attend).view(n, length, -1)
        return self._logits(hidden[torch.arange(n, device=ids.device), last])

    def decode(self, kv: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """One token for rows 0..R-1: `tokens` [R] at `positions` [R] (their cache holds the positions
        before; `length` > every position) -> logits [R, V] float32.

        CUDA-graph hook: every input is a fixed-address buffer (slices of the engine's _next/_lens and the
        cache); capturing this per bucket of R with `length` = the cache's capacity would remove the
        per-kernel launch cost. Not done yet."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        cos, sin = self._rope(positions[:, None])
        keys = torch.arange(length, device=tokens.device)
        seen = keys <= positions[:, None]
        masks = {w: torch.where(seen & (keys > positions[:, None] - w) if w else seen, 0.0, float("-inf"))
                 .to(cos.dtype)[:, None, None] for w in set(self.windows)}  # additive (a bool mask is slower)

        def attend(layer: int, q, k, v):
            kv[layer, 0][rows, :, positions] = k[:, :, 0]
            kv[layer, 1][rows, :, positions] = v[:, :, 0]
            cached = kv[layer, :, : len(rows), :, :length]
            return F.scaled_dot_product_attention(q, cached[0], cached[1], attn_mask=masks[self.windows[layer]],
                                                  enable_gqa=True)

        x = F.embedding(tokens, self.model.get_input_embeddings().weight)
        return self._logits(self._layers(x, len(rows), cos, sin, attend))

    def _rope(self, positions: torch.Tensor):
        """positions [B, Q] -> cos, sin [B, Q, 1, head_dim] in the model dtype (HF's formula)."""
        freqs = positions[..., None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, :, None]
        dtype = self.model.dtype
        return (angles.cos() * self.rope_scale).to(dtype), (angles.sin() * self.rope_scale).to(dtype)

    def _layers(self, x: torch.Tensor, batch: int, cos, sin, attend: Callable) -> torch.Tensor:
        """The decoder layers on the tokens x [B * Q, hidden] of `batch` rows (2-D: the fewest ops per
        linear); `attend(layer, q, k, v)` caches k, v [B, kv_heads, Q, d] and attends."""
        width = x.shape[0] // batch
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = _rms_norm(x, layer.input_layernorm)
            q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(batch, width, self.heads, self.head_dim)
            k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(batch, width, self.kv_heads, self.head_dim)
            v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(batch, width, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # qwen3
                q, k = _rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            out = attend(index, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            x = x + F.linear(out.transpose(1, 2).reshape(x.shape[0], -1), attn.o_proj.weight, attn.o_proj.bias)
            h = _rms_norm(x, layer.post_attention_layernorm)
            gate = mlp.act_fn(F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias))
            x = x + F.linear(gate * F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias), mlp.down_proj.weight,
                             mlp.down_proj.bias)
        return x

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.get_output_embeddings()  # tied or not: the HF model's own tensor
        return F.linear(_rms_norm(hidden, self.model.model.norm), head.weight, head.bias).float()


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
                 version: int = 0, max_batch_size: int = 256, recompute_cache_on_swap: bool = True):
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).to(self.device).eval()
        self.forward = _LlamaForward(self.model, model_path)
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
        self._cache_version = version  # the weights version the running rows' cache was computed with
        self._lens = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)  # cached tokens per slot
        self._next = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)  # last sampled, not cached
        self._temps = torch.ones(max_batch_size, 1, dtype=torch.float32, device=self.device)
        self.decode_steps = 0  # forward passes (prefills included), for metrics and tests
        self.tokens_generated = 0
        self.weight_swaps = 0

    async def generate(self, input_ids: list[int], params: SamplingParams, *,
                       episode_id: Optional[str] = None) -> Completion:
        """See engine.Engine.generate (`episode_id` orders a lockstep wave; there is one cache)."""
        if len(input_ids) == 0:
            raise ValueError("generate needs at least one input token")
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
                with torch.inference_mode():
                    self._guarded(self._decode_step, 0)
                    if self._pending and len(self._rows) < self.max_batch_size and not (
                            self.lockstep is not None and self._rows):
                        self._guarded(self._admit, len(self._rows))
                await asyncio.sleep(0)
        except BaseException as error:  # cancelled (its loop is closing) or a bug: no one may wait forever
            for request in self._rows + self._pending:
                if not request.future.done():
                    request.future.set_exception(error) if isinstance(error, Exception) else request.future.cancel()
            self._rows, self._pending = [], []
            raise

    def _guarded(self, step: Callable[[], None], first: int) -> None:
        """Run `step`; if it fails, its callers (the rows from `first` on) get the exception, others go on."""
        try:
            step()
        except Exception as error:
            for request in self._rows[first:]:
                if not request.future.done():
                    request.future.set_exception(error)
            del self._rows[first:]

    def _decode_step(self) -> None:
        """One token for every running row (the whole context again if the weights changed under it)."""
        if not self._rows:
            return
        if self.recompute_cache_on_swap and self._cache_version != self.version:
            logits = self._prefill(0, [r.input_ids + r.completion.token_ids for r in self._rows])
        else:
            count, length = len(self._rows), max(r.length() for r in self._rows)
            self._reserve(count, length)
            logits = self.forward.decode(self._kv, self._next[:count], self._lens[:count], length)
            self._lens[:count] += 1
        self._emit(0, logits)

    def _admit(self) -> None:
        """Prefill the waiting requests into the slots after the running rows; sample their first token."""
        start = len(self._rows)
        if self.lockstep is not None:
            self._pending.sort(key=lambda r: r.episode_id)
            wave = ";".join(f"{r.episode_id}:{len(r.input_ids)}" for r in self._pending)
            self._generator.manual_seed(int.from_bytes(
                hashlib.blake2b(f"{self.seed}|{wave}".encode(), digest_size=8).digest(), "little") >> 1)
        new = [r for r in self._pending[: self.max_batch_size - start] if not r.future.done()]
        del self._pending[: self.max_batch_size - start]
        if new:
            self._rows += new
            self._emit(start, self._prefill(start, [r.input_ids for r in new]))

    def _prefill(self, start: int, seqs: list[list[int]]) -> torch.Tensor:
        """Cache `seqs` from position 0 in slots start.. (one right-padded batch) -> their last logits."""
        width = max(len(s) for s in seqs)
        self._reserve(start + len(seqs), width)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.long).to(self.device)
        lens = torch.tensor([len(s) for s in seqs], dtype=torch.long).to(self.device)
        temps = [r.params.temperature for r in self._rows[start:start + len(seqs)]]
        self._lens[start:start + len(seqs)] = lens
        self._temps[start:start + len(seqs), 0] = torch.tensor(temps, dtype=torch.float32).to(self.device)
        return self.forward.prefill(self._kv, ids, lens - 1, start)

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
                    request.future.set_result(completion)
                done.append(row)
        if done:
            self._compact(done)

    def _compact(self, done: list[int]) -> None:
        """Drop finished rows; the last running rows move into their slots, so rows stay in 0..R-1."""
        keep, gone = len(self._rows) - len(done), set(done)
        holes = [row for row in done if row < keep]
        movers = [row for row in range(keep, len(self._rows)) if row not in gone]
        if holes:
            length = max(self._rows[row].length() for row in movers)
            dst, src = (torch.tensor(rows, device=self.device) for rows in (holes, movers))
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
