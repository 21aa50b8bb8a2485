"""Asynchronous (bounded staleness) vs synchronous (staleness.max=0) on the same job, side by side.

    python bench/async_vs_sync.py [key=value ...]        # e.g. run.total_steps=40

Runs configs/agent_grpo.yaml in this process tree, one run after the other, for the same number of
trained samples: with staleness.max=0 (exactly on-policy), once with the config's one thread per role
and once with two threads per role (a synchronous run leaves the other role's core idle, so this is
the fairer baseline on a 2-core machine), then with the config's staleness. Prints wall-clock of the
training loop, samples/s, the mean reward of the first and last 10% of steps for each, and the
ratios. Extra key=value arguments apply to every run.
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


def run_one(label: str, overrides: list[str]) -> dict:
    cfg = load_config(CONFIG, overrides + [f"run.output_dir=outputs/bench/async_vs_sync/{label}", "run.overwrite=true"])
    started = time.monotonic()
    output_dir = launch(cfg)
    total = time.monotonic() - started
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    train_wall = sum(row["time/step_s"] for row in rows)
    tail = rows[-max(1, len(rows) // 10):]
    return {
        "label": label,
        "staleness": cfg.staleness.max,
        "steps": len(rows),
        "samples": rows[-1]["samples/trained"],
        "train_wall_s": train_wall,
        "total_wall_s": total,
        "samples_per_s": rows[-1]["samples/trained"] / train_wall,
        "final_reward": sum(row["reward/mean"] for row in tail) / len(tail),
        "first_reward": sum(row["reward/mean"] for row in rows[:len(tail)]) / len(tail),
        "staleness_max_seen": max(row["staleness/max"] for row in rows),
    }


def main(extra: list[str]) -> None:
    default_eta = load_config(CONFIG, extra).staleness.max
    start_ray(load_config(CONFIG, extra).ray)  # one Ray instance for both runs
    quiet = ["run.progress=false"]
    two_threads = ["generator.torch_threads=2", "learner.torch_threads=2"]
    results = [run_one("sync", extra + quiet + ["staleness.max=0"]),
               run_one("sync_2threads", extra + quiet + ["staleness.max=0"] + two_threads),
               run_one(f"async_eta{default_eta}", extra + quiet + [f"staleness.max={default_eta}"])]
    table = Table(title="async vs sync (same trained samples, same machine, one after the other)")
    for column in ("run", "staleness.max", "steps", "samples", "train wall s", "total wall s", "samples/s",
                   "reward first 10%", "reward last 10%", "max staleness seen"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r["label"], str(r["staleness"]), str(r["steps"]), str(r["samples"]),
                      f"{r['train_wall_s']:.1f}", f"{r['total_wall_s']:.1f}", f"{r['samples_per_s']:.1f}",
                      f"{r['first_reward']:.3f}", f"{r['final_reward']:.3f}", str(r["staleness_max_seen"]))
    console = Console(width=200)
    console.print(table)
    async_ = results[-1]
    for sync in results[:-1]:
        console.print(f"{async_['label']} vs {sync['label']}: speedup (train wall) "
                      f"{sync['train_wall_s'] / async_['train_wall_s']:.2f}x, samples/s "
                      f"{async_['samples_per_s'] / sync['samples_per_s']:.2f}x, final reward "
                      f"{async_['final_reward']:.3f} vs {sync['final_reward']:.3f}")
    Path("outputs/bench/async_vs_sync/results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
