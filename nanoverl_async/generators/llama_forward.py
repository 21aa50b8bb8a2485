"""Prefill and extend of the Llama family (llama, mistral, qwen2, qwen3) on a transformers model's own
parameter tensors, with a KV cache of row slots: the forward of `hf_engine.TransformersEngine`.

    forward = LlamaForward(model, model_dir)          # refuses other model types in one line
    kv = forward.cache(slots, positions)               # [layers, k|v, slots, kv_heads, positions, head_dim]
    logits = forward.prefill(kv, ids, last, start)     # rows from position 0 (right-padded)
    logits = forward.extend(kv, ids, last, start, offsets, length)   # rows after their cached positions

Why our own: at these sizes HF's per-step cache concatenation, mask building and position re-derivation
cost more than the math. Each op follows HF's (RMSNorm in float32, rotary embeddings with HF's
frequencies, grouped-query attention), and tests compare the logits with HF's forward per model type.
Loading a state dict into the HF model swaps the tensors this reads.

Run alone: nothing to run; tests/test_engine.py checks it against HF and a full forward.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """HF's RMSNorm, op for op: normalize in float32, cast back, then scale."""
    x32 = x.float()
    return norm.weight * (x32 * x32.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon).rsqrt_()).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LlamaForward:
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
        return self.logits(hidden[torch.arange(n, device=ids.device), last])

    def extend(self, kv: torch.Tensor, ids: torch.Tensor, last: Optional[torch.Tensor], start: int,
               offsets: torch.Tensor, length: int, head: bool = True) -> torch.Tensor:
        """Rows start..start+n-1 whose cache holds positions [0, offsets[r]): ids [n, Q] right-padded new
        tokens at positions offsets[r].. (`length` > every one of them), `last` [n] the index of each row's
        last new token (None when Q = 1) -> its logits [n, V] float32. Decode is Q = 1 over the running
        rows; an episode's next turn is its new tokens after its cached turns (`TransformersEngine` keeps them).
        head=False returns those tokens' final hidden states [n, hidden] instead (decode_graphs.py captures
        the layers and runs the head on the live rows only). No host sync: CUDA graphs can capture it."""
        n, width = ids.shape
        slots = torch.arange(start, start + n, device=ids.device)[:, None]
        positions = offsets[:, None] + torch.arange(width, device=ids.device)  # [n, Q]
        cos, sin = self._rope(positions)
        keys = torch.arange(length, device=ids.device)
        seen = keys <= positions[..., None]  # [n, Q, length]
        masks = {w: torch.where(seen & (keys > positions[..., None] - w) if w else seen, 0.0, float("-inf"))
                 .to(cos.dtype)[:, None] for w in set(self.windows)}  # additive (a bool mask is slower)

        def attend(layer: int, q, k, v):
            kv[layer, 0][slots, :, positions] = k.transpose(1, 2)  # [n, Q, kv_heads, d] at (slot, position)
            kv[layer, 1][slots, :, positions] = v.transpose(1, 2)
            cached = kv[layer, :, start:start + n, :, :length]
            return F.scaled_dot_product_attention(q, cached[0], cached[1], attn_mask=masks[self.windows[layer]],
                                                  enable_gqa=True)

        hidden = self._layers(F.embedding(ids.flatten(), self.model.get_input_embeddings().weight), n, cos, sin,
                              attend)
        if last is not None:
            hidden = hidden.view(n, width, -1)[torch.arange(n, device=ids.device), last]
        return self.logits(hidden) if head else hidden

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

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, hidden] -> float32 logits [n, V] (final norm, then the LM head)."""
        head = self.model.get_output_embeddings()  # tied or not: the HF model's own tensor
        return F.linear(_rms_norm(hidden, self.model.model.norm), head.weight, head.bias).float()
