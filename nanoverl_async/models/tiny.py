"""The built-in tiny model: `builtin:tiny`, created locally (no download) and cached.

    path = build_tiny()                               # builds once (~a minute), then a cache hit
    model = AutoModelForCausalLM.from_pretrained(path); tok = AutoTokenizer.from_pretrained(path)

What it is: a byte-level tokenizer without merges (every byte one token, so each digit and operator
is one token, and any text round-trips) with a compact chat template, and a ~1M-parameter
Qwen2ForCausalLM warm-started by a short SFT on demos of the built-in "A*B?" task
(nanoverl_async/agents/multiply_task.py). The warm start is calibrated to leave RL something to learn: the
policy sampled at temperature 1 uses the tool rarely and succeeds rarely at first (docs/design.md
"The embedded default model and task").

Invariants:
- the cache directory name carries a hash of the whole recipe (every hyperparameter, the recipe
  version, the chat template), so a changed recipe never reuses a stale model;
- it is built once and cached (nanoverl_async/models/cache.py: atomic rename under a lock);
- the tokenizer is exactly what transformers' `Qwen2Tokenizer` (which `AutoTokenizer` returns for a
  `qwen2` config) rebuilds from tokenizer.json: byte-level BPE, NFC, no merges, so `final/` loads as
  itself in transformers and SGLang (nanoverl_async/models/load.py);
- the chat template is prefix-consistent: rendering messages[:k] and then the delta of the rest
  gives exactly the rendering of all messages (the agent loop appends deltas, never re-renders).

Run alone:  python -m nanoverl_async.models.tiny [cache_dir]   (builds or finds, prints the path)
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config

from nanoverl_async.agents import code_task, long_tail_task, multiply_task, sandbox
from nanoverl_async.models.cache import build_once

RECIPE_VERSION = 2  # bump whenever the build code changes what it produces
SECONDS_PER_STEP = 0.23  # warm-start step time at batch 64, measured on one busy core (log line only)
MAX_POSITIONS = 256  # its position table; preflight.py reads this line to check agent.max_total_tokens unbuilt

# The warm start's task -> (demo(rng) -> [(question, tool call, tool result, answer)], the tool it calls).
# A task's model is `builtin:tiny-TASK` (multiply's is plain `builtin:tiny`): the cache directory names it.
TASKS = {"multiply": (multiply_task.demo, multiply_task.calculator),
         "long-tail": (long_tail_task.demo, multiply_task.calculator),
         "code": (code_task.demo, sandbox.python)}

PAD = "<|pad|>"
END = "<|end|>"
UNK = "<|unk|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
CALL = "<call>"
CALL_END = "</call>"
RES = "<res>"
RES_END = "</res>"
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
    """The byte-level tokenizer with the chat template (deterministic; takes milliseconds)."""
    # The special tokens first, then the 256 byte symbols in a fixed order; no merges, so one byte is
    # one token, and the tokenizer is the byte-level BPE that Qwen2Tokenizer rebuilds from the file.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=END, unk_token=UNK,
                                   additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (PAD, END, UNK)],
                                   clean_up_tokenization_spaces=False, model_max_length=256)
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines the built model; its hash names the cache directory."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_positions: int = MAX_POSITIONS
    steps: int = 300  # SFT optimizer steps (fixed, never time-based: the result must not depend on the CPU)
    batch_size: int = 64  # demos per step
    lr: float = 2e-3  # AdamW peak lr; linear warmup then cosine decay to 10%
    warmup_steps: int = 30
    weight_decay: float = 0.0
    tool_fraction: float = 0.5  # demos that call the tool; the rest answer directly (mostly wrongly)
    call_rate: float = 0.25  # the trained P(first token is <call>): the policy's initial tool use
    tools_header_fraction: float = 0.0  # demos opening with the `tools:` line (doubles their cost)
    seed: int = 0
    task: str = "multiply"  # whose demos (TASKS); each question of a demo decides on the tool alone

    def __post_init__(self):
        if not 0 < self.call_rate <= self.tool_fraction < 1:
            raise ValueError(f"TinyRecipe needs 0 < call_rate <= tool_fraction < 1, got {self}")
        if self.task not in TASKS:
            raise ValueError(f"TinyRecipe task {self.task!r} is not one of {', '.join(TASKS)}")

    @property
    def call_keep(self) -> float:
        """The share of tool demos whose `<call>` decision token is trained, so that
        P(<call>) = f q / (f q + 1 - f) equals call_rate (f = tool_fraction, q = this)."""
        f, r = self.tool_fraction, self.call_rate
        return r * (1 - f) / (f * (1 - r))

    @property
    def kind(self) -> str:
        """The cache directory's prefix and the built-in's name: tiny, tiny-long-tail, tiny-code."""
        return "tiny" if self.task == "multiply" else f"tiny-{self.task}"

    def contents(self) -> dict:
        """What the cache directory's name hashes: this recipe, the build code's version and the chat template.
        The task is in the name's prefix (`kind`), not the hash: builtin:tiny kept its directory when tasks came."""
        recipe = {key: value for key, value in dataclasses.asdict(self).items() if key != "task"}
        return {"recipe_version": RECIPE_VERSION, "chat_template": CHAT_TEMPLATE, **recipe}


