"""Where every role gets its model files, tokenizer and dtype: one function each.

    path = resolve_model_path("builtin:tiny")   # a Hugging Face directory (built-ins are made once, cached)
                                                 # builtin:smollm2-135m is the other (user_code.BUILTINS),
                                                 # and `file.py:fn` names a builder of one's own; weights
                                                 # pickled by PyTorch are checked to be data (check_weights)
    tokenizer = load_tokenizer(path)             # the generator, the learner's save and tests all use this
    vocab_size(path)                             # what bounds every token id (the buffer checks them)
    check_positions(path, max_total_tokens)      # agent.max_total_tokens fits the model's positions
    require_model_dir(path, "node 10.0.0.2")     # each placed role, on its own node
    on_device(tensor, device)                    # a host tensor on the role's device, without a host wait

Why one loader: under transformers 5.x `AutoTokenizer` picks the tokenizer class from the model type
(a `qwen2` config always gets the byte-level `Qwen2Tokenizer`), whatever `tokenizer.json` holds. A
tokenizer that is not what that class rebuilds would silently lose spaces and newlines. The built-in
model's tokenizer is byte-level for exactly this reason (it loads as itself), and `load_tokenizer`
refuses any tokenizer that drops whitespace, naming the directory and the class it got.

Weights are data, never code. The learners (transformers) and the builtin engine read PyTorch-pickled
weights (pytorch_model*.bin, where a directory has no safetensors) with torch's weights-only unpickler, which
refuses a pickle that calls anything but tensor builders, in a paragraph that names no file; `check_weights`
gives that refusal at launch, in one line naming the file (`refusal`: the same line for learner checkpoints).
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Optional

import torch
from transformers import AutoConfig, AutoTokenizer

from nanoverl_async.agents.user_code import load_object
from nanoverl_async.validation import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WHITESPACE_PROBE = "a b\nc  d"


def resolve_model_path(path: str, cache_dir: str = "") -> str:
    """`builtin:NAME`, or a builder `path/to/file.py:fn` / `package.module:fn` (fn(cache_dir) -> a directory
    it makes once and caches, e.g. a model warm-started for a task: examples/smollm2_tools.py) -> its Hugging
    Face directory; any other path unchanged (a directory, or a Hugging Face Hub id where the hub is
    reachable). A path that can only be local (absolute, or starting with . or ~) must exist."""
    if path.startswith("builtin:") or (":" in path and not Path(path).expanduser().is_dir()):
        directory = load_object(path, "model.path")(cache_dir)
        if not Path(str(directory)).is_dir():
            raise ValueError(f"{path!r} returned {directory!r}, not a model directory")
        return str(directory)
    if path.startswith(("/", ".", "~")) and not Path(path).expanduser().is_dir():
        raise ValueError(f"{path!r} is not a directory")
    check_weights(path)
    return path


def check_weights(path: str) -> None:
    """A local model directory's PyTorch-pickled weights, where it has no safetensors (transformers reads those
    first), load with weights_only, as every role loads them: else ValueError naming the file. Zip-format files
    (torch.save's since 1.6) are mapped, not read: the check reads the pickle, not gigabytes of tensors."""
    directory = Path(path).expanduser()
    if not directory.is_dir() or any(directory.glob("*.safetensors")):
        return
    for file in sorted(directory.glob("pytorch_model*.bin")):
        try:
            torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
        except Exception as error:
            raise ValueError(f"{file} is not weights a run can load ({refusal(error)}); save them as "
                             f"safetensors, or with torch.save of the state dict alone") from None


def refusal(error: BaseException) -> str:
    """Why a file failed to load, in one line: the code its pickle calls, where torch's weights-only unpickler
    refused it (its message runs to paragraphs of advice), else the error's type and first line."""
    named = re.search(r"GLOBAL (\S+)", str(error))
    if named:
        return f"its pickle calls {named.group(1)}: code, not data"
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def require_model_dir(path: str, where: str) -> None:
    """On a cluster each role loads model.path (resolved on the launching node) from its own node's disk:
    the same directory must exist there (a shared filesystem, or a copy); one clear line if it does not."""
    if Path(path).is_absolute() and not Path(path).is_dir():
        raise FileNotFoundError(f"config key 'model.path': {path} does not exist on {where}; every node that runs "
                                f"a generator or learner needs the model directory at the same path")


def load_tokenizer(path: str):
    """The tokenizer of the model directory `path`, checked to keep whitespace through encode/decode."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(WHITESPACE_PROBE, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    if sum(ch.isspace() for ch in decoded) < sum(ch.isspace() for ch in WHITESPACE_PROBE):
        raise ValueError(f"the tokenizer in {path} ({type(tokenizer).__name__}) drops whitespace: "
                         f"{WHITESPACE_PROBE!r} comes back as {decoded!r}; set tokenizer_class in its "
                         f"tokenizer_config.json to the class that matches tokenizer.json")
    return tokenizer


def vocab_size(path: str) -> int:
    """The size of the model's embedding table: every token id it is given must be below it."""
    return AutoConfig.from_pretrained(path).get_text_config().vocab_size


def check_positions(path: str, max_total_tokens: int) -> None:
    """The buffer drops every trajectory longer than agent.max_total_tokens; one that the model's position
    table (max_position_embeddings, where its config names one) cannot hold must not be trained either, so
    a run whose episodes could outgrow the model is refused at start, naming both numbers."""
    positions = getattr(AutoConfig.from_pretrained(path).get_text_config(), "max_position_embeddings", None)
    if positions is not None and max_total_tokens > positions:
        raise ConfigError(f"config key 'agent.max_total_tokens': {max_total_tokens} is more than the model's "
                          f"{positions} positions (max_position_embeddings of {path})")


def on_device(tensor: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """`tensor` on `device` (None stays None). Host to GPU it is copied from pinned memory without blocking: a
    copy from pageable memory makes the host wait until the GPU has finished all the work queued before it,
    so the host could not prepare the next step while the GPU runs this one (torch's blocking copies
    synchronise the stream)."""
    if tensor is None:
        return None
    if torch.device(device).type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
