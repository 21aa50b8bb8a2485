"""nanoverl-async vs TRL's synchronous GRPOTrainer on our own default job, side by side.

    python bench/vs_trl.py --trl-python /work/trl-venv/bin/python [--steps 60] [--repeats 2] [--vary-seed]
                           [--config configs/agent_grpo.yaml | configs/slow_tool.yaml]
                           [--device cpu|cuda] [--model PATH] [--project-overrides key=value ...] [--out results.json]

--device cuda runs both sides on one GPU, in bfloat16 (autocast over float32 weights on both): TRL's trainer
on it (generation by `model.generate`: TRL's vLLM mode needs vllm, which the GPU machine lacks), ours with
learner and generator sharing it (half a GPU each, as bench/gpu.sh's async step). --model (both sides) picks
the shape, e.g. bench/qwen_shape.py:qwen_body_with_tiny_tokenizer (the Qwen2.5-0.5B body, random weights).

TRL is an optional extra (`pip install '.[bench]'`), best kept in its own virtual environment so that its
pins never touch this one:
    python3 -m venv /work/trl-venv
    /work/trl-venv/bin/pip install torch==2.13.0 trl==1.16.0 datasets omegaconf msgpack
(bench/trl_side.py imports `nanoverl_async` from this checkout; omegaconf, and msgpack for
configs/slow_tool.yaml, are all it needs besides torch and transformers). --trl-python defaults to this interpreter.

Each side runs as its own subprocess (its own process tree), interleaved A B B A (TRL, project, project,
TRL for --repeats 2) so that slow drift of the machine hits both sides alike:
  - project: `nanoverl-async launch <--config> run.output_dir=<tmp> run.progress=false
    run.overwrite=true run.total_steps=<steps> [--project-overrides]`, read from <tmp>/metrics.jsonl;
  - TRL: bench/trl_side.py with the config's task and learner settings (prompts, model, B x G, lr, clip,
    turn and token limits, temperature; --project-overrides apply to our side only), 2 torch threads.
Reported per side, as "min-max" over the repeats: the training loop's wall-clock (first step's start to
the last step's end: the sum of `time/step_s`, TRL's step callback), samples/s over it, the time until
the mean reward of the last 5 steps first reaches 0.8, the final reward (mean of the last 10% of steps),
the wall-clock of the whole process including start-up (less the TRL side's re-score, which is this
benchmark's check, not TRL's work), and nanoverl-async / TRL (for a range:
our min over TRL's max to our max over TRL's min). TRL's episodes are re-scored by the project's `score`
(trl_side.py); the disagreements are a row of the table. Timings on 2 cores are very sensitive to other
load: run it on a quiet machine.

With one seed TRL's run is deterministic, so its final reward is one draw, not a spread. --vary-seed runs
repeat i of both sides with run.seed + i (other prompts, other sampling; the same model), and the table adds
the mean final reward of each side over the seeds: the fair way to say whether one side learns better.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from nanoverl_async.config import load_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/agent_grpo.yaml"
TARGET = 0.8  # reward the 5-step mean must reach
WINDOW = 5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=CONFIG, help="the job: the default one, or the slow tool's")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2, help="runs per side, interleaved A B B A ...")
    p.add_argument("--vary-seed", action="store_true",
                   help="repeat i of both sides uses run.seed + i (default: every repeat uses run.seed)")
    p.add_argument("--trl-python", default=sys.executable, help="interpreter with trl==1.16.0 and datasets")
    p.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both sides run")
    p.add_argument("--model", default="", help="model.path of both sides (default: the config's)")
    p.add_argument("--project-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra overrides for our side only, e.g. learner.torch_threads=2")
    p.add_argument("--out", default="outputs/bench/vs_trl/results.json", help="raw results ('' for none)")
    return p.parse_args(argv)


def summarize(walls: list[float], rewards: list[float], samples: int, process_wall: float) -> dict:
    """Per-step cumulative walls (s since the first step began) and reward means -> the reported figures."""
    reached = next((walls[i] for i in range(WINDOW - 1, len(rewards))
                    if sum(rewards[i - WINDOW + 1:i + 1]) / WINDOW >= TARGET), None)
    tail = rewards[-max(1, len(rewards) // 10):]
    return {"steps": len(walls), "samples": samples, "train_wall_s": walls[-1], "samples_per_s": samples / walls[-1],
            "time_to_target_s": reached, "final_reward": sum(tail) / len(tail), "process_wall_s": process_wall}


def run_logged(command: list[str], log: Path, label: str, env: dict | None = None) -> float:
    started = time.monotonic()
    with log.open("w") as out:
        code = subprocess.call(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    wall = time.monotonic() - started
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
        raise SystemExit(f"{label} failed (exit {code}): {' '.join(command)}\n{tail}")
    return wall


def run_project(args, scratch: Path, index: int, seed: int) -> dict:
    output_dir = scratch / f"project_{index}"
    cli = Path(sys.executable).parent / "nanoverl-async"
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "nanoverl_async.cli"]
    command += ["launch", args.config, f"run.output_dir={output_dir}", "run.progress=false", "run.overwrite=true",
                f"run.total_steps={args.steps}", f"run.seed={seed}", *args.project_overrides]
    wall = run_logged(command, scratch / f"project_{index}.log", "nanoverl-async")
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    walls, total = [], 0.0
    for row in rows:  # time/step_s: from the end of the previous step (the loop's start for the first)
        total += row["time/step_s"]
        walls.append(total)
    return summarize(walls, [row["reward/mean"] for row in rows], rows[-1]["samples/trained"], wall)


# ours on one GPU: learner and generator share it (as bench/gpu.sh's async step)
GPU_PLACEMENT = ["learner.device=cuda", "generator.device=cuda", "learner.gpus_per_rank=0.5",
                 "generator.gpus_per_replica=0.5"]


def job_overrides(args) -> list[str]:
    """What both sides run: the config's job, on --model, in bfloat16 on a GPU."""
    return ([f"model.path={args.model}"] if args.model else []) + (["model.dtype=bfloat16"] if args.device == "cuda"
                                                                   else [])


