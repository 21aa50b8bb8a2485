"""Measure a policy on the built-in "A*B?" task: success and tool-use rates at temperature 1.

    python bench/warm_start_eval.py [model_dir|builtin:tiny] [--episodes 256] [--seed 0]

Episodes follow the token-level format of nanoverl_async/agents/multiply_task.py: sample until `</call>` or
`<|end|>`; after `</call>` the true `<res>result</res>` (or `<res>error: ...</res>`) is appended as a
chat-template delta and sampling continues, for at most `max_turns` assistant segments. An episode
succeeds when its last segment ends with `<|end|>` and its text equals the product. Sampling is plain
softmax at the given temperature (no top-k / top-p), as the RL generators sample.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nanoverl_async.agents import multiply_task  # noqa: E402
from nanoverl_async.models.load import resolve_model_path  # noqa: E402

_CALL = re.compile(r"<call>(.*?)</call>$", re.S)


def _sample(model, tok, contexts: list[list[int]], max_new_tokens: int, temperature: float) -> list[list[int]]:
    """Sample one segment per context (left padded, KV cache), stopping at </call> or <|end|>."""
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("</call>")]
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):] = torch.tensor(c)
        mask[i, width - len(c):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                         top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, eos_token_id=stops,
                         pad_token_id=tok.pad_token_id)
    segments = []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
        segments.append(row[:cut])
    return segments


def evaluate_model(model, tok, episodes: int = 256, seed: int = 0, temperature: float = 1.0,
                   max_turns: int = 3, max_new_tokens: int = 16) -> dict:
    """Success / tool-use rates of `model` over `episodes` fresh prompts (seeded)."""
    torch.manual_seed(seed)
    samples = [multiply_task.make_prompt(seed + 10_000, i) for i in range(episodes)]
    contexts = [tok.apply_chat_template(s["messages"], add_generation_prompt=True, tokenize=False) for s in samples]
    contexts = [tok(c, add_special_tokens=False)["input_ids"] for c in contexts]
    active, calls, answers = list(range(episodes)), [0] * episodes, [""] * episodes
    for _ in range(max_turns):
        if not active:
            break
        segments = _sample(model, tok, [contexts[i] for i in active], max_new_tokens, temperature)
        still = []
        for i, seg in zip(active, segments):
            contexts[i] = contexts[i] + seg
            text = tok.decode(seg, skip_special_tokens=False)
            match = _CALL.search(text)
            if match is None:  # ended with <|end|> (an answer) or ran out of tokens (no answer)
                answers[i] = text[: -len(tok.eos_token)] if text.endswith(tok.eos_token) else ""
                continue
            calls[i] += 1
            try:
                result = multiply_task.calculator(match.group(1))
            except ValueError as err:
                result = f"error: {err}"
            # The tool result is a chat-template delta, exactly as the agent loop appends it.
            delta = tok.apply_chat_template([{"role": "tool", "content": result}], tokenize=False)
            contexts[i] = contexts[i] + tok(delta, add_special_tokens=False)["input_ids"]
            still.append(i)
        active = still
    success = [multiply_task.score(s, a) if a else 0.0 for s, a in zip(samples, answers)]
    return {
        "episodes": episodes,
        "success": sum(success) / episodes,
        "tool_use": sum(c > 0 for c in calls) / episodes,
        "success_with_tool": sum(s for s, c in zip(success, calls) if c) / max(1, sum(c > 0 for c in calls)),
        "success_direct": sum(s for s, c in zip(success, calls) if not c) / max(1, sum(c == 0 for c in calls)),
    }


def evaluate_policy(model_dir: str, episodes: int = 256, seed: int = 0) -> dict:
    """evaluate_model on a saved model directory (or builtin:tiny)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model_dir)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return evaluate_model(model, tok, episodes=episodes, seed=seed)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="builtin:tiny")
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    stats = evaluate_policy(args.model, args.episodes, args.seed)
    print(json.dumps({**stats, "seconds": round(time.perf_counter() - start, 1)}))
