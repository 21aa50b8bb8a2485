"""The built-in tiny model: `builtin:tiny`, created locally (no download) and cached.

    path = resolve_model_path("builtin:tiny")        # builds once (~a minute), then a cache hit
    model = AutoModelForCausalLM.from_pretrained(path); tok = AutoTokenizer.from_pretrained(path)

What it is: a character-level tokenizer trained with `tokenizers` (every character one token, so
each digit and operator is one token) with a compact chat template, and a ~1M-parameter
Qwen2ForCausalLM warm-started by a short SFT on demos of the built-in "A*B?" task
(nanoverl_async/multiply_task.py). The warm start is calibrated to leave RL something to learn: the
policy sampled at temperature 1 uses the tool rarely and succeeds rarely at first (DESIGN.md,
"The embedded default").

Invariants:
- the cache directory name carries a hash of the whole recipe (every hyperparameter, the recipe
  version, the chat template), so a changed recipe never reuses a stale model;
- the directory is built in a temporary directory and renamed into place under an fcntl lock:
  it exists only when complete, and two processes never build it twice;
- the chat template is prefix-consistent: rendering messages[:k] and then the delta of the rest
  gives exactly the rendering of all messages (the agent loop appends deltas, never re-renders).

Run alone:  python -m nanoverl_async.tiny_model [cache_dir]   (builds or finds, prints the path)
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import string
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from nanoverl_async import multiply_task

RECIPE_VERSION = 1  # bump whenever the build code changes what it produces
BUILTIN_NAMES = ("builtin:tiny",)

PAD, END, UNK = "<|pad|>", "<|end|>", "<|unk|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
CALL, CALL_END, RES, RES_END = "<call>", "</call>", "<res>", "</res>"
SPECIAL_TOKENS = (PAD, END, UNK, SYSTEM, USER, ASSISTANT, CALL, CALL_END, RES, RES_END)

# Roles render as <|role|>content<|end|>. An assistant turn that calls the tool stops right after
# </call> (no <|end|>); the tool result <res>..</res> follows, and the next assistant message
# continues the same turn without a new header. `add_generation_prompt` therefore opens a turn only
# when the last message is not a tool result: that keeps every rendering a prefix of the next one.
CHAT_TEMPLATE = (
    "{%- if tools -%}{{ '<|system|>tools: ' }}"
    "{%- for t in tools -%}{%- set f = t.function if t.function is defined else t -%}"
    "{{ f.name }}({{ (f.parameters.properties if f.parameters is defined else {}) | list | join(', ') }})"
    "{%- if not loop.last %}, {% endif -%}{%- endfor -%}<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}<res>{{ m.content }}</res>"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|assistant|>{%- endif -%}"
    "{{ m.content if m.content else '' }}"
    "{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}"
    "{%- set f = c.function if c.function is defined else c -%}"
    "<call>{{ f.arguments if f.arguments is string else f.arguments.expression }}</call>"
    "{%- endfor -%}{%- else -%}<|end|>{%- endif -%}"
    "{%- else -%}<|{{ m.role }}|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and not (messages and messages[-1].role == 'tool') -%}"
    "<|assistant|>{%- endif -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer with the chat template (deterministic; takes milliseconds)."""
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    # Special tokens are matched before pre-tokenization; everything else splits into characters.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate characters back, no spaces in between
    trainer = trainers.WordLevelTrainer(
        vocab_size=1024, min_frequency=0, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    # Every printable ASCII character once, plus task text so digits and operators get low ids.
    rng = random.Random(0)
    task_text = [f"{a}*{b}?{a * b}" for a, b in ((rng.randrange(100), rng.randrange(100)) for _ in range(64))]
    tok.train_from_iterator([string.printable, *task_text], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=END,
        unk_token=UNK,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (PAD, END, UNK)],
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