def trl_arguments(cfg) -> list[str]:
    """The job's task and learner settings for bench/trl_side.py (from the config, without our overrides)."""
    if cfg.agent.env not in ("", "builtin:slow-tool"):
        raise SystemExit(f"agent.env={cfg.agent.env!r}: the TRL side runs the multiply task, with or without "
                         f"builtin:slow-tool's delays")
    latency = {"median_s": 0.2, "p99_s": 2.0, **cfg.agent.env_args} if cfg.agent.env else {"median_s": 0, "p99_s": 0}
    return ["--tool-median-s", str(latency["median_s"]), "--tool-p99-s", str(latency["p99_s"]),
            "--model", cfg.model.path, "--dtype", cfg.model.dtype,
            "--prompts-per-step", str(cfg.data.prompts_per_step),
            "--samples-per-prompt", str(cfg.data.samples_per_prompt),
            "--lr", str(cfg.learner.lr), "--betas", *map(str, cfg.learner.betas),
            "--weight-decay", str(cfg.learner.weight_decay), "--grad-clip", str(cfg.learner.grad_clip),
            "--clip-low", str(cfg.algorithm.clip.low), "--clip-high", str(cfg.algorithm.clip.high),
            "--temperature", str(cfg.generator.temperature), "--max-turns", str(cfg.agent.max_turns),
            "--max-new-tokens", str(cfg.agent.max_new_tokens), "--max-total-tokens", str(cfg.agent.max_total_tokens)]


def run_trl(args, scratch: Path, index: int, seed: int, settings: list[str]) -> dict:
    steps_file, summary_file = scratch / f"trl_{index}.jsonl", scratch / f"trl_{index}.json"
    command = [args.trl_python, str(REPO / "bench" / "trl_side.py"), "--steps", str(args.steps),
               "--out", str(steps_file), "--summary", str(summary_file), "--threads", str(args.trl_threads),
               "--seed", str(seed), "--device", args.device, *settings]
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    wall = run_logged(command, scratch / f"trl_{index}.log", "TRL side", env)
    rows = [json.loads(line) for line in steps_file.read_text().splitlines() if line.strip()]
    summary = json.loads(summary_file.read_text())
    result = summarize([r["wall_s"] for r in rows], [r["reward_mean"] for r in rows],
                       sum(r["samples"] for r in rows), wall - summary["rescore_s"])  # the check is ours, not TRL's
    result.update({k: summary[k] for k in ("episodes", "disagreements", "token_mismatches", "malformed_calls",
                                           "not_utf8", "versions")})
    return result


def span(values: list[float | None], fmt: str) -> str:
    if any(v is None for v in values):
        reached = [v for v in values if v is not None]
        return f"not reached ({len(reached)}/{len(values)})" if not reached else \
            f"{span(reached, fmt)} ({len(reached)}/{len(values)})"
    low, high = min(values), max(values)
    return format(low, fmt) if format(low, fmt) == format(high, fmt) else f"{low:{fmt}}-{high:{fmt}}"