def build_model(tokenizer: PreTrainedTokenizerFast, recipe: TinyRecipe) -> Qwen2ForCausalLM:
    """A freshly initialised Qwen2 (seeded by recipe.seed), sized for the tokenizer."""
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, num_hidden_layers=recipe.num_layers,
                         num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
                         intermediate_size=recipe.intermediate_size, max_position_embeddings=recipe.max_positions,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    from transformers import Qwen2ForCausalLM  # here: the modeling code takes a second; the tokenizer needs none of it

    torch.manual_seed(recipe.seed)
    return Qwen2ForCausalLM(config)  # its generation config takes eos and pad from `config`


def demo_pieces(tokenizer: PreTrainedTokenizerFast, tools: bool, tool=multiply_task.calculator) -> dict[str, str]:
    """The chat-template renderings of one demo, cut at turn boundaries, with placeholders.

    Rendering each demo through Jinja would cost a rendering a message
    (docs/benchmarks.md "Costs behind choices in the code"); the template output is plain text, so we render
    once with placeholders {Q} {E} {R} {P} and fill them per demo.
    """
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "{E}"}}}
    msgs = [{"role": "user", "content": "{Q}"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "{R}"}, {"role": "assistant", "content": "{P}"}]
    kw = {"tools": [tool] if tools else None, "tokenize": False}
    prompt = tokenizer.apply_chat_template(msgs[:1], add_generation_prompt=True, **kw)
    renders = [prompt] + [tokenizer.apply_chat_template(msgs[:k], **kw) for k in (2, 3, 4)]
    direct = tokenizer.apply_chat_template([msgs[0], msgs[3]], **kw)  # prefix-consistent: tests/test_tiny_model.py
    return {"prompt": prompt, "call": renders[1][len(prompt):], "result": renders[2][len(renders[1]):],
            "answer": renders[3][len(renders[2]):], "direct": direct[len(prompt):]}


def demo_batch(tokenizer, pieces: list[dict], recipe: TinyRecipe, rng: random.Random) -> list[dict]:
    """One SFT batch as sub-batches (demos that call the tool, direct demos), each right-padded to its own width.

    Labels are -100 except on tokens the model samples (the call and the answer): never on the
    prompt or the `<res>..</res>` tool result (the environment writes those, as in RL). Why the
    `<call>` token is trained on only a share of the tool demos: copying operands is a skill the
    model learns abruptly and only from enough tool demos, while the initial tool-use rate must stay
    low for RL to have something to learn; training the decision token on a share `call_keep`
    separates the two (many tool demos, a calibrated P(<call>)). Tool demos are about twice as long
    as direct ones, so they are padded apart, which saves compute
    (docs/benchmarks.md "Costs behind choices in the code"). A demo of several questions (long-tail) asks each
    after the last answer, as the environment does, and decides on the tool for each.
    """
    demos = []  # (calls the tool, [(text, trained on)])
    for _ in range(recipe.batch_size):
        questions = TASKS[recipe.task][0](rng)
        p = pieces[rng.random() < recipe.tools_header_fraction]
        segments, called = [], False
        for i, (question, call, result, answer) in enumerate(questions):
            prompt = (p if i == 0 else pieces[0])["prompt"]  # a follow-up question has no tools line
            segments.append((prompt.replace("{Q}", question), 0))
            use_tool = rng.random() < recipe.tool_fraction
            decide = int(rng.random() < recipe.call_keep)
            if use_tool:  # `<call>` is the decision to use the tool; the rest of the call is the skill
                segments += [(CALL, decide), (p["call"][len(CALL):].replace("{E}", call), 1),
                             (p["result"].replace("{R}", result), 0), (p["answer"].replace("{P}", answer), 1)]
            else:
                segments.append((p["direct"].replace("{P}", answer), 1))
            called |= use_tool
        demos.append((called, segments))
    # one tokenizer call for the whole batch: per-segment calls showed in a step
    # (docs/benchmarks.md "Costs behind choices in the code")
    encoded = iter(tokenizer([t for _, segs in demos for t, _ in segs], add_special_tokens=False)["input_ids"])
    groups: dict[bool, list[tuple[list[int], list[int]]]] = {True: [], False: []}
    for use_tool, segments in demos:
        ids, labels = [], []
        for _, train in segments:
            seg = next(encoded)
            ids += seg
            labels += seg if train else [-100] * len(seg)
        groups[use_tool].append((ids, labels))
    return [_pad(rows, tokenizer.pad_token_id) for rows in groups.values() if rows]


