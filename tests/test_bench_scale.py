"""bench/scale.py, the learner at scale: each (shape, memory setting) is measured in a process of its own, so its
peak never includes memory that the process measuring before it (or the script itself) still holds; and its
--smoke mode (the CPU, a tiny shape, 7B refused at start-up) runs end to end.

Run alone: `python -m pytest tests/test_bench_scale.py -q` (~50 s: each measurement spawns a process).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # the script imports its neighbours as the script's folder is on its path
import scale  # noqa: E402
from qwen_shape import random_model  # noqa: E402

from nanoverl_async.learners.memory import GB  # noqa: E402

BALLAST_GB = 1.5  # held by the test's process while a setting is measured: far above a tiny learner's process


def resident_gb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:")) / GB


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's resident set size")
def test_a_setting_is_measured_apart_from_the_memory_its_caller_holds(tmp_path):
    """In one process (the script's first form) the peak of a setting was read on top of what the process
    held already: here 1.5 GB of ballast, which a spawned process does not have."""
    path = random_model(scale.SMOKE, str(tmp_path / "tiny"))
    batch_shape = {"vocab": scale.SMOKE.vocab_size, "sequences": 8, "prompt": scale.SMOKE_PROMPT,
                   "sampled": scale.SMOKE_SAMPLED}
    ballast = torch.ones(int(BALLAST_GB * GB) // 4)  # written: every page resident
    assert resident_gb() > BALLAST_GB
    results, publish_s = scale.measured(path, "cpu", [128], batch_shape, updates=1, threads=1, checkpointing=True,
                                        chunk=scale.SMOKE_CHUNK, publish=True)
    del ballast
    fits, speed, peak = results[128]
    assert fits == "yes" and speed > 0 and publish_s > 0
    assert 0 < peak < BALLAST_GB  # the measuring process's own peak, the ballast not in it


@pytest.mark.slow
def test_the_smoke_mode_runs_on_the_cpu_and_refuses_7b_at_start_up():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--smoke"], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("tiny | ")]
    settings = [(row[3], row[4], row[5]) for row in rows]
    assert settings == [("plain", "128", "yes"), ("plain", "256", "yes"),
                        (f"checkpointed, logits in {scale.SMOKE_CHUNK}s", "128", "yes"),
                        (f"checkpointed, logits in {scale.SMOKE_CHUNK}s", "256", "yes")]
    assert all(float(row[7]) > 0 for row in rows)  # a peak each
    assert "7b: the learner cannot fit: an update's peak is predicted at" in done.stdout