def ratio(ours: list[float | None], theirs: list[float | None]) -> str:
    if any(v is None for v in ours + theirs) or min(theirs) <= 0:
        return "—"
    low, high = min(ours) / max(theirs), max(ours) / min(theirs)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def main(argv=None) -> None:
    args = parse_args(argv)
    job = job_overrides(args)  # the job and its shape: both sides
    args.project_overrides = [*job, *(GPU_PLACEMENT if args.device == "cuda" else []), *args.project_overrides]
    cfg = load_config(str(REPO / args.config), job)
    ours_cfg = load_config(str(REPO / args.config), args.project_overrides)  # a bad override fails here, early
    settings = trl_arguments(cfg)
    order = [(side, cfg.run.seed + i if args.vary_seed else cfg.run.seed) for i in range(args.repeats)
             for side in (("trl", "project") if i % 2 == 0 else ("project", "trl"))]
    results: dict[str, list[dict]] = {"trl": [], "project": []}
    console = Console(width=160)
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        scratch = Path(tmp)
        for index, (side, seed) in enumerate(order):
            console.print(f"[{index + 1}/{len(order)}] {'TRL GRPOTrainer' if side == 'trl' else 'nanoverl-async'}"
                          f", {args.steps} steps, seed {seed} ...")
            run = run_trl(args, scratch, index, seed, settings) if side == "trl" else \
                run_project(args, scratch, index, seed)
            results[side].append({**run, "seed": seed})
    trl, ours = results["trl"], results["project"]

    def column(runs: list[dict], key: str) -> list:
        return [r[key] for r in runs]

    versions = trl[0]["versions"]
    seeds = ", ".join(str(s) for s in sorted({seed for _, seed in order}))
    overrides = f", overrides {' '.join(args.project_overrides)}" if args.project_overrides else ""
    table = Table(title=f"nanoverl-async vs TRL {versions['trl']} GRPOTrainer: {args.config}, {args.steps} steps of "
                        f"{cfg.data.prompts_per_step} x {cfg.data.samples_per_prompt}, runs "
                        f"{' '.join('A' if s == 'trl' else 'B' for s, _ in order)} (A = TRL, B = nanoverl-async)",
                  caption=f"ranges min-max over {args.repeats} run(s) per side; ratio = nanoverl-async / TRL; "
                          f"seeds {seeds}; nanoverl-async staleness.max {ours_cfg.staleness.max}"
                          f"{overrides}; TRL: torch {versions['torch']}, transformers {versions['transformers']}, "
                          f"{args.trl_threads} threads")
    for name in ("", "TRL (sync)", "nanoverl-async", "ratio"):
        table.add_column(name, justify="right" if name else "left")
    rows = [("training loop wall, s", "train_wall_s", ".1f"), ("samples/s", "samples_per_s", ".0f"),
            (f"time to {WINDOW}-step mean reward {TARGET}, s", "time_to_target_s", ".1f"),
            ("process wall incl. start-up, s", "process_wall_s", ".1f")]
    for label, key, fmt in rows:
        table.add_row(label, span(column(trl, key), fmt), span(column(ours, key), fmt),
                      ratio(column(ours, key), column(trl, key)))
    table.add_row("final reward (last 10% of steps)", span(column(trl, "final_reward"), ".3f"),
                  span(column(ours, "final_reward"), ".3f"), "")
    if args.vary_seed:
        mean_trl, mean_ours = (sum(column(runs, "final_reward")) / len(runs) for runs in (trl, ours))
        table.add_row("final reward, mean over the seeds", f"{mean_trl:.3f}", f"{mean_ours:.3f}",
                      f"{mean_ours - mean_trl:+.3f}")
    table.add_row("TRL episodes re-scored by our `score`: disagreements",
                  f"{sum(column(trl, 'disagreements'))} of {sum(column(trl, 'episodes'))}", "", "")
    table.add_row("TRL token ids vs our template's rendering: mismatches",
                  f"{sum(column(trl, 'token_mismatches'))} (skipped {sum(column(trl, 'malformed_calls'))} "
                  f"malformed, {sum(column(trl, 'not_utf8'))} non-UTF-8)",
                  "", "")
    console.print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"order": [side for side, _ in order], "steps": args.steps,
                                   "project_overrides": args.project_overrides,
                                   "trl": trl, "project": ours}, indent=2))


if __name__ == "__main__":
    main()
