"""A warm start before RL: supervised steps on demonstrations that a scripted solver writes (model.warm_start).

    model_path = start_model(cfg, base)     # preflight's plan (launch, replay); base: model.path resolved
    print(report(model_path))               # what the warm start measured

Why: RL learns only from what the policy samples. A base model that never calls the environment's tools
(SmolLM2-135M-Instruct never does) gives groups whose rewards are all equal, so GRPO has no signal. A few
hundred demonstrations of the environment's own tool calls give it one (the cold-start SFT before RL of
DeepSeek-R1, and of agentic RL recipes). The user writes the solver, the environment writes the rest:

    def solve(sample, messages):                  # model.warm_start.solver: path/file.py:solve
        if messages[-1]["role"] != "tool":        # the messages so far, tool results included
            return {"name": "calc", "arguments": {"expression": sample["expression"]}}
        return f"The answer is {messages[-1]['content']}."

1. Demonstrations: `demos` episodes of agent.env through the real agent loop (agent_loop.play), each turn
   written by the solver instead of sampled (a tool call is written in the environment's tool format,
   tool_parsers.write_calls), so their tokens, loss masks and template deltas are exactly RL's. Prompts come
   from the run's own prompt stream, DEMO_INDEX on (data.task: prompts RL does not draw; data.train_files:
   the same rows in another epoch's order).
2. The demonstrations that earned a reward > 0 train the model: cross-entropy on the written tokens (loss
   mask 1), `epochs` passes in batches of `batch_size`, AdamW at `lr`, gradients clipped at 1.
3. `eval_episodes` held-out episodes (the next prompts of that stream, or data.val_files), sampled by the base
   and by the warm-started model at generator.temperature with the project's engine: the share that calls a
   tool and the mean reward, kept beside the model (warm_start.json) and printed at every launch.

The model is cached like the built-in ones (models/cache.py): its directory is named by a hash of everything
that determines it (the base model's files by name, size and time, the source files of the solver, environment,
task and reward by content, the agent's limits, these settings), so an edited solver makes a new one and an
unchanged config finds it.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import random
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from nanoverl_async.agents.agent_loop import Episode, play, run_episode
from nanoverl_async.agents.data import load_samples, prompt_source
from nanoverl_async.agents.env import env_factory
from nanoverl_async.agents.rewards import load_reward
from nanoverl_async.agents.tool_parsers import write_calls
from nanoverl_async.agents.user_code import (BUILTINS, UserCodeError, broken_contract, call_user, defined_at,
                                             load_object)
from nanoverl_async.config import Config, ConfigError, to_dict
from nanoverl_async.agents.engine import Completion, SamplingParams
from nanoverl_async.models.cache import build_once
from nanoverl_async.models.load import DTYPES, load_tokenizer

DEMO_INDEX = 10**9  # demonstrations and held-out episodes draw the run's prompt stream from here: RL never gets so far
RESULTS = "warm_start.json"  # beside the warm-started model: what the warm start trained on and measured
EXPECTED = ('a final answer (str), or a tool call {"name": ..., "arguments": {...}} (or a list of them)')


def start_model(cfg: Config, model_path: str) -> str:
    """The model RL starts from: model.path resolved, after model.warm_start if it is on (made once, cached)."""
    try:
        return warm_started(cfg, model_path)
    except (UserCodeError, ValueError) as error:  # the solver's or the environment's, in one line
        raise ConfigError(f"config key 'model.warm_start.solver': {error}") from None


def warm_started(cfg: Config, base: str) -> str:
    """The model directory RL starts from: `base` (model.path resolved) itself if model.warm_start.solver is
    unset, else `base` after the warm start, made once and cached."""
    settings = cfg.model.warm_start
    if not settings.solver:
        return base
    note = f"{settings.demos} demonstrations, {settings.epochs} epoch(s), {settings.eval_episodes} episodes evaluated"
    with torch.random.fork_rng(devices=[]):  # seeded, and the caller's stream stays untouched
        torch.manual_seed(cfg.run.seed)
        return build_once(f"warm-start-{Path(base).name}"[:64], recipe(cfg, base),
                          lambda directory: write(cfg, base, directory), cfg.model.cache_dir, note=note,
                          what=f"the warm start of {cfg.model.path} (model.warm_start)")


def report(model_path: str) -> str:
    """One line of what a warm start measured, read from its directory ("" for a model without one)."""
    path = Path(model_path) / RESULTS
    if not path.is_file():
        return ""
    done = json.loads(path.read_text())
    before, after = done["base"], done["warm_started"]
    return (f"warm start: trained on {done['trained']} of {done['demos']} demonstrations (final loss "
            f"{done['loss']:.3f}); on {after['episodes']} held-out episodes, tool calls in "
            f"{after['tool_call_rate']:.0%} (base model {before['tool_call_rate']:.0%}), mean reward "
            f"{after['reward']:.2f} (base {before['reward']:.2f}); {model_path}")


def recipe(cfg: Config, base: str) -> dict:
    """Everything that determines the warm-started model, JSON-able: its cache key."""
    task = [] if cfg.data.train_files else [cfg.data.task]
    sources = [cfg.model.warm_start.solver, cfg.agent.env, cfg.reward.path, *task]
    return {"base": _files_digest([p for p in Path(base).rglob("*") if p.is_file()], content=False),
            "sources": {spec: _source_digest(spec) for spec in sources if spec},
            "data": _files_digest([Path(p) for p in [*cfg.data.train_files, *cfg.data.val_files]], content=False),
            "warm_start": to_dict(cfg.model.warm_start), "agent": to_dict(cfg.agent), "reward": to_dict(cfg.reward),
            "dtype": cfg.model.dtype, "temperature": cfg.generator.temperature, "seed": cfg.run.seed}


def _files_digest(paths: list[Path], content: bool = True) -> str:
    """A hash of the files' names, sizes and contents; without `content`, their modification times instead (a
    model's weights, a dataset: reading gigabytes at every launch to find the cached warm start costs too much)."""
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(paths):
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{'' if content else stat.st_mtime_ns}\0".encode())
        if content:
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _source_digest(spec: str) -> str:
    """A hash of the file that defines `spec` (builtin:NAME, pkg.module:Name or path/file.py:Name)."""
    target = next((table[spec] for table in BUILTINS.values() if spec in table), spec)
    where = target.rsplit(":", 1)[0]
    found = None if where.endswith(".py") else importlib.util.find_spec(where)
    origin = where if found is None else found.origin
    return _files_digest([Path(origin)]) if origin and Path(origin).is_file() else ""


