"""Off-policy correction ablation: `algorithm.correction=none` vs `decoupled` at the same staleness bound.

    python bench/correction_ablation.py [key=value ...]        # default: staleness.max=4, 60 steps

Runs configs/agent_grpo.yaml in this process tree, one run after the other (same seed, same machine),
once with the naive baseline (ratio against the behaviour policy, no IS weight) and once with the
decoupled correction (proximal recompute + truncated IS weight, AReaL). Prints, for each: the mean
reward of the first and last 10% of steps, the mean `mismatch_kl` (KL(mu || p_old) on tokens sampled by
the very weights the learner holds: train/inference mismatch alone), the mean `behaviour_kl` (all
tokens: staleness plus mismatch), the mean IS weight and clip fraction, the staleness seen and the wall
time. Extra key=value arguments apply to every run (e.g. run.total_steps=20 for a quick look).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from nanoverl_async.config import load_config
from nanoverl_async.launcher import launch, start_ray

CONFIG = "configs/agent_grpo.yaml"
OUT = Path("outputs/bench/correction_ablation")


def mean(rows: list[dict], key: str) -> float:
    values = [row[key] for row in rows if key in row]
    return sum(values) / len(values) if values else float("nan")


def run_one(correction: str, overrides: list[str]) -> dict:
    cfg = load_config(CONFIG, overrides + [f"algorithm.correction={correction}",
                                           f"run.output_dir={OUT / correction}", "run.overwrite=true"])
    started = time.monotonic()
    output_dir = launch(cfg)
    wall = time.monotonic() - started
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    tail = rows[-max(1, len(rows) // 10):]
    return {
        "correction": correction,
        "staleness": cfg.staleness.max,
        "steps": len(rows),
        "first_reward": mean(rows[:len(tail)], "reward/mean"),
        "final_reward": mean(tail, "reward/mean"),
        "mismatch_kl": mean(rows, "learner/mismatch_kl"),
        "behaviour_kl": mean(rows, "learner/behaviour_kl"),
        "is_weight_mean": mean(rows, "learner/is_weight_mean"),
        "clip_fraction": mean(rows, "learner/clip_fraction"),
        "staleness_mean": mean(rows, "staleness/mean"),
        "staleness_max_seen": max(row["staleness/max"] for row in rows),
        "wall_s": wall,
    }


def main(extra: list[str]) -> None:
    overrides = ["staleness.max=4", "run.progress=false", *extra]
    start_ray(load_config(CONFIG, overrides).ray)  # one Ray instance for both runs
    results = [run_one(correction, overrides) for correction in ("none", "decoupled")]
    seed = load_config(CONFIG, overrides).run.seed
    table = Table(title=f"off-policy correction ablation (same config, seed {seed}, one run after the other)")
    columns = ("correction", "staleness.max", "steps", "reward first 10%", "reward last 10%", "mismatch_kl",
               "behaviour_kl", "IS weight mean", "clip fraction", "staleness mean", "max staleness", "wall s")
    for column in columns:
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r["correction"], str(r["staleness"]), str(r["steps"]), f"{r['first_reward']:.3f}",
                      f"{r['final_reward']:.3f}", f"{r['mismatch_kl']:.2e}", f"{r['behaviour_kl']:.2e}",
                      f"{r['is_weight_mean']:.3f}", f"{r['clip_fraction']:.3f}", f"{r['staleness_mean']:.2f}",
                      str(r["staleness_max_seen"]), f"{r['wall_s']:.0f}")
    Console(width=200).print(table)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
