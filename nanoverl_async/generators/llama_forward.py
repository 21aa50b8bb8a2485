"""The forward of `builtin_engine.BuiltinEngine`: the Llama family (llama, mistral, qwen2, qwen3) on a
checkpoint's own tensors, read without transformers' model classes, over flat tokens, with a paged KV cache.

    model = LlamaModel(model_dir, device, torch.float32)   # refuses other model types in one line
    kv = model.cache(blocks, block_size)                # [layers, k|v, kv_heads, blocks, block_size, head_dim]
    table = ...                                         # [rows, columns]: row r's position p is in block
                                                        #   table[r, p // block_size] (kv_blocks.py hands them out)
    tokens = Tokens()
    tokens.add(first=3, offsets=[0, 40], new=[prompt, next_turn])   # rows 3, 4 after their cached positions
    logits = model.paged(kv, table, *tokens.tensors(device))   # [rows, V]: each row's last new token

One forward serves every row that needs one, however many new tokens each has: a decoding row's one
token, a new prompt, an episode's next turn after its cached ones, a whole context to recompute. The
rows' new tokens are laid end to end (no padding), so the linear layers, most of a small model's work,
compute only real tokens, and rows that join the batch cost no forward of their own. Attention runs per
`Span` (consecutive rows of the block table): one gather of the span's blocks through the table, laid out
[kv_heads, rows, positions, head_dim] so that a decode step's grouped-query attention is two batched
matmuls with no further copy; its queries padded to its longest row. Each op follows HF's (RMSNorm in
float32, rotary embeddings with HF's frequencies, grouped-query attention); tests compare the logits with
HF's forward per model type.

Why `LlamaModel` and not transformers' model class: importing the model classes costs a generator seconds of
CPU at start-up (a thousand modules; docs/benchmarks.md "Costs behind choices in the code"), and the engine runs
only this forward. The tensors keep transformers' names (checkpoint_reader.py reads them), so a learner's state
dict loads into them in place (`load_state_dict`), and this forward reads them.

Run alone: nothing to run; tests/test_engine.py checks it against HF and a full forward.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from types import SimpleNamespace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanoverl_async.generators.checkpoint_reader import open_checkpoint, read_parameters
from nanoverl_async.models.load import on_device

FAMILY = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # fixed frequencies (no per-length update)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm, op for op: normalize in float32, cast back, then scale."""
    x32 = x.float()
    return weight * (x32 * x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).to(x.dtype)


def _linear(x: torch.Tensor, projection: torch.nn.Module) -> torch.Tensor:
    return F.linear(x, projection.weight, getattr(projection, "bias", None))


def _one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v for one query per row (a decode step): q [rows, heads, 1, d], k, v
    [kv_heads, rows, length, d] (as gathered), mask [rows, 1, 1, length]. The query heads that share a kv
    head become that kv head's queries, so grouped-query attention is two batched matmuls over the gathered
    keys and values as they lie, read once. Faster than SDPA for one query per row on both devices: on the CPU
    SDPA's kernel is built for blocks of queries, and on CUDA SDPA given a mask and grouped heads falls back to
    its math kernel (see `_expanded_sdpa`; docs/benchmarks.md "Costs behind choices in the code"). Softmax in
    float32, as HF's eager attention."""
    rows, heads, _, dim = q.shape
    grouped = q.reshape(rows, k.shape[0], heads // k.shape[0], dim).transpose(0, 1)  # [kv_heads, rows, group, d]
    scores = grouped @ k.transpose(-1, -2) * dim ** -0.5 + attn_mask.view(1, rows, 1, -1)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return (weights.to(q.dtype) @ v).transpose(0, 1).reshape(rows, heads, 1, dim)


def _expanded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
    """SDPA for blocks of queries on CUDA, each kv head repeated for the query heads that share it. The kernel
    that takes an arbitrary mask (memory-efficient attention; flash takes none) does not take grouped heads in
    every torch version, and torch then falls back to its math kernel, which repeats the kv heads itself and
    computes the whole score matrix in float32."""
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          attn_mask=attn_mask)