def write(cfg: Config, base: str, directory: Path) -> str:
    """Demonstrate, train, save into `directory`, evaluate both models there: models/cache.build_once's `write`."""
    settings, tokenizer = cfg.model.warm_start, load_tokenizer(base)
    new_env = env_factory(cfg.agent.env, load_reward(cfg.reward.path, cfg.reward.name), cfg.agent.env_args)
    prompts = prompt_source(cfg.data, cfg.run.seed)
    held_out = load_samples(cfg.data.val_files, cfg.data.skip_rows)[:settings.eval_episodes] if cfg.data.val_files \
        else [prompts(DEMO_INDEX + settings.demos + i) for i in range(settings.eval_episodes)]
    solver = load_object(settings.solver, "model.warm_start.solver")
    samples = [prompts(DEMO_INDEX + i) for i in range(settings.demos)]
    shown = asyncio.run(demonstrations(solver, samples, new_env, tokenizer, cfg))
    kept = [(ids, mask) for ids, mask, reward in shown if reward > 0]
    if not kept:
        raise UserCodeError(f"{solver_hook(solver)}{defined_at(solver)}: none of its {len(shown)} demonstrations "
                            f"earned a reward > 0 from agent.env")
    model = _model(base, cfg)
    loss = train(model, kept, settings.batch_size, settings.epochs, settings.lr, cfg.run.seed)
    model.to(DTYPES[cfg.model.dtype]).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    del model
    results = {"demos": len(shown), "trained": len(kept), "loss": loss,
               **{name: asyncio.run(evaluate(path, held_out, new_env, tokenizer, cfg))
                  for name, path in (("base", base), ("warm_started", str(directory)))}}
    (directory / RESULTS).write_text(json.dumps(results, indent=1))
    return f"{len(kept)} of {len(shown)} demonstrations, final loss {loss:.3f}"


def solver_hook(solver: Callable) -> str:
    """How errors name the solver: 'model.warm_start.solver solve'."""
    return f"model.warm_start.solver {getattr(solver, '__name__', solver)}"


