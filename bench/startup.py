"""Start-up of the default job against its floor: what Ray and the roles' imports alone take.

    python bench/startup.py --repeats 2      # A B B A: the job, the floor, the floor, the job, ...

"job": `nanoverl-async launch configs/agent_grpo.yaml run.total_steps=1`, its time/startup_s (launch to the
first trained step) and the phase lines' seconds. "floor": the same CLI start (Ray started while the
controller imports the launcher, startup.py), then three Ray actors placed as the roles are (num_cpus=0), each
importing only its role's modules (buffer: the role module; generator: generators/worker.py; learner rank:
learners/fsdp_rank.py) with the collector paused, and nothing built: no model, tokenizer, socket or batch.
Whatever start-up is cut to, it cannot go below the floor while each role is its own Ray process that imports
torch. Run it alone: on a busy machine both numbers grow.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOOR = r"""
import importlib, sys, time
from nanoverl_async.cli import IMPORTED
import ray
from nanoverl_async.config import RayConfig
from nanoverl_async.controller.startup import collecting_later, start_ray_while_importing

class Importer:
    def __init__(self, modules):
        with collecting_later():
            for module in modules:
                importlib.import_module(module)
    def ready(self):
        return True

with collecting_later():
    start_ray_while_importing(RayConfig(), "nanoverl_async.launcher")
role = ray.remote(num_cpus=0)(Importer)
roles = [role.remote(["nanoverl_async.learners.fsdp_rank"]), role.remote(["nanoverl_async.generators.worker"]),
         role.remote(["nanoverl_async.controller.role_actors"])]
ray.get([r.ready.remote() for r in roles])
print(f"FLOOR {time.time() - IMPORTED:.2f}")
ray.shutdown()
"""


def run_job(output_dir: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "nanoverl_async.cli", "launch", "configs/agent_grpo.yaml",
                           "run.total_steps=1", "run.progress=false", f"run.output_dir={output_dir}",
                           "run.overwrite=true"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode:
        sys.exit(f"the job failed:\n{done.stderr[-2000:]}")
    phases = re.findall(r"^\[\s*([\d.]+) s\] (\w+ \w+)", done.stderr, re.M)
    metrics = json.loads((Path(output_dir) / "metrics.jsonl").read_text().splitlines()[0])
    return {"seconds": metrics["time/startup_s"],
            "phases": ", ".join(f"{what} {at}" for at, what in phases)}


def run_floor() -> dict:
    done = subprocess.run([sys.executable, "-c", FLOOR], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    found = re.search(r"FLOOR ([\d.]+)", done.stdout)
    if not found:
        sys.exit(f"the floor run failed:\n{done.stderr[-2000:]}")
    return {"seconds": float(found.group(1)), "phases": ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="A B B A rounds")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.repeats):
            for kind in ("job", "floor", "floor", "job"):
                result = run_job(f"{scratch}/run") if kind == "job" else run_floor()
                rows.append((kind, result))
                print(f"round {round_} {kind}: {result['seconds']:.1f} s",
                      file=sys.stderr, flush=True)
    print(f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}\n")
    print("| run | seconds: to the first trained step (job), to the roles imported (floor) | phase lines (s) |")
    print("|---|---|---|")
    for kind, result in rows:
        print(f"| {kind} | {result['seconds']:.1f} | {result['phases']} |")


if __name__ == "__main__":
    main()