_gqa_sdpa = partial(F.scaled_dot_product_attention, enable_gqa=True)  # the CPU's kernel takes a mask and groups


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclasses.dataclass(frozen=True)
class Span:
    """Rows first..first+rows-1 of the block table whose new tokens are the forward's flat tokens [begin, end),
    row by row, each row's at the positions after its cached ones; `length` > every position (the attention span). For
    attention the queries are padded to the longest row: `padded` [rows, width] indexes each (row, j) into
    the span's tokens (a short row repeats its last one) and `unpadded` [end - begin] each token into the
    flattened [rows * width]; both None when every row has one new token (decoding)."""

    begin: int
    end: int
    first: int
    rows: int
    length: int
    padded: Optional[torch.Tensor] = None
    unpadded: Optional[torch.Tensor] = None


class Tokens:
    """The flat new tokens of one forward, laid out on the host span by span (`tensors` moves them)."""

    def __init__(self, decoding: Optional[tuple[torch.Tensor, torch.Tensor, int]] = None):
        """`decoding`: rows 0..R-1 with one new token each, which come first: their tokens and positions [R],
        already on the device (a decode step's), and their attention length."""
        self.decoding = decoding
        self.begin = len(decoding[0]) if decoding is not None else 0  # flat tokens before the host's
        # per flat token: its id, its position and its row of the block table; each row's last new token (its
        # logits are returned)
        self.ids, self.positions, self.rows, self.last = [], [], [], []
        self.spans = [Span(0, self.begin, 0, self.begin, decoding[2])] if decoding is not None else []

    def add(self, first: int, offsets: Sequence[int], new: Sequence[Sequence[int]], copies: Sequence[int] = ()) -> None:
        """Rows first.. of the block table, row r holding positions [0, offsets[r]), get the tokens new[r] (at
        least one each): in spans of consecutive rows whose queries, padded to their longest row, are at most
        twice their tokens (a 4k-token prompt beside short ones would pad each of them to 4k). The rows after
        them repeat the contexts of rows first + copies[i]: they get those rows' logits, computing nothing."""
        start = 0
        for end in range(1, len(new) + 1):
            lengths = [len(tokens) for tokens in new[start:end + 1]]
            if end == len(new) or max(lengths) * len(lengths) > 2 * sum(lengths):
                self._add_span(first + start, offsets[start:end], new[start:end])
                start = end
        self.last += [self.last[-len(new) + source] for source in copies]

    def _add_span(self, first: int, offsets: Sequence[int], new: Sequence[Sequence[int]]) -> None:
        begin, width = self.begin + len(self.ids), max(map(len, new))
        padded, unpadded = [], []
        for row, (offset, tokens) in enumerate(zip(offsets, new)):
            start = len(self.ids) + self.begin - begin
            padded += [start + min(j, len(tokens) - 1) for j in range(width)]
            unpadded += range(row * width, row * width + len(tokens))
            self.ids += tokens
            self.positions += range(offset, offset + len(tokens))
            self.rows += [first + row] * len(tokens)
            self.last.append(self.begin + len(self.ids) - 1)
        indices = (torch.tensor(padded).view(len(new), width), torch.tensor(unpadded)) if width > 1 else (None, None)
        self.spans.append(Span(begin, self.begin + len(self.ids), first, len(new),
                                 max(offset + len(tokens) for offset, tokens in zip(offsets, new)), *indices))

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Span],
                                                      Optional[torch.Tensor]]:
        """(ids, positions, rows, spans, last) on `device`: the arguments of `LlamaModel.paged` after the
        cache and the table."""
        spans = [dataclasses.replace(span, padded=on_device(span.padded, device),
                                     unpadded=on_device(span.unpadded, device)) for span in self.spans]
        if self.ids:
            flat = on_device(torch.tensor([self.ids, self.positions, self.rows], dtype=torch.long), device)
            ids, positions, rows, last = *flat, on_device(torch.tensor(self.last, dtype=torch.long), device)
        if self.decoding is None:
            return ids, positions, rows, spans, last
        decoded, at, _ = self.decoding
        decoding = torch.arange(self.begin, device=device)
        if not self.ids:
            return decoded, at, decoding, spans, None  # every token is a row's last
        return (torch.cat([decoded, ids]), torch.cat([at, positions]), torch.cat([decoding, rows]), spans,
                torch.cat([decoding, last]))