class Teacher:
    """An engine (agents/engine.Engine) whose every turn the solver writes for one episode, from the
    sample and the episode's messages so far, each within agent.hook_timeout_s as any hook (user_code.call_user);
    logprobs 0 and version 0, as nothing is sampled."""

    def __init__(self, solver: Callable, sample: dict, tokenizer):
        self.solver, self.sample, self.tokenizer = solver, sample, tokenizer
        self.hook = solver_hook(solver)
        self.episode: Optional[Episode] = None  # set once the episode exists: its messages are the solver's input

    async def generate(self, input_ids: list[int], params: SamplingParams, episode_id=None) -> Completion:
        turn = await call_user(self.hook, self.solver, self.sample, [dict(m) for m in self.episode.messages],
                               timeout_s=self.episode.agent.hook_timeout_s, key="agent.hook_timeout_s")
        calls = [turn] if isinstance(turn, dict) else turn
        if not (isinstance(turn, str) or (isinstance(calls, list) and calls and all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)
                for c in calls))):
            raise broken_contract(self.hook, self.solver, turn, f"return {EXPECTED}")
        try:
            text = turn if isinstance(turn, str) else write_calls(calls, self.episode.tool_format)
        except ValueError as error:
            raise UserCodeError(f"{self.hook}{defined_at(self.solver)}: {error}") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        ids += [] if ids and ids[-1] in params.stop_token_ids else [self.tokenizer.eos_token_id]
        if len(ids) > params.max_new_tokens:
            raise UserCodeError(f"{self.hook}{defined_at(self.solver)} wrote a turn of {len(ids)} tokens, more than "
                                f"the {params.max_new_tokens} that agent.max_new_tokens and max_total_tokens leave")
        return Completion(ids, [0.0] * len(ids), [0] * len(ids), "stop")


async def demonstrations(solver: Callable, samples: list[dict], new_env: Callable[[], Any], tokenizer,
                         cfg: Config) -> list[tuple[list[int], list[int], float]]:
    """(token ids, loss mask, reward) of one solver-written episode per sample."""
    async def demonstrate(sample: dict):
        env, teacher = new_env(), Teacher(solver, sample, tokenizer)
        teacher.episode = episode = Episode(teacher, tokenizer, cfg.agent, 1.0, env)
        reward, _ = await play(episode, env, sample)
        return episode.record.ids, episode.record.mask, reward
    return list(await asyncio.gather(*(demonstrate(sample) for sample in samples)))


def _model(base: str, cfg: Config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM  # here: the launching process imports it only for this

    device = "cuda" if cfg.learner.device == "cuda" else "cpu"
    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(device)


def train(model: torch.nn.Module, demos: list[tuple[list[int], list[int]]], batch_size: int, epochs: int,
          lr: float, seed: int) -> float:
    """Cross-entropy on each demonstration's written tokens (mask 1) -> the last batch's loss. Right-padded
    batches in an order shuffled per epoch by `seed`."""
    device, order = next(model.parameters()).device, list(range(len(demos)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.zeros(())
    for epoch in range(epochs):
        random.Random(f"warm_start:{seed}:{epoch}").shuffle(order)
        for start in range(0, len(order), batch_size):
            rows = [demos[i] for i in order[start:start + batch_size]]
            width = max(len(ids) for ids, _ in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            labels, attention = torch.full_like(ids, -100), torch.zeros_like(ids)
            for i, (row, mask) in enumerate(rows):
                row = torch.as_tensor(row, dtype=torch.long)
                ids[i, :len(row)], attention[i, :len(row)] = row, 1
                labels[i, :len(row)] = torch.where(torch.as_tensor(mask, dtype=torch.bool), row, -100)
            loss = model(input_ids=ids.to(device), attention_mask=attention.to(device), labels=labels.to(device)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    model.eval()
    return float(loss.detach())


async def evaluate(path: str, samples: list[dict], new_env: Callable[[], Any], tokenizer, cfg: Config) -> dict:
    """The model at `path` on `samples`, one episode each, sampled as the generators sample: the share of
    episodes that call a tool, and the mean reward."""
    from nanoverl_async.generators.builtin_engine import BuiltinEngine  # the engine's imports: only when evaluating

    engine = BuiltinEngine(path, cfg.generator.device, cfg.model.dtype, seed=cfg.run.seed,
                           kv_cache_memory=cfg.generator.kv_cache_memory, block_size=cfg.generator.kv_block_size)
    runs = await asyncio.gather(*(run_episode(engine, tokenizer, sample, new_env(), cfg.agent,
                                              cfg.generator.temperature, sample_index=i)
                                  for i, sample in enumerate(samples)))
    return {"episodes": len(runs), "tool_call_rate": sum(t.tool_calls > 0 for t in runs) / max(1, len(runs)),
            "reward": sum(t.reward for t in runs) / max(1, len(runs))}