def _pad(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
    ids = [torch.tensor(row) for row, _ in rows]
    return {"input_ids": pad_sequence(ids, batch_first=True, padding_value=pad_id),
            "attention_mask": pad_sequence([torch.ones_like(row) for row in ids], batch_first=True),
            "labels": pad_sequence([torch.tensor(labels) for _, labels in rows], batch_first=True, padding_value=-100)}


def sft_step(model, sub_batches: list[dict]) -> torch.Tensor:
    """Backpropagate the mean token loss over all sub-batches (one global normaliser); returns it."""
    # HF shifts labels left by one inside the loss, so the count of predicted tokens is labels[:, 1:].
    n_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in sub_batches)
    total = torch.zeros(())
    for b in sub_batches:
        loss = model(**b, num_items_in_batch=n_tokens).loss  # sum over this sub-batch / n_tokens
        loss.backward()
        total += loss.detach()
    return total


def warm_start(model: Qwen2ForCausalLM, tokenizer, recipe: TinyRecipe) -> float:
    """Supervised warm start on synthetic demos; a fixed number of steps, seeded -> the final loss."""
    rng = random.Random(recipe.seed)
    pieces = [demo_pieces(tokenizer, tools, TASKS[recipe.task][1]) for tools in (False, True)]
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)

    def lr_scale(step: int) -> float:  # linear warmup, then cosine decay to 10% of the peak
        if step < recipe.warmup_steps:
            return (step + 1) / recipe.warmup_steps
        progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_scale)
    model.train()
    losses = []
    for _ in range(recipe.steps):
        opt.zero_grad(set_to_none=True)
        loss = sft_step(model, demo_batch(tokenizer, pieces, recipe, rng))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    tail = losses[-20:] or [float("nan")]
    return sum(tail) / len(tail)


def build_tiny(cache_dir: str = "", recipe: TinyRecipe = TinyRecipe()) -> str:
    """The directory of the tiny model for `recipe`, built once and cached (nanoverl_async/models/cache.py)."""
    def write(directory: Path) -> str:
        with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
            tokenizer = build_tokenizer()
            model = build_model(tokenizer, recipe)
            final_loss = warm_start(model, tokenizer, recipe)
        model.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)
        return f"final SFT loss {final_loss:.3f}"

    estimate = max(1, round(recipe.steps * SECONDS_PER_STEP * recipe.batch_size / 64))
    return build_once(recipe.kind, recipe.contents(), write, cache_dir, note=f"one-time warm start, ~{estimate} s")


def build_tiny_long_tail(cache_dir: str = "") -> str:
    """`builtin:tiny-long-tail`: the tiny model warm-started on builtin:long-tail's demos."""
    return build_tiny(cache_dir, TinyRecipe(task="long-tail"))


def build_tiny_code(cache_dir: str = "") -> str:
    """`builtin:tiny-code`: the tiny model warm-started on builtin:code's demos."""
    return build_tiny(cache_dir, TinyRecipe(task="code"))


if __name__ == "__main__":
    print(build_tiny(sys.argv[1] if len(sys.argv) > 1 else ""))