def _check_supported(config, model_path: str) -> None:
    """One line for a model this forward cannot run, before any tensor is read."""
    if config.model_type not in FAMILY:
        raise ValueError(f"model.path={model_path!r}: model_type {config.model_type!r} is not supported by the "
                         f"builtin engine (it runs {', '.join(FAMILY)}); try generator.engine=sglang")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type") not in ROPE_TYPES:
        raise ValueError(f"model.path={model_path!r}: config.rope_parameters={rope} is not supported by the "
                         f"builtin engine (rope_type must be one of {', '.join(ROPE_TYPES)})")
    layer_types = set(getattr(config, "layer_types", None) or []) - {"full_attention", "sliding_attention"}
    if config.hidden_act != "silu" or layer_types:
        raise ValueError(f"model.path={model_path!r}: hidden_act={config.hidden_act!r} or layer_types {layer_types} "
                         f"are not supported by the builtin engine (silu; full or sliding attention)")


def rope_frequencies(config, dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] float32, the cos/sin scale) of config.rope_parameters for heads of `dim`, as
    transformers' rotary embedding computes them (RoFormer, Su et al. 2021: inv_freq_i = theta^(-2i / dim))."""
    rope = config.rope_parameters
    if rope["rope_type"] != "default":  # linear, llama3, yarn: transformers' own functions
        return ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
    return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


