"""Shared fixtures: one local Ray instance for every test that places roles in-process, and one short real
run with every observation key on, which the plot, trace, replay and simulator tests all read; and the
Hypothesis profile every property test runs under."""

import os

import pytest
import ray
from hypothesis import settings

from nanoverl_async.config import load_config
from nanoverl_async.launcher import start_ray

# Hypothesis draws the same examples on every run (seeded from a hash of each test), so a failure replays and a
# pass means the same thing everywhere; no example database. HYPOTHESIS_PROFILE=default explores at random.
# Loaded before any test module builds its own settings(...), which inherit these values.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def ray_session():
    started = start_ray(load_config(None).ray)
    yield
    if started:
        ray.shutdown()


OBSERVED_STEPS = 4
OBSERVED_RUN = (f"run.total_steps={OBSERVED_STEPS}", "generator.replicas=2", "staleness.max=1",
                "data.prompts_per_step=4", "data.samples_per_prompt=4", "run.log_samples=3", "run.trace=true",
                "run.record=true", "wire.host=0.0.0.0")  # off loopback: every socket CURVE with the run's keys


@pytest.fixture(scope="session")
def observed_run(tmp_path_factory):
    """The CLI's default job for a few asynchronous steps on two generators, with samples.jsonl,
    trace.json and record/ written, its sockets bound off loopback (CURVE): one run instead of one per
    test file (the real CLI costs ~30 s)."""
    from test_cli_run import run_cli

    path = tmp_path_factory.mktemp("observed")
    result = run_cli(path, *OBSERVED_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    (path / "console.txt").write_text(result.stderr)  # the start-up phase lines (test_cli_run.py)
    return path
