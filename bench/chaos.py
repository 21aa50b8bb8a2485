"""Fault injection: kill the launcher (its whole process group, Ray workers included) at chosen moments of
a checkpointing run, resume each time, and check that nothing was lost or done twice.

    python bench/chaos.py [--steps 12] [--save-every 3] [--seed 0]

The default job runs `--steps` steps saving every `--save-every`. The run is SIGKILLed:
  1. after step 1 is logged, before any checkpoint (the next launch must start fresh: run.overwrite=true);
  2. while a checkpoint is being written (its `.step_N.tmp` folder exists);
  3. and 4. at a random step between two checkpoints;
  5. after the last checkpoint is committed, before `final/` is written;
then it is resumed with `run.resume=auto` until it finishes. Printed as one table: kills, launches, and
the checks: every step 0..steps-1 logged exactly once, every prompt trained in exactly one step, the
final model loads with `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.005  # a tiny model's checkpoint takes well under a second: poll often to catch one
LAUNCH_TIMEOUT_S = 600


def launch(out: Path, steps: int, save_every: int, fresh: bool) -> subprocess.Popen:
    command = [sys.executable, "-m", "nanoverl_async.cli", "launch", "configs/agent_grpo.yaml",
               f"run.output_dir={out}", f"run.total_steps={steps}", f"run.save_every={save_every}",
               "run.progress=false", "run.overwrite=true" if fresh else "run.resume=auto"]
    log = (out.parent / "chaos.log").open("a")
    return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, RAY_AUTH_MODE="disabled"))


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass  # a torn last line: the resumed logger drops it
    return steps


def wait_for(process: subprocess.Popen, condition, what: str) -> bool:
    """Poll until `condition()`; False if the run ended first."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not condition():
        if process.poll() is not None:
            return False
        if time.monotonic() > deadline:
            raise SystemExit(f"chaos: waited {LAUNCH_TIMEOUT_S} s for {what}")
        time.sleep(POLL_S)
    return True


def kill(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(tempfile.mkdtemp(prefix="chaos-")) / "run"
    checkpoints = out / "checkpoints"
    last_save = args.steps // args.save_every * args.save_every

    def in_progress_save() -> bool:
        return checkpoints.is_dir() and any(p.name.endswith(".tmp") for p in checkpoints.iterdir())

    def step_logged(step: int):
        return lambda: step in logged_steps(out)

    # step s is saved as version s + 1: kill after steps that are not followed by a save
    between = sorted(rng.sample([s for s in range(args.save_every, last_save - 1) if (s + 1) % args.save_every], 2))
    moments = [("after step 1, before any checkpoint", step_logged(1)),
               ("during a checkpoint write", in_progress_save),
               (f"at step {between[0]}", step_logged(between[0])),
               (f"at step {between[1]}", step_logged(between[1])),
               ("after the last checkpoint, before final/", lambda: (checkpoints / f"step_{last_save}").is_dir())]
    kills, launches, report = 0, 0, []
    started = time.monotonic()
    for what, condition in moments:
        has_checkpoint = checkpoints.is_dir() and any(p.name.startswith("step_") for p in checkpoints.iterdir())
        process = launch(out, args.steps, args.save_every, fresh=not has_checkpoint)
        launches += 1
        if wait_for(process, condition, what):
            kill(process)
            kills += 1
            report.append((what, f"killed; steps logged so far {sorted(set(logged_steps(out)))}"))
        else:
            report.append((what, f"the run ended first (exit {process.returncode})"))
    while not (out / "final").is_dir():  # resume until done
        process = launch(out, args.steps, args.save_every, fresh=False)
        launches += 1
        if process.wait(timeout=LAUNCH_TIMEOUT_S) != 0:
            raise SystemExit(f"chaos: the resumed run failed (exit {process.returncode}); see {out.parent}/chaos.log")

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows]
    prompts = [index for row in rows for index in row["batch/prompt_indices"]]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    table = Table(title=f"chaos: {args.steps} steps, save_every {args.save_every}, {kills} kills, {launches} "
                        f"launches, {time.monotonic() - started:.0f} s ({out})")
    table.add_column("check or kill")
    table.add_column("result")
    for what, result in report:
        table.add_row(f"kill {what}", result)
    table.add_row("every step logged exactly once", f"{steps == list(range(args.steps))} ({len(steps)} rows)")
    table.add_row("every prompt trained in exactly one step",
                  f"{len(prompts) == len(set(prompts))} ({len(set(prompts))} distinct prompts)")
    table.add_row("final model loads", f"True ({sum(p.numel() for p in model.parameters()):,} parameters)")
    Console(width=160).print(table)
    if steps != list(range(args.steps)) or len(prompts) != len(set(prompts)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
