"""Asynchronous RL on an agent workload: staleness 1, 2 and 4 against the fair synchronous run.

    python bench/agentic.py configs/slow_tool.yaml [--repeats N] [--threshold R] [--etas 1,2,4] [key=value ...]

For one workload config (configs/slow_tool.yaml, configs/long_tail.yaml, configs/code.yaml) it runs the same
job with staleness.max 1, 2, 4 (or --etas) and 0 (synchronous; on a CPU with two intra-op threads per role, as in
bench/async_vs_sync.py, whose run_one it uses), one after the other in this process tree, interleaved over
repeats (A B C D, then D C B A, ...). Prints one table: trained samples per second of the training loop, and
the steps and seconds until the reward, as a mean over WINDOW steps, first reaches the threshold (default
0.5; "-": never). Extra key=value arguments apply to every run (agent.env_args.blocking=true: the slow tool
as a blocking function). Timings mean something on a quiet machine only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from async_vs_sync import run_one
from rich.console import Console
from rich.table import Table

from nanoverl_async.config import load_config
from nanoverl_async.launcher import start_ray

ETAS = (1, 2, 4)
WINDOW = 5  # steps the reward is averaged over before it is compared with the threshold


def to_threshold(result: dict, threshold: float) -> tuple[int, float] | None:
    """(steps, seconds of the training loop) until the WINDOW-step mean reward first reaches `threshold`."""
    rewards = result["rewards"]
    for end in range(WINDOW, len(rewards) + 1):
        if sum(rewards[end - WINDOW:end]) / WINDOW >= threshold:
            return end, sum(result["step_s"][:end])
    return None


def main(argv: list[str]) -> None:
    config = argv.pop(0) if argv and argv[0].endswith(".yaml") else "configs/slow_tool.yaml"
    repeats = int(argv.pop(argv.index("--repeats") + 1)) if "--repeats" in argv else 1
    threshold = float(argv.pop(argv.index("--threshold") + 1)) if "--threshold" in argv else 0.5
    etas = [int(eta) for eta in argv.pop(argv.index("--etas") + 1).split(",")] if "--etas" in argv else ETAS
    extra = [arg for arg in argv if arg not in ("--repeats", "--threshold", "--etas")] + ["run.progress=false"]
    cfg = load_config(config, extra)
    on_cpu = cfg.generator.device == "cpu" and cfg.learner.device == "cpu"
    sync = ["staleness.max=0"] + (["generator.torch_threads=2", "learner.torch_threads=2",
                                   "learner.micro_batch_threads=1"] if on_cpu else [])
    runs = {f"async_eta{eta}": [f"staleness.max={eta}"] for eta in etas} | {"sync": sync}
    start_ray(cfg.ray)  # one Ray instance for every run
    name = Path(config).stem
    results = {label: [] for label in runs}
    for repeat in range(repeats):  # A B C D, then D C B A, ...
        for label in list(runs)[::1 if repeat % 2 == 0 else -1]:
            results[label].append(run_one(label, repeat, extra + runs[label], config, f"agentic/{name}"))
    table = Table(title=f"{config}: async vs sync, same trained samples, one after the other ({repeats} repeat(s); "
                        f"threshold: the {WINDOW}-step mean reward reaches {threshold})")
    for column in ("run", "staleness.max", "steps", "samples/s", "steps to threshold", "s to threshold",
                   "reward last 10%"):
        table.add_column(column, justify="right")
    for label, rows in results.items():
        reached = [to_threshold(row, threshold) for row in rows]
        table.add_row(label, str(rows[0]["staleness"]), str(rows[0]["steps"]),
                      " ".join(f"{row['samples_per_s']:.1f}" for row in rows),
                      " ".join(str(r[0]) if r else "-" for r in reached),
                      " ".join(f"{r[1]:.0f}" if r else "-" for r in reached),
                      " ".join(f"{row['final_reward']:.3f}" for row in rows))
    Console(width=200).print(table)
    Path(f"outputs/bench/agentic/{name}/results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
