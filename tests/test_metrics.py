"""step_metrics is pure: the keys the issue promises, computed from a hand-made batch."""

import json

import numpy as np

from nanoverl_async.buffer.service import Batch
from nanoverl_async.metrics import MetricsLogger, step_metrics
from nanoverl_async.trajectory import Trajectory


def trajectory(version: int, reward: float, tool_calls: int) -> Trajectory:
    mask = np.array([0, 0, 1, 1, 0, 1], dtype=np.uint8)
    return Trajectory(id=f"{version}-{reward}", group_id=0, prompt_index=0, sample_index=0,
                      token_ids=np.arange(6, dtype=np.int32), loss_mask=mask,
                      behaviour_logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
                      versions=np.where(mask == 1, version, -1).astype(np.int32), reward=reward,
                      num_turns=1 + tool_calls, tool_calls=tool_calls)


def test_step_metrics_keys_and_values(tmp_path):
    batch = Batch(step=5, trajectories=[trajectory(5, 1.0, 1), trajectory(3, 0.0, 0), trajectory(4, 1.0, 1),
                                        trajectory(4, 0.0, 0)],
                  stats={"generator_versions": {0: 4, 1: 5}, "tokens_generated": 120, "dropped_stale": 2})
    m = step_metrics(5, 2, batch, {"loss": 0.1, "grad_norm": 0.5}, step_seconds=2.0, samples_trained=24)
    assert m["step"] == 5 and m["reward/mean"] == 0.5
    assert m["staleness/max"] == 2 and m["staleness/mean"] == 1.0 and m["staleness/limit"] == 2
    assert m["staleness/histogram"] == {"0": 1, "1": 2, "2": 1} and m["staleness/dropped"] == 2
    assert m["samples/trained"] == 24 and m["time/step_s"] == 2.0
    assert m["tokens/generated_per_s"] == 60.0 and m["weights/version_lag_max"] == 1
    assert m["episodes/turns_mean"] == 1.5 and m["episodes/tool_calls_mean"] == 0.5
    assert m["learner/loss"] == 0.1 and m["learner/grad_norm"] == 0.5

    logger = MetricsLogger(tmp_path, total_steps=6, progress=False)
    logger.log(m)
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["staleness/max"] == 2
