"""A policy's tool-call, tool-error and success rates on any environment, through the real agent loop.

    python bench/tool_eval.py builtin:smollm2-135m --env examples/smollm2_tools.py:WordProblemEnv \
        --task examples/smollm2_tools.py:make_prompt [--episodes 16] [--max-new-tokens 64] [--dtype float32]

Episodes run as in training: `BuiltinEngine` (continuous batching), `run_episode` (tokens in, tokens
out, tool calls parsed and run, results appended as template deltas), the environment's own reward, at
the given temperature (plain softmax, as the generators sample). Prints one JSON line: the rates, the
generated tokens/s, and --show example episodes' text on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nanoverl_async.config import AgentConfig  # noqa: E402
from nanoverl_async.agents.env import env_factory  # noqa: E402
from nanoverl_async.agents.agent_loop import run_episode  # noqa: E402
from nanoverl_async.generators.builtin_engine import BuiltinEngine  # noqa: E402
from nanoverl_async.models.load import load_tokenizer, resolve_model_path  # noqa: E402
from nanoverl_async.agents.user_code import load_object  # noqa: E402


async def evaluate(model: str, env: str, task: str, episodes: int, agent: AgentConfig, temperature: float,
                   dtype: str, seed: int, show: int) -> dict:
    path = resolve_model_path(model)
    tokenizer, engine = load_tokenizer(path), BuiltinEngine(path, dtype=dtype, seed=seed)
    make_env, make_prompt = env_factory(env), load_object(task, "data.task")
    samples = [make_prompt(seed + 10_000, i) for i in range(episodes)]
    started = time.perf_counter()
    runs = await asyncio.gather(*(run_episode(engine, tokenizer, s, make_env(), agent, temperature,
                                              sample_index=i) for i, s in enumerate(samples)))
    seconds = time.perf_counter() - started
    for t in runs[:show]:
        print(f"--- reward {t.reward} ---\n{tokenizer.decode(t.token_ids.tolist())}", file=sys.stderr)
    sampled = sum(int(t.loss_mask.sum()) for t in runs)
    return {
        "episodes": episodes, "success": sum(t.reward for t in runs) / episodes,
        "tool_call_rate": sum(t.tool_calls > 0 for t in runs) / episodes,
        "tool_error_rate": sum(t.tool_errors for t in runs) / max(1, sum(t.tool_calls for t in runs)),
        "success_with_tool": sum(t.reward for t in runs if t.tool_calls) / max(1, sum(t.tool_calls > 0 for t in runs)),
        "turns_mean": sum(t.num_turns for t in runs) / episodes,
        "sampled_tokens": sampled, "tokens_per_s": round(sampled / seconds, 1), "seconds": round(seconds, 1),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--env", required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-total-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=0, help="print this many episodes' text on stderr")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = AgentConfig(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                         max_total_tokens=args.max_total_tokens)
    print(json.dumps(asyncio.run(evaluate(args.model, args.env, args.task, args.episodes, config, args.temperature,
                                          args.dtype, args.seed, args.show))))
