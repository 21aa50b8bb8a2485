"""SmolLM2-135M-Instruct learns the calculator task: one measured RL run on this machine, one table.

    python bench/smollm2_learning.py                          # configs/smollm2_tools.yaml as it stands
    python bench/smollm2_learning.py --steps 30 learner.lr=3e-5   # key=value: config overrides
    python bench/smollm2_learning.py --summarize outputs/bench/smollm2_learning/run   # a finished run's table again
    python bench/smollm2_learning.py --out outputs/bench/smollm2_lora learner.lora.rank=16 learner.lr=2e-4 \
        learner.lora.save_merged=true                             # LoRA: held-out on final/merged

The run is `nanoverl-async launch configs/smollm2_tools.yaml` in this process tree (Ray, generator,
buffer, learner), alone on the machine. Before and after it, the warm-started policy and the run's
`final/` play the same held-out episodes (prompts the run never trains on, `bench/tool_eval.py`, the
real agent loop at the run's temperature), because the run's own per-step numbers are 16 episodes each
and noisy. The table: tool-call rate, tool error rate (errors per call) and reward over the first and
last 10% of steps, the held-out rates before and after, generated and trained tokens/s, and wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches beside this file
from staleness_sweep import mean  # noqa: E402
from tool_eval import evaluate  # noqa: E402

from nanoverl_async.config import load_config  # noqa: E402
from nanoverl_async.controller.warm_start import start_model  # noqa: E402
from nanoverl_async.launcher import launch  # noqa: E402
from nanoverl_async.models.load import resolve_model_path  # noqa: E402
from nanoverl_async.controller.preflight import prepare  # noqa: E402

CONFIG = "configs/smollm2_tools.yaml"
RATES = {"tool-call rate": ("episodes/tool_use_frac", "tool_call_rate"),
         "tool errors per call": ("episodes/tool_error_rate", "tool_error_rate"),
         "reward (success)": ("reward/mean", "success")}  # row: (metrics.jsonl key, tool_eval key)


def held_out(model: str, cfg, episodes: int) -> dict:
    return asyncio.run(evaluate(model, cfg.agent.env, cfg.data.task, episodes, cfg.agent, cfg.generator.temperature,
                                cfg.model.dtype, seed=cfg.run.seed, show=0))


def summarize(run_dir: Path, wall: float | None, before: dict | None, after: dict | None) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tenth = max(1, round(len(rows) / 10))
    first, last = rows[:tenth], rows[-tenth:]
    table = Table(title=f"{run_dir}: {len(rows)} steps, first and last {tenth} of them; held-out: "
                        f"{(before or after or {}).get('episodes', 0)} episodes")
    for column in ("", "first 10% of steps", "last 10% of steps", "held-out, warm start", "held-out, final"):
        table.add_column(column, justify="right")
    for name, (metric, key) in RATES.items():
        table.add_row(name, f"{mean(first, metric):.3f}", f"{mean(last, metric):.3f}",
                      *(f"{side[key]:.3f}" if side else "-" for side in (before, after)))
    generated = mean(rows, "tokens/generated_per_s")
    train_s = sum(row["time/train_s"] for row in rows)
    sampled = sum(row["learner/tokens"] for row in rows) / train_s  # the loss's tokens
    data = load_config(str(run_dir / "config.yaml")).data
    processed = sum(row["episodes/length_mean"] for row in rows) * data.episodes_per_step / train_s
    steps = sum(row["time/step_s"] for row in rows)
    console = Console(width=140)
    console.print(table)
    console.print(f"generated tokens/s {generated:.1f} during the run, beside the learner (alone, held-out: "
                  f"{before['tokens_per_s'] if before else '-'} / {after['tokens_per_s'] if after else '-'}); "
                  f"trained tokens/s {sampled:.1f} sampled, {processed:.1f} with prompts and tool results; step "
                  f"{steps / len(rows):.1f} s, steps {steps:.0f} s" + (f", run wall {wall:.0f} s" if wall else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="run.total_steps (default: the config's)")
    parser.add_argument("--episodes", type=int, default=64, help="held-out episodes before and after (0: none)")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/smollm2_learning"))
    parser.add_argument("--summarize", type=Path, help="print the table of this finished run only")
    parser.add_argument("overrides", nargs="*", help="config key=value for the run")
    args = parser.parse_args()
    if args.summarize:  # with the held-out rates the full run wrote beside it, if any
        saved = args.summarize.parent / "held_out.json"
        held = json.loads(saved.read_text()) if saved.is_file() else {}
        return summarize(args.summarize, held.get("wall_s"), held.get("before"), held.get("after"))
    run_dir = args.out / "run"
    overrides = [*args.overrides, f"run.output_dir={run_dir}", "run.overwrite=true", "run.progress=false"]
    cfg = load_config(CONFIG, overrides + ([f"run.total_steps={args.steps}"] if args.steps else []))
    warm_started = start_model(prepare(cfg), resolve_model_path(cfg.model.path))  # model.warm_start, once
    before = held_out(warm_started, cfg, args.episodes) if args.episodes else None
    started = time.monotonic()
    launch(cfg)
    wall = time.monotonic() - started
    final = run_dir / "final" / ("merged" if cfg.learner.lora.rank else "")  # a LoRA run: its merged model
    after = held_out(str(final), cfg, args.episodes) if args.episodes else None
    (args.out / "held_out.json").write_text(json.dumps({"before": before, "after": after, "wall_s": wall}))
    summarize(run_dir, wall, before, after)


if __name__ == "__main__":
    main()
