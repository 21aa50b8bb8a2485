"""Fault injection: SIGKILL the launcher (its process alone: nothing of the run may outlive it) at chosen
moments of a checkpointing run, resume each time, and check that nothing was lost or done twice.

    python bench/chaos.py [--steps 12] [--save-every 3] [--seed 0]

The default job runs `--steps` steps saving every `--save-every`; every launch, the first included, says
only `run.resume=auto`. The launcher is SIGKILLed:
  1. after step 1 is logged, before any checkpoint (the next launch must start afresh);
  2. while a checkpoint is being written (its `.step_N.tmp` folder exists);
  3. and 4. at a random step between two checkpoints;
  5. after the last checkpoint is committed, before `final/` is written;
then it is resumed until it finishes. Printed as one table: kills, the processes of the run still alive
KILL_GRACE_S after each kill, launches, and the checks: every step 1..steps logged exactly once, every
prompt trained in exactly one step, the final model loads with `AutoModelForCausalLM.from_pretrained`.
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
KILL_GRACE_S = 5.0  # the run's other processes must be gone this long after the launcher was killed


def launch(out: Path, steps: int, save_every: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "nanoverl_async.cli", "launch", "configs/agent_grpo.yaml",
               f"run.output_dir={out}", f"run.total_steps={steps}", f"run.save_every={save_every}",
               "run.progress=false", "run.resume=auto"]
    log = (out.parent / "chaos.log").open("a")
    return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


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


def kill(process: subprocess.Popen) -> int:
    """SIGKILL the launcher alone; -> how many processes of its session outlived it by KILL_GRACE_S (then
    they are killed, so that the next launch starts clean)."""
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    time.sleep(KILL_GRACE_S)
    left = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if session_of(pid) == process.pid]
    if left:
        os.killpg(process.pid, signal.SIGKILL)
    return len(left)


def session_of(pid: int) -> int:
    try:
        return os.getsid(pid)
    except OSError:
        return -1


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

    # step N is saved as step_N every save_every steps: kill after steps that are not followed by a save
    between = sorted(rng.sample([s for s in range(args.save_every + 1, last_save) if s % args.save_every], 2))
    moments = [("after step 1, before any checkpoint", step_logged(1)),
               ("during a checkpoint write", in_progress_save),
               (f"at step {between[0]}", step_logged(between[0])),
               (f"at step {between[1]}", step_logged(between[1])),
               ("after the last checkpoint, before final/", lambda: (checkpoints / f"step_{last_save}").is_dir())]
    kills, launches, outlived, report = 0, 0, 0, []
    started = time.monotonic()
    for what, condition in moments:
        process = launch(out, args.steps, args.save_every)
        launches += 1
        if wait_for(process, condition, what):
            left = kill(process)
            kills, outlived = kills + 1, outlived + left
            report.append((what, f"killed; {left} processes of the run alive {KILL_GRACE_S:.0f} s later; steps "
                                 f"logged so far {sorted(set(logged_steps(out)))}"))
        else:
            report.append((what, f"the run ended first (exit {process.returncode})"))
    while not (out / "final" / "config.json").is_file():  # resume until done
        process = launch(out, args.steps, args.save_every)
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
    table.add_row("every step logged exactly once", f"{steps == list(range(1, args.steps + 1))} ({len(steps)} rows)")
    table.add_row("every prompt trained in exactly one step",
                  f"{len(prompts) == len(set(prompts))} ({len(set(prompts))} distinct prompts)")
    table.add_row("final model loads", f"True ({sum(p.numel() for p in model.parameters()):,} parameters)")
    table.add_row(f"no process outlives the launcher by {KILL_GRACE_S:.0f} s", f"{outlived == 0} ({outlived} did)")
    Console(width=160).print(table)
    if steps != list(range(1, args.steps + 1)) or len(prompts) != len(set(prompts)) or outlived:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