class LlamaModel(torch.nn.Module):
    """The forward of the Llama family on a checkpoint's tensors, flat tokens and a paged KV cache (`paged`).
    The tensors keep their transformers names (model.layers.0.self_attn.q_proj.weight, ...), read from the
    checkpoint in `dtype` on `device`; a tied LM head is the embedding's own tensor, as in transformers. `config`
    is the checkpoint's. Called on input_ids [B, T] it returns `.logits` [B, T, V] of one full forward, as a
    transformers model would (tests compare the engine's logprobs with it)."""

    def __init__(self, model_path: str, device: torch.device, dtype: torch.dtype):
        super().__init__()
        directory, config = open_checkpoint(model_path)
        self.config = config
        _check_supported(config, model_path)
        read_parameters(self, directory, model_path, config, device, dtype)
        self.eps, self.dtype, self.device = config.rms_norm_eps, dtype, device
        self.layers = [getattr(self.model.layers, str(i)) for i in range(config.num_hidden_layers)]
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        inv_freq, self.rope_scale = rope_frequencies(config, self.head_dim)
        self.inv_freq = inv_freq.float().to(device)
        sliding = getattr(config, "sliding_window", None)  # without layer_types, every layer slides if any does
        types = getattr(config, "layer_types", None) or ["sliding_attention"] * len(self.layers)
        self.windows = [sliding if kind == "sliding_attention" else None for kind in types]

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        rows, length = input_ids.shape
        tokens = Tokens()
        tokens.add(0, [0] * rows, input_ids.tolist())
        table = torch.arange(rows, device=input_ids.device)[:, None]  # a block of `length` positions per row
        logits = self.paged(self.cache(rows, length), table, *tokens.tensors(input_ids.device)[:4])  # all, not `last`
        return SimpleNamespace(logits=logits.view(rows, length, -1))

    def block_bytes(self, block_size: int) -> int:
        """The memory of one KV block: keys and values of `block_size` positions in every layer."""
        return len(self.layers) * 2 * self.kv_heads * block_size * self.head_dim * self.dtype.itemsize

    def cache(self, blocks: int, block_size: int) -> torch.Tensor:
        """The pool, uninitialised: the engine zeroes each block before its first use (on the CPU a page of
        memory is taken only when written, so an unused budget costs nothing)."""
        return torch.empty((len(self.layers), 2, self.kv_heads, blocks, block_size, self.head_dim),
                           dtype=self.dtype, device=self.device)

    def paged(self, kv: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
              rows: torch.Tensor, spans: Sequence[Span], last: Optional[torch.Tensor] = None,
              head: bool = True) -> torch.Tensor:
        """Flat new tokens: ids, positions, rows of the block table [T] (`Tokens`), in `spans` -> the logits
        [n, V] float32 of the tokens `last` [n] (None: of every token); head=False returns their final hidden
        states [n, hidden] instead (decode_graphs.py captures the layers and runs the head on the live rows
        only). Each token's keys and values are written at its position in its row's blocks; it attends to
        its row's cached positions up to its own. No host sync: CUDA graphs can capture it."""
        cos, sin = self._rope(positions)
        block_size = kv.shape[4]
        where = table[rows, positions // block_size] * block_size + positions % block_size  # [T] in the flat pool
        gathers, masks = [], []  # per span: its rows' blocks, flat; per window, an additive mask [rows, 1, width, keys]
        for span in spans:
            blocks = -(-span.length // block_size)
            gathers.append(table[span.first:span.first + span.rows, :blocks].flatten())
            keys = torch.arange(blocks * block_size, device=ids.device)
            at = positions[span.begin:span.end]
            at = (at[span.padded] if span.padded is not None else at[:, None])[..., None]  # [rows, width, 1]
            seen = keys <= at  # also hides the positions past a row's own, whatever blocks the table holds there
            masks.append({w: torch.where(seen & (keys > at - w) if w else seen, 0.0, float("-inf"))
                          .to(cos.dtype)[:, None] for w in set(self.windows)})

        x = F.embedding(ids, self.model.embed_tokens.weight)
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = _rms_norm(x, layer.input_layernorm.weight, self.eps)
            q = _linear(h, attn.q_proj).view(-1, self.heads, self.head_dim)
            k = _linear(h, attn.k_proj).view(-1, self.kv_heads, self.head_dim)
            v = _linear(h, attn.v_proj).view(-1, self.kv_heads, self.head_dim)
            if "q_norm" in attn._modules:  # qwen3
                q, k = _rms_norm(q, attn.q_norm.weight, self.eps), _rms_norm(k, attn.k_norm.weight, self.eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            pool = kv[index]  # [k|v, kv_heads, blocks, block_size, head_dim]
            flat = pool.view(2, self.kv_heads, -1, self.head_dim)
            flat[0].index_copy_(1, where, k.transpose(0, 1))
            flat[1].index_copy_(1, where, v.transpose(0, 1))
            out = [self._attend(pool, q, span, gather, mask[self.windows[index]])
                   for span, gather, mask in zip(spans, gathers, masks)]
            x = x + _linear((torch.cat(out) if len(out) > 1 else out[0]).flatten(1), attn.o_proj)
            h = _rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
            # silu: the one hidden_act _check_supported lets through
            x = x + _linear(F.silu(_linear(h, mlp.gate_proj)) * _linear(h, mlp.up_proj), mlp.down_proj)
        if last is not None:
            x = x[last]
        return self.logits(x) if head else x

    def _attend(self, pool: torch.Tensor, q: torch.Tensor, span: Span, gather: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """The attention [end - begin, heads, d] of one span's queries (q [T, heads, d], all the forward's) to its
        rows' cached keys and values (`gather`: their blocks in the layer's `pool`, written already)."""
        queries = q[span.begin:span.end]
        queries = queries[span.padded] if span.padded is not None else queries[:, None]
        cached = pool.index_select(2, gather).view(2, self.kv_heads, span.rows, -1, self.head_dim)
        if span.padded is None:
            o = _one_query_attention(queries.transpose(1, 2), cached[0], cached[1], mask)
        else:
            attention = _expanded_sdpa if q.device.type == "cuda" else _gqa_sdpa
            o = attention(queries.transpose(1, 2), cached[0].transpose(0, 1), cached[1].transpose(0, 1), attn_mask=mask)
        o = o.transpose(1, 2).flatten(0, 1)
        return o[span.unpadded] if span.unpadded is not None else o

    def _rope(self, positions: torch.Tensor):
        """positions [T] -> cos, sin [T, 1, head_dim] in the model dtype (HF's formula)."""
        freqs = positions[:, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        return (angles.cos() * self.rope_scale).to(self.dtype), (angles.sin() * self.rope_scale).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, hidden] -> float32 logits [n, V] (final norm, then the LM head)."""
        return F.linear(_rms_norm(hidden, self.model.norm.weight, self.eps), self.lm_head.weight).float()
