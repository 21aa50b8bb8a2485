"""Asynchronous RL on an agent workload: staleness 1, 2 and 4 against the fair synchronous run.

    python bench/agentic.py configs/slow_tool.yaml [--repeats N] [--threshold R] [--etas 1,2,4] [--instant]
                            [key=value ...]

For one workload config (configs/slow_tool.yaml, configs/long_tail.yaml, configs/code.yaml) it runs the same
job with staleness.max 1, 2, 4 (or --etas) and 0 (synchronous; on a CPU with two intra-op threads per role, as in
bench/async_vs_sync.py, whose run_one it uses), one after the other in this process tree, interleaved over
repeats (A B C D, then D C B A, ...). Prints one table: trained samples per second of the training loop, and
the steps and seconds until the reward, as a mean over WINDOW steps, first reaches the threshold (default
0.5; "-": never), and each run's samples/s over the synchronous run's of the same repeat. --instant (the slow
tool only) adds the largest eta's run with the tool's delay cut to 0.1 ms, the same job with an instant tool, and
the title gives the slow tool's samples/s over it, by repeat: how much of the latency the job hides. Extra
key=value arguments apply to every run (agent.env_args.blocking=true: the slow tool as a blocking function).
Timings mean something on a quiet machine only.
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
INSTANT = ["agent.env_args.median_s=0.0001", "agent.env_args.p99_s=0.0001"]  # the slow tool's delay, cut to 0.1 ms
WINDOW = 5  # steps the reward is averaged over before it is compared with the threshold


def to_threshold(result: dict, threshold: float) -> tuple[int, float] | None:
    """(steps, seconds of the training loop) until the WINDOW-step mean reward first reaches `threshold`."""
    rewards = result["rewards"]
    for end in range(WINDOW, len(rewards) + 1):
        if sum(rewards[end - WINDOW:end]) / WINDOW >= threshold:
            return end, sum(result["step_s"][:end])
    return None


def ratios(results: dict, label: str, other: str) -> str:
    """`label`'s samples/s over `other`'s, repeat by repeat."""
    return " ".join(f"{a['samples_per_s'] / b['samples_per_s']:.2f}" for a, b in zip(results[label], results[other]))


def table_of(results: dict, title: str, threshold: float, slow_and_instant: tuple[str, str] | None) -> Table:
    if slow_and_instant:
        title += f"; the slow tool / an instant one, by repeat: {ratios(results, *slow_and_instant)}"
    table = Table(title=title)
    for column in ("run", "staleness.max", "steps", "samples/s", "/ sync, by repeat", "steps to threshold",
                   "s to threshold", "reward last 10%"):
        table.add_column(column, justify="right")
    for label, rows in results.items():
        reached = [to_threshold(row, threshold) for row in rows]
        table.add_row(label, str(rows[0]["staleness"]), str(rows[0]["steps"]),
                      " ".join(f"{row['samples_per_s']:.1f}" for row in rows), ratios(results, label, "sync"),
                      " ".join(str(r[0]) if r else "-" for r in reached),
                      " ".join(f"{r[1]:.0f}" if r else "-" for r in reached),
                      " ".join(f"{row['final_reward']:.3f}" for row in rows))
    return table


def main(argv: list[str]) -> None:
    config = argv.pop(0) if argv and argv[0].endswith(".yaml") else "configs/slow_tool.yaml"
    repeats = int(argv.pop(argv.index("--repeats") + 1)) if "--repeats" in argv else 1
    threshold = float(argv.pop(argv.index("--threshold") + 1)) if "--threshold" in argv else 0.5
    etas = [int(eta) for eta in argv.pop(argv.index("--etas") + 1).split(",")] if "--etas" in argv else ETAS
    instant = "--instant" in argv
    extra = [arg for arg in argv if arg not in ("--repeats", "--threshold", "--etas", "--instant")] + \
        ["run.progress=false"]
    cfg = load_config(config, extra)
    if instant and cfg.agent.env != "builtin:slow-tool":
        sys.exit(f"--instant cuts the slow tool's delay; {config} runs agent.env={cfg.agent.env}")
    on_cpu = cfg.generator.device == "cpu" and cfg.learner.device == "cpu"
    sync = ["staleness.max=0"] + (["generator.torch_threads=2", "learner.torch_threads=2",
                                   "learner.micro_batch_threads=1"] if on_cpu else [])
    slow, fast = f"async_eta{etas[-1]}", f"instant_eta{etas[-1]}"  # --instant's run beside the largest eta's
    runs = {f"async_eta{eta}": [f"staleness.max={eta}"] for eta in etas} | \
        ({fast: [f"staleness.max={etas[-1]}"] + INSTANT} if instant else {}) | {"sync": sync}
    start_ray(cfg.ray)  # one Ray instance for every run
    name = Path(config).stem
    results = {label: [] for label in runs}
    for repeat in range(repeats):  # A B C D, then D C B A, ...
        for label in list(runs)[::1 if repeat % 2 == 0 else -1]:
            results[label].append(run_one(label, repeat, extra + runs[label], config, f"agentic/{name}"))
    title = (f"{config}: async vs sync, same trained samples, one after the other ({repeats} repeat(s); threshold: "
             f"the {WINDOW}-step mean reward reaches {threshold})")
    Console(width=200).print(table_of(results, title, threshold, (slow, fast) if instant else None))
    Path(f"outputs/bench/agentic/{name}/results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
