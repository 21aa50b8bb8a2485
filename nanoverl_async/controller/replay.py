"""The learner alone on a run's recorded batches: the second entry point besides `launch`.

    nanoverl-async replay outputs/agent_grpo     # a run launched with run.record=true (observe/record.py)

One prepare + update per recorded step, in order, as the launcher's `train` runs them, on a learner pool
placed as the run's was; the weights go to RUN_DIR/replay/final and are compared with the run's final/
tensor by tensor, so a run whose learner is deterministic replays bit for bit.

Run alone: nanoverl-async replay RUN_DIR   (tests/test_reproducibility.py replays a recorded run)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ray

from nanoverl_async import checkpoint
from nanoverl_async.config import ConfigError, load_config
from nanoverl_async.controller.learner_pool import LearnerPool
from nanoverl_async.controller.preflight import replay_plan
from nanoverl_async.controller.roles import role_failures
from nanoverl_async.controller.startup import start_ray
from nanoverl_async.models.load import vocab_size
from nanoverl_async.observe import record
from nanoverl_async.wire.auth import run_keys


def replay(run_dir: str) -> dict:
    """The learner alone on a run's recorded batches (record.py), in order, one prepare + update per step
    as in `train`; its weights go to RUN_DIR/replay/final and are compared with the run's final/."""
    cfg = load_config(str(Path(run_dir) / "config.yaml"))
    cfg = dataclasses.replace(cfg, wire=dataclasses.replace(cfg.wire, host="127.0.0.1"))  # no generator connects
    if not cfg.run.record:
        raise ConfigError(f"{run_dir}: run.record was off in this run's config.yaml, so there is nothing to replay")
    plan = replay_plan(cfg)  # the model the run started from, resolved as launch resolved it
    batches = record.read_batches(run_dir, cfg.run.total_steps, vocab_size(plan.model_path),
                                  cfg.agent.max_total_tokens)
    started_ray = start_ray(cfg.ray)
    learners = None
    try:
        with role_failures("learner pool"):
            learners = LearnerPool(cfg, plan.model_path, run_keys())
            for version, trajectories in enumerate(batches):  # step N updates version N - 1, as in `train`
                learners.update(learners.prepare(trajectories), version)
            learners.save_pretrained(str(checkpoint.claim(run_dir, "replay") / "final"))
    finally:
        if learners is not None:
            learners.shutdown()
        if started_ray:
            ray.shutdown()
    replayed = Path(run_dir) / "replay" / "final"
    return {"steps": len(batches), **record.compare_weights(Path(run_dir) / "final", replayed)}
