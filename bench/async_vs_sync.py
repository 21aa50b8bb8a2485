"""Asynchronous (bounded staleness) vs synchronous (staleness.max=0) on the same job, side by side.

    python bench/async_vs_sync.py [--repeats N] [key=value ...]        # e.g. run.total_steps=40

Runs configs/agent_grpo.yaml in this process tree, one run after the other, for the same number of
trained samples: with staleness.max=0 (exactly on-policy), once with the config's threads per role (the
generator's one, the learner's micro-batch threads) and once with two intra-op threads per role (so that each
phase of a synchronous step may use both cores of a 2-core machine; left out when the roles run on a GPU), then
with the config's staleness; with --repeats N, N times each, interleaved (A B C C B A ...), reported as min-max.
Prints wall-clock of the training loop, samples/s, the learner's mean seconds per step training and waiting for a batch
(how much of a synchronous step training is), the mean reward of the first and last 10% of steps for
each, and the ratios (the range, and each repeat's); the headline is against the faster synchronous run of
each repeat. Extra key=value arguments apply to every run.
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


def run_one(label: str, repeat: int, overrides: list[str], config: str = CONFIG, bench: str = "async_vs_sync") -> dict:
    """One run of `config` -> its summary, and its per-step rewards and seconds (bench/agentic.py reads them)."""
    output = f"outputs/bench/{bench}/{label}-{repeat}"
    cfg = load_config(config, overrides + [f"run.output_dir={output}", "run.overwrite=true"])
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
        "train_s_per_step": sum(row["time/train_s"] for row in rows) / len(rows),
        "wait_s_per_step": sum(row["time/wait_batch_s"] for row in rows) / len(rows),
        "final_reward": sum(row["reward/mean"] for row in tail) / len(tail),
        "first_reward": sum(row["reward/mean"] for row in rows[:len(tail)]) / len(tail),
        "staleness_max_seen": max(row["staleness/max"] for row in rows),
        "rewards": [row["reward/mean"] for row in rows],
        "step_s": [row["time/step_s"] for row in rows],
    }


def main(argv: list[str]) -> None:
    repeats = int(argv.pop(argv.index("--repeats") + 1)) if "--repeats" in argv else 1
    extra = [arg for arg in argv if arg != "--repeats"]
    cfg = load_config(CONFIG, extra)
    default_eta, on_cpu = cfg.staleness.max, cfg.generator.device == "cpu" and cfg.learner.device == "cpu"
    start_ray(cfg.ray)  # one Ray instance for every run
    quiet = ["run.progress=false"]
    # two intra-op threads each (as fast as two micro-batch threads when the learner has both cores to itself)
    two_threads = ["generator.torch_threads=2", "learner.torch_threads=2", "learner.micro_batch_threads=1"]
    runs = {"sync_2threads": quiet + ["staleness.max=0"] + two_threads} if on_cpu else {}  # cores matter on CPU only
    runs |= {f"async_eta{default_eta}": quiet + [f"staleness.max={default_eta}"], "sync": quiet + ["staleness.max=0"]}
    results = {label: [] for label in runs}
    for repeat in range(repeats):  # A B C, then C B A, ...
        for label in list(runs)[::1 if repeat % 2 == 0 else -1]:
            results[label].append(run_one(label, repeat, extra + runs[label]))
    table = Table(title=f"async vs sync (same trained samples, same machine, one after the other; min-max over "
                        f"{repeats} run(s) each)")
    for column in ("run", "staleness.max", "steps", "train wall s", "total wall s", "samples/s", "train s/step",
                   "wait s/step", "reward first 10%", "reward last 10%", "max staleness seen"):
        table.add_column(column, justify="right")

    def span(label: str, key: str, digits: int) -> str:
        values = [r[key] for r in results[label]]
        return f"{min(values):.{digits}f}" if min(values) == max(values) else \
            f"{min(values):.{digits}f}-{max(values):.{digits}f}"

    for label, rows in results.items():
        table.add_row(label, str(rows[0]["staleness"]), str(rows[0]["steps"]), span(label, "train_wall_s", 1),
                      span(label, "total_wall_s", 1), span(label, "samples_per_s", 1),
                      span(label, "train_s_per_step", 2), span(label, "wait_s_per_step", 2), span(label, "first_reward", 3),
                      span(label, "final_reward", 3), str(max(r["staleness_max_seen"] for r in rows)))
    console = Console(width=200)
    console.print(table)
    async_ = [r["samples_per_s"] for r in results[f"async_eta{default_eta}"]]
    final = span(f"async_eta{default_eta}", "final_reward", 3)
    synchronous = [(label, note) for label, note in (("sync_2threads", "two intra-op threads per role"),
                                                     ("sync", "each role's threads as the config runs async"))
                   if label in results]
    for label, note in synchronous:
        rates = [r["samples_per_s"] for r in results[label]]
        console.print(f"async (staleness {default_eta}) vs {label} ({note}): samples/s "
                      f"{min(async_) / max(rates):.2f}-{max(async_) / min(rates):.2f}x (per repeat "
                      f"{', '.join(f'{a / b:.2f}' for a, b in zip(async_, rates))}), final reward "
                      f"{final} vs {span(label, 'final_reward', 3)}")
    # the headline: against whichever synchronous run was faster in each repeat, the baseline a user would keep
    fastest = [max(r["samples_per_s"] for r in runs_of)
               for runs_of in zip(*(results[label] for label, _ in synchronous))]
    console.print(f"async (staleness {default_eta}) vs the faster synchronous run of each repeat: per repeat "
                  f"{', '.join(f'{a / b:.2f}' for a, b in zip(async_, fastest))}x")
    Path("outputs/bench/async_vs_sync/results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
