"""The staleness sweep: staleness.max x algorithm.correction on the default job, one run after the other.

    python bench/staleness_sweep.py                              # eta 0,1,2,4,8 x none,decoupled, 60 steps
    python bench/staleness_sweep.py --etas 4,8 --out outputs/bench/lr1e-3 learner.lr=1e-3   # key=value: every run

Every run trains on the same number of samples (run.total_steps batches of B x G) with the same seed, in
this process tree, alone on the machine. `none` is naive PPO: the ratio is taken against the behaviour
policy mu and clipped there, so staleness is clipped away with everything else. `decoupled` (AReaL,
docs/design.md "Losses and off-policy corrections") clips against the proximal policy and corrects the
gap to mu with a truncated importance weight. Prints one table (wall, samples/s, reward over the first
and last 10% of steps, observed staleness, behaviour_kl = KL(mu || p_old), the IS weight) and draws the
runs with `nanoverl-async plot` into <--out>/plot.png. Each run's directory is <--out>/eta<E>-<correction>.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from nanoverl_async.config import load_config
from nanoverl_async.launcher import launch, start_ray
from nanoverl_async.observe.plot import save_plot

CONFIG = "configs/agent_grpo.yaml"
TARGET, WINDOW = 0.8, 5  # "steps to 0.8": the first step whose last-5-step mean reward reaches 0.8


def mean(rows: list[dict], key: str) -> float:
    values = [row[key] for row in rows if key in row]
    return sum(values) / len(values) if values else float("nan")


def run_one(eta: int, correction: str, overrides: list[str], out: Path) -> dict:
    output_dir = out / f"eta{eta}-{correction}"
    cfg = load_config(CONFIG, [*overrides, f"staleness.max={eta}", f"algorithm.correction={correction}",
                               f"run.output_dir={output_dir}", "run.overwrite=true", "run.progress=false"])
    started = time.monotonic()
    launch(cfg)
    return summarize(output_dir, time.monotonic() - started)


def summarize(output_dir: Path, wall: float) -> dict:
    """One run's row of the table, from its config.yaml and metrics.jsonl."""
    cfg = load_config(str(output_dir / "config.yaml"))
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    tenth = max(1, len(rows) // 10)
    rewards = [row["reward/mean"] for row in rows]
    reached = [step for step in range(WINDOW - 1, len(rows)) if mean(rows[step - WINDOW + 1: step + 1], "reward/mean")
               >= TARGET]
    samples = len(rows) * cfg.data.episodes_per_step
    return {"eta": cfg.staleness.max, "correction": cfg.algorithm.correction, "dir": str(output_dir), "wall_s": wall,
            "samples_per_s": samples / sum(row["time/step_s"] for row in rows),
            "first_reward": mean(rows[:tenth], "reward/mean"), "mean_reward": sum(rewards) / len(rewards),
            "last_reward": mean(rows[-tenth:], "reward/mean"), "step_to_target": reached[0] if reached else None,
            "staleness_mean": mean(rows, "staleness/mean"), "staleness_max": max(row["staleness/max"] for row in rows),
            "behaviour_kl": mean(rows, "learner/behaviour_kl"), "is_weight_mean": mean(rows, "learner/is_weight_mean"),
            "gated_frac": mean(rows, "generators/gated_frac")}


def print_table(results: list[dict], overrides: list[str]) -> None:
    table = Table(title=f"staleness sweep on {CONFIG} {' '.join(overrides)} (one run after the other)")
    columns = ("staleness.max", "correction", "wall s", "samples/s", "reward first 10%", "reward mean",
               "reward last 10%", f"step to {TARGET}", "staleness mean", "staleness max", "behaviour_kl",
               "IS weight mean", "gated_frac")
    for column in columns:
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r["eta"]), r["correction"], f"{r['wall_s']:.0f}", f"{r['samples_per_s']:.0f}",
                      f"{r['first_reward']:.3f}", f"{r['mean_reward']:.3f}", f"{r['last_reward']:.3f}",
                      str(r["step_to_target"]) if r["step_to_target"] is not None else "never",
                      f"{r['staleness_mean']:.2f}",
                      str(r["staleness_max"]), f"{r['behaviour_kl']:.2e}", f"{r['is_weight_mean']:.3f}",
                      f"{r['gated_frac']:.2f}")
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etas", default="0,1,2,4,8", help="staleness.max values, comma-separated")
    parser.add_argument("--corrections", default="none,decoupled", help="algorithm.correction values")
    parser.add_argument("--out", default="outputs/bench/staleness_sweep", help="where the runs, results.json and "
                        "plot.png go")
    parser.add_argument("--report", action="store_true", help="only print the table of the runs in --out again")
    parser.add_argument("overrides", nargs="*", help="key=value for every run, e.g. learner.lr=4e-4")
    args = parser.parse_args()
    out = Path(args.out)
    if args.report:
        results = [summarize(Path(r["dir"]), r["wall_s"]) for r in json.loads((out / "results.json").read_text())]
        return print_table(results, args.overrides)
    start_ray(load_config(CONFIG, args.overrides).ray)  # one Ray instance for every run
    results = [run_one(int(eta), correction, args.overrides, out) for eta in args.etas.split(",")
               for correction in args.corrections.split(",")]
    print_table(results, args.overrides)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"plot: {save_plot([r['dir'] for r in results], str(out / 'plot.png'))}")


if __name__ == "__main__":
    main()
