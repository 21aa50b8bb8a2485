"""Models of Qwen2.5-0.5B-Instruct's shape with random weights, for GPU benchmarks (no weights can be
downloaded where the GPU is; throughput depends on the shape alone).

    qwen_shaped_model(directory)          # the exact architecture: 24 layers, hidden 896, 14/2 heads,
                                          # vocabulary 151,936, tied embeddings; saved in bfloat16
    model.path=bench/qwen_shape.py:qwen_body_with_tiny_tokenizer   (or qwen_1_5b_body_with_tiny_tokenizer)
                                          # the same body on the built-in tiny model's byte tokenizer and
                                          # chat template, so the default job runs on it (a builder:
                                          # models.resolve_model_path); random weights, so its rewards
                                          # mean nothing: samples/s does
    wide_vocab_model(directory)           # a small body (4 layers, hidden 256) with that vocabulary: where
                                          # the LM head costs what it does with a real tokenizer (CPU)
    qwen2_5_config("3b")                  # Qwen2.5-{0.5B,1.5B,3B,7B}-Instruct's architecture (QWEN2_5), and
    random_model(config, directory, "cuda")  # random weights for it, initialised on a device, saved in bfloat16

Run alone: python bench/qwen_shape.py DIR   (writes the first into DIR)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

QWEN_BODY = dict(hidden_size=896, intermediate_size=4_864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
# Qwen2.5-*-Instruct's config.json (hidden, intermediate, layers, attention heads, key-value heads, tied
# embeddings, vocabulary), from the model cards' repositories
QWEN2_5 = {"0.5b": (896, 4_864, 24, 14, 2, True, 151_936), "1.5b": (1_536, 8_960, 28, 12, 2, True, 151_936),
           "3b": (2_048, 11_008, 36, 16, 2, True, 151_936), "7b": (3_584, 18_944, 28, 28, 4, False, 152_064)}


def qwen2_5_config(size: str) -> Qwen2Config:
    """The architecture of Qwen2.5-`size`-Instruct (a key of QWEN2_5)."""
    hidden, intermediate, layers, heads, kv_heads, tied, vocab = QWEN2_5[size]
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=32_768,
                       bos_token_id=151_643, eos_token_id=151_645)


def random_model(config: Qwen2Config, directory: str, device: str = "cpu") -> str:
    """A Qwen2 of `config` with random weights, initialised on `device` (a 3B model initialises in seconds
    on a GPU, minutes on a CPU), saved in bfloat16 into `directory`; nothing of it stays on the device."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(directory)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return directory


def qwen_shaped_model(directory: str) -> str:
    """Qwen2.5-0.5B-Instruct's architecture with random weights, saved in bfloat16."""
    config = Qwen2Config(vocab_size=151_936, max_position_embeddings=32_768, bos_token_id=151_643,
                         eos_token_id=151_645, **QWEN_BODY)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def wide_vocab_model(directory: str) -> str:
    """A 4-layer, hidden-256 Qwen2 with Qwen2.5's vocabulary (151,936, tied), random weights, float32."""
    config = Qwen2Config(vocab_size=151_936, hidden_size=256, intermediate_size=1_024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def qwen_body_with_tiny_tokenizer(cache_dir: str = "", size: str = "0.5b") -> str:
    """Qwen2.5-`size`'s body on the tiny model's tokenizer (0.5b: ~360M parameters; 1.5b: ~1.3B), random
    weights in bfloat16, built once in the model cache (initialised on a GPU where there is one)."""
    from nanoverl_async.models.cache import build_once
    from nanoverl_async.models.tiny import build_tokenizer

    hidden, intermediate, layers, heads, kv_heads, tied, _ = QWEN2_5[size]

    def write(directory: Path) -> str:
        tokenizer = build_tokenizer()
        config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=4_096, bos_token_id=None,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                             rope_theta=1_000_000.0, rms_norm_eps=1e-6)
        random_model(config, str(directory), "cuda" if torch.cuda.is_available() else "cpu")
        tokenizer.save_pretrained(directory)
        return "random weights"

    name = "qwen-body-tiny-tokenizer" if size == "0.5b" else f"qwen{size}-body-tiny-tokenizer"
    return build_once(name, {"size": size, "version": 1}, write, cache_dir)


def qwen_1_5b_body_with_tiny_tokenizer(cache_dir: str = "") -> str:
    """The 1.5B body on the tiny tokenizer: model.path=bench/qwen_shape.py:qwen_1_5b_body_with_tiny_tokenizer."""
    return qwen_body_with_tiny_tokenizer(cache_dir, "1.5b")


if __name__ == "__main__":
    print(qwen_shaped_model(sys.argv[1]) if len(sys.argv) > 1 else __doc__)
